"""``ForkableEnv``: a Gymnasium wrapper whose env can be snapshotted, restored and forked.

The env runs in a worker (a process, or in-process for the pickle backend) that the wrapper
talks to through a handle; snapshots, restores and forks are the backend's.  The underscore
methods at the end of :class:`ForkableEnv` (``_from_handle``, ``_swap_worker``,
``_side_snapshot``, ``_record_step`` ...) are the internal API that migration, vector envs and
plugins use instead of its fields.
"""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
import warnings
import weakref
from typing import Any, Callable, Literal, Sequence

import gymnasium as gym
import numpy as np

from gym_fork.backends import capacity
from gym_fork.backends import Backend, get_backend
from gym_fork.backends.auto import start_env
from gym_fork.backends.base import Handle, RemoteHandle
from gym_fork.errors import (BackendUnavailableError, EnvClosedError, EnvNotShippableError, ForeignSnapshotError,
                             NotSendableError, UncapturableStateError, UncapturedFilesError, UnsupportedEnvError, WorkerDiedError, WorkerError,
                             remote_exception)
from gym_fork.interrupts import held
from gym_fork.proxy import WorkerEnv, read
from gym_fork.proxy import call as proxy_call
from gym_fork.snapshots.snapshot import RestoreRate, Snapshot, new_id
from gym_fork.snapshots import private_dirs as private_dirs_mod, sessiondir, tree_stat
from gym_fork.snapshots.workspace import Workspace, aliases_of, attach as attach_workspace, binds_for as workspace_binds
from gym_fork.snapshots.workspace import remove_dirs
from gym_fork.worker import files
from gym_fork.worker.commands import AUTORESET_ERROR_KEY, AUTORESET_KEY, MUTABLE_ACTIONS, make_source, own_action, pickle_policy

log = logging.getLogger("gym_fork")
# lineages whose first snapshot looked for sets that iterate by memory address (_warn_address_order)
_ORDER_LOOKED_AT: set[str] = set()


class ForkableEnv(gym.Wrapper):
    """A Gymnasium env that runs in a worker process and can be snapshotted, restored and forked.

    ``env`` is an env id (like :func:`gymnasium.make`), a zero-argument factory returning a
    ``gymnasium.Env``, or an env instance (then it is pickled to the worker; envs that cannot be
    pickled must be passed as an id or factory).  The whole wrapper stack that the id or factory
    builds (``TimeLimit``, ``OrderEnforcing``, ...) lives in the worker, so it is captured too.

    Example:
        >>> import gym_fork
        >>> env = gym_fork.ForkableEnv("CartPole-v1", backend="pickle")
        >>> obs, info = env.reset(seed=0)
        >>> for i in range(10):
        ...     _ = env.step(i % 2)
        >>> snap = env.snapshot()
        >>> a = [env.step(i % 2)[0] for i in range(5)]
        >>> obs_then, _ = env.restore(snap)
        >>> b = [env.step(i % 2)[0] for i in range(5)]
        >>> all((x == y).all() for x, y in zip(a, b))
        True
        >>> snap.steps, env.steps
        (10, 15)
        >>> kids = env.fork(snap, n=2)          # two independent copies of that moment
        >>> bool((kids[0].step(0)[0] == kids[1].step(0)[0]).all())
        True
        >>> for k in kids:
        ...     k.close()
        >>> env.close()

    Args:
        env: env id, factory or instance.
        backend: ``"auto"`` (CRIU when usable here, else pickle), ``"criu"`` or ``"pickle"``.
        env_kwargs: keyword arguments for ``gymnasium.make`` when ``env`` is an id.
        verify: what a CRIU restore checks first. ``"full"``: images that came from elsewhere (a
            bundle, a store, a migration) by their signed sha256; images this process dumped
            into its private (0700) session directory by identity (device, inode and mtime
            recorded at the dump: any write, truncation or replacement changes one), which
            costs microseconds instead of re-reading every byte. ``"sha256"``: also hash this
            process's own images at the dump and check them before each restore (~20 ms per
            24 MB here; catches a change whose mtime was put back). ``"size"``: only that the
            files are present with the right sizes.
        record_actions: keep the actions since the last snapshot, so every snapshot knows its
            action path from its parent (``Snapshot.actions``).
        worker_log: append the worker's stdout/stderr to this file (default: discarded).
        fork_tier: criu backend only. ``"auto"``: in-memory snapshots are copy-on-write
            ``fork()`` copies of the worker (milliseconds), written as CRIU images only by
            ``Snapshot.persist()``; used when the worker is single-threaded. ``False``: every
            snapshot is a CRIU dump. ``True``: require the fork tier.
        store: a :class:`~gym_fork.SnapshotStore` (memory and disk budgets; snapshots written
            there survive the process).
        workspace: a directory the env works in; every snapshot also captures its files (SQLite
            databases consistently), ``restore()`` puts them back, each ``fork()`` child gets its
            own copy (``DIR.branch-<id>``, deleted when the child is closed), and ``Snapshot.save``
            / a store keep them.  The contract with the env: :mod:`gym_fork.snapshots.workspace`.
        private_network: criu backend, as root: the worker gets a network namespace of its own
            (only ``lo``), and every restored copy a fresh one, so servers the env starts (Redis,
            a web app) keep their addresses in every copy without colliding.  Without it, an env
            holding TCP/UDP sockets is refused at its first snapshot (UncapturableStateError).
        wrappers: Gymnasium wrappers to apply *in the worker*, innermost first: wrapper classes
            (``RecordEpisodeStatistics``) or ``env -> env`` callables
            (``lambda e: FrameStackObservation(e, 4)``).  Wrappers in the worker are part of every
            snapshot; wrappers you put *around* a ForkableEnv are not (their counters and buffers
            stay as they are on restore -- see :func:`gym_fork.snapshot_of`).
        untracked_paths: files outside the workspace whose content may stay as it is when a
            snapshot is restored or forked (logs, caches): absolute paths or ``fnmatch`` patterns
            (``"/tmp/run/*.log"``; ``*`` also matches ``/``; a directory covers everything in it).
            gym_fork records every file the env writes outside its workspace (:mod:`gym_fork.worker.files`)
            and refuses a ``snapshot()`` of an env that wrote one, and a ``restore()``/``fork()``
            after it wrote one (``UncapturedFilesError``, naming the paths), unless the path
            matches one of these; their content is then *not* restored.  One the env keeps open
            between steps (a ``logging.FileHandler``) is a log that every copy appends to,
            provided it is open write-only (SB3's ``*.monitor.csv`` are such logs by default).
        private_dirs: directories (absolute, existing) the env works in anywhere on the machine;
            criu backend, as root.  Every worker -- the first, each ``restore()``, each ``fork()``
            branch -- sees its own copy of them at the same paths (a mount namespace per worker),
            captured with every snapshot; the real directories are the template and stay as they
            are.  Files kept open there, shell tools' and servers' writes and bound unix socket
            paths are captured too (CRIU dumps); a SQLite database held open across steps is
            refused (connect per step).  ``private_dir_view(DIR)`` says where the env's files are.
            Their snapshots can be saved and stored (the files go along, signed) and restore into
            an env with the same ``private_dirs``; migrating such an env is refused.  See
            :mod:`gym_fork.snapshots.private_dirs`.

    Raises:
        ValueError: an unknown backend name or option value.
        BackendUnavailableError: the backend cannot work here (e.g. ``backend="criu"`` without a
            usable CRIU), or no backend can snapshot this env exactly (``"auto"``).
        UnsupportedEnvError: the pickle backend cannot copy this env exactly (EzPickle envs).
        WorkerError / WorkerDiedError: the env failed to build in the worker.
    """

    _store: Any = None  # a gym_fork.SnapshotStore: budgets, persistence
    _workspace: Any = None  # a Workspace whose files every snapshot captures
    # the other paths this env's worker sees its workspace at: those a restored snapshot's
    # processes knew it by (bound in the worker's mount namespace, see _workspace_binds)
    _ws_known: tuple[str, ...] = ()
    _origin: Any = None  # (env, env_kwargs, wrappers) it was built from: gym_fork.check_env builds more
    # forked with rng="reseed": a policy rolled out here (rollout(policy=...)) is reseeded from
    # the copy's seed too, as explore() does for its branches
    _policy_reseed: bool = False
    _untracked: tuple[str, ...] = ()  # untracked_paths: patterns of files whose content is not restored
    _private: Any = None  # a PrivateDirs: directories every worker of this env sees a copy of its own

    def __init__(self, env: str | Callable[[], gym.Env] | gym.Env, *, backend: str | Backend = "auto",
                 env_kwargs: dict | None = None, verify: Literal["full", "sha256", "size"] = "full",
                 record_actions: bool = True, worker_log: str | None = None,
                 fork_tier: bool | Literal["auto"] = "auto", store: Any = None,
                 workspace: str | None = None, private_network: bool = False,
                 wrappers: Sequence[Callable[[gym.Env], gym.Env]] | None = None,
                 untracked_paths: Sequence[str] | None = None,
                 private_dirs: str | Sequence[str] | None = None):
        untracked = files.untracked_patterns(untracked_paths)
        private = private_dirs_mod.normalise(private_dirs)
        if private:
            backend = _private_dirs_backend(backend)
        source = make_source(env, env_kwargs, wrappers)
        self._origin = (env, env_kwargs, wrappers)
        be = get_backend(backend, verify=verify, worker_log=worker_log, fork_tier=fork_tier,
                         private_network=private_network)
        pd = root0 = None
        try:
            if private:  # the first worker too works in a copy: the real directories stay as they are
                if getattr(be, "mode", None) != "root":
                    raise BackendUnavailableError("private_dirs needs the criu backend running as root (each "
                                                  "copy of the env gets a mount namespace of its own)")
                pd = private_dirs_mod.PrivateDirs(private)
                root0, binds0 = pd.new_copy(None)
                handle, meta = be.start(source, binds=binds0)
            else:
                be, handle, meta = start_env(be, source)
        except BaseException as e:
            if root0 is not None:
                private_dirs_mod.remove([root0])
            if not isinstance(e, (WorkerError, AttributeError)):
                raise
            # PicklingError in the worker (an AttributeError "Can't pickle local object" / 3.13's
            # "Can't get local object" for a class defined in a function), or "Can't get
            # attribute" unpickling its answer here
            if (getattr(e, "remote_type", "") != "PicklingError"
                    and not any(words in str(e) for words in ("Can't get attribute", "Can't pickle local object",
                                                              "Can't get local object"))):
                raise
            raise EnvNotShippableError(
                f"the env was built in the worker, but what it answered cannot be sent back ({e}). A class "
                "it uses (e.g. the entry point it was registered with, or a type in its spaces) is defined "
                "inside a function, where pickle cannot find it by name: define it at module level, in "
                "your script or a module.") from None
        self._setup(be, handle, meta, lineage=uuid.uuid4().hex, record_actions=record_actions)
        self._store = store
        self._untracked = untracked
        if untracked:  # the worker's scan lets the env hold these open as logs (worker/resources.py)
            self._request("untracked", list(untracked))
        if pd is not None:
            self._set_private(pd)
            pd.switch(root0)
            self._request("private_dirs", list(private), [])
        if workspace is not None:
            self._workspace = Workspace(workspace)
            self._request("setattr", "workspace", self._workspace.path, "unwrapped")

    # --- construction ---------------------------------------------------------------------------
    def _setup(self, be: Backend, handle: Handle, meta: dict, *, lineage: str, record_actions: bool) -> None:
        self._backend = be
        self._handle = handle
        self._meta = meta
        self._lineage = lineage
        self._record_actions = record_actions
        self._closed = False
        self._live: Any = None  # a LiveMigration in progress (migration/live.py)
        self._steps = 0
        self._parent_id: str | None = None
        self._actions: list | None = [] if record_actions else None
        self._pending_rollout: list | None = None  # an open-loop rollout's actions, until its reply
        self._rollout_id: str | None = None  # the worker's name of the last rollout accounted for
        self._snapshots: weakref.WeakValueDictionary[str, Snapshot] = weakref.WeakValueDictionary()
        self._restore_rate = RestoreRate()  # whether a new snapshot is worth a ready copy
        # Stop the worker even if the user forgets close(): the finalizer sees the current handle.
        self._box = [handle]
        self._finalizer = weakref.finalize(self, _kill_boxed, self._box)
        super().__init__(WorkerEnv(self, meta))

    @classmethod
    def _from_handle(cls, backend: Backend, handle: Handle, meta: dict | None = None, *, steps: int = 0,
                     parent_id: str | None = None, lineage: str | None = None, record_actions: bool = True,
                     store: Any = None) -> "ForkableEnv":
        """A ForkableEnv around a worker that already runs (restored, cloned, received).

        Args:
            backend: the backend that made ``handle`` (it snapshots and restores the new env).
            handle: the worker.
            meta: the worker's ``meta`` reply (spaces, spec, ...); asked for when None.
            steps: the env's step count now.
            parent_id: the snapshot this state descends from, if any.
            lineage: the lineage its snapshots carry (default: a new one).
            record_actions: as for :class:`ForkableEnv`.
            store: a SnapshotStore for its snapshots.

        Returns:
            The env; it owns ``handle`` from now on (``close()`` stops it).
        """
        env = cls.__new__(cls)
        env._setup(backend, handle, handle.request("meta") if meta is None else meta,
                   lineage=lineage or uuid.uuid4().hex, record_actions=record_actions)
        env._steps = steps
        env._parent_id = parent_id
        env._store = store
        return env

    @classmethod
    def from_snapshot(cls, snapshot: Snapshot, *, record_actions: bool = True, store: Any = None,
                      workspace: str | None = None,
                      untracked_paths: Sequence[str] | None = None,
                      private_dirs: str | Sequence[str] | None = None) -> "ForkableEnv":
        """A new env that starts exactly at ``snapshot`` (e.g. one from :func:`gym_fork.load_snapshot`),
        without first starting a fresh env.

        Args:
            snapshot: any snapshot (taken here, loaded from a bundle or a store).
            record_actions: as for :class:`ForkableEnv`.
            store: a :class:`~gym_fork.SnapshotStore` for the new env's snapshots.
            workspace: the directory the new env works in; required when the snapshot captured a
                workspace (its content is replaced by the snapshot's files, and the env's
                ``workspace`` attribute set to it).
            untracked_paths: as for :class:`ForkableEnv`.
            private_dirs: required when the snapshot holds private directories: the same
                directories (the new worker sees a copy of the snapshot's files at those paths).

        Raises:
            ValueError: the snapshot captured a workspace and ``workspace`` is None, or its
                private directories are not ``private_dirs``.
            SnapshotReleasedError, SnapshotCorruptedError, RestoreError: the restore failed.
        """
        private = private_dirs_mod.normalise(private_dirs)
        held = tuple(getattr(snapshot, "private_dirs_paths", None) or ()) if getattr(snapshot, "private_dirs", None) else ()
        if held != private:
            raise ValueError(f"snapshot {snapshot.id} holds the private directories {list(held)}: pass "
                             f"private_dirs={list(held)} (not {list(private)}); the new worker sees a copy of "
                             "the snapshot's files there")
        if getattr(snapshot, "workspace", None) and workspace is None:
            raise ValueError(f"snapshot {snapshot.id} captured a workspace: pass workspace=DIR, the "
                             "directory its files are put back into")
        untracked = files.untracked_patterns(untracked_paths)
        be = snapshot.payload_backend
        pd = root = binds = None
        if private:
            if getattr(be, "mode", None) != "root":
                raise BackendUnavailableError("private_dirs needs the criu backend running as root")
            pd = private_dirs_mod.PrivateDirs(private)
            root, binds = pd.new_copy(snapshot.private_dirs)
        # the directory first: a process of the snapshot's tree that knew its workspace by the
        # path it was captured from sees this one there (ForkableEnv._workspace_binds)
        ws = Workspace(workspace) if workspace is not None else None
        ws_binds = (workspace_binds(snapshot, ws.path)
                    if ws is not None and getattr(snapshot, "workspace", None) and _can_bind(be) else [])
        per = [*(binds or ()), *ws_binds]
        made: list[str] = []
        try:
            _spare_namespace(snapshot)
            snapshot._note_restored()
            with snapshot._open_payload() as payload:  # images kept in a SnapshotStore: reassembled
                if ws is not None and getattr(snapshot, "workspace", None) and be.reopens_paths(payload, per):
                    made = ws.make_missing_dirs(snapshot.workspace)  # (a working directory there)
                # (a tool server of the tree waits until its workspace's files are in place)
                handle = be.restore(payload, per, hold_tree=ws is not None)
            if ws is not None:
                _refuse_unbound_tree(be, [handle], snapshot, [ws.path])
        except BaseException:
            remove_dirs(made)
            if root is not None:
                private_dirs_mod.remove([root])
            raise
        env = cls._from_handle(be, handle, steps=snapshot.steps, parent_id=snapshot.id,
                               lineage=snapshot.lineage, record_actions=record_actions, store=store)
        env._untracked = untracked
        env._ws_known = tuple(alias for _own, alias in ws_binds)
        env._request("untracked", list(untracked))  # not those the snapshot's process was told
        if pd is not None:
            env._set_private(pd)
            pd.switch(root)
        if ws is not None:
            try:
                env._workspace = ws
                if getattr(snapshot, "workspace", None):
                    env._workspace.restore_from(snapshot.workspace)
                handle.release_held()
                env._request("setattr", "workspace", env._workspace.path, "unwrapped")
            except BaseException:
                env.close()
                raise
        return env

    # --- Gymnasium API ---------------------------------------------------------------------------
    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict]:
        if self._closed:
            raise EnvClosedError("step() on a closed ForkableEnv; create a new one")
        try:
            out = self._handle.request("step", action)
            # _record_step(action), inline (every step's path), inside the try: an interrupt right
            # after the reply was read is settled too. No interrupt falls between the count and
            # the append (the interpreter checks for one after a call, not after a store): counted
            # is recorded. A mutable action is copied first (own_action: inline for the usual ones).
            if type(action) in MUTABLE_ACTIONS:
                action = own_action(action)
            self._steps += 1
            if self._actions is not None:
                self._actions.append(action)
        except WorkerError as e:
            if isinstance(e, NotSendableError):  # the step ran; only its result could not come back
                self._record_step(action)
            raise
        except BaseException as e:  # Ctrl-C: settled by asking the worker, at the next request
            if not isinstance(e, Exception):
                self._after_interrupt(lambda: self._settle_step(action))
            raise
        return out

    def step_send(self, action: Any) -> None:
        """First half of :meth:`step`: the worker starts stepping; collect with :meth:`step_receive`.
        Lets many ForkableEnvs step in parallel from one thread. Until its reply is read, this env
        takes no other call (:class:`~gym_fork.errors.ConcurrentUseError`: it would drop the reply)."""
        self._step_send(action, False)

    def _step_send(self, action: Any, reset_at_end: bool) -> None:
        """:meth:`step_send`; ``reset_at_end``: the worker resets right after a step that ends
        the episode, and the step's reply carries the reset's (obs, info) (:func:`take_autoreset`
        takes it out) -- where the worker takes such steps (``Handle.autoreset_steps``); a
        worker of an older gym_fork just steps, and the caller resets it with a request of its own."""
        if self._closed:
            raise EnvClosedError("step() on a closed ForkableEnv; create a new one")
        handle = self._handle
        may_reset = self._step_may_reset = reset_at_end and handle.autoreset_steps
        try:
            if may_reset:
                handle.send("step", action, True)
            else:
                handle.send("step", action)
            self._record_step(action)
        except BaseException as e:  # Ctrl-C inside the send: given up, settled at the next request
            if not isinstance(e, Exception):
                self._give_up_request(lambda: self._settle_step(action, may_reset=may_reset))
            raise

    #: the step in flight was sent with reset_at_end (its worker may have reset after it)
    _step_may_reset = False

    def step_receive(self) -> tuple[Any, float, bool, bool, dict]:
        try:
            return self._handle.receive()
        except Exception as e:
            if self._handle.refused(e):  # the env's step raised (or was refused): not taken, as in step()
                self._unrecord_step()
            elif ran_unanswered(e) and self._step_may_reset:  # (counted at the send)
                action = self._actions[-1] if self._actions else None
                self._account_unanswered_step(action, counted=True, may_reset=True)
            raise
        except BaseException as e:  # Ctrl-C: its reply is dropped (the channel may be mid-frame)
            if not isinstance(e, Exception):
                action = self._actions[-1] if self._actions else None
                may_reset = self._step_may_reset
                self._give_up_request(lambda: self._settle_step(action, may_reset=may_reset))
            raise

    def rollout(self, actions: Sequence[Any] | None = None, *, policy: Callable[[Any], Any] | None = None,
                steps: int | None = None, stop_at_done: bool = True, reseed_policy: bool | None = None) -> dict:
        """Step a whole branch inside the worker, in one round trip.

        Either open loop, through ``actions``, or closed loop: ``policy(obs) -> action`` runs
        *in the worker* for ``steps`` steps, choosing each action from the observation it sees.
        The policy is cloudpickled and the worker steps its own copy of it (the object here is
        not changed); it must not need anything of this process (a model on a GPU, a lock, a
        counter shared with other branches). Its random generators are copied as they are, except
        in an env made by ``fork(..., rng="reseed")``: there the policy's copy is reseeded from
        that copy's seed (``reseed_policy=None``, the default; ``False`` keeps the policy's own), as
        :func:`gym_fork.explore` does for its branches, so one stochastic policy rolled out in
        several reseeded children draws differently in each, and the same ``seeds`` repeat them.
        The reseed reaches the generators the policy holds (attributes, closure, defaults,
        ``functools.partial`` arguments, the object a method is bound to, module globals its code
        names) and process-wide ones its unpickling created (torch's); see
        :func:`gym_fork.worker.reseed.reseed_policy`. Each call starts from the policy as it is
        here, so two calls in one child draw the same numbers again.

        Returns ``{"rewards", "terminated", "truncated", "final_obs", "final_info", "steps",
        "actions"}``; it stops at the first episode end, or (``stop_at_done=False``) resets and
        goes on. Much cheaper than one :meth:`step` call per action: on this project's 2-vCPU VM a
        round trip per step costs more than a cheap env's step itself.

        Raises:
            ValueError: neither or both of ``actions`` and ``policy``; ``policy`` without ``steps``;
                ``reseed_policy`` with ``actions``, or ``True`` in an env not forked with ``rng="reseed"``.
            TypeError: ``policy`` is not callable or cannot be pickled; ``reseed_policy`` is not a bool.
            PolicyError: the policy raised in the worker (a :class:`WorkerError` too; the env
                raising is a WorkerError as for :meth:`step`). The steps taken before it count:
                :attr:`steps` and the snapshots' action log match what the worker did.

        Example:
            >>> import gym_fork
            >>> env = gym_fork.make("CartPole-v1")
            >>> _ = env.reset(seed=0)
            >>> out = env.rollout(policy=lambda obs: int(obs[2] > 0), steps=100)  # the pole falls at 41
            >>> len(out["actions"]), sum(out["rewards"]), out["terminated"], env.steps
            (41, 41.0, True, 41)
            >>> env.close()
        """
        try:
            self.rollout_send(actions, policy=policy, steps=steps, stop_at_done=stop_at_done,
                              reseed_policy=reseed_policy)
            return self.rollout_receive()
        except BaseException as e:
            if not isinstance(e, Exception):  # Ctrl-C: one call, not a send waiting for its receive
                self._give_up_request(self._settle_rollout)
            raise

    def rollout_send(self, actions: Sequence[Any] | None = None, *, policy: Callable[[Any], Any] | None = None,
                     steps: int | None = None, stop_at_done: bool = True, reseed_policy: bool | None = None) -> None:
        """First half of :meth:`rollout`: the worker starts; collect with :meth:`rollout_receive`."""
        if self._closed:
            raise EnvClosedError("rollout() on a closed ForkableEnv; create a new one")
        if (actions is None) == (policy is None):
            raise ValueError("rollout() takes either open-loop `actions` or a `policy` (with `steps`), "
                             "not both or neither")
        if policy is None:
            if steps is not None:
                raise ValueError("`steps` goes with a `policy`; open-loop `actions` run len(actions) steps")
            if reseed_policy is not None:
                raise ValueError("`reseed_policy` goes with a `policy`; open-loop `actions` draw nothing")
            self._pending_rollout = list(actions)
            self._handle.send("rollout", self._pending_rollout, stop_at_done)
        else:
            if steps is None:
                raise ValueError("rollout(policy=...) needs steps=N: how many steps to run at most")
            if reseed_policy is not None and not isinstance(reseed_policy, bool):
                raise TypeError(f"reseed_policy must be True, False or None, not {reseed_policy!r}")
            if reseed_policy and not self._policy_reseed:
                raise ValueError("reseed_policy=True needs an env made by fork(..., rng='reseed'): this one has no "
                                 "seed of its own to reseed the policy from")
            reseed = self._policy_reseed if reseed_policy is None else bool(reseed_policy)
            self._policy_rollout_send(pickle_policy(policy), capacity.count(steps, "steps"), stop_at_done,
                                      reseed=reseed, shared=reseed)

    def _policy_rollout_send(self, policy_blob: bytes | int, steps: int, stop_at_done: bool, *,
                             reseed: bool = False, shared: bool = False) -> None:
        """:meth:`rollout_send` with the policy pickled already (explore() pickles it once for all
        of its branches), or the index of one the worker has unpickled ahead (``load_policy``).
        ``reseed``/``shared``: a reseeded branch's policy (``EnvServer.cmd_policy_rollout``)."""
        if self._closed:
            raise EnvClosedError("rollout() on a closed ForkableEnv; create a new one")
        self._pending_rollout = None
        if reseed:
            self._handle.send("policy_rollout", policy_blob, steps, stop_at_done, True, shared)
        else:  # (the arguments every worker, of any gym_fork version, takes)
            self._handle.send("policy_rollout", policy_blob, steps, stop_at_done)

    def rollout_receive(self) -> dict:
        """Second half of :meth:`rollout`. When the policy or the env raised midway, this env's
        step count and action log still account for the steps the worker took before it."""
        try:
            try:
                out = self._handle.receive()
            except (WorkerDiedError, EnvClosedError):
                raise
            except Exception:  # the policy or the env raised (a WorkerError, or itself in process)
                try:
                    progress = self._request("rollout_progress")
                except Exception:  # noqa: BLE001 - a worker of an older gym_fork (restored from its images)
                    progress = None
                if progress is not None:
                    self._account_rollout(progress)
                raise
            return self._account_rollout_reply(out, self._pending_rollout)
        except BaseException as e:  # Ctrl-C while the worker rolled out, or before its reply was
            if not isinstance(e, Exception):  # accounted: settled after the resync
                self._give_up_request(self._settle_rollout)
            raise

    def _account_rollout_reply(self, out: dict, sent: list | None) -> dict:
        if "actions" not in out:  # an older worker's open-loop reply: the actions we sent
            out["actions"] = (sent or [])[:len(out["rewards"])]
        self._account_rollout(out)
        out.pop("id", None)  # (the worker's name for it: for settling after Ctrl-C, not the caller's)
        return out

    def _account_rollout(self, out: dict) -> None:
        # The count and the rollout's name are stored first and the actions after them, with no
        # call between (where an interrupt could fall): an interrupted accounting is either not
        # begun or done, and _settle_rollout (which compares names) does it once.
        acts, n, steps, rid = out["actions"], len(out["actions"]), out["steps"], out.get("id")
        if steps == self._steps + n:  # no reset inside: the same timeline goes on
            self._steps = steps
            self._rollout_id = rid
            if self._actions is not None:
                self._actions.extend(acts)
        else:  # the worker reset at an episode end: like reset(), a new timeline
            tail = acts[n - steps:n] if self._actions is not None else None
            self._steps = steps
            self._rollout_id = rid
            self._parent_id = None
            if tail is not None:
                self._actions = tail

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[Any, dict]:
        try:
            obs_info = self._request("reset", seed, options)
            self._record_reset()  # (inside the try: an interrupt before it is settled too)
        except WorkerError as e:
            if isinstance(e, NotSendableError):  # it reset; only its answer could not come back
                self._record_reset()
            raise
        except BaseException as e:  # Ctrl-C while the worker reset: settled at the next request
            if not isinstance(e, Exception):
                self._after_interrupt(self._settle_reset)
            raise
        return obs_info

    def render(self) -> Any:
        return self._request("render")

    def close(self, *, keep_workspace: bool | None = None) -> None:
        """Stop the worker and release this env's snapshots.  A fork branch's workspace directory
        (``DIR.branch-*``, made by :meth:`fork`) is deleted too, unless ``keep_workspace=True``
        here or in ``fork()``; a workspace the user passed in is never deleted."""
        if self._closed:
            return
        self._end_live("the env was closed")
        self._closed = True
        for snap in list(self._snapshots.values()):
            snap.release()
        self._handle.close()
        self._finalizer.detach()
        if self._private is not None:
            self._private_finalizer()  # the worker is gone: its private copies go too
        if self._workspace is not None:
            if keep_workspace is not None:
                self._workspace.keep = bool(keep_workspace)
            fin = getattr(self, "_ws_finalizer", None)
            if fin is not None:
                fin()  # Workspace.discard: deletes only a gym_fork-made branch directory

    def _begin_close(self) -> None:
        """Send the worker its polite ``close`` now; :meth:`close` reads the reply (see
        :func:`close_envs`). Nothing is sent while a live migration runs (cancelling it talks to
        the worker first)."""
        if not self._closed and self._live is None:
            self._handle.begin_close()

    def _abort(self) -> None:
        """:meth:`close` without waiting for a request in flight whose reply nobody will read
        (explore()'s other branches after one failed): a polite close would first wait for the
        worker to finish it -- a whole rollout. The worker is stopped instead."""
        if not self._closed and getattr(self._handle, "_pending", False):
            self._handle.kill()
        self.close()

    @property
    def spec(self) -> gym.envs.registration.EnvSpec | None:  # type: ignore[override]
        return self._meta["spec"]

    # The worker's outer stack's (``self.env``, the base env's stand-in, mirrors the base env's);
    # set here, as on any gymnasium.Wrapper, they are this layer's own.
    @property
    def observation_space(self) -> gym.Space:  # type: ignore[override]
        return self._meta["observation_space"] if self._observation_space is None else self._observation_space

    @observation_space.setter
    def observation_space(self, space: gym.Space) -> None:
        self._observation_space = space

    @property
    def action_space(self) -> gym.Space:  # type: ignore[override]
        return self._meta["action_space"] if self._action_space is None else self._action_space

    @action_space.setter
    def action_space(self, space: gym.Space) -> None:
        self._action_space = space

    @property
    def metadata(self) -> dict[str, Any]:  # type: ignore[override]
        return self._meta["metadata"] if self._metadata is None else self._metadata

    @metadata.setter
    def metadata(self, value: dict[str, Any]) -> None:
        self._metadata = value

    @property
    def render_mode(self) -> str | None:  # type: ignore[override]
        return self._meta["render_mode"]

    # --- the env in the worker -------------------------------------------------------------------
    def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Call the method ``name`` of the worker's env stack (found as ``get_wrapper_attr`` finds
        it: the outermost layer that has it) with these arguments, in the worker; an attribute
        that is not callable is returned instead, as Gymnasium's ``VectorEnv.call`` does.

        Arguments and result are pickled (the result is the caller's own copy).  ``step``,
        ``reset``, ``render`` and ``close`` go through this env (its step count and action
        record stay right).

        Example:
            >>> import gym_fork, numpy as np
            >>> env = gym_fork.make("CartPole-v1", backend="pickle")
            >>> _ = env.reset(seed=0)
            >>> env.call("force_mag")
            10.0

        Raises:
            AttributeError: no layer has ``name``.
            WorkerError: the call raised in the worker (also an instance of the env's exception
                type when that is a builtin, e.g. ``TypeError``).
        """
        if name in ("step", "reset", "render", "close"):
            return getattr(self, name)(*args, **kwargs)
        return proxy_call(self, ("wrapper", ("a", name)), args, kwargs, True)

    def get_wrapper_attr(self, name: str) -> Any:
        """Gymnasium's ``get_wrapper_attr``: this env's own attribute, else the first layer of the
        worker's env stack (outside in) that has it.  Plain values come back as copies, methods
        and other objects as references that act in the worker (see :mod:`gym_fork.proxy`)."""
        if _own_attr(self, name):
            return getattr(self, name)
        return read(self, ("wrapper", ("a", name)))

    def set_wrapper_attr(self, name: str, value: Any, *, force: bool = True) -> bool:
        """Gymnasium's ``set_wrapper_attr``, in the worker: on the first layer of the worker's
        env stack that has ``name``; when none has it and ``force``, it is created on the
        outermost layer in the worker.  ``value`` is pickled.

        Returns:
            Whether the attribute was set.
        """
        if _own_attr(self, name):
            setattr(self, name, value)
            return True
        return bool(self._request("set_wrapper_attr", name, value, force))

    def has_wrapper_attr(self, name: str) -> bool:
        """Gymnasium's ``has_wrapper_attr``: this env or a layer in the worker has ``name``."""
        return _own_attr(self, name) or bool(self._request("ref_call", ("wrapper", ("a", "has_wrapper_attr")),
                                                           (name,), {}))

    # --- copies and pickles ----------------------------------------------------------------------
    def __deepcopy__(self, memo: dict) -> "ForkableEnv":
        """``copy.deepcopy(env)``: an exact fork (:meth:`fork`), a new env that continues from this
        env's current state; this env is not changed."""
        return self.fork()[0]

    def __copy__(self) -> "ForkableEnv":
        raise TypeError("copy.copy() of a ForkableEnv would share its worker process with the original; "
                        "use copy.deepcopy(env) or env.fork() for an independent copy of its current state")

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError("cannot pickle a ForkableEnv: its env runs in a worker process. To keep or send its "
                        "state, save a snapshot: env.snapshot().save(path), then "
                        "ForkableEnv.from_snapshot(gym_fork.load_snapshot(path)); for a copy in this process, "
                        "copy.deepcopy(env) or env.fork()")

    def _refresh_meta(self) -> None:
        """A mirrored attribute (spaces, metadata, render_mode, spec) was set on the worker's base
        env: the outer stack's may follow it (a wrapper that defers to the env) or not (one with
        a space of its own), so both are asked of the worker again (a new dict: forks and
        snapshots share the old one)."""
        self._adopt_meta(None)

    # --- snapshots -----------------------------------------------------------------------------
    @property
    def backend(self) -> str:
        """Name of the backend in use (``"criu"`` or ``"pickle"``)."""
        return self._backend.name

    @property
    def steps(self) -> int:
        """Steps since the last ``reset()`` (restores set it to the snapshot's)."""
        self._settle_interrupted()
        return self._steps

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def step_path(self) -> Literal["ring", "socket", "network", "in-process"]:
        """How a step reaches the env now: ``"ring"`` (the worker's shared-memory step ring,
        opened after 64 steps made one at a time where a CPU is free to spin; see
        ``GYM_FORK_RING``), ``"socket"``, ``"network"`` (migrated: the worker runs on another
        node) or ``"in-process"`` (the pickle backend)."""
        from gym_fork.migration.client import NetworkHandle

        handle = getattr(self._handle, "inner", self._handle)  # a live migration's stand-in
        if isinstance(handle, NetworkHandle):
            return "network"
        if not isinstance(handle, RemoteHandle):
            return "in-process"
        ring = handle.ring
        return "ring" if ring is not None and not ring.closed else "socket"

    @property
    def worker_pid(self) -> int | None:
        """Host pid of the worker process (``None`` for the in-process pickle backend)."""
        return self._handle.pid

    def snapshot(self, *, restore_soon: bool | None = None) -> Snapshot:
        """Capture the env's whole state now. The env keeps running.

        Args:
            restore_soon: whether to prepare this snapshot's first restore ahead. With the fork
                tier that is a *ready copy*, forked off the snapshot in the background (~3 ms of
                CPU): the first restore then takes ~1.3 ms instead of ~5. ``None`` (the default)
                guesses from this env's own recent snapshots (prepared for its first few, then
                while at least a quarter of the recent ones were restored:
                :class:`~gym_fork.snapshots.snapshot.RestoreRate`); ``True`` / ``False`` says it
                (a search that always returns to the snapshot it just took; a checkpoint kept
                "just in case"). Either way every restore is exact, and a snapshot restored once
                prepares its next restore itself. CRIU images and the pickle backend ignore it.

        Raises:
            TypeError: ``restore_soon`` is not True, False or None.
            SnapshotError: the backend failed; the env is unchanged and usable.
            UnsupportedEnvError: the backend cannot capture this env exactly.
            UncapturedFilesError: the env wrote files outside its workspace (``untracked_paths``).

        Example:
            >>> import gym_fork
            >>> env = gym_fork.ForkableEnv("CartPole-v1", fork_tier=True)
            >>> _ = env.reset(seed=0)
            >>> root = env.snapshot(restore_soon=True)  # a search will come back here at once
            >>> _ = env.step(0)
            >>> obs, _ = env.restore(root)
            >>> env.close()
        """
        if restore_soon is not None and not isinstance(restore_soon, bool):
            raise TypeError(f"restore_soon must be True, False or None (let gym_fork guess), "
                            f"not {type(restore_soon).__name__} {restore_soon!r}")
        ready = self._restore_rate.likely() if restore_soon is None else restore_soon
        return self._snapshot(ready_copy=ready, counted=True)

    def _written_meanwhile(self) -> list[str]:
        """The directories a snapshot copies after the processes' memory (the workspace, private
        directories) when the env may change them on its own while it is snapshotted: its worker
        said it has threads, a timer or processes (the same word a restore asks again on)."""
        chan = getattr(self._handle, "chan", None)
        if not getattr(chan, "spawned", False):
            return []
        out = [self._workspace.path] if self._workspace is not None else []
        if self._private is not None:
            out += [f"/proc/{self._handle.pid}/root{d}" for d in self._private.dirs]
        return out

    def _snapshot(self, *, ready_copy: bool, counted: bool = False, retry: bool = True) -> Snapshot:
        """:meth:`snapshot`; ``ready_copy``: prepare a restore ahead (the backend's hint, see
        :class:`~gym_fork.snapshots.snapshot.RestoreRate`); ``counted``: one of the snapshots the
        env's restore rate counts (those the user takes)."""
        self._check_open()
        # a snapshot copies the local worker, which the target of a live migration cannot replay
        self._end_live("a snapshot was taken (snapshot(), or fork()/explore() from the current state)")
        sid = new_id()
        watched = self._written_meanwhile()
        before = tree_stat.signature(watched) if watched else None
        with self._one_call("a snapshot was taken"):  # no other thread's step between its requests
            self._settle_interrupted()  # (the snapshot's steps and actions are read after it)
            payload, size = self._backend.snapshot(self._handle, sid, ready_copy=ready_copy)
        try:
            # after the backend: its scan's refusal (e.g. a file still open) names more precisely
            self._refuse_outside_writes()
        except UncapturedFilesError:
            self._backend.release(payload)
            raise
        snap = Snapshot(backend=self._backend, payload=payload, size_bytes=size, steps=self._steps,
                        parent_id=self._parent_id, lineage=self._lineage,
                        env_id=self.spec.id if self.spec else None,
                        actions=list(self._actions) if self._actions is not None else None, snap_id=sid)
        self._snapshots[snap.id] = snap
        if self._lineage not in _ORDER_LOOKED_AT and self._backend.name != "pickle":  # (pickle refuses it)
            _ORDER_LOOKED_AT.add(self._lineage)
            self._warn_address_order()
        if counted:
            self._restore_rate.taken(snap)
        snap._mirror = self._meta  # replaced, never changed in place (_refresh_meta): no copy needed
        if self._backend.dies_with(payload, self._handle):
            snap._namespace_of = (weakref.ref(self), weakref.ref(self._handle))
        snap._worker_polls = self._handle.worker_polls  # (its copies are told only where they differ)
        if self._workspace is not None:
            attach_workspace(snap, self._workspace, self._ws_known)
        if self._private is not None:
            try:
                private_dirs_mod.attach(snap, self._private, self._handle.pid)
            except BaseException:
                snap.release()
                raise
        if before is not None:
            changed = tree_stat.first_change(before, tree_stat.signature(watched))
            if changed is not None and changed.startswith(f"/proc/{self._handle.pid}/root/"):
                changed = changed[len(f"/proc/{self._handle.pid}/root"):]  # (a private directory, as the env sees it)
            if changed is not None:
                self._snapshots.pop(snap.id, None)
                snap.release()
                if retry:  # (a write just before the dump froze the tree is no race: once more)
                    return self._snapshot(ready_copy=ready_copy, counted=counted, retry=False)
                raise UncapturableStateError(
                    f"gym_fork cannot snapshot this env exactly: while it was snapshotted, a thread or process of "
                    f"the env changed {changed} (its directory is copied after the processes' memory, so the "
                    "copy of the file would not go with the copy of the memory). Change such files only inside "
                    "step() and reset() (a thread or server that writes them on its own is not snapshotted "
                    "consistently), or keep them outside the workspace and private directories. No snapshot was "
                    "kept; the env keeps running.", [])
        if self._store is not None:
            self._store.add(snap)  # may move older in-memory snapshots to disk (memory budget)
        self._parent_id = snap.id
        if self._actions is not None:
            self._actions = []
        return snap

    def restore(self, snapshot: Snapshot) -> tuple[Any, dict]:
        """Bring the env back to ``snapshot``; returns the ``(obs, info)`` of that moment.

        On any failure the env keeps running exactly as before the call.

        Raises:
            UncapturedFilesError: this env wrote files outside its workspace, which the restore
                would not bring back (``untracked_paths``).
        """
        return self._restore(snapshot)

    def _restore(self, snapshot: Snapshot, accept: Callable[[Handle, Snapshot], None] | None = None) -> tuple[Any, dict]:
        """:meth:`restore`; ``accept(new_handle, snapshot)`` (a vector env's slot checks) runs on
        the restored worker before the env switches to it: where it raises, the new worker is
        stopped and the env keeps running as before."""
        self._check_open()
        self._check_snapshot(snapshot)
        self._end_live("restore() replaces the worker")
        _spare_namespace(snapshot, (self,))
        # (held: the blocks inside, which cannot be cut, run as one: one handler swap, ~30-60 µs
        # here, instead of one per block)
        with self._one_call("a restore was made"), held():  # the worker it replaces takes no other call
            roots, binds = self._private_copies(snapshot, 1)
            ws_binds = self._workspace_binds(snapshot, self._workspace.path if self._workspace else None)
            per = [*(binds[0] if binds else ()), *ws_binds]
            made: list[str] = []
            try:
                with snapshot._open_payload() as payload:
                    if (self._workspace is not None and getattr(snapshot, "workspace", None)
                            and self._backend.reopens_paths(payload, per)):
                        # (the snapshot's directories must exist: a working directory there)
                        made = self._workspace.make_missing_dirs(snapshot.workspace)
                    # a restored tree's tool processes wait until the workspace is put back
                    # (_adopt_restored): run at once, they would see this trajectory's files
                    new = self._backend.restore(payload, per, hold_tree=self._workspace is not None)
                if self._workspace is not None:
                    _refuse_unbound_tree(self._backend, [new], snapshot, [self._workspace.path])
            except BaseException:
                remove_dirs(made)
                private_dirs_mod.remove(roots)
                raise
            if accept is not None:
                try:
                    accept(new, snapshot)
                except BaseException:
                    new.kill()
                    remove_dirs(made)
                    private_dirs_mod.remove(roots)
                    raise
            return self._adopt_restored(new, snapshot, roots[0] if roots else None, ws_binds)

    @contextlib.contextmanager
    def _one_call(self, what: str):
        """Hold the worker's channel for this thread through a call made of several requests (a
        snapshot, a restore): another thread's call meanwhile is refused (ConcurrentUseError),
        not run between them."""
        handle = self._handle
        claimed = False
        try:
            claimed = handle._claim(what)
            yield
        except BaseException as e:
            if not isinstance(e, Exception):  # Ctrl-C: no hold of this thread's may outlive it
                handle.recover_gate()
            raise
        finally:
            if claimed:
                handle._release()

    def _adopt_restored(self, new: Handle, snapshot: Snapshot, private_root: str | None,
                        ws_binds: Sequence[tuple[str, str]] = ()) -> tuple[Any, dict]:
        """Run on ``new``, a worker the backend restored from ``snapshot``, with everything else
        the snapshot holds put back too: the workspace's files (restore() and a vector env's
        fork_into() alike: a worker without them would read its old trajectory's files) and
        the private directories' copy ``private_root``; ``ws_binds``: the workspace binds the
        worker was restored with (:meth:`_workspace_binds`). Returns the snapshot's ``(obs, info)``."""
        # Ctrl-C waits until the switch is whole: cut in the middle, the env ran the restored
        # worker and counted the old one's steps (or on half-restored files); see interrupts.held
        with held():
            if snapshot._store is not None:
                snapshot._store.touch(snapshot)
            snapshot._note_restored()
            self._switch_to(new, snapshot)
            self._ws_known = tuple(alias for _own, alias in ws_binds)
            if self._private is not None:
                self._private.switch(private_root)
            if self._workspace is not None and getattr(snapshot, "workspace", None):
                self._workspace.restore_from(snapshot.workspace)
            new.release_held()  # (the tree's other processes: only now that their files are back)
            if self._workspace is not None and getattr(snapshot, "workspace", None):
                if snapshot.workspace_path != self._workspace.path:  # taken by another branch / process
                    self._request("setattr", "workspace", self._workspace.path, "unwrapped")
            initial = getattr(new, "initial", None)
            obs, info, _steps = initial if initial else self._handle.request("last")
        return obs, info

    def fork(self, snapshot: Snapshot | None = None, n: int = 1, *, rng: Literal["same", "reseed"] = "same",
             seeds: Sequence[int] | None = None, keep_workspace: bool = False,
             max_copies: int | None = None) -> list["ForkableEnv"]:
        """``n`` new, independent envs that each start exactly at ``snapshot``.

        With ``snapshot=None`` a snapshot of the current state is taken (and released after).
        ``rng="same"`` keeps every copy's randomness identical to the snapshot's (same actions give
        the same trajectories); ``rng="reseed"`` reseeds, from ``seeds[i]`` or fresh entropy, every
        random generator each copy's env draws from -- ``np_random``, generators of its own, ALE's
        RNG, and in its worker ``random``'s, ``np.random``'s and torch's (see
        :mod:`gym_fork.worker.reseed`) -- leaving the simulated state untouched.
        This env is not changed. Close the returned envs when done.

        With a ``workspace``, each child works in its own new directory ``DIR.branch-<id>`` holding
        the snapshot's files; it is deleted when the child is closed (or garbage-collected) unless
        ``keep_workspace=True`` (or ``child.close(keep_workspace=True)``).

        ``n`` is checked against what the machine can hold (processes, threads, memory; see
        :mod:`gym_fork.backends.capacity`) before anything starts; ``max_copies`` (or
        ``$GYM_FORK_MAX_COPIES``) replaces the memory estimate by "at most that many".

        Raises:
            TypeError: ``n`` is not an int, or ``snapshot`` not a Snapshot.
            CapacityError: more copies than fit (the message has the numbers and the override).
        """
        return self._fork(snapshot, n, rng=rng, seeds=seeds, keep_workspace=keep_workspace, max_copies=max_copies)

    def _fork(self, snapshot: Snapshot | None, n: int, *, rng: Literal["same", "reseed"] = "same",
              seeds: Sequence[int] | None = None, keep_workspace: bool = False, max_copies: int | None = None,
              policies: Sequence[bytes] | None = None) -> list["ForkableEnv"]:
        """:meth:`fork`; ``policies``: the pickled policies the copies will run in their workers
        (``explore(..., policy_in_worker=True)``), which the backend may unpickle ahead, once."""
        self._check_open()
        n = capacity.count(n, "n")
        if snapshot is not None and not isinstance(snapshot, Snapshot):
            raise TypeError(f"snapshot must be a gym_fork Snapshot (from env.snapshot()) or None, "
                            f"not {type(snapshot).__name__}")
        check_rng(rng, seeds, n, "n")
        own = snapshot is None
        # only cloned, then released; it leaves this env's timeline alone (parent_id, actions)
        snap = self._side_snapshot() if own else snapshot
        try:
            self._check_snapshot(snap)
            _spare_namespace(snap)
            with snap._open_payload() as payload:
                capacity.check_copies(payload, n, max_copies=max_copies)
                # each child's workspace first: its processes may run before the worker answers
                # (a tool server restored with the tree), and see it at the snapshot's paths too
                branches = self._workspace_branches(snap, n, keep_workspace)
                try:
                    roots, binds = self._private_copies(snap, n)
                except BaseException:
                    for b in branches:
                        b.discard(force=True)
                    raise
                ws_binds = [self._workspace_binds(snap, b.path) for b in branches] if branches else []
                per = [[*(binds[i] if binds else ()), *(ws_binds[i] if ws_binds else ())] for i in range(n)]
                handles: list[Handle] = []
                try:
                    reseed = rng == "reseed"
                    if any(per):
                        handles = self._backend.restore_many(payload, n, per, restoring=False, reseed=reseed)
                    elif policies:
                        handles = self._backend.restore_many(payload, n, policies=policies, restoring=False,
                                                             reseed=reseed)
                    else:
                        handles = self._backend.restore_many(payload, n, restoring=False, reseed=reseed)
                    _refuse_unbound_tree(self._backend, handles, snap, [b.path for b in branches])
                except BaseException:
                    for h in handles:  # (Ctrl-C right after they were made; a refusal killed them)
                        h.kill()
                    private_dirs_mod.remove(roots)
                    for b in branches:
                        b.discard(force=True)
                    raise
        finally:
            if own:
                snap.release()
        children: list[ForkableEnv] = []
        try:
            for i, h in enumerate(handles):
                h.worker_polls = snap._worker_polls  # (a copy polls as the snapshot's worker did)
                child = ForkableEnv._from_handle(self._backend, h, snap._mirror, steps=snap.steps,
                                                 parent_id=None if own else snap.id, lineage=self._lineage,
                                                 record_actions=self._record_actions, store=self._store)
                children.append(child)
                child._origin = self._origin
                child._untracked = self._untracked
                if self._private is not None:
                    child._set_private(private_dirs_mod.PrivateDirs(self._private.dirs))
                    child._private.switch(roots[i])
                if branches:
                    child._workspace = branches[i]
                    child._ws_known = tuple(alias for _own, alias in ws_binds[i])
                    child._ws_finalizer = weakref.finalize(child, child._workspace.discard)
                    child._request("setattr", "workspace", child._workspace.path, "unwrapped")
                if rng == "reseed":  # sent to all, then answered: the copies reseed side by side
                    seed = int(seeds[i]) if seeds is not None else int(np.random.SeedSequence().entropy % (2**63))
                    child._handle.send("reseed", seed)
                    child._policy_reseed = True
            if rng == "reseed":
                for child in children:
                    child._handle.receive()
        except BaseException:
            # a failure or Ctrl-C while the children are set up: none is returned, so none may
            # live on (a copy waiting for requests nobody will send, until this process exits)
            with held():
                for child in children:
                    child.close()
                for h in handles[len(children):]:
                    h.kill()
                if roots:
                    private_dirs_mod.remove(roots[i] for i in range(len(handles)) if i >= len(children)
                                            or children[i]._private is None)
                for i, b in enumerate(branches):
                    if i >= len(children) or children[i]._workspace is not b:
                        b.discard(force=True)
            raise
        return children

    def migrate(self, target: Any, *, token: str | bytes | None = None, token_file: str | None = None,
                tls: bool | str = False, timeout: float = 30.0, netns: str | None = None,
                live: bool = False, insecure: bool = False) -> Any:
        """Move this env's worker to the ``gym-fork agent`` at ``target`` ("host:port"); from then
        on steps go over the network (see :mod:`gym_fork.migration.client`). Token: ``token``,
        ``token_file`` or ``$GYM_FORK_TOKEN``. On failure a ``gym_fork.migration`` error is raised
        and the env keeps running locally, unchanged. Returns a report (bytes, timings).

        ``live=True``: pre-copy (:mod:`gym_fork.migration.live`): returns a ``LiveMigration`` at
        once; keep stepping the env -- it switches to the target inside a later ``step()`` after
        the target has replayed (and matched) every request made meanwhile. Pauses are a few ms
        instead of the whole transfer. Only for envs without effects outside their process.

        The connection is TLS, authenticated by the token (which also covers the agent's
        certificate); ``tls=True`` or a CA file checks that certificate against CAs too.
        ``insecure=True``: plain TCP, for an agent started with ``--insecure`` -- anyone on the
        path can then read the env's memory and steps and inject commands into the worker and
        pickles into this process.

        ``target`` may also be ``gym_fork.ray.RayNode(node_id)``: the worker moves to that Ray
        node's host actor, and can move on from there (:mod:`gym_fork.ray.env_migration`)."""
        if not isinstance(target, str) and not hasattr(target, "_gym_fork_migrate"):
            raise TypeError(f"target must be an agent's 'host:port' or a gym_fork.ray.RayNode, not "
                            f"{type(target).__name__}")
        if self._private is not None:
            raise UnsupportedEnvError(f"an env with private_dirs {list(self._private.dirs)} cannot migrate yet: "
                                      "its files stay on this machine; the env keeps running here")
        self._end_live("migrate() was called")
        if live:
            if not isinstance(target, str) and hasattr(target, "_gym_fork_migrate"):
                return target._gym_fork_migrate(self, token=token, timeout=max(timeout, 60.0), live=True)
            from gym_fork.migration.live import migrate_env_live

            return migrate_env_live(self, target, token=token, token_file=token_file, tls=tls, timeout=timeout,
                                    netns=netns, insecure=insecure)
        # stop-and-copy: no other thread's step between the freeze and the switch (it would run
        # on the worker left behind and be lost)
        with self._one_call("a migration was made"):
            if not isinstance(target, str) and hasattr(target, "_gym_fork_migrate"):
                return target._gym_fork_migrate(self, token=token, timeout=max(timeout, 60.0))
            from gym_fork.migration.client import migrate_env

            return migrate_env(self, target, token=token, token_file=token_file, tls=tls, timeout=timeout,
                               netns=netns, insecure=insecure)

    # --- internals -----------------------------------------------------------------------------
    def _end_live(self, why: str) -> None:
        """Cancel a live migration in progress (calls that replace the worker cannot be replayed)."""
        if self._live is not None:
            self._live.cancel(why)

    def _request(self, *args: Any) -> Any:
        if self._closed:
            raise EnvClosedError(f"{args[0]}() on a closed ForkableEnv; create a new one")
        try:
            return self._handle.request(*args)
        except WorkerError as e:
            if e.remote_type == "AttributeError" and args[0] == "getattr":
                raise AttributeError(str(e)) from None
            raise
        except BaseException as e:
            if not isinstance(e, Exception):  # Ctrl-C: the channel resyncs at the next request
                self._after_interrupt(None)
            raise

    def _check_open(self) -> None:
        if self._closed:
            raise EnvClosedError("this ForkableEnv was closed; create a new one")

    def _check_snapshot(self, snapshot: Snapshot) -> Any:
        if not isinstance(snapshot, Snapshot):
            raise TypeError(f"expected a gym_fork.Snapshot, got {type(snapshot).__name__}")
        if snapshot.lineage is None:  # loaded from a bundle: it must be the same env
            if snapshot.env_id != (self.spec.id if self.spec else None):
                raise ForeignSnapshotError(
                    f"snapshot {snapshot.id} is of env {snapshot.env_id!r}, this env is "
                    f"{self.spec.id if self.spec else None!r}; use ForkableEnv.from_snapshot(snapshot)"
                )
        elif snapshot.lineage != self._lineage:
            raise ForeignSnapshotError(
                f"snapshot {snapshot.id} was taken from another env; restore it into that env or one "
                "of its forks"
            )
        if snapshot.backend != self._backend.name:
            raise ForeignSnapshotError(
                f"snapshot {snapshot.id} was taken by backend {snapshot.backend!r}, this env uses "
                f"{self._backend.name!r}"
            )
        if getattr(snapshot, "workspace", None) and self._workspace is None:
            raise ValueError(f"snapshot {snapshot.id} captured a workspace but this env has none; use "
                             "ForkableEnv.from_snapshot(snapshot, workspace=DIR)")
        self._refuse_outside_writes(snapshot)
        return snapshot.payload()  # raises SnapshotReleasedError

    def _warn_address_order(self) -> None:
        """Warn, once per lineage (its first snapshot: one round trip), when the env holds a set
        that iterates by memory address: no copy of it can be exact, and nothing else would say so."""
        try:
            hazard = self._request("order_hazard")
        except Exception:  # noqa: BLE001 - a warning's look, never a reason to fail the snapshot
            return
        if hazard:
            warnings.warn(
                f"gym_fork: the env holds {hazard}. Such a set iterates in the order its objects lie in memory, "
                "which no snapshot keeps (gym_fork's own work allocates differently in a restored copy, and so "
                "does a second run): if the env iterates it, restores and forks may go on differently. Give "
                "the class a __hash__ (an id of its own), or keep the objects in a list or dict.",
                RuntimeWarning, stacklevel=3)

    def _outside_writes(self) -> list[str]:
        """The files this env's worker wrote outside its workspace and ``untracked_paths``, as the
        worker last reported them (ahead of its latest reply: no round trip)."""
        handle = self._handle
        chan = getattr(handle, "chan", None)
        if chan is not None:
            if getattr(chan, "spawned", False) and not self._closed:
                # the env's processes write at any time, not only inside a step: one more look
                # (the worker reads the kernel's record of changes ahead of its answer)
                try:
                    handle.request("ping")
                except WorkerDiedError:
                    # crashed: what it reported last is all there is (a restore is how the env
                    # goes on: it must not fail on the dead worker), as for an env that never
                    # started a process (see "When a worker crashes" in docs/guide/snapshots.md)
                    pass
            record = getattr(chan, "files", None)
        else:  # in-process (pickle backend): the handle's own record
            written = getattr(handle, "written", None)
            record = written.current() if written is not None else None
        ws = self._workspace.path if self._workspace is not None else None
        return files.outside(record, ws, self._untracked)

    def _refuse_outside_writes(self, snapshot: Snapshot | None = None) -> None:
        """Raise UncapturedFilesError when this env wrote files no snapshot holds: for a new
        snapshot (``snapshot`` None), or before going back to ``snapshot``."""
        paths = self._outside_writes()
        if not paths:
            return
        procs = [p for p in paths if p.startswith(files.PROCESS)]
        if procs:  # an in-process env (pickle backend) started processes: their writes go unseen
            what = ", ".join(p[len(files.PROCESS):-1] for p in procs[:3])
            msg = (f"gym_fork cannot {'snapshot this env' if snapshot is None else f'go back to snapshot {snapshot.id}'} "
                   f"exactly: with backend='pickle' the env runs in this process, and it started processes "
                   f"({what}) whose writes to files gym_fork cannot see here. To fix: use the default backend "
                   "(the env runs in a worker process, where the files its processes write are seen and "
                   "refused by path, or captured in its workspace=DIR). "
                   + ("No snapshot was kept; the env keeps running." if snapshot is None
                      else "Nothing was changed; the env keeps running."))
            raise UncapturedFilesError(msg, paths)
        shown = ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
        dirs = sorted({os.path.dirname(p) for p in paths if p.startswith("/")})[:3]
        fix = ("To fix: declare the directories private (ForkableEnv(..., private_dirs="
               f"{dirs or ['DIR']}), root: every copy of the env then works in its own copy of them, at the "
               "same paths, captured with every snapshot), or keep such files in the env's workspace "
               "(ForkableEnv(..., workspace=DIR)), or, for files whose content need not come back (logs, "
               "caches), declare them with ForkableEnv(..., untracked_paths=[PATH or PATTERN, ...]).")
        if snapshot is None:
            raise UncapturedFilesError(
                f"gym_fork cannot snapshot this env exactly: it wrote {shown} outside its workspace, and no "
                "snapshot holds the content of such files (a restore would find them as they are then, and "
                f"forked copies would all write the same files). {fix} No snapshot was kept; the env keeps "
                "running.", paths)
        raise UncapturedFilesError(
            f"gym_fork cannot go back to snapshot {snapshot.id} exactly: this env wrote {shown} outside "
            "its workspace, and a restore or fork would bring back the env's memory of that moment but "
            f"leave these files as they are now. {fix} Nothing was changed; the env keeps running.", paths)

    def _set_private(self, pd: Any) -> None:
        self._private = pd
        self._untracked = (*self._untracked, *pd.dirs, os.path.join(sessiondir.session_dir(), "pdl-*"))
        self._private_finalizer = weakref.finalize(self, pd.discard)

    def _workspace_branches(self, snapshot: Snapshot, n: int, keep: bool) -> list[Workspace]:
        """A new workspace directory for each of ``n`` fork() children, holding ``snapshot``'s
        files (none when this env has no workspace or the snapshot captured none)."""
        if self._workspace is None or not getattr(snapshot, "workspace", None):
            return []
        out: list[Workspace] = []
        try:
            for _ in range(n):
                out.append(self._workspace.branch(snapshot.workspace, uuid.uuid4().hex[:8], keep=keep))
        except BaseException:
            for b in out:
                b.discard(force=True)
            raise
        return out

    def _workspace_binds(self, snapshot: Snapshot, own: str | None) -> list[tuple[str, str]]:
        """The binds a worker restored from ``snapshot`` into the workspace ``own`` runs with:
        ``(own, path)`` for every other path the snapshot's processes may know the workspace by
        (:func:`gym_fork.snapshots.workspace.binds_for`) -- a tool server started with
        ``cwd=workspace`` or given its path, restored with the tree, then works in ``own`` and
        never in the directory of the env the snapshot was taken from.  Only where the backend
        gives workers mount namespaces (criu, as root); elsewhere ``[]`` (the worker's audit hook
        still refuses the env's own use of the old path, see :mod:`gym_fork.worker.files`)."""
        if own is None or not getattr(snapshot, "workspace", None) or not _can_bind(self._backend):
            return []
        return workspace_binds(snapshot, own)

    def _private_copies(self, snapshot: Snapshot, n: int) -> tuple[list[str], list | None]:
        """Fresh copies of ``snapshot``'s private directories for ``n`` new workers: ``(their
        roots, binds per worker)``, or ``([], None)`` for an env without private directories."""
        captured = getattr(snapshot, "private_dirs", None)
        if self._private is None and captured is None:
            return [], None
        if self._private is None or captured is None or snapshot.private_dirs_paths != self._private.dirs:
            raise ValueError(f"snapshot {snapshot.id} holds private directories "
                             f"{list(snapshot.private_dirs_paths or ())} but this env has "
                             f"{list(self._private.dirs) if self._private else 'none'}: restore it in an env "
                             "made with the same private_dirs")
        roots: list[str] = []
        binds = []
        try:
            for _ in range(n):
                root, b = self._private.new_copy(captured)
                roots.append(root)
                binds.append(b)
        except BaseException:
            private_dirs_mod.remove(roots)
            raise
        return roots, binds

    def private_dir_view(self, path: str) -> str:
        """Where this env's worker sees its private directory ``path``, as a path on the host:
        ``path`` itself until the first ``restore()``; a private copy after it (and in every
        ``fork()`` child).  Read the env's files there.

        Raises:
            KeyError: ``path`` is not one of this env's ``private_dirs``.
        """
        if self._private is None:
            raise KeyError(f"{path}: this env has no private_dirs")
        return self._private.view(path)

    def _switch_to(self, new: Handle, snapshot: Snapshot) -> None:
        """Run on ``new``, a worker restored from ``snapshot``; the old worker is stopped."""
        # The new worker polls for requests as the snapshot's did; told where this env's differs
        # (a vector env's slot, polling off, restored from a snapshot taken elsewhere, or back).
        # Before the switch: where that fails (the new worker died), the env runs on as it was.
        polls, new.worker_polls = self._handle.worker_polls, snapshot._worker_polls
        if new.worker_polls != polls:  # (off: the snapshot is this process's, its worker knows the request)
            try:
                new.set_worker_polling(polls, tell_only=not new.worker_polls)
            except BaseException:
                new.kill()
                raise
        old = self._swap_worker(new)
        new.adopt_pace(old)
        if type(old) is RemoteHandle and self._workspace is None and self._private is None:
            # told to go, off the learner's path (see RemoteHandle.retire): where that is just its
            # channel's EOF and it sleeps (waking it costs 0.1-0.2 ms here), once the new worker's
            # first request is out, while that one computes its answer
            if isinstance(new, RemoteHandle) and old.retires_by_eof() and old.worker_sleeps():
                new.defer(old.retire)
            else:
                old.retire()
        else:
            # a thread of the old copy's env must not write into files restored right after this,
            # nor a process it started (a file watcher): kill() waits until those are gone
            old.await_env_exit = True
            old.kill()
        self._steps = snapshot.steps
        self._parent_id = snapshot.id
        if self._actions is not None:
            self._actions = []
        self._adopt_meta(snapshot._mirror)

    def _adopt_meta(self, meta: dict | None) -> None:
        """Mirror the worker's spaces, metadata, render_mode and spec as they were at the snapshot
        it now runs from (set through ``env.unwrapped`` after it, they went back with the restore);
        a loaded snapshot's are asked of the worker."""
        if meta is None:
            meta = self._handle.request("meta")
        if meta is self._meta:
            return
        self._meta = meta
        self.env._adopt(meta)

    # --- internal API for migration, vector envs and plugins --------------------------------------
    def _set_worker_polling(self, on: bool) -> None:
        """Whether this env's worker polls for its next request before sleeping (on by default:
        see :class:`~gym_fork.worker.channel.SpinWait`). A vector env turns it off where its
        workers and the learner outnumber the CPUs: polling workers then take the CPU that
        another one, or the learner, waits for. Kept by this env's restores and by copies of its
        snapshots."""
        if on != self._handle.worker_polls:
            with self._one_call("the worker's polling was set"):
                self._handle.set_worker_polling(on)

    def _swap_worker(self, new: Handle) -> Handle:
        """From now on talk to ``new`` (and stop it if this env is garbage-collected unclosed).

        Returns:
            The previous handle, still running: the caller stops it (``kill()``) or keeps it.
        """
        old, self._handle = self._handle, new
        self._box[0] = new
        return old

    def _leave_namespace_init(self) -> None:
        """Run on from a copy of the current state, the worker it replaces retired into a reaper
        that holds its PID namespace open (as after any restore): see :func:`_spare_namespace`.
        The env's timeline (parent, actions, steps) is left as it was. Where the switch fails,
        the env runs on as before. Not with ``private_dirs``: the frozen snapshots its worker
        took work in that worker's private copy, which a switch would let go (not built)."""
        if self._private is not None:
            return
        parent, actions = self._parent_id, None if self._actions is None else list(self._actions)
        try:
            snap = self._side_snapshot()  # (a copy ahead would save nothing: the clone waits for this fork)
        except Exception as e:  # noqa: BLE001 - the env runs on as it was
            log.debug("gym_fork: the env stays on its namespace's init (%s: %s)", type(e).__name__, e)
            return
        try:
            snap._namespace_of = None  # (this very switch)
            self._restore(snap)
        except Exception as e:  # noqa: BLE001 - the env runs on as it was
            log.debug("gym_fork: the env stays on its namespace's init (%s: %s)", type(e).__name__, e)
        finally:
            self._parent_id, self._actions = parent, actions
            snap.release()

    def _side_snapshot(self) -> Snapshot:
        """A snapshot of the current state that leaves the env's timeline alone: the next user
        snapshot's ``parent_id`` and ``actions`` are as if it had never been taken, and it is not
        one of this env's snapshots (``close()`` does not release it: the caller does).

        Raises:
            As :meth:`snapshot`.
        """
        parent, actions = self._parent_id, None if self._actions is None else list(self._actions)
        try:
            snap = self._snapshot(ready_copy=False)  # dumped or shipped, not restored here
        finally:
            self._parent_id, self._actions = parent, actions
        self._snapshots.pop(snap.id, None)
        return snap

    def _after_interrupt(self, settle: Callable[[], Any] | None) -> None:
        """A request was interrupted (Ctrl-C): no hold on the handle's gate may outlive it, and if
        the worker got the request it runs it all the same: ``settle()`` accounts for it once the
        next request has resynced the channel, by asking the worker (a step the worker took and
        this env did not count would leave ``steps`` and the recorded actions a step behind the
        env: a snapshot's ``actions`` would replay elsewhere)."""
        self._handle.interrupted(settle)

    def _give_up_request(self, settle: Callable[[], Any]) -> None:
        """After Ctrl-C, for a request in flight that no one will receive (a vector env's step or
        reset, an interrupted step_receive() or rollout): its send no longer holds the channel,
        and what the worker did is settled (``settle()``) after the next resync."""
        handle = self._handle
        if getattr(handle, "_on_drain", None) is None:  # (else its own handler has done it)
            # also when no reply is pending: it may have been read, and not yet accounted for
            handle._send_holds = False
            self._after_interrupt(settle)

    def _settle_interrupted(self) -> None:
        """Account now for what an interrupted request did (it is settled at the next request
        otherwise): for :attr:`steps` and a snapshot's ``actions``, read right after Ctrl-C."""
        if getattr(self._handle, "_on_drain", None) is not None and not self._closed:
            self._worker_steps()  # (its request resyncs first, which settles)

    def _worker_steps(self) -> int | None:
        """The worker's step count since its last reset (None: it cannot say)."""
        try:
            return int(self._handle.request("steps"))
        except WorkerError as e:  # (an older gym_fork's worker knows no "steps": "last" says it too)
            if not (isinstance(e, ValueError) and "unknown worker command" in str(e)):
                return None
        except Exception:  # noqa: BLE001 - a dead worker: nothing to account for
            return None
        try:
            return int(self._handle.request("last")[2])
        except Exception:  # noqa: BLE001 - as above
            return None

    def _account_unanswered_step(self, action: Any, *, counted: bool, may_reset: bool) -> None:
        """A step that ran but whose reply could not come back (:func:`ran_unanswered`): counted
        (``counted``: it is already); sent with ``reset_at_end``, the reset that may have followed
        it in the same request is accounted for as the worker says."""
        if not counted:
            self._record_step(action)
        if may_reset:
            self._settle_step(action, may_reset=True)

    def _settle_step(self, action: Any, *, may_reset: bool = False) -> None:
        """After an interrupted step (counted or not, by step_send()): counted when the worker
        took it, not when it did not. ``may_reset``: a reset may have been in flight instead (a
        vector env's auto-reset)."""
        n = self._worker_steps()
        if n is None or n == self._steps:
            return
        if n == self._steps + 1:
            self._record_step(action)
        elif n == 0 and may_reset:  # (a step never brings the count to 0)
            self._record_reset()
        elif n == self._steps - 1:
            self._unrecord_step()
        else:  # (not one step apart: at least the count is right)
            self._steps = n

    def _settle_reset(self) -> None:
        if self._worker_steps() == 0:
            self._record_reset()

    def _settle_rollout(self) -> None:
        try:
            progress = self._handle.request("rollout_progress")
        except Exception:  # noqa: BLE001 - a dead worker: nothing to account for
            return
        if "id" in progress:
            # None: no rollout ran on this worker since its snapshot (nor on this one: never
            # sent); a name: the rollout that ran last, accounted for unless it is not the last
            # this env accounted for (names are drawn afresh: a copy's cannot be an old one)
            if progress["id"] not in (None, self._rollout_id):
                self._account_rollout(progress)
        elif progress["steps"] != self._steps:  # a worker of an older gym_fork: by its count
            self._account_rollout(progress)

    def _unrecord_step(self) -> None:
        """Undo :meth:`_record_step` (a step sent with step_send() that the env refused)."""
        self._steps -= 1
        if self._actions:
            self._actions.pop()

    def _record_step(self, action: Any) -> None:
        """Account for one step the worker took with ``action`` (step count, recorded actions)."""
        action = own_action(action)
        self._steps += 1
        if self._actions is not None:
            self._actions.append(action)

    def _record_reset(self) -> None:
        """Account for a reset of the worker: step 0 of a new timeline."""
        self._steps = 0
        self._parent_id = None
        if self._actions is not None:
            self._actions = []

    def _use_backend(self, backend: Backend) -> None:
        """From now on ``backend`` takes this env's snapshots and restores (a migrated env's
        stand-in, which refuses them with the reason)."""
        self._backend = backend

    def _track_live(self, migration: Any) -> None:
        """``migration`` (a ``LiveMigration``) now runs for this env; None: it ended.  Calls that
        replace the worker cancel a running one first."""
        self._live = migration

    def _set_steps(self, steps: int) -> None:
        """The worker was stepped past this env (through a bridge to it): its step count is ``steps``."""
        self._steps = steps

    def _share_lineage(self, other: "ForkableEnv") -> None:
        """Declare this env interchangeable with ``other`` (same source, same wrappers): from now
        on its snapshots restore into ``other`` and ``other``'s into it."""
        self._lineage = other._lineage

    def _hand_over(self, snapshot: Snapshot, to: "ForkableEnv") -> None:
        """Make ``snapshot`` (taken here) belong to ``to``: released when ``to`` is closed, not
        when this env is."""
        self._snapshots.pop(snapshot.id, None)
        to._snapshots[snapshot.id] = snapshot

    def __repr__(self) -> str:
        env_id = self._meta["spec"].id if self._meta.get("spec") else self._meta["unwrapped_type"]
        return f"<ForkableEnv {env_id} backend={self.backend} pid={self.worker_pid}>"


def _kill_boxed(box: list) -> None:
    box[0].kill()


def make(id: str | gym.envs.registration.EnvSpec, *, backend: str | Backend = "auto",
         verify: Literal["full", "sha256", "size"] = "full",
         record_actions: bool = True, worker_log: str | None = None,
         fork_tier: bool | Literal["auto"] = "auto", store: Any = None, workspace: str | None = None,
         private_network: bool = False, wrappers: Sequence[Callable[[gym.Env], gym.Env]] | None = None,
         untracked_paths: Sequence[str] | None = None, private_dirs: str | Sequence[str] | None = None,
         **kwargs: Any) -> ForkableEnv:
    """The :func:`gymnasium.make` twin: ``gym_fork.make("LunarLander-v3", continuous=True)``
    (an ``EnvSpec`` works too, as there).

    ``store``, ``workspace``, ``private_network``, ``wrappers``, ``untracked_paths`` and
    ``private_dirs`` are :class:`ForkableEnv`'s.
    Keyword arguments other than gym_fork's own go to ``gymnasium.make`` in the worker.

    Example:
        >>> import gym_fork
        >>> from gymnasium.wrappers import RecordEpisodeStatistics
        >>> env = gym_fork.make("CartPole-v1", wrappers=[RecordEpisodeStatistics])
        >>> _ = env.reset(seed=0)
        >>> for _ in range(3):
        ...     _ = env.step(0)
        >>> env.get_wrapper_attr("episode_lengths")   # the wrapper runs in the worker, in every snapshot
        3
        >>> env.close()
    """
    return ForkableEnv(id, backend=backend, env_kwargs=kwargs, verify=verify,
                       record_actions=record_actions, worker_log=worker_log, fork_tier=fork_tier,
                       store=store, workspace=workspace, private_network=private_network, wrappers=wrappers,
                       untracked_paths=untracked_paths, private_dirs=private_dirs)


def start_envs(sources: Sequence[Any], **kwargs: Any) -> list[ForkableEnv]:
    """One :class:`ForkableEnv` per source (an env id, factory or instance; ``kwargs`` are
    ForkableEnv's), started concurrently: a worker spends most of its start-up importing.

    Raises:
        The first start's error, after closing the envs that did start.
    """
    if len(sources) == 1:
        return [ForkableEnv(sources[0], **kwargs)]
    from concurrent.futures import ThreadPoolExecutor  # not at import: env workers import this module

    with ThreadPoolExecutor(max_workers=min(len(sources), 16)) as pool:
        futures = [pool.submit(ForkableEnv, src, **kwargs) for src in sources]
    envs, error = [], None
    for future in futures:
        try:
            envs.append(future.result())
        except Exception as e:  # noqa: BLE001 - raised below, after closing the others
            error = error or e
    if error is not None:
        for env in envs:
            env.close()
        raise error
    return envs


def share_cpus(envs: Sequence[ForkableEnv]) -> None:
    """Where ``envs`` (a vector env's slots, stepped together) and the learner outnumber the CPUs
    this process may run on, their workers sleep at once between requests instead of polling for
    the next: a polling worker then holds a CPU that another worker, or the learner, waits for
    (CartPole, 4 slots on 2 CPUs: a batch takes 0.81x the time it took with polling).
    With a CPU each, they poll as a single env's worker does."""
    if len(envs) + 1 > len(os.sched_getaffinity(0)):
        set_workers_polling(envs, False)


def set_workers_polling(envs: Sequence[ForkableEnv], on: bool) -> None:
    """:meth:`ForkableEnv._set_worker_polling` for each of ``envs``, all at once: every ``poll``
    request is sent before any answer is read (:class:`WorkerCall`), so the workers answer at the
    same time (the 16 copies of an ``explore()``, LunarLander: 2.4-3.0 ms one after another, now
    0.9-1.4 ms). A worker from before the request existed keeps polling, as in
    :meth:`~gym_fork.backends.base.RemoteHandle.set_worker_polling`.

    Raises:
        The first error (a worker that died), once every request sent has been answered.
    """
    todo = [e for e in envs if not e._closed and on != e._handle.worker_polls]
    for env in todo:
        if not isinstance(env._handle, RemoteHandle):  # (in process: nothing polls, nothing to ask)
            env._handle.set_worker_polling(on)
    remote = [e for e in todo if isinstance(e._handle, RemoteHandle)]
    results, error = collect_calls([WorkerCall(e, "poll", (None if on else 0.0,)) for e in remote],
                                    tolerate_unknown=True)
    for env, result in zip(remote, results):
        if result is not FAILED:
            env._handle.worker_polls = on if result is not UNKNOWN else True
    if error is not None:
        raise error


class WorkerCall:
    """One request to one ForkableEnv's worker, sent now and answered by :meth:`result`.

    The request goes out at construction (``Handle.send``), so the workers of all calls created
    before the first ``result()`` compute concurrently; the in-process pickle backend just runs
    the command then. Errors (a dead worker, an exception in the env) surface from ``result()``,
    never earlier, so a caller can always collect every reply and keep every channel in
    request/reply step.
    """

    __slots__ = ("env", "handle", "cmd", "args", "error", "sent")

    def __init__(self, env: ForkableEnv, cmd: str, args: tuple = ()):
        self.env, self.cmd, self.args = env, cmd, args
        self.error: BaseException | None = None
        self.sent = False
        if env.closed:
            self.error = EnvClosedError(f"{cmd}() on a closed ForkableEnv; create a new one")
            return
        self.handle = env._handle
        if hasattr(self.handle, "send"):  # a handle without send/receive is asked in result()
            try:
                self.handle.send(cmd, *args)
                self.sent = True
            except Exception as e:  # noqa: BLE001 - reported by result()
                self.error = e

    def result(self) -> Any:
        """The reply; raises what the request raised (kept in :attr:`error`: the caller may ask
        whether it ran all the same, :func:`ran_unanswered`)."""
        if self.error is not None:
            raise self.error
        try:
            if self.sent:
                return self.handle.receive()
            return self.handle.request(self.cmd, *self.args)
        except WorkerError as e:
            self.error = e
            # Like ForkableEnv._request: a missing attribute is a plain AttributeError.
            if e.remote_type == "AttributeError" and self.cmd == "getattr":
                raise AttributeError(str(e)) from None
            raise
        except Exception as e:
            self.error = e
            raise


FAILED = object()
UNKNOWN = object()


def ran_unanswered(error: BaseException) -> bool:
    """Whether ``error``, from a worker's reply, says the request ran but what it returned could
    not come back (a :class:`~gym_fork.errors.NotSendableError` from the worker; one raised here
    while sending means nothing ran)."""
    return isinstance(error, WorkerError) and isinstance(error, NotSendableError)


def take_autoreset(env: ForkableEnv, info: Any) -> tuple[Any, dict] | None:
    """The ``(obs, info)`` of the reset that ``env``'s worker made right after a step that ended
    the episode (a step sent with ``reset_at_end``), taken out of that step's ``info`` (the
    worker's own copy of the env's dict) and accounted for as the env's reset. None where the
    worker did not reset: an older gym_fork's, which the caller resets with a request of its own.

    Raises what the env's reset raised there (a :class:`~gym_fork.errors.WorkerError`, as a
    reset request's error would be), after taking it out of ``info``: the step stands (the
    caller has counted it), the reset does not, and the env needs ``reset()`` as after any
    failed reset."""
    if type(info) is not dict:
        return None
    failed = info.pop(AUTORESET_ERROR_KEY, None)
    if failed is not None:
        type_name, message, traceback_text = failed
        error = remote_exception(type_name, message, traceback_text)
        error.args = (f"{error} (in the reset right after a step that ended the episode; that step "
                      "was taken and counted, and the env needs reset() before its next step)",)
        raise error
    reset = info.pop(AUTORESET_KEY, None)
    if reset is not None:
        env._record_reset()
    return reset


def collect_calls(calls: Sequence[WorkerCall], *, tolerate_unknown: bool = False) -> tuple[list[Any], BaseException | None]:
    """Every call's result (``FAILED`` where it raised) and the first error, if any.
    ``tolerate_unknown``: a worker of an older gym_fork that does not know the request answers
    ``UNKNOWN``, no error.

    All replies are read even after a failure: an unread reply would desynchronize its channel.
    """
    results: list[Any] = []
    first: BaseException | None = None
    for call in calls:
        try:
            results.append(call.result())
        except Exception as e:  # noqa: BLE001 - re-raised below, after the other replies
            if tolerate_unknown and isinstance(e, ValueError) and "unknown worker command" in str(e):
                results.append(UNKNOWN)
                continue
            results.append(FAILED)
            first = first or e
    return results, first


def check_rng(rng: str, seeds: Sequence[int] | None, n: int, what: str) -> None:
    """Check ``fork()``'s randomness arguments for ``n`` copies (``what`` names ``n`` in the message).

    Raises:
        ValueError: ``rng`` is not ``"same"`` or ``"reseed"``, or ``seeds`` is given without
            ``rng="reseed"`` or not with exactly ``n`` entries.
    """
    if rng not in ("same", "reseed"):
        raise ValueError(f"rng must be 'same' or 'reseed', not {rng!r}")
    if seeds is not None and (rng != "reseed" or len(seeds) != n):
        raise ValueError(f"seeds needs rng='reseed' and exactly {what} entries")


def close_envs(envs: Sequence[ForkableEnv]) -> None:
    """Close every env in ``envs``, also when one fails to close. Their workers close their envs
    at the same time (every polite ``close`` is sent before any reply is read).

    Raises:
        The first ``close()`` error, after trying all of them.
    """
    for env in envs:
        env._begin_close()
    error = None
    for env in envs:
        try:
            env.close()
        except Exception as e:  # noqa: BLE001 - close the others anyway
            error = error or e
    if error is not None:
        raise error


def _own_attr(env: ForkableEnv, name: str) -> bool:
    """Whether ``name`` is the ForkableEnv's own (its class's or set on it), not the worker env's:
    Gymnasium's ``hasattr(self, name)`` check, which a Wrapper without ``__getattr__`` passes
    only for its own attributes."""
    return hasattr(type(env), name) or name in env.__dict__


def _spare_namespace(snap: Snapshot, into: Sequence["ForkableEnv"] = ()) -> None:
    """Before ``snap`` is copied into the envs ``into`` (whose workers the copies replace) or into
    new ones: where ``snap`` is a frozen process in the PID namespace of the worker that the env
    which took it still runs on -- that namespace's init: the env's first worker, or one CRIU
    restored --, that env first moves to a copy of its current state
    (:meth:`ForkableEnv._leave_namespace_init`).

    Why: a namespace, and every process in it, ends with its init. A copy of ``snap`` made for
    another env (a fork, another slot of a vector env, a branch) would die with the taking env's
    worker -- a crash of one env (a segfault, the OOM killer) would take envs that are
    independent of it. The taking env's own restores need none of this: the worker a restore
    replaces retires into a reaper that holds the namespace open. The taking env's own
    copy-on-write snapshots still end with it: keep those with ``persist()``. The price, once
    per such worker: two forks in a row (~10 ms for LunarLander here), and that env now runs
    as a copy, which (as after any restore) cannot be dumped with child processes it starts
    later."""
    mark = snap._namespace_of
    if mark is None:
        return
    owner, handle = mark[0](), mark[1]()
    if any(owner is env for env in into):
        return  # (a copy replaces its worker too, which retires into a reaper)
    snap._namespace_of = None
    if owner is None or owner.closed or handle is None or owner._handle is not handle or handle.closed:
        return  # (closed, or moved on: the namespace's init is a reaper already)
    owner._leave_namespace_init()


def _refuse_unbound_tree(backend: Backend, handles: Sequence[Handle], snapshot: Snapshot, owns: Sequence[str]) -> None:
    """Where workers get no mount namespace (no root): refuse new workers (restored from
    ``snapshot`` into the workspaces ``owns``) with a process in their tree that knows the
    workspace by a path that is not theirs -- started there, or given it in its arguments or
    environment -- which would go on working in another env's files.  The handles are killed
    (and the error raised) before anything was switched to them."""
    if (backend.name != "criu" or not getattr(snapshot, "workspace", None) or _can_bind(backend)
            or len(owns) != len(handles)):
        return
    from gym_fork.backends.treecapture import tree_process_naming

    for handle, own in zip(handles, owns):
        others = [a for a in aliases_of(snapshot) if a != own]
        hit = tree_process_naming(handle.pid, others) if others and handle.pid else None
        if hit is not None:
            for h in handles:
                h.kill()
            raise UnsupportedEnvError(
                f"gym_fork: a process of snapshot {snapshot.id}'s tree knows the workspace by a path that is not "
                f"this copy's ({hit}); the copy works in {own}, and without root gym_fork cannot show it its own "
                "directory at that path (a mount namespace per copy needs CAP_SYS_ADMIN): the process would go on "
                "working in another env's files. Run as root, or have the env start such tools during a step, "
                "from self.workspace, instead of keeping them running across snapshots. Nothing was changed.")


def _can_bind(backend: Backend) -> bool:
    """Whether ``backend`` can start a worker in a mount namespace of its own with binds (the
    criu backend as root: a CRIU restore, from a fork-tier snapshot too, or -- without CRIU -- a
    fork-tier copy binding at its first request; see ``CriuBackend.restore_many``)."""
    return backend.name == "criu" and getattr(backend, "mode", None) in ("root", "fork") and os.geteuid() == 0


def _private_dirs_backend(backend: str | Backend) -> str | Backend:
    """The backend for an env with ``private_dirs``: CRIU as root (mount namespaces)."""
    if os.geteuid() != 0:
        raise BackendUnavailableError("private_dirs needs root: each copy of the env gets a mount namespace "
                                      "of its own (run as root, or use workspace=DIR)")
    if backend == "auto":
        return "criu"
    if backend == "pickle" or getattr(backend, "name", None) == "pickle":
        raise BackendUnavailableError("private_dirs needs backend 'criu' (mount namespaces per copy), not pickle")
    return backend

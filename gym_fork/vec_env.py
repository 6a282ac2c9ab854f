"""``ForkableVecEnv``: a Stable-Baselines3 ``VecEnv`` over N :class:`~gym_fork.ForkableEnv` workers.

It behaves like SB3's ``SubprocVecEnv`` (every env in its own process, stepped in parallel,
auto-reset on done, ``terminal_observation`` and ``TimeLimit.truncated`` in the infos), and adds
per-slot snapshots: :meth:`ForkableVecEnv.snapshot`, :meth:`ForkableVecEnv.restore` and
:meth:`ForkableVecEnv.fork_into`.  Needs ``stable-baselines3`` (``pip install gym_fork[sb3]``).
"""

from __future__ import annotations

import contextlib
import copy
import re
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal

import gymnasium as gym
import numpy as np
from stable_baselines3.common.vec_env.base_vec_env import (VecEnv, VecEnvIndices, VecEnvObs, VecEnvStepReturn,
                                                           VecEnvWrapper)
from stable_baselines3.common.vec_env.subproc_vec_env import _stack_obs

from gym_fork.backends.base import Backend
from gym_fork.env import (FAILED, ForkableEnv, WorkerCall, _refuse_unbound_tree, _spare_namespace, check_rng, close_envs,
                          collect_calls, ran_unanswered, share_cpus, start_envs, take_autoreset)
from gym_fork.errors import EnvClosedError, IncompleteStepError, WorkerError
from gym_fork.interrupts import held
from gym_fork.snapshots import private_dirs
from gym_fork.snapshots.snapshot import Snapshot
from gym_fork.snapshots.workspace import remove_dirs

EnvSpecifier = str | Callable[[], gym.Env] | gym.Env


# --- requests to many workers at once ----------------------------------------------------------
def _abandon(envs: Sequence[ForkableEnv], actions: Sequence[Any] | None = None) -> None:
    """After Ctrl-C: every sub-env's request in flight is given up here and settled after the
    env's next resync: a step (its action in ``actions``) or its auto-reset; without
    ``actions``, a reset."""
    for i, env in enumerate(envs):
        if actions is None:
            env._give_up_request(env._settle_reset)
            continue
        action = actions[i].copy() if isinstance(actions[i], np.ndarray) else actions[i]
        env._give_up_request(lambda env=env, action=action: env._settle_step(action, may_reset=True))


def _run(envs: Sequence[ForkableEnv], cmd: str, args: Sequence[tuple] | tuple = ()) -> list[Any]:
    """``cmd`` on every env concurrently; ``args`` is one tuple for all or one tuple per env."""
    per_env = args if args and isinstance(args, list) else [args] * len(envs)
    results, error = collect_calls([WorkerCall(env, cmd, a) for env, a in zip(envs, per_env, strict=True)])
    if error is not None:
        raise error
    return results


# --- ForkableEnv bookkeeping (mirrors ForkableEnv.step / reset) --------------------------------
def _note_step(env: ForkableEnv, action: Any) -> None:
    """What ``ForkableEnv.step`` records after the worker stepped."""
    env._record_step(action)  # (a copy of it: SB3 may reuse its action array, and a row is a view)


class ForkableVecEnv(VecEnv):
    """A vectorized env of N :class:`~gym_fork.ForkableEnv` workers that step in parallel,
    where any slot can be snapshotted, restored or overwritten with a snapshot of any other.

    It follows SB3's ``SubprocVecEnv`` conventions exactly: ``step_async`` sends every worker its
    action before ``step_wait`` reads any reply (so the envs compute concurrently); a finished
    episode is reset at once, with the last observation in ``info["terminal_observation"]`` and
    ``info["TimeLimit.truncated"] = truncated and not terminated``; ``seed()`` / ``set_options()``
    apply at the next ``reset()``; ``get_attr``, ``set_attr``, ``env_method``, ``env_is_wrapped``,
    ``render`` and ``get_images`` reach into the worker's env stack the way SB3's worker does.

    All N slots share one *lineage* (the id a snapshot checks before it is restored), because they
    are built from the same source: a snapshot taken in one slot can be restored into any slot.

    Example:
        >>> import numpy as np
        >>> from gym_fork.vec_env import ForkableVecEnv
        >>> venv = ForkableVecEnv("CartPole-v1", n_envs=4, seed=0)
        >>> obs = venv.reset()
        >>> obs.shape
        (4, 4)
        >>> obs, rewards, dones, infos = venv.step(np.array([0, 1, 0, 1]))
        >>> snap = venv.snapshot(0)                   # slot 0, now
        >>> branch_obs = venv.fork_into(snap, [1, 2, 3])  # slots 1-3 continue from there
        >>> bool((branch_obs == obs[0]).all())
        True
        >>> obs, *_ = venv.step(np.array([1, 1, 1, 1]))
        >>> all((obs[i] == obs[0]).all() for i in range(4))
        True
        >>> venv.close()

    With an SB3 algorithm, a slot changed *during* ``learn()`` (in a callback) must also be
    changed in the algorithm's copy of the current observation, which it keeps itself::

        model._last_obs = venv.current_obs

    Args:
        env: an env id (like ``gymnasium.make``), a zero-argument factory, an env instance (each
            worker gets its own pickled copy), a list of factories (one per slot, like
            ``SubprocVecEnv``'s ``env_fns``), or a list of ForkableEnvs (see :meth:`from_envs`).
        n_envs: how many slots (default 1); must be ``None`` or the list's length for a list.
        backend: ``"auto"``, ``"criu"`` or ``"pickle"`` (see :class:`~gym_fork.ForkableEnv`).
            ``"pickle"`` runs every env in this process: no parallelism.
        env_kwargs: keyword arguments for ``gymnasium.make`` when ``env`` is an id.
        seed: calls :meth:`seed`, so the first ``reset()`` seeds slot ``i`` with ``seed + i``.
        start_method: accepted as ``SubprocVecEnv`` accepts it (``"fork"``, ``"spawn"``,
            ``"forkserver"`` or None), so ``make_vec_env(..., vec_env_kwargs=dict(start_method=...))``
            works unchanged.  It changes nothing: every worker is a fresh Python process (as with
            ``"spawn"``) that receives the env factory by cloudpickle, as ``SubprocVecEnv``'s
            workers receive theirs under every start method.
        **forkable_kwargs: passed to every :class:`~gym_fork.ForkableEnv` (``verify``,
            ``record_actions``, ``worker_log``, ...).

    Attributes:
        envs: the slots' ForkableEnvs. Stepping one directly bypasses this VecEnv's bookkeeping
            (:attr:`current_obs`, ``reset_infos``); use the VecEnv API instead.
    """

    def __init__(self, env: EnvSpecifier | Sequence[EnvSpecifier] | Sequence[ForkableEnv],
                 n_envs: int | None = None, *, backend: str | Backend = "auto", env_kwargs: dict | None = None,
                 seed: int | None = None, start_method: str | None = None, **forkable_kwargs: Any):
        _check_start_method(start_method)
        if isinstance(env, (list, tuple)):
            if n_envs is not None and n_envs != len(env):
                raise ValueError(f"n_envs={n_envs} but {len(env)} envs were given")
            if env and all(isinstance(e, ForkableEnv) for e in env):
                self._init(self._check_envs(list(env)), seed)
                return
            if any(isinstance(e, ForkableEnv) for e in env):
                raise TypeError("mix of ForkableEnvs and env sources; pass one kind")
            sources = list(env)
        else:
            sources = [env] * (1 if n_envs is None else n_envs)
        if not sources:
            raise ValueError("need at least one env")
        envs = start_envs(sources, backend=backend, env_kwargs=env_kwargs, **forkable_kwargs)
        # One lineage for all slots: they come from the same source, so a snapshot of one slot is
        # a valid state for every other (ForkableEnv checks the lineage on restore).
        for e in envs[1:]:
            e._share_lineage(envs[0])
        self._init(envs, seed)

    @classmethod
    def from_envs(cls, envs: Sequence[ForkableEnv], *, share_lineage: bool = False,
                  seed: int | None = None) -> "ForkableVecEnv":
        """A ForkableVecEnv over already-built ForkableEnvs; it owns them from now on (``close()``
        closes them).

        Snapshots move between slots only when the slots share a lineage: forks of one env do;
        independently built envs do when ``share_lineage=True`` declares them interchangeable
        (same env, same wrappers). Their earlier snapshots then only restore into slot 0's.
        """
        envs = cls._check_envs(list(envs))
        if share_lineage:
            for e in envs[1:]:
                e._share_lineage(envs[0])
        self = cls.__new__(cls)
        self._init(envs, seed)
        return self

    @staticmethod
    def _check_envs(envs: list[ForkableEnv]) -> list[ForkableEnv]:
        if not envs:
            raise ValueError("need at least one env")
        if not all(isinstance(e, ForkableEnv) for e in envs):
            raise TypeError("from_envs() takes ForkableEnvs")
        if len({id(e) for e in envs}) != len(envs):
            raise ValueError("the same ForkableEnv appears twice; every slot needs its own env")
        if any(e.closed for e in envs):
            raise EnvClosedError("one of the envs is closed")
        first = envs[0]
        for e in envs[1:]:
            if e.backend != first.backend:
                raise ValueError(f"envs use different backends ({first.backend!r}, {e.backend!r})")
            if e.observation_space != first.observation_space or e.action_space != first.action_space:
                raise ValueError("envs have different observation or action spaces")
        return envs

    def _init(self, envs: list[ForkableEnv], seed: int | None) -> None:
        self.envs = envs
        try:
            share_cpus(envs)  # (workers outnumbering the CPUs do not poll for requests)
        except BaseException:
            close_envs(envs)  # (a worker died: this env owns them all, and is not made)
            raise
        self.waiting = False
        self.closed = False
        # why the last step did not complete (Ctrl-C in the middle): steps wait for a reset
        self._incomplete: str | None = None
        self._calls: list[WorkerCall] = []
        self._step_actions: Sequence[Any] = ()
        self._obs: list[Any] = [None] * len(envs)  # each slot's observation for the next action
        super().__init__(len(envs), envs[0].observation_space, envs[0].action_space)
        if seed is not None:
            self.seed(seed)

    # --- the VecEnv API --------------------------------------------------------------------------
    def reset(self) -> VecEnvObs:
        self._cancel_pending_step()
        # SB3 passes options only when there are some (reset(seed=s) otherwise): so do we.
        args = [(self._seeds[i], self._options[i] or None) for i in range(self.num_envs)]
        calls = [WorkerCall(env, "reset", a) for env, a in zip(self.envs, args, strict=True)]
        try:
            results, error = collect_calls(calls)
            for env, call, r in zip(self.envs, calls, results):
                # (also when another one failed: this one did reset; and one whose answer could not come back)
                if r is not FAILED or ran_unanswered(call.error):
                    env._record_reset()
        except BaseException as e:  # Ctrl-C: each worker resets all the same (settled by asking it)
            _abandon(self.envs)
            if not isinstance(e, Exception):
                self._incomplete = "interrupted while resetting"  # (the caller holds no observation)
            raise
        if error is not None:
            raise error
        for i, (obs, info) in enumerate(results):
            self._obs[i] = obs
            self.reset_infos[i] = info
        self._incomplete = None
        # Seeds and options are only used once
        self._reset_seeds()
        self._reset_options()
        return _stack_obs(self._obs, self.observation_space)

    def step(self, actions: np.ndarray) -> VecEnvStepReturn:
        """``step_async`` + ``step_wait`` (SB3's ``VecEnv.step``); Ctrl-C between the two leaves
        no step waiting: its sends are handed over as interrupted requests."""
        self.step_async(actions)
        try:
            return self.step_wait()
        except BaseException as e:
            if not isinstance(e, Exception) and self.waiting:  # (interrupted before step_wait began)
                _abandon(self.envs, self._step_actions)
                self._calls, self.waiting = [], False
                self._incomplete = "interrupted before the replies were read"
            raise

    def step_async(self, actions: np.ndarray) -> None:
        self._check_open("step_async")
        if self.waiting:
            raise RuntimeError("step_async() called twice; call step_wait() first")
        if len(actions) != self.num_envs:
            raise ValueError(f"expected {self.num_envs} actions, got {len(actions)}")
        if self._incomplete is not None:
            raise IncompleteStepError(
                f"the last step did not complete ({self._incomplete}): some sub-envs stepped (and reset "
                "at an episode's end) and others did not, so they are out of step with each other and "
                "with the observations you hold. Call reset() first.")
        self._step_actions = actions
        self._calls = calls = []
        try:
            for env, a in zip(self.envs, actions):
                # (the worker resets right after a step that ends the episode and sends the reset
                # with it: no second round trip; an older gym_fork's worker is reset in step_wait)
                calls.append(WorkerCall(env, "step", (a, True) if env._handle.autoreset_steps else (a,)))
        except BaseException:  # Ctrl-C: the steps sent so far run all the same
            _abandon(self.envs, actions)
            self._calls = []
            self._incomplete = "interrupted while the actions were sent"
            raise
        self.waiting = True

    def step_wait(self) -> VecEnvStepReturn:
        """Every slot's reply to :meth:`step_async` (SB3's ``VecEnv.step_wait``).

        Raises:
            Exception: what a slot's ``step`` or auto-reset raised (a
                :class:`~gym_fork.errors.WorkerError` that is also the env's own type), once every
                reply is read. Each slot's step count and action log say what its worker did: a
                step that ran counts even where the reset right after it raised or its answer
                could not come back (:class:`~gym_fork.errors.NotSendableError`);
                :attr:`current_obs` holds where each slot is. The other slots' steps stand: the
                error's ``partial_step`` holds this step's results, ``(observations, rewards,
                dones, infos, failed)``, as ``step_wait`` returns them, with a row of no step
                (the slot's observation before it, reward 0, not done, an empty info) for each
                slot in ``failed``. ``restore()`` or ``reset()`` those to go on; ``reset()``
                brings all back in line.
        """
        if not self.waiting:
            raise RuntimeError("step_wait() without step_async()")
        calls, self._calls, self.waiting = self._calls, [], False
        results: list[Any] = []
        resets: dict[int, WorkerCall] = {}  # slots reset by a request of their own
        reset_now: dict[int, Any] = {}  # slots whose worker reset right after the step: (obs, info)
        error: BaseException | None = None
        try:
            for i, (call, action) in enumerate(zip(calls, self._step_actions)):
                try:
                    out = call.result()
                except Exception as e:  # noqa: BLE001 - raised after every reply is read
                    results.append(FAILED)
                    error = error or e
                    if ran_unanswered(e):  # the step ran (and a reset may have followed): as step() counts it
                        call.env._account_unanswered_step(action, counted=False, may_reset=len(call.args) > 1)
                    continue
                _note_step(call.env, action)
                if out[2] or out[3]:
                    try:
                        reset = take_autoreset(call.env, out[4]) if len(call.args) > 1 else None
                    except Exception as e:  # noqa: BLE001 - the reset after the step raised: as a reset request's error
                        reset_now[i] = FAILED
                        error = error or e
                    else:
                        if reset is not None:  # the worker reset already, with the step
                            reset_now[i] = reset
                        else:  # Send the auto-reset now: it overlaps with the replies still to come.
                            resets[i] = WorkerCall(call.env, "reset", (None, None))
                results.append(out)
            reset_results, reset_error = collect_calls(list(resets.values()))
            for (i, call), r in zip(resets.items(), reset_results):
                if r is not FAILED or ran_unanswered(call.error):  # (one unanswered ran all the same)
                    self.envs[i]._record_reset()
        except BaseException:  # Ctrl-C: every worker steps (and resets) all the same
            _abandon(self.envs, self._step_actions)
            self._incomplete = "interrupted while the replies were read"
            raise
        obs, rews, dones, infos = [], [], [], []
        failed: list[int] = []
        reset_out = {**reset_now, **dict(zip(resets, reset_results))}
        for i, out in enumerate(results):
            if out is FAILED or ((out[2] or out[3]) and reset_out[i] is FAILED):
                # (no row of this step: the slot's observation stays where it was; its step count
                # says what its worker did. restore() or reset() it)
                failed.append(i)
                obs.append(self._obs[i])
                rews.append(0.0)
                dones.append(False)
                infos.append({})
                continue
            o, reward, terminated, truncated, info = out
            done = terminated or truncated
            # See https://github.com/openai/gym/issues/3102 (as SB3)
            info["TimeLimit.truncated"] = truncated and not terminated
            if done:
                # save final observation where user can get it, then the reset's
                info["terminal_observation"] = o
                o, self.reset_infos[i] = reset_out[i]
            obs.append(o)
            rews.append(reward)
            dones.append(done)
            infos.append(info)
        # where a slot failed, the others did step (and reset at an episode's end): current_obs
        # follows every worker (before, it kept the observations from before this step: a learner
        # that went on from it fed slot i's old observation with slot i's next action)
        self._obs = obs
        if error is None and reset_error is None:
            return _stack_obs(obs, self.observation_space), np.stack(rews), np.stack(dones), infos
        # ... and their rewards, episode ends and infos travel with the error (they were lost);
        # a courtesy that never replaces the error (an exception that takes no attribute)
        error = error or reset_error
        with contextlib.suppress(Exception):
            error.partial_step = (_stack_obs(obs, self.observation_space), np.stack(rews), np.stack(dones), infos,
                                  failed)
        raise error

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.waiting:  # read the step replies first: the workers are still answering them
            collect_calls(self._calls)
            self._calls, self.waiting = [], False
        close_envs(self.envs)

    def getattr_recursive(self, name: str) -> Any:
        """Where SB3's ``VecEnvWrapper`` looks up what it lacks itself (``VecFrameStack(venv).restore``).
        ``restore`` and ``fork_into`` found that way warn: they put the snapshot into this env's slot
        only, and the wrappers' own per-slot state (``VecFrameStack``'s stacked frames,
        ``VecMonitor``'s episode statistics, ``VecNormalize``'s transform of the observation
        returned) is not part of any snapshot."""
        attr = getattr(self, name)
        if name in ("restore", "fork_into"):
            frame, wrappers, depth = sys._getframe(1), [], 1
            while frame is not None and frame.f_code.co_name in ("getattr_recursive", "__getattr__") \
                    and isinstance(frame.f_locals.get("self"), VecEnvWrapper):
                if not wrappers or wrappers[-1] is not frame.f_locals["self"]:
                    wrappers.append(frame.f_locals["self"])
                frame, depth = frame.f_back, depth + 1
            if wrappers:
                names = "".join(f"{type(w).__name__}(" for w in reversed(wrappers)) + "ForkableVecEnv" + ")" * len(wrappers)
                warnings.warn(
                    f"{name}() reached through {names}: it puts the snapshot into the ForkableVecEnv's slot only. "
                    "The wrappers' own per-slot state (VecFrameStack's stacked frames, VecMonitor's episode "
                    "statistics) is not in the snapshot and stays as it was, and the observation returned (and "
                    "current_obs) is the ForkableVecEnv's, without the wrappers' transforms: do not feed it to "
                    "a model trained through them. Call it on the ForkableVecEnv itself and bring the wrappers "
                    "in line yourself, or use BranchExplorationCallback, which handles VecMonitor, VecCheckNan "
                    "and VecTransposeImage.", RuntimeWarning, stacklevel=depth + 1)
        return attr

    def get_images(self) -> Sequence[np.ndarray | None]:
        if self.render_mode != "rgb_array":
            import warnings

            warnings.warn(
                f"The render mode is {self.render_mode}, but this method assumes it is `rgb_array` to obtain images."
            )
            return [None for _ in self.envs]
        return _run(self._idle_envs(None, "render"), "render")

    def has_attr(self, attr_name: str) -> bool:
        """Check if an attribute exists for a vectorized environment (see base class)."""
        return all(_run(self._idle_envs(None, "has_attr"), "call",
                        ("has_wrapper_attr", (attr_name,), {}, "wrapper")))

    def get_attr(self, attr_name: str, indices: VecEnvIndices = None) -> list[Any]:
        """Return attribute from vectorized environment (see base class): the worker's
        ``env.get_wrapper_attr(attr_name)``, as SB3's worker does."""
        return _run(self._idle_envs(indices, "get_attr"), "getattr", (attr_name, "wrapper"))

    def set_attr(self, attr_name: str, value: Any, indices: VecEnvIndices = None) -> None:
        """Set attribute inside vectorized environments (see base class).

        Like SB3's ``setattr(env, attr_name, value)`` in the worker: on the *outermost* wrapper.
        """
        _run(self._idle_envs(indices, "set_attr"), "call", ("__setattr__", (attr_name, value), {}, "wrapper"))

    def env_method(self, method_name: str, *method_args: Any, indices: VecEnvIndices = None,
                   **method_kwargs: Any) -> list[Any]:
        """Call instance methods of vectorized environments: the worker's
        ``env.get_wrapper_attr(method_name)(*method_args, **method_kwargs)``, as SB3's worker."""
        # the outermost layer of the stack that has it, an inner wrapper too (a HER-style
        # ``compute_reward`` that a reward-shaping wrapper overrides: not the base env's)
        return _run(self._idle_envs(indices, "env_method"), "call",
                    (method_name, method_args, method_kwargs, "stack"))

    def env_is_wrapped(self, wrapper_class: type[gym.Wrapper], indices: VecEnvIndices = None) -> list[bool]:
        """Check if worker environments are wrapped with a given wrapper (``isinstance`` on each
        layer of the worker's env stack, like SB3's ``is_wrapped``)."""
        envs = self._idle_envs(indices, "env_is_wrapped")
        # By module and qualified name along each wrapper layer's MRO, not by class (unpickling
        # e.g. SB3's Monitor would import torch in the worker): isinstance, exactly
        key = (wrapper_class.__module__, wrapper_class.__qualname__)
        if "<locals>" in key[1]:  # a class made in a function travels by value, by its bare name
            key = (key[0], wrapper_class.__name__)
        try:
            stacks = _run(envs, "wrapper_classes")
        except WorkerError as e:
            if "unknown worker command" not in str(e):
                raise
            # a worker of an older gym_fork (restored from its bundle): the class names that
            # gymnasium's repr shows (``<TimeLimit<...>>``), counting subclasses known here
            names = {c.__name__ for c in _with_subclasses(wrapper_class)}
            reprs = _run(envs, "call", ("__repr__", (), {}, "wrapper"))
            return [bool(names & set(re.findall(r"<(\w+)", r))) for r in reprs]
        return [any(key in layer for layer in stack) for stack in stacks]

    # --- snapshots -------------------------------------------------------------------------------
    @property
    def current_obs(self) -> VecEnvObs:
        """Every slot's observation for the next action, stacked (after reset, step_wait, restore
        and fork_into): what an SB3 algorithm's ``_last_obs`` must be after slots changed."""
        if any(o is None for o in self._obs):
            raise RuntimeError("call reset() first: some slots have no observation yet")
        return _stack_obs(self._obs, self.observation_space)

    @property
    def worker_pids(self) -> list[int | None]:
        """Host pid of each slot's worker (``None`` for the in-process pickle backend)."""
        return [env.worker_pid for env in self.envs]

    def snapshot(self, index: int, *, restore_soon: bool | None = None) -> Snapshot:
        """Capture slot ``index`` now (the slot keeps running). Restorable into any slot.
        ``restore_soon``: as :meth:`gym_fork.ForkableEnv.snapshot` (prepare the first restore
        ahead; None: guessed from the slot's recent snapshots)."""
        (env,) = self._idle_envs(index, "snapshot")
        snap = env.snapshot(restore_soon=restore_soon)
        snap._reset_info = copy.deepcopy(self.reset_infos[index])  # (the slot's, for restore())
        return snap

    def restore(self, index: int, snapshot: Snapshot) -> Any:
        """Put ``snapshot`` (taken in any slot) into slot ``index``; returns the slot's new
        observation, the one the snapshot's env had returned last. Other slots are untouched."""
        (env,) = self._idle_envs(index, "restore")
        # a Ctrl-C raises once the slot's observation is its restored worker's: raised as the
        # worker switched, it left current_obs the old state's, for the learner's next action
        with held():
            obs, info = env.restore(snapshot)
            self._obs[index] = obs
            self.reset_infos[index] = _reset_info(snapshot, info)
        return obs

    def fork_into(self, snapshot: Snapshot, indices: Sequence[int], *,
                  rng: Literal["same", "reseed"] = "same", seeds: Sequence[int] | None = None) -> VecEnvObs:
        """Put ``snapshot`` into every slot in ``indices`` at once (the restores run concurrently);
        returns those slots' new observations, stacked in the order of ``indices``.

        ``rng="same"`` keeps every copy's randomness identical (same actions, same trajectories);
        ``rng="reseed"`` reseeds every generator each copy's env draws from with ``seeds[k]`` (or
        fresh entropy), as :meth:`ForkableEnv.fork` does. On a failed restore no slot has changed.
        """
        idx = [int(i) for i in self._get_indices(indices)]
        if not idx:
            raise ValueError("indices is empty")
        if len(set(idx)) != len(idx) or not all(0 <= i < self.num_envs for i in idx):
            raise ValueError(f"indices must be distinct slots in 0..{self.num_envs - 1}, got {idx}")
        check_rng(rng, seeds, len(idx), "len(indices)")
        targets = self._idle_envs(idx, "fork_into")
        for env in targets:  # every target slot must accept it (lineage, backend, workspace, not released)
            env._check_snapshot(snapshot)
        for env in targets:
            env._end_live("fork_into() replaces the worker")
        _spare_namespace(snapshot, targets)
        roots, binds = targets[0]._private_copies(snapshot, len(targets))  # private_dirs: a copy each
        # each slot's workspace shown at the paths the snapshot's processes know (ForkableEnv._workspace_binds)
        ws_binds = [env._workspace_binds(snapshot, env._workspace.path if env._workspace else None) for env in targets]
        per = [[*(binds[k] if binds else ()), *ws_binds[k]] for k in range(len(targets))]
        made: list[str] = []
        try:
            with snapshot._open_payload() as payload:  # a stored snapshot's images, reassembled
                for env, b in zip(targets, per):  # (the snapshot's directories: see ForkableEnv.restore)
                    if (env._workspace is not None and getattr(snapshot, "workspace", None)
                            and env._backend.reopens_paths(payload, b)):
                        made += env._workspace.make_missing_dirs(snapshot.workspace)
                # (tool processes of a restored tree wait until their slot's workspace is back)
                hold = any(env._workspace is not None for env in targets)
                handles = (targets[0]._backend.restore_many(payload, len(targets), per, hold_tree=hold) if any(per)
                           else targets[0]._backend.restore_many(payload, len(targets), hold_tree=hold))
            if all(env._workspace is not None for env in targets):
                _refuse_unbound_tree(targets[0]._backend, handles, snapshot, [env._workspace.path for env in targets])
        except BaseException:
            remove_dirs(made)
            private_dirs.remove(roots)
            raise
        # Each slot takes its new worker exactly as ForkableEnv.restore does: the old one is
        # stopped, and the slot's workspace files and private directories are put back too.
        # A Ctrl-C raises once every slot has (a Ctrl-C between two slots left the later slots'
        # restored workers running unowned, and current_obs the old states')
        with held():
            adopted = 0
            try:
                for k, (i, env, handle) in enumerate(zip(idx, targets, handles)):
                    self._obs[i], info = env._adopt_restored(handle, snapshot, roots[k] if roots else None,
                                                             ws_binds[k])
                    adopted += 1
                    self.reset_infos[i] = _reset_info(snapshot, info)
            except BaseException:
                # the slots from the failing one on keep their workers: the copies made for them,
                # and their private directories' copies, go
                gone = [k for k in range(adopted, len(handles)) if targets[k]._handle is not handles[k]]
                for k in gone:
                    handles[k].kill()
                private_dirs.remove([roots[k] for k in gone] if roots else [])
                raise
            if rng == "reseed":  # the simulated state, and so the observation, stays as it is
                seed_list = [int(s) for s in seeds] if seeds is not None else [
                    int(np.random.SeedSequence().entropy % (2**63)) for _ in targets]
                _run(targets, "reseed", [(s,) for s in seed_list])
        return _stack_obs([self._obs[i] for i in idx], self.observation_space)

    # --- internals -------------------------------------------------------------------------------
    def _check_open(self, what: str) -> None:
        if self.closed:
            raise EnvClosedError(f"{what}() on a closed ForkableVecEnv; create a new one")

    def _idle_envs(self, indices: VecEnvIndices, what: str) -> list[ForkableEnv]:
        """The slots' envs, after checking that no step is in flight (its replies are owed)."""
        self._check_open(what)
        if self.waiting:
            raise RuntimeError(f"{what}() while a step is in flight; call step_wait() first")
        return [self.envs[i] for i in self._get_indices(indices)]

    def _cancel_pending_step(self) -> None:
        """SB3: reset() cancels a step_async() whose step_wait() was never called."""
        self._check_open("reset")
        if self.waiting:
            results, _ = collect_calls(self._calls)
            for call, action, out in zip(self._calls, self._step_actions, results):
                if out is not FAILED:
                    _note_step(call.env, action)
                    if len(call.args) > 1 and (out[2] or out[3]):
                        with contextlib.suppress(Exception):  # (a reset that raised: reset() follows)
                            take_autoreset(call.env, out[4])  # (its worker reset: accounted for)
                elif ran_unanswered(call.error):  # (it ran: only its answer did not come back)
                    call.env._account_unanswered_step(action, counted=False, may_reset=len(call.args) > 1)
            self._calls, self.waiting = [], False

    def __repr__(self) -> str:
        first = self.envs[0]
        env_id = first.spec.id if first.spec else first._meta.get("unwrapped_type")
        return f"<ForkableVecEnv {env_id} n_envs={self.num_envs} backend={first.backend}>"


def _check_start_method(start_method: str | None) -> None:
    """Refuse what ``SubprocVecEnv`` refuses (``multiprocessing.get_context`` raises ValueError)."""
    import multiprocessing

    if start_method is not None and start_method not in multiprocessing.get_all_start_methods():
        raise ValueError(f"cannot find context for {start_method!r}: start_method must be one of "
                         f"{', '.join(multiprocessing.get_all_start_methods())} or None")


def _reset_info(snapshot: Snapshot, last_info: dict) -> dict:
    """A restored slot's ``reset_infos`` entry: as SB3's VecEnvs keep it, the info of the slot's
    last reset (explicit or automatic) -- not of its last step, which is what the worker returned
    last (``last_info``) in a snapshot taken mid-episode. A snapshot taken through a vector env
    carries it; another is right after a reset (0 steps: ``last_info`` is that reset's) or says
    nothing of it ({}, as SB3's own VecEnvs start)."""
    kept = getattr(snapshot, "_reset_info", None)
    if kept is not None:
        return copy.deepcopy(kept)
    return last_info if snapshot.steps == 0 else {}


def _with_subclasses(cls: type) -> list[type]:
    out, todo = [], [cls]
    while todo:
        c = todo.pop()
        out.append(c)
        todo.extend(c.__subclasses__())
    return out

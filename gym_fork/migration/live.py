"""``env.migrate(target, live=True)``: pre-copy live migration of one env worker.

The learner keeps stepping its *local* worker while a copy-on-write snapshot of it travels and
is restored on the target; every request made meanwhile is recorded with the digest of its
answer (:func:`gym_fork.worker.channel.canonical_digest`). The target replays them in batches
and must answer each identically; at most :data:`FINAL_OPS` are left for the switch, which
happens inside a later ``step()``/``reset()`` (or :meth:`LiveMigration.result`). The learner
pauses twice: for the snapshot and for the switch.

The comparison is what makes it exact: a worker whose answers depend on anything outside its
process (clock, network, files) diverges and the move is abandoned, the env untouched. Each
request and its answer are recorded as they were when the answer came back (copies: the learner
may then change either in place -- a reused action buffer, an observation normalised in place, a
vector env's info; about 1-3 us a step, the digests are taken in the background). Before the
switch the worker's random generators are compared too (the env's ``np_random`` and those of its
wrappers, ``random``, ``numpy.random``, torch's): an answer does not show a generator seeded
differently on the target (``reset()`` without a seed on an env never seeded draws its seed from
the OS), so such a move is abandoned as well. Because the target *re-executes* the steps, envs
with outside effects must use ``live=False``.
Anything but plain requests (``snapshot``, ``restore``, ``fork``, ``migrate``, ``close``)
cancels a live migration first, and so does an error answer from the local worker.
"""

from __future__ import annotations

import copy
import logging
import socket
import threading
import time
from typing import Any, Callable

import numpy as np

from gym_fork.criu.status import dump_size_bound
from gym_fork.errors import ConcurrentUseError, DivergedError, GymForkError, MigrationError, WorkerError
from gym_fork.migration.client import (MigratedBackend, NetworkHandle, check_migratable, ship_snapshot,
                                       switch_to_remote)
from gym_fork.migration.wire.auth import load_token
from gym_fork.migration.wire.connect import connect_in_background
from gym_fork.worker.channel import canonical_digest

log = logging.getLogger("gym_fork.migration")

FINAL_OPS = 16  # catch up in the background until at most this many requests are left
MAX_ROUNDS = 50  # a learner faster than the target's replay: switch anyway after this many rounds

# values recorded as they are: nothing can change them in place
_IMMUTABLE = frozenset({int, float, bool, str, bytes, type(None), complex, range, np.float64, np.float32,
                        np.float16, np.int64, np.int32, np.int16, np.int8, np.uint64, np.uint32, np.uint16,
                        np.uint8, np.bool_})


class _Unknown(Exception):
    """:func:`_frozen` met a type it does not copy."""


def _frozen(obj: Any) -> Any:
    """A copy of ``obj`` that nothing the caller does later changes, with the same
    :func:`canonical_digest`: plain arrays copied, tuples, lists and dicts rebuilt, immutable
    scalars kept. About 4x cheaper than the digest itself (a step's answer: 1-3 us), which is then
    taken off the learner's path (the background thread's catch-up). Raises _Unknown for any
    other type (the caller digests or deep-copies the original right away)."""
    t = type(obj)
    if t in _IMMUTABLE:
        return obj
    if t is np.ndarray:
        if obj.dtype.hasobject:
            raise _Unknown
        return obj.copy()
    if t is tuple:
        return tuple([_frozen(x) for x in obj])
    if t is dict:
        return {_frozen(k): _frozen(v) for k, v in obj.items()}
    if t is list:
        return [_frozen(x) for x in obj]
    if isinstance(obj, np.generic):
        return obj
    raise _Unknown


def _own_args(args: tuple) -> tuple:
    """The request's arguments as they are now, for the target's replay: copies where the caller
    could change them in place afterwards (a policy filling one action buffer for every step)."""
    for a in args:  # (the usual step: one int)
        if type(a) not in _IMMUTABLE:
            break
    else:
        return args
    try:
        return _frozen(args)
    except _Unknown:
        pass
    try:
        return copy.deepcopy(args)
    except Exception:  # noqa: BLE001 - uncopyable: as it is (changed later, it only fails the move)
        return args


class _RecordingHandle:
    """Stands in for the env's local handle during a live migration: passes every request to the
    local worker and records it with its answer's digest; switches at a step boundary."""

    def __init__(self, inner: Any, mig: "LiveMigration"):
        self.inner = inner
        self.mig = mig
        self._sent: tuple | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    @property
    def closed(self) -> bool:
        return self.inner.closed

    def request(self, cmd: str, *args: Any) -> Any:
        try:
            out = self.inner.request(cmd, *args)
        except BaseException:
            self.mig._cancel_from_learner(f"the local worker answered {cmd!r} with an error")
            raise
        self.mig._record(cmd, args, out)
        return out

    def send(self, cmd: str, *args: Any) -> None:
        self.inner.send(cmd, *args)
        self._sent = (cmd, args)

    def receive(self) -> Any:
        cmd, args = self._sent or ("?", ())
        self._sent = None
        try:
            out = self.inner.receive()
        except BaseException:
            self.mig._cancel_from_learner(f"the local worker answered {cmd!r} with an error")
            raise
        self.mig._record(cmd, args, out)
        return out

    def kill(self) -> None:
        self.mig._cancel_from_learner("the env was closed")
        self.inner.kill()

    def close(self) -> None:
        self.mig._cancel_from_learner("the env was closed")
        self.inner.close()


def _rollout_name(cmd: str, answer: Any) -> str | None:
    """The worker's name of the rollout ``answer`` answers (``rollout``, ``policy_rollout``)."""
    if cmd in ("rollout", "policy_rollout") and isinstance(answer, dict):
        rid = answer.get("id")
        return rid if isinstance(rid, str) else None
    return None


def _replay_args(ids: dict[int, str], generators: bool) -> tuple:
    """``cmd_replay``'s arguments after ``ops``: ``rollout_ids`` only where rollouts are replayed
    (a target of older gym_fork code takes none; its replay of a rollout answers with a name of
    its own and is refused as diverged, as before), ``generators`` only where asked for (older
    still: none)."""
    if ids:
        return generators, ids
    return (True,) if generators else ()


class LiveMigration:
    """A pre-copy migration in progress; returned by ``env.migrate(target, live=True)``.

    The env stays fully usable: keep stepping it. The switch to the target happens inside one
    of the next ``step()``/``reset()`` calls once the target has caught up, or when you call
    :meth:`result`, which finishes (or fails) the migration now and returns its report.

    Example::

        >>> mig = env.migrate("10.0.0.2:7060", live=True)       # doctest: +SKIP
        >>> while not mig.done():                                # doctest: +SKIP
        ...     obs, *_ = env.step(policy(obs))
        >>> mig.result()["downtime_s"]                           # doctest: +SKIP
        0.004
    """

    def __init__(self, env: Any, target: str, snap: Any, timings: dict, ship: Callable, switch: Callable):
        """``ship(snap, timings, self) -> (remote handle, info)``: dump ``snap``, move it and start
        it on the target (background thread; adds to ``timings``; info: pid, bytes, remote_timings). ``switch(env, remote,
        local) -> node``: point the env at ``remote`` and stop the local worker."""
        self.env = env
        self.target = target
        self._ship, self._switch_to = ship, switch
        self._info: dict = {}
        self._snap = snap
        self._timings = timings
        self._lock = threading.Lock()
        self._ops: list[tuple[str, tuple]] = []  # what the learner sent since the snapshot (copies)
        self._digests: list[bytes | None] = []  # their answers' digests (None: not computed yet)
        self._answers: list[Any] = []  # copies of the answers whose digest is still to compute
        # the source worker's name of each rollout among the ops, by index: a name is drawn afresh
        # (os.urandom) in each rollout, so the target's replay takes the source's (the digests
        # then match, and the env's record of its last rollout names the target's too)
        self._rollout_ids: dict[int, str] = {}
        self._replayed = 0  # ops the target has replayed and matched
        self._state = "shipping"  # -> ready -> done | failed | cancelled
        self._error: BaseException | None = None
        self._report: dict | None = None
        self._finished = threading.Event()
        self._ready = threading.Event()
        self._remote: Any = None
        self._rounds: list[dict] = []
        self._t_start = time.monotonic()
        self._recording = _RecordingHandle(env._handle, self)
        self._local = env._swap_worker(self._recording)
        env._track_live(self)
        self._sock: Any = None  # the connection to an agent, once made (shut down on cancel)
        self._thread = threading.Thread(target=self._background, daemon=True, name="gym_fork-live-migration")
        self._thread.start()

    # --- the learner's side ----------------------------------------------------------------------
    def done(self) -> bool:
        """True once the migration switched, failed or was cancelled (see :meth:`result`)."""
        return self._finished.is_set()

    @property
    def state(self) -> str:
        return self._state

    def result(self, timeout: float | None = None) -> dict:
        """Finish now: wait (at most ``timeout`` s) for the target to be ready, replay what is left
        and switch. Returns the report (``downtime_s``: the learner's two pauses, the
        ``migrate()`` call (``timings["start_s"]``, a fork-tier snapshot) + the switch;
        bytes, timings, catch-up rounds). Raises the migration's error if it failed or was
        cancelled -- the env then runs locally, unchanged. Call it from the learner's thread.

        Raises:
            ConcurrentUseError: a ``step_send()`` (or ``rollout_send()``) waits for its reply:
                switching now would lose that step. Read it first (``step_receive()``), then call
                ``result()`` again; nothing was changed.
        """
        if not self._finished.is_set() and self._recording._sent is not None:
            raise ConcurrentUseError(
                f"result() of the live migration to {self.target} while this env's "
                f"{self._recording._sent[0]!r} request, sent with step_send() or rollout_send(), waits for "
                "its reply: switching now would lose it. Read it first (step_receive() / rollout_receive()), "
                "then call result() again (or just keep stepping: the switch happens inside a later step). "
                "Nothing was changed: the migration and the env go on.")
        if not self._finished.is_set():
            if not self._ready.wait(timeout) and not self._finished.is_set():
                raise TimeoutError(f"the live migration to {self.target} is not ready after {timeout} s")
            if not self._finished.is_set():
                self._switch()
        if self._error is not None:
            self._uninstall()
            raise self._error
        assert self._report is not None
        return self._report

    def cancel(self, why: str = "cancelled by the user") -> None:
        """Give up: the target's copy is stopped and the env keeps its local worker."""
        self._cancel_from_learner(why)

    def _record(self, cmd: str, args: tuple, answer: Any) -> None:
        state = self._state
        if state in ("shipping", "ready"):
            written = self.env._outside_writes()
            if written:  # the target would replay this request and write those files a second time
                self._cancel_from_learner(f"the env wrote files outside its workspace ({', '.join(written[:3])}), "
                                          "which a replay on the target would write again")
                return
            # taken now: once this returns, the learner may change the action it sent (one buffer
            # for every step) or the answer it got (obs normalised in place, a vector env's info)
            op = (cmd, _own_args(args))
            rid = _rollout_name(cmd, answer)
            try:
                answer, digest = _frozen(answer), None  # digested later, off the learner's path
            except _Unknown:
                answer, digest = None, canonical_digest(answer)
            with self._lock:
                state = self._state
                if state in ("shipping", "ready"):
                    if rid is not None:
                        self._rollout_ids[len(self._ops)] = rid
                    self._ops.append(op)
                    self._answers.append(answer)
                    self._digests.append(digest)
        if state == "ready":
            self._switch()
        elif state in ("failed", "cancelled"):
            self._uninstall()

    def _switch(self) -> None:
        """In the learner's thread: replay the rest, compare, switch (or give up)."""
        if self._state != "ready":
            if self._state == "failed":
                self._uninstall()
            return
        self._thread.join()  # it stopped using the remote handle when it set "ready"
        t0 = time.monotonic()
        try:
            # (nothing recorded: the target is the snapshot itself, generators included)
            self._catch_up(self._remote, len(self._ops), final=bool(self._ops))
        except BaseException as e:  # noqa: BLE001 - diverged, or the target died: stay local
            self._fail(e)
            self._uninstall()
            return
        node = self._switch_to(self.env, self._remote, self._local)
        self.env._track_live(None)
        switch_s = time.monotonic() - t0
        self._timings["switch_s"] = switch_s
        self._timings["total_s"] = time.monotonic() - self._t_start
        self._report = {
            "node": node, "target": self.target, "live": True, "pid": self._info.get("pid"),
            "bytes": self._info.get("bytes", 0), "downtime_s": self._timings["start_s"] + switch_s,
            "replayed_ops": len(self._ops), "rounds": self._rounds + [{"ops": len(self._ops) - self._rounds_total(),
                                                                        "seconds": switch_s, "final": True}],
            "timings": self._timings, "remote_timings": self._info.get("remote_timings", {}),
        }
        self._state = "done"
        self._finished.set()
        log.info("live migration to %s: switched after replaying %d requests in %d rounds; downtime %.1f ms",
                 node, len(self._ops), len(self._rounds) + 1, self._report["downtime_s"] * 1e3)

    def _rounds_total(self) -> int:
        return sum(r["ops"] for r in self._rounds)

    def _cancel_from_learner(self, why: str) -> None:
        if self._finished.is_set():
            return
        self._fail(MigrationError(f"live migration to {self.target} cancelled: {why}; the env runs here, unchanged"),
                   state="cancelled")
        self._uninstall()

    def _fail(self, e: BaseException, state: str = "failed") -> None:
        with self._lock:
            if self._finished.is_set():
                return
            self._state = state
            self._error = e
        if self._remote is not None:
            self._remote.kill()  # the agent stops the target's copy when the connection ends
        elif self._sock is not None:  # mid-transfer: cut it, the agent drops what it received
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._finished.set()
        self._ready.set()
        log.warning("%s", e)

    def _uninstall(self) -> None:
        """Give the env its local handle back (learner's thread only)."""
        if self.env._handle is self._recording:
            self.env._swap_worker(self._local)
        if getattr(self.env, "_live", None) is self:
            self.env._track_live(None)

    # --- the background thread -------------------------------------------------------------------
    def _background(self) -> None:
        try:
            remote, self._info = self._ship(self._snap, self._timings, self)
        except BaseException as e:  # noqa: BLE001
            self._release_snapshot()
            self._fail(e)
            return
        self._release_snapshot()
        with self._lock:
            cancelled = self._state != "shipping"
            self._remote = remote
        if cancelled:  # cancelled while the snapshot travelled: stop the target's copy
            remote.kill()
            return
        try:
            for _ in range(MAX_ROUNDS):
                if self._state != "shipping":
                    return
                with self._lock:
                    n = len(self._ops)
                if n - self._replayed <= FINAL_OPS:
                    break
                t0 = time.monotonic()
                k = n - self._replayed
                self._catch_up(remote, n)
                self._rounds.append({"ops": k, "seconds": time.monotonic() - t0})
        except BaseException as e:  # noqa: BLE001
            self._fail(e)
            return
        with self._lock:
            if self._state == "shipping":
                self._state = "ready"
        self._ready.set()

    def _catch_up(self, remote: Any, upto: int, final: bool = False) -> None:
        """Have the target replay ops [replayed, upto) and check every answer; ``final`` (the
        switch's): then compare the random generators of both workers too."""
        lo = self._replayed
        if upto <= lo and not final:
            return
        with self._lock:
            ops = self._ops[lo:upto]
            ids = {i - lo: rid for i, rid in self._rollout_ids.items() if lo <= i < upto}
            todo = [(i, self._answers[i]) for i in range(lo, upto) if self._digests[i] is None]
        for i, ans in todo:  # digest outside the lock: the learner keeps appending meanwhile
            self._digests[i] = canonical_digest(ans)
            self._answers[i] = None
        theirs, generators = (self._replay_final(remote, ops, ids) if final else
                              (remote.request("replay", ops, *_replay_args(ids, False)), None))
        for j, d in enumerate(theirs):
            if d != self._digests[lo + j]:
                cmd = ops[j][0]
                raise DivergedError(
                    f"the target's replay of request {lo + j} ({cmd!r}, {lo + j} requests after the snapshot) "
                    "answered differently from the source: this env depends on something outside its "
                    "process (clock, network, shared files), so it cannot be live-migrated; use live=False")
        self._replayed = upto
        if generators is not None:
            ours, theirs_g = generators
            differ = sorted(k for k in set(ours) | set(theirs_g) if ours.get(k) != theirs_g.get(k))
            if differ:
                raise DivergedError(
                    f"after replaying the {upto} requests made since the snapshot, the target's random "
                    f"generators differ from the source's ({', '.join(differ[:5])}) although every answer "
                    "matched: the env drew randomness from outside its process meanwhile (e.g. reset() without "
                    "a seed on an env never seeded takes its seed from the OS), so the target would go on "
                    "differently. Seed the env (reset(seed=...)) before migrating it live, or use live=False; "
                    "the env runs here, unchanged")

    def _replay_final(self, remote: Any, ops: list, ids: dict[int, str]) -> tuple[list, tuple[dict, dict] | None]:
        """The switch's replay: the target replays ``ops`` and then reports its random generators
        (their digests, by name) while the local worker reports its own (learner's thread: this
        is the switch's pause). Returns the replay's digests and (ours, theirs), or None where the
        worker runs older code that cannot report them."""
        remote.send("replay", ops, *_replay_args(ids, True))
        try:
            ours = self._local.request("rng_digests")
        except WorkerError as e:
            if not (e.remote_type == "ValueError" and "unknown worker command" in str(e)):
                raise
            ours = None  # a worker restored from an image of older gym_fork code (so is the target)
        try:
            theirs = remote.receive()
        except WorkerError:
            if ours is not None:
                raise
            theirs = None  # (it refused the argument, replaying nothing)
        if ours is None:
            log.warning("live migration to %s: this env's worker runs older gym_fork code, which cannot "
                        "report its random generators; switching without comparing them", self.target)
            return (theirs[0] if theirs is not None else remote.request("replay", ops, *_replay_args(ids, False))), None
        return theirs[0], (ours, theirs[1])

    def _release_snapshot(self) -> None:
        try:
            self._snap.release()
        except GymForkError:
            pass


class _Conn:
    """The background connection, handed to :func:`ship_snapshot`: remembers the socket so that
    a cancel can cut a transfer in progress, and refuses to start one after a cancel."""

    def __init__(self, conn: Any, mig: LiveMigration):
        self._conn, self._mig = conn, mig
        self.elapsed = 0.0

    def result(self) -> tuple:
        sock, hello = self._conn.result()
        self.elapsed = self._conn.elapsed
        with self._mig._lock:
            self._mig._sock = sock
            cancelled = self._mig._state != "shipping"
        if cancelled:
            sock.close()
            raise MigrationError("cancelled before the transfer")
        return sock, hello

    def discard(self) -> None:
        self._conn.discard()


def check_live(env: Any) -> None:
    """What pre-copy needs beyond a migratable env (raises MigrationError)."""
    if getattr(env, "_live", None) is not None:
        raise MigrationError("a live migration of this env is already in progress")
    if not getattr(env._handle, "fork_tier", False):
        raise MigrationError("live=True needs a copy-on-write (fork tier) snapshot, and this env's worker "
                             "has none (fork_tier=False, or a multi-threaded worker); use live=False")


def start_live(env: Any, target: str, ship: Callable, switch: Callable, on_error: Callable | None = None) -> LiveMigration:
    """The learner's first pause: a fork-tier snapshot, then a :class:`LiveMigration` that ships
    it with ``ship`` and switches with ``switch`` (see :class:`LiveMigration`)."""
    check_live(env)
    t_call = time.monotonic()
    timings: dict[str, float] = {}
    t0 = time.monotonic()
    try:
        snap = env._side_snapshot()  # the env's own timeline goes on; not one of the user's snapshots
    except BaseException:
        if on_error is not None:
            on_error()
        raise
    timings["snapshot_s"] = time.monotonic() - t0
    mig = LiveMigration(env, target, snap, timings, ship, switch)
    timings["start_s"] = time.monotonic() - t_call  # the learner's first pause (snapshot included)
    return mig


def migrate_env_live(env: Any, target: str, *, token: str | bytes | None = None, token_file: str | None = None,
                     tls: bool | str = False, timeout: float = 30.0, netns: str | None = None,
                     insecure: bool = False) -> LiveMigration:
    """Start a pre-copy migration of ``env``'s worker to the agent at ``target``; see the module doc."""
    check_migratable(env, target)
    check_live(env)
    tok = load_token(token, token_file)
    limit = dump_size_bound(env.worker_pid)
    conn = connect_in_background(target, tok, tls=tls, insecure=insecure, timeout=timeout, netns=netns)

    def ship(snap: Any, timings: dict, mig: LiveMigration) -> tuple[NetworkHandle, dict]:
        sock, hello, reply, nbytes = ship_snapshot(snap, target, tok, _Conn(conn, mig), timings, limit)
        remote = NetworkHandle(sock, reply["pid"], hello.get("node", target), target)
        return remote, {"pid": reply["pid"], "bytes": nbytes, "remote_timings": reply.get("timings", {})}

    def switch(env: Any, remote: NetworkHandle, local: Any) -> str:
        switch_to_remote(env, remote, MigratedBackend(remote.node, target), local=local)
        return remote.node

    return start_live(env, target, ship, switch, on_error=conn.discard)

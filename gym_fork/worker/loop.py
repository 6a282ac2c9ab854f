"""The worker process: one env, one channel, a plain command loop.

Started by a backend as ``python -m gym_fork.worker FD`` (:mod:`gym_fork.worker.__main__`, which
reports a failed import on the channel; for CRIU, as PID 1 of its own PID namespace through a
small launcher).  It becomes a session leader (CRIU then needs no
``--shell-job``), receives ``("init", source)``, builds the env and serves commands until
``close`` or until the controller goes away (EOF on the channel), so a worker never outlives
its controller.

Besides the env commands of :class:`~gym_fork.worker.commands.EnvServer`, the loop knows the
process-level commands of the copy-on-write tier:

``fork_snapshot`` (+ an fd)
    ``fork()`` a *frozen* child that keeps this exact state, copy-on-write, and serves the
    frozen loop on the given fd.  The worker answers *before* it forks (the controller carries
    on at once; the worker's next command waits for the fork) and then carries on.  First it
    looks for what ``fork()`` cannot copy (:mod:`gym_fork.worker.resources`: other threads, child
    processes, shared descriptors); if anything is there it does not fork and answers with the
    findings instead, and the controller takes a CRIU dump of the whole tree or refuses.
``resources``
    the same scan, answered as is (before a CRIU dump: what the dump would not capture).
``clone`` (frozen loop, + an fd)
    ``fork()`` an active worker from the frozen state, serving env commands on the fd.  Usually
    not needed: the frozen loop offers the controller a *ready* copy unasked (see
    :func:`frozen_loop`), so a restore needs no round trip.
``promote`` (frozen loop, + an fd)
    ``fork()`` (via a short-lived intermediate) a copy that is PID 1 of a *new* PID namespace and
    waits, blocked in ``recv`` on the fd, to be dumped by CRIU: a persistent image of the frozen
    state, taken without stopping anything else.
``retire``
    a PID-namespace init cannot exit while the namespace holds other live processes (clones,
    frozen snapshots) without killing them all: it closes everything and ``exec``s a tiny reaper.

A CRIU-restored copy wakes up inside :func:`serve`, blocked in ``recv`` on a fresh channel that
CRIU attached in place of the old one, and carries on from there.
"""

from __future__ import annotations

import _thread
import ctypes
import errno
import os
import signal
import socket
import sys
import time
import traceback
from typing import Callable, NoReturn

# Single-threaded numerics: smaller images, and fork() stays safe (see ARCHITECTURE.md).
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")
os.environ.setdefault("SDL_VIDEODRIVER", "dummy")
os.environ.setdefault("SDL_AUDIODRIVER", "dummy")

from gym_fork.worker.channel import (  # noqa: E402
    ERR, OK, PACKED_VERSION, READY, Channel, ChannelClosed, SpinWait, recv_fds, reply_parts, send_fds, spin_cap)
from gym_fork import atfork  # noqa: E402
from gym_fork.errors import NotSendableError  # noqa: E402
from gym_fork.worker.commands import EnvServer, build_env, host_pid  # noqa: E402
from gym_fork.worker import cpus, exits, lean, output, prefault, resources  # noqa: E402
from gym_fork.worker import files, fswatch, reseed  # noqa: E402
from gym_fork.worker.ring import Ring  # noqa: E402

CLONE_NEWPID = 0x20000000
PR_SET_CHILD_SUBREAPER = 36
_subreaper = False  # whether this process (a frozen snapshot) has made itself a child subreaper
# A retired namespace init becomes this reaper. A worker whose child it may be (a promoted copy,
# orphaned to the worker's namespace) must not take it for a process of the env's own: exec names
# it "python", so it takes gym_fork's name back (PR_SET_NAME), and until it has, its command line
# (resources.REAPER_MARK) says what it is.
REAPER = (
    f"# {resources.REAPER_MARK.decode()}\n"
    "import ctypes, os\n"
    "ctypes.CDLL(None).prctl(15, b'gym_fork-fork', 0, 0, 0)\n"
    "try:\n"  # (writes down how they end: gym_fork.worker.exits)
    "    from gym_fork.worker.exits import reap_until_none_left\n"
    "    reap_until_none_left()\n"
    "except BaseException:\n"  # (never ends the namespace early: collects on without writing)
    "    pass\n"
    "while True:\n"
    "    try: os.wait()\n"
    "    except ChildProcessError: break\n"
    "    except InterruptedError: pass\n"
)


def _error_reply(exc: BaseException) -> tuple:
    return (ERR, type(exc).__name__, str(exc), traceback.format_exc())


def _unsendable_reply(cmd: str, exc: BaseException) -> tuple:
    """The error reply for a request that ran but whose result does not pickle: a
    ``NotSendableError`` that says the command ran, so the controller counts a step or a reset
    that happened (its step count and action log stay the worker's)."""
    try:
        raise NotSendableError(
            f"the env's {cmd}() ran, but what it returned does not pickle, so it cannot come back to your "
            f"process ({type(exc).__name__}: {exc}); return plain values, arrays and classes defined at "
            "module level (not lambdas, locks or open files) from step()/reset() and their info") from exc
    except NotSendableError as e:
        return _error_reply(e)


# This worker's own fork-tier children (frozen snapshots): the env's child processes are the env's.
_FORKED: set[int] = set()
_CLONE_INIT = False  # a fork-tier copy made PID 1 of its own namespace (_fork_copy_process)
# In a frozen snapshot: how the env handled SIGCHLD (a Python handler, SIG_IGN to reap its tools'
# processes, SIG_DFL) before the frozen loop ignored it; every copy it forks gets it back. An env
# that ignores SIGCHLD sees every subprocess exit with 0 (waitpid finds nothing to wait for), so a
# copy left with SIG_DFL saw its tools' real exit codes: a silent divergence.
_ENV_SIGCHLD: object = None
_FROZEN = False  # this process is a frozen snapshot (frozen_loop): it forks copies and runs no env code


def _reap_zombies() -> None:
    """Collect exited fork-tier children (frozen snapshots that were released, clones orphaned to
    a namespace init) without blocking. The env's own children are left to the env to wait for."""
    resources.reap_fork_zombies(_FORKED)


def thread_count() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def _retire_or_exit(code: int = 0, chan: Channel | None = None) -> None:
    """Leave the loop. The env's own child processes are killed (no process outlives its env). A
    PID-namespace init becomes a reaper so that its namespace's other processes (clones, frozen
    snapshots) live on; any other process just exits.  ``chan``: the active worker's channel,
    shut down once the env's processes are dead -- the EOF a controller waits for
    (``RemoteHandle.kill``) before it puts files back; a shutdown, not a close, since processes
    forked from this one may hold the same socket."""
    victims = resources.kill_env_processes(_FORKED)  # first, at full priority: nothing of the env runs on
    resources.await_dead(victims)
    if chan is not None:
        try:
            chan.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
    if os.getpid() == 1:
        os.closerange(3, 65536)
    try:  # its exit (tearing down tens of MB) must not preempt the learner or its new worker
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        os.setpriority(os.PRIO_PROCESS, 0, 19)
    except OSError:
        pass
    if os.getpid() == 1:
        os.execv(sys.executable, [sys.executable, "-S", "-c", REAPER])
    os._exit(code)


def _check_single_threaded() -> None:
    if thread_count() > 1:
        raise RuntimeError(
            f"the worker has {thread_count()} threads; fork() would keep only one (e.g. torch's "
            "OpenMP pool would deadlock). Use ForkableEnv(..., fork_tier=False) for CRIU-only snapshots."
        )


try:  # fork(2) as os.fork() calls it (the GIL held), without Python's work around it: _fork_exact
    _libc_fork = ctypes.PyDLL(None, use_errno=True).fork
    _libc_fork.restype, _libc_fork.argtypes = ctypes.c_int, ()
except (OSError, AttributeError):
    _libc_fork = None
try:  # (looked up once per worker: a dlopen in every copy of a namespace-init env cost it ~0.1 ms)
    _libc_unshare = ctypes.CDLL(None, use_errno=True).unshare
except (OSError, AttributeError):
    _libc_unshare = None


def _fork_exact(quiet: bool = False) -> int:
    """``os.fork()``, but the child goes on drawing what the parent would have drawn.

    Python makes a forked child draw differently from its parent, on purpose for processes an
    env starts, wrongly for a copy that must continue the parent's state exactly:

    * the global ``random`` state is reseeded in every child (an at-fork hook): kept here;
    * ``tempfile`` names (``mkstemp``, ``mkdtemp``, ``NamedTemporaryFile``, ...) and
      ``multiprocessing`` lock names come from a generator that starts over, freshly seeded,
      in any process whose pid is not the one it last drew in: re-keyed to the child's pid
      (:func:`_rekey_name_sequences`), so a copy draws the names its parent would have drawn.

    ``quiet`` (every fork of the fork tier: the worker's for a snapshot, a frozen snapshot's for
    a copy): fork(2) without Python's after-fork work (``os.register_at_fork`` hooks, the
    ``os.fork`` audit event), so nothing above needs undoing. Those hooks prepare a *new* process
    (locks another thread held, caches, the ``random`` seed); a fork-tier copy is the same
    computation going on, and a hook run there makes it differ from the original: an
    ``lru_cache`` cleared, a generator reseeded. Python's own state needs no after-fork care in a
    process that has one thread and holds no lock -- the worker between requests (its scan
    checked the one thread), a frozen snapshot -- and only there: where another thread waits for
    the GIL, the copy would wait for it to be handed over by a thread it does not have, forever
    (so with more than one, this is ``os.fork()``). gym_fork's own hooks, for the state its
    process keeps for its channel, run all the same (:mod:`gym_fork.atfork`). What it saves: a
    frozen snapshot's CPU until it waits fell from ~1.8 to ~1.3 ms (LunarLander; ~120 page faults
    fewer), a copy's first ~180 faults (~0.4 ms) (threading's and logging's hooks).
    """
    parent = os.getpid()
    if quiet and _libc_fork is not None and _thread._count() == 0:  # (no Python thread but this one)
        pid = _libc_fork()
        if pid < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        if pid == 0:
            _rekey_name_sequences(parent)
            atfork.run_in_child()  # gym_fork's own, all the same (output, file-change group, rings, lock)
        return pid
    rnd = sys.modules.get("random")
    state = rnd.getstate() if rnd is not None else None
    files.quiet_fork = True  # gym_fork's fork, not a process the env started
    try:
        pid = os.fork()
    finally:
        files.quiet_fork = False
    if pid == 0:
        if state is not None:
            rnd.setstate(state)
        _rekey_name_sequences(parent)
    return pid


def _name_sequences() -> list:
    """The pid-keyed name generators of the standard library loaded in this process."""
    found = []
    tmp = sys.modules.get("tempfile")
    if tmp is not None and getattr(tmp, "_name_sequence", None) is not None:
        found.append(tmp._name_sequence)
    sync = sys.modules.get("multiprocessing.synchronize")
    if sync is not None and getattr(getattr(sync, "SemLock", None), "_rand", None) is not None:
        found.append(sync.SemLock._rand)
    return found


def _rekey_name_sequences(parent: int) -> None:
    """In a copy just forked from ``parent``: a generator that last drew in the parent goes on
    from its state instead of starting over (``tempfile._RandomNameSequence`` compares its
    ``_rng_pid`` with ``os.getpid()`` at every draw)."""
    me = None
    for seq in _name_sequences():
        if getattr(seq, "_rng_pid", None) == parent and getattr(seq, "_rng", None) is not None:
            me = me or os.getpid()
            seq._rng_pid = me


def _child_life(run: Callable[[], object]) -> NoReturn:
    """Live a forked child's whole life in ``run()``, then exit: the child never returns into
    the frames it inherited from its parent. (It did on an exception: a ready copy that failed
    went on in the frozen loop that forked it -- a second frozen process reading the snapshot's
    channel, which then lost its requests' replies and the snapshot -- and a frozen process that
    failed went on in the worker's loop, answering on the worker's channel.)"""
    code = 0
    try:
        run()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - said, then this process ends whatever it was
        _child_failed()
    os._exit(code)


def _child_failed() -> NoReturn:
    """In a forked child, inside ``except``: say what failed and end (see :func:`_child_life`)."""
    try:
        traceback.print_exc()
        sys.stderr.flush()
    except BaseException:  # noqa: BLE001 - it ends all the same
        pass
    os._exit(1)


def _fork_child(keep_fd: int, *drop: Channel | None) -> int:
    """fork(); in the child, the ``drop`` channels are closed (a child must hold no socket but
    its own channel: CRIU could not dump it otherwise) and ``keep_fd`` becomes its channel.
    Returns the child's pid in the parent and 0 in the child. The worker calls it only after its
    scan found one thread (``serve`` checks that before it answers: an error then is the request's
    answer); a frozen snapshot has one thread, it never steps."""
    global _FROZEN
    from_frozen = _FROZEN
    pid = _fork_exact(quiet=True)  # (a copy goes on as the original: see _fork_exact)
    if pid == 0:
        _FROZEN = False  # (a copy steps)
        try:
            if from_frozen:
                exits.in_copy()  # (before the env's SIGCHLD handling is back)
            global _subreaper
            _subreaper = False  # (the kernel does not pass it on either)
            if not from_frozen:  # (a copy of a frozen snapshot has its name)
                resources.mark_fork_process()  # a scan tells gym_fork's processes from the env's own
            _FORKED.clear()  # the parent's frozen snapshots are not this process's children
            for ch in drop:
                if ch is not None:
                    ch.close()
            global _ENV_SIGCHLD
            if _ENV_SIGCHLD is not None:  # a copy of a frozen snapshot: the env's own handling again
                signal.signal(signal.SIGCHLD, _ENV_SIGCHLD)
                _ENV_SIGCHLD = None
            # (a frozen snapshot forked from the worker keeps the env's until its loop saves it)
        except BaseException:  # noqa: BLE001 - never back into the parent's frames (see _child_life)
            _child_failed()
    return pid


def _poll_cap(server: EnvServer) -> float:
    """How long this worker polls for its next request at most: the controller's cap where it
    set one (``poll``), else ``GYM_FORK_WORKER_SPIN_US`` (500 µs)."""
    return server.poll_cap if server.poll_cap is not None else spin_cap("GYM_FORK_WORKER_SPIN_US", 500)


#: requests after which a copy's inherited list of generators (EnvServer.generators) still holds:
#: none of them runs the env's code
_KEEP_GENERATORS = frozenset({"hello", "exit_log", "reseed", "private_dirs", "poll", "ring", "ping", "last", "steps", "meta"})


def serve(chan: Channel, server: EnvServer) -> None:
    """The active worker's loop. Once the controller hands it a step ring (``ring`` + an fd),
    requests are announced there and steps travel through it (:mod:`gym_fork.worker.ring`)."""
    ring: Ring | None = None
    step = server.cmd_step
    server.abandoned = lambda: _readable(chan, 0.0)  # mid-request: EOF, or a retire (never a request)
    # Poll for the next request before sleeping while requests follow replies fast (a learner
    # stepping in a tight loop; SpinWait learns it): a wake-up costs more than CartPole's step.
    # A copy starts at the pace its snapshot's worker had learned (server.pace, set before forking).
    spin = SpinWait(_poll_cap(server), server.pace)
    clock, replied = time.perf_counter, 0.0
    # a list of generators comes only with a fresh copy (frozen_loop makes it): a local, so that
    # each step pays for the check a local's test, no attribute lookup
    listed = server.generators is not None
    while True:
        try:
            if ring is None:
                if replied:
                    cmd, args = chan.recv(spin.budget)
                    spin.observe(clock() - replied)
                    replied = 0.0
                else:
                    cmd, args = chan.recv()
                in_ring = False
            else:
                (cmd, args), in_ring = ring.wait_request(chan)
                if in_ring:
                    chan.packed_in = True  # answer in kind: a packed frame
        except ChannelClosed:
            _retire_or_exit(chan=chan)
            return
        if fswatch.deferred:  # a ready copy's first request: from now on it watches its changes
            fswatch.resume()
        if listed and cmd not in _KEEP_GENERATORS:  # the env may change now
            server.generators, listed = None, False
        if cmd == "step" and ring is None:  # most requests: the general path below, minus its cases
            try:
                reply = (OK, step(*args))
            except Exception as exc:  # noqa: BLE001 - every env error goes back to the controller
                reply = _error_reply(exc)
            output.flush(chan)  # what the env printed, warned or logged: ahead of the reply
            try:
                chan.reply(reply)  # packed when the request was a packed step
            except (ChannelClosed, BrokenPipeError, ConnectionResetError):  # the controller went away
                _retire_or_exit(chan=chan)
                return
            except Exception as exc:  # noqa: BLE001 - e.g. the result does not pickle
                chan.send(_unsendable_reply(cmd, exc) if reply[0] == OK else _error_reply(exc))
            replied = clock()
            continue
        if cmd == "close":
            try:
                server.cmd_close()
            finally:
                sink = _Replies(chan, ring)
                output.flush(sink)
                sink.send((OK, None))
            _retire_or_exit(chan=chan)
            return
        if cmd == "retire":
            _retire_or_exit(chan=chan)
            return
        drop_ring = False  # a CRIU dump may follow this reply: no image may hold the ring
        try:
            if cmd == "fork_snapshot":
                if len(args) > 1:  # off the learner's CPU: it polls for the answer (see cpus)
                    cpus.step_aside(args[1])
                server.pace = spin.avg  # its copies go on at this pace
                server.forget_rollout()
                fd = _recv_one_fd(chan)
                try:
                    # What fork() cannot copy (threads, children, shared descriptors): then no
                    # fork; the controller gets the findings and takes a CRIU dump or refuses.
                    scan = resources.fork_blockers({chan.fileno(), fd, *fswatch.own_fds()}, _FORKED)
                    if not scan.resources:
                        _check_single_threaded()
                    elif any(r.kind == "child" for r in scan.resources):
                        fswatch.note_spawn()
                except BaseException:
                    os.close(fd)
                    raise
                # the files the env (its children, native code) changed up to now, ahead of the
                # answer: the controller refuses the snapshot if one is outside its workspace
                fswatch.drain()
                # One sink for the output and the answer: with a ring, a reply is announced
                # there once, whatever rides ahead of it (two announcements for one answer left
                # the controller a reply ahead, and the next step waited on both sides forever).
                sink = _Replies(chan, ring)
                output.flush(sink)  # e.g. what an env's audit hook printed during the scan
                if scan.resources:
                    os.close(fd)
                    sink.send((OK, scan.to_wire()))
                    if ring is not None:
                        ring.close()
                        ring = None
                    continue
                # Answer first, then fork: nothing is read from the channel before the fork, so
                # the child holds exactly the state this request saw, while the controller goes
                # on (its next request waits in the socket; work it does meanwhile -- the
                # policy's next action -- overlaps the fork). A request on the new snapshot's
                # own channel waits likewise until the child serves it.
                sink.send((OK, None))
                # Answered: from here on nothing may answer this request again. A second answer
                # would be read as the next request's, and every answer after it one request off.
                try:
                    pid = _fork_child(fd, chan)  # the child drops the ring (gym_fork.worker.ring)
                except Exception as exc:  # noqa: BLE001 - e.g. ENOMEM: the snapshot's channel closes;
                    os.close(fd)  # using it raises "the snapshot's frozen process is gone"
                    print(f"gym_fork worker: fork for a snapshot failed: {exc!r}", file=sys.stderr, flush=True)
                    continue
                if pid == 0:
                    ready_ahead = bool(args[0]) if args else True
                    _child_life(lambda: frozen_loop(Channel.from_fd(fd), server, ready_ahead=ready_ahead))
                _FORKED.add(pid)
                os.close(fd)
                try:
                    resources.reap_forked(_FORKED)  # no /proc reads here: the scan collected the orphans
                except Exception as exc:  # noqa: BLE001 - the next scan collects them
                    print(f"gym_fork worker: collecting exited snapshots failed: {exc!r}", file=sys.stderr, flush=True)
                continue
            elif cmd == "ring":  # the controller's step ring: requests are announced there from now on
                fd = _recv_one_fd(chan)
                new = Ring.attach(fd)
                # waiting for requests, spin as long as the socket would poll for them (the
                # learner's own work between steps: 300 µs of it slept through a 300 µs cap)
                new.spin_ns = max(int(args[0]), round(spin.cap * 1e9))
                _Replies(chan, ring).send((OK, None))
                if ring is not None:
                    ring.close()
                ring = new
                continue
            elif cmd == "poll":  # the controller's cap on polling for requests (None: the default)
                server.poll_cap = None if args[0] is None else float(args[0])
                spin = SpinWait(_poll_cap(server), spin.avg)
                if len(args) > 1 and not args[1]:  # told, not asked (RemoteHandle.set_worker_polling)
                    continue
                reply = (OK, None)
            elif cmd == "hello" and os.getpid() == 1 and not _CLONE_INIT:  # a CRIU-restored copy's first words
                # dumped as a promoted copy of a snapshot (named gym_fork-fork), it is a worker
                # again: its env's forked children must not look like gym_fork's processes
                resources.unmark_fork_process()
                reply = (OK, server.dispatch(cmd, args))
            elif cmd == "resources":  # before a CRIU dump: what it would (not) capture
                _reap_zombies()
                server.forget_rollout()
                drop_ring = True
                reply = (OK, resources.fork_blockers({chan.fileno(), *fswatch.own_fds()}, _FORKED).to_wire())
            else:
                reply = (OK, server.dispatch(cmd, args))
        except Exception as exc:  # noqa: BLE001 - every env error goes back to the controller
            reply = _error_reply(exc)
        sink = _Replies(chan, ring)
        output.flush(sink)  # what the env printed, warned or logged: ahead of the reply
        try:
            if in_ring and not sink.announced:
                parts = reply_parts(reply)
                if parts is not None and ring.reply(chan, parts):
                    continue
            sink.announce()
            chan.reply(reply)  # packed when the request was a packed step
        except (ChannelClosed, BrokenPipeError, ConnectionResetError):  # the controller went away
            _retire_or_exit(chan=chan)
            return
        except Exception as exc:  # noqa: BLE001 - e.g. the result does not pickle
            sink.send(_unsendable_reply(cmd, exc) if reply[0] == OK else _error_reply(exc))
        if drop_ring and ring is not None:
            ring.close()
            ring = None


class _Replies:
    """Sends a worker's answer on the socket; with a ring, announces it there first (once)."""

    __slots__ = ("chan", "ring", "announced")

    def __init__(self, chan: Channel, ring: Ring | None):
        self.chan, self.ring, self.announced = chan, ring, ring is None

    def announce(self) -> None:
        if not self.announced:
            self.announced = True
            self.ring.announce_reply()

    def send(self, msg: object) -> None:
        self.announce()
        self.chan.send(msg)


def _frozen_exit() -> NoReturn:
    """A frozen snapshot ends (released, or its controller went away): first it collects the
    copies that have ended (their SIGCHLD may still wait for its handler, which would never run),
    so that how they ended is written down (:mod:`gym_fork.worker.exits`)."""
    exits.collect()
    os._exit(0)


def frozen_loop(chan: Channel, server: EnvServer, ready_ahead: bool = True) -> None:
    """A frozen snapshot: holds the state and makes copies of it on request, never steps.

    It keeps one *ready* copy forked ahead of time and hands that copy's channel to the
    controller unasked: a ``(READY, None)`` message with the fd after it (``SCM_RIGHTS``), sent
    only between requests.  The copy has already written the answer to a ``hello`` into its
    channel, so a restore that finds a ready copy costs the controller no round trip at all.
    The first is forked once this channel has been quiet for :data:`FIRST_READY_DELAY_S`. The
    controller says ``taken`` (no reply) when it uses one, and the next is forked once this
    channel has been quiet for :data:`READY_DELAY_S` (:data:`FIRST_READY_DELAY_S` after a
    ``clone``: no copy to learn from) -- or, keeping :data:`BURST_READY`, at once
    (none left) or after :data:`BURST_QUIET_S` (one left) while copies are used less than
    :data:`BURST_S` apart (restores in a burst).  ``clone``
    forks a copy on demand (none was ready, or more are wanted).  Ready copies exit when the controller closes their channel.

    With ``ready_ahead`` false (the controller expects no restore: the root of an ``explore()``,
    the branch ends it returns, an env that restores few of its snapshots), no copy is forked
    ahead until the snapshot is restored -- a ``taken`` notice, or a ``clone`` made for a restore
    (``("clone", (True,))``; a batch for ``fork()`` sends ``(False,)``). Why, and what a ready
    copy costs: :class:`gym_fork.snapshots.snapshot.RestoreRate`.
    """
    global _ENV_SIGCHLD, _FROZEN
    _FROZEN = True
    # copies are not ours to wait for; a handler installed from C (getsignal: None) cannot be
    # put back from Python: its copies get SIG_DFL, as before
    _ENV_SIGCHLD = signal.getsignal(signal.SIGCHLD)
    if _ENV_SIGCHLD is None:
        _ENV_SIGCHLD = signal.SIG_DFL
    # Collected here, so that how each copy ended reaches the learner (gym_fork.worker.exits);
    # where that cannot be written down, ignored: the kernel collects them
    if not exits.collect_in_this_process():
        signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    offered = 0  # ready copies whose channels were handed out and not taken yet
    failed = 0
    # Restores in a burst (tree search: restore, a few steps, restore again) would each find the
    # ready copy gone and clone on demand (~4 ms instead of ~1): when copies are taken or cloned
    # less than BURST_S apart, keep BURST_READY of them -- the next forked at once when none is
    # left, else after BURST_QUIET_S of quiet, once the copy just taken has served its first step.
    last_use = -1.0
    burst = False
    # whose touched pages a ready copy faults in ahead (gym_fork.worker.prefault): the copy
    # used last (the controller names it). Not before the first restore: most snapshots are
    # never restored, and learning and faulting cost tens of ms of CPU.
    learn_from: int | None = None
    plan, learned = prefault.Plan(), None  # in a burst, the plan learned last serves again
    prepare = ready_ahead  # fork copies ahead: from the start, or once the snapshot is restored
    while True:
        learn = bool(learn_from and learn_from != learned and not (burst and learned))
        if burst:
            wanted, quiet = BURST_READY, (BURST_QUIET_S if offered else 0.0)
        else:
            # longer only when the next copy will learn what the used one touched (READY_DELAY_S)
            wanted, quiet = 1, (READY_DELAY_S if learn else FIRST_READY_DELAY_S)
        if prepare and offered < wanted and failed < 3 and not _readable(chan, quiet):
            # Fork only once things are quiet: forking right away would compete for the CPU
            # with the process that just started (the worker, or the copy just taken).
            try:
                if learn:
                    plan, learned = prefault.learn(learn_from), learn_from
                _offer_ready_copy(chan, server, plan)
                offered += 1
            except ChannelClosed:
                _frozen_exit()
            except Exception:  # noqa: BLE001 - e.g. ENOMEM: clone requests fork on demand
                failed += 1
            continue  # up to `wanted` of them, each after its quiet time
        try:
            cmd, args = chan.recv()
        except ChannelClosed:
            _frozen_exit()
        if cmd == "exit":
            _frozen_exit()
        if cmd == "taken" or (cmd == "clone" and (not args or args[0])):  # restored: in a burst?
            now = time.monotonic()
            burst = now - last_use < BURST_S
            last_use = now
            prepare = True
        if cmd == "taken":  # a notice, not a request: no reply; args: the copy's host pid
            offered = max(0, offered - 1)
            learn_from = args[0] if args else learn_from
            continue
        try:
            if cmd == "clone":
                if len(args) > 1 and args[1] and server.generators is None:  # its copies reseed first
                    server.generators = _generators_once(server)
                fd = _recv_one_fd(chan)
                try:
                    _fork_copy(fd, chan, server)
                finally:
                    os.close(fd)
                reply = (OK, None)
            elif cmd == "promote":
                fd = _recv_one_fd(chan)
                reply = (OK, _spawn_pidns_init(fd, server, chan))
                os.close(fd)
            elif cmd == "ping":
                reply = (OK, host_pid())
            else:
                raise ValueError(f"a frozen snapshot cannot {cmd!r}; clone it first")
        except Exception as exc:  # noqa: BLE001
            reply = _error_reply(exc)
        try:
            chan.send(reply)
        except ChannelClosed:
            _frozen_exit()


#: how long a frozen snapshot's channel must be quiet before it forks its next ready copy
READY_DELAY_S = 0.02
#: ... and its first one, and the next after a copy cloned on demand (nothing to learn from: only
#: a taken ready copy is named): a restore 5-20 ms after the snapshot otherwise
#: cloned on demand (LunarLander: 6-7.5 ms, restore + step, against 1.6-2.7 with a ready copy);
#: the steps after a snapshot are no slower for it; after a clone, the quickstart's second restore
#: 10-40 ms after the first found a ready copy (3.2-3.7 ms instead of 7.5-8.4), the steps between
#: no slower. Not after a ready copy was taken: then the next copy also learns what the used one
#: touched (3-9 ms of CPU), and done 5 ms after a restore, that slowed the restored copy's steps
#: by ~40 % for the next 30 ms.
FIRST_READY_DELAY_S = 0.005
#: how long a ready copy waits for its first request before it faults in its plan
PREFAULT_AFTER_S = 0.005
#: how long a ready copy keeps its file-change group (gym_fork.worker.fswatch) while no request
#: comes; then it closes it, and opens one again with its first request
READY_GROUP_S = 0.5
#: copies taken or cloned less than this apart are a burst: then BURST_READY are kept
BURST_S = 0.1
BURST_READY = 2
#: in a burst, how long the channel must be quiet before a copy is forked while another is still
#: ready: a fork at once runs beside the first step of the copy just taken, which then waited
#: 1.4-2 ms for a CPU in about half of the restores made 30 ms apart (2 vCPUs; 2 ms of quiet were
#: not enough). With no copy left, the next is forked at once: a restore may come any moment.
BURST_QUIET_S = 0.004


def _generators_once(server: EnvServer) -> list | None:
    """The env's generators, found here once for all the copies about to be reseeded (see
    ``EnvServer.generators``); None -- each copy walks the env itself, as without this -- where
    the walk fails or warns: the copy's own walk then says so to the controller (a warning here,
    in the frozen process, would reach nobody)."""
    import warnings

    try:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            found = reseed.generators_of(server.env)
    except Exception:  # noqa: BLE001 - the copies' own walks raise it, each to its fork()
        return None
    return None if said else found


def _readable(chan: Channel, timeout: float) -> bool:
    """Whether a request is waiting on ``chan`` (or arrives within ``timeout`` seconds)."""
    import select

    return bool(select.select([chan.sock], [], [], timeout)[0])


def _fork_copy(fd: int, frozen_chan: Channel, server: EnvServer) -> None:
    """Fork a copy of this frozen state that serves env commands on ``fd`` (the frozen process
    keeps ``fd`` open: the caller closes it)."""
    if _fork_copy_process(fd, frozen_chan, want_host=False)[0] == 0:
        _child_life(lambda: serve(Channel.from_fd(fd), server))


def _fork_copy_process(fd: int, frozen_chan: Channel, want_host: bool = True) -> tuple[int, int | None]:
    """Fork a copy of this frozen snapshot: ``(0, None)`` in the copy, ``(pid, host pid)`` here
    (the host pid None with ``want_host=False``: a clone's controller learns it from the copy's
    ``hello``, and looking it up costs the frozen process ~0.3 ms a copy just after a fork).

    A copy of an env that has started processes of its own (:data:`fswatch.spawned`) is made
    PID 1 of a namespace of its own, like a CRIU-restored worker: should its env start a child
    again (a server), its snapshots can then be CRIU dumps of its whole tree (a plain clone is
    no namespace init and would be refused), and the kernel tells its children's file changes
    from its siblings' exactly.  It costs one more fork, so only for such envs."""
    global _subreaper
    if not _subreaper:
        # Nor what they leave: a copy's processes orphaned when it ends (a frozen snapshot of it
        # that explore() cloned its branches from, released while they ran) come to this frozen
        # process, which collects them at once (its SIGCHLD handler: gym_fork.worker.exits), not
        # to the worker, which would keep them as zombies until its next scan. Set before the
        # first copy, not when the frozen process starts: then it costs the snapshot's next step
        # nothing.
        if resources.prctl is not None:  # (looked up once: a dlopen here cost ~0.3 ms at the first copy)
            resources.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        _subreaper = True
    if not fswatch.spawned:
        pid = _fork_child(fd, frozen_chan)
        return (0, None) if pid == 0 else (pid, resources.host_pid_of_child(pid) if want_host else None)
    pid, host = _fork_ns_init(fd, frozen_chan)
    if pid == 0:
        # keeps its fork-tier name: orphaned to the worker (its parent exited), it must not
        # look like one of the env's children there (a retiring worker kills those)
        global _CLONE_INIT
        _CLONE_INIT = True
    return pid, host


def _fork_ns_init(fd: int, *drop: Channel | None) -> tuple[int, int | None]:
    """Fork a copy of this process as PID 1 of a new PID namespace (through a short-lived
    intermediate: ``unshare(CLONE_NEWPID)`` affects only the caller's future children, once), its
    own session leader (CRIU dumps a tree whose session is its own).  Returns ``(0, None)`` in the
    copy and ``(intermediate's pid, copy's host pid)`` here."""
    r, w = os.pipe()
    mid = _fork_child(fd, *drop)
    if mid == 0:
        try:
            os.close(r)
            if _libc_unshare is None or _libc_unshare(CLONE_NEWPID) != 0:
                os.write(w, b"E%d" % (ctypes.get_errno() if _libc_unshare is not None else errno.ENOSYS))
                os._exit(1)
            if _fork_exact(quiet=True) == 0:  # (this process only ran gym_fork's code since the fork)
                os.setsid()
                os.write(w, str(host_pid()).encode())
                os.close(w)
                return 0, None  # (the copy: its caller lives its life in _child_life)
        except BaseException:  # noqa: BLE001 - never back into the parent's frames (see _child_life)
            _child_failed()
        os._exit(0)
    os.close(w)
    try:
        os.waitpid(mid, 0)
    except ChildProcessError:
        pass  # already collected: by a frozen snapshot's SIGCHLD handler (gym_fork.worker.exits)
    data = os.read(r, 64)
    os.close(r)
    if not data or data.startswith(b"E"):
        err = int(data[1:] or 0)
        raise OSError(err, f"unshare(CLONE_NEWPID) failed: {os.strerror(err)}")
    return mid, int(data)


def _offer_ready_copy(frozen_chan: Channel, server: EnvServer, plan: prefault.Plan) -> None:
    """Fork a copy that has already answered ``hello`` on a new channel, and send the
    controller's end of that channel over ``frozen_chan``. The copy then faults in the pages
    ``plan`` names, while it waits for its first request."""
    ours, theirs = socket.socketpair()
    try:
        pid, host = _fork_copy_process(theirs.fileno(), frozen_chan)
        if pid == 0:
            _child_life(lambda: _ready_copy_life(ours, theirs, server, plan))
        frozen_chan.send((READY, host))  # its memory counts for the snapshot
        send_fds(frozen_chan.sock, b"R", [ours.fileno()])
    finally:
        ours.close()
        theirs.close()


def _ready_copy_life(ours: socket.socket, theirs: socket.socket, server: EnvServer, plan: prefault.Plan) -> None:
    """A ready copy (see :func:`_offer_ready_copy`), from its fork to its end."""
    ours.close()
    chan = Channel(theirs)
    fswatch.defer()  # no group of its own while it answers hello (hello opens none)
    try:
        hello = server.cmd_hello(PACKED_VERSION)
        output.flush(chan)  # as ahead of any reply: its record of written files, first
        chan.send((OK, (hello, os.fstat(theirs.fileno()).st_ino)))
    except OSError:
        os._exit(0)  # the controller went away
    # Its group opens now, not with its first request, on which a restore waits (opening
    # one costs 0.15-0.25 ms here). Nothing of the env's runs before that request, so what
    # the group queues meanwhile is other processes' changes, told apart as always.
    fswatch.resume()
    # Its first step must not fault on every page it touches -- unless that step comes
    # within PREFAULT_AFTER_S (restores in a search loop: faulting in would only take CPU
    # from the learner and the copy in use) or while it faults in: then it serves at once.
    if not _readable(chan, PREFAULT_AFTER_S):
        _prefault_on_a_free_cpu(chan, plan)
        if not _readable(chan, READY_GROUP_S):
            fswatch.defer()  # idle: its group would queue every file change on the machine
    serve(chan, server)


def _prefault_on_a_free_cpu(chan: Channel, plan: prefault.Plan) -> None:
    """Fault in ``plan`` while no request waits and a CPU is free (:class:`prefault.CpuWatch`);
    while every CPU is busy, wait for a request, looking again every :data:`PREFAULT_AFTER_S`,
    for at most :data:`READY_GROUP_S`. In a search loop (restore, tens of steps, restore again)
    the learner and the copy in use keep both CPUs of this machine busy, and faulting in there
    took CPU from them: 50-step LunarLander branches were 3-9 % slower with it than without.

    Stopped because the CPUs filled up, it goes on where it stopped once one is free again
    (until then, a request, or the end of :data:`READY_GROUP_S`). It used to give up for good:
    right after a restore the old worker's exit, the next ready copy's fork and the learner's
    steps fill the CPUs for a moment, and a copy that looked then kept none of its plan -- its
    first step, ~180 copy-on-write faults, took 1.3-1.8 ms instead of ~0.7 (LunarLander,
    restores 60 ms apart, four runs: 12 of the 28 copies taken after the second restore; 0 now)."""
    with prefault.CpuWatch() as cpus:
        give_up = time.monotonic() + READY_GROUP_S
        steps = None
        while True:
            while not cpus.free():
                if time.monotonic() > give_up or _readable(chan, PREFAULT_AFTER_S):
                    return
            if steps is None:
                if _readable(chan, 0):  # (reading this process's mappings alone takes ~1 ms)
                    return
                steps = prefault.installments(plan)
            _pages, done = prefault.drive(steps, stop=lambda: _readable(chan, 0) or not cpus.free())
            # done, a request, or the CPUs filled up: then wait a while before looking again
            if done or time.monotonic() > give_up or _readable(chan, PREFAULT_AFTER_S):
                return


def _spawn_pidns_init(fd: int, server: EnvServer, *drop: Channel | None) -> int:
    """A copy of this process as PID 1 of a new PID namespace, serving on ``fd``, to be dumped.
    Returns its host pid."""
    pid, host = _fork_ns_init(fd, *drop)
    if pid == 0:
        _child_life(lambda: serve(Channel.from_fd(fd), server))
    assert host is not None
    return host


def _recv_one_fd(chan: Channel) -> int:
    """The descriptor sent right after a request (a ``b"F"`` byte carrying it). Where none came --
    the sender was cut between the request and its descriptor (a signal handler that raised) --
    what was read instead is the start of the next request: it goes back to be read as such, so
    this request fails alone and the channel stays in step (it was read as the descriptor's byte,
    and the worker then waited forever inside a frame whose head was gone)."""
    msg, fds = recv_fds(chan.sock, 1)
    if len(fds) == 1 and msg[:1] == b"F":
        if len(msg) > 1:
            chan.unread(msg[1:])
        return fds[0]
    for f in fds:
        os.close(f)
    if fds and msg[:1] == b"F":
        msg = msg[1:]
    if msg:
        chan.unread(msg)
    raise RuntimeError("expected exactly one file descriptor with the command (none came: the sender was cut "
                       "between the two)")


def main(argv: list[str]) -> int:
    try:
        os.setsid()
    except OSError:
        pass  # already a session leader
    failed = None  # stdout and stderr may be /dev/null: a setup error is the init request's answer
    try:
        lean.install()  # SB3's Monitor without SB3's algorithms and torch (see gym_fork.worker.lean)
        files.install()  # files the env writes outside its workspace (see gym_fork.worker.files)
        reseed.own_process()  # rng="reseed" may reseed this process's global generators too
        resources.watch_at_fork_hooks()  # hooks the env's modules register, which fork-tier copies would run
        fswatch.forked = _FORKED  # the same set: fork-tier processes are not the env's
        fswatch.start(refresh=True)  # ... and what its children and native code write (root only)
    except Exception as exc:  # noqa: BLE001
        failed = (ERR, type(exc).__name__, f"it could not start, setting up the worker failed: {exc}",
                  traceback.format_exc())
    chan = Channel.from_fd(int(argv[1]))
    try:
        cmd, args = chan.recv()
    except ChannelClosed:
        return 0
    if cmd != "init":
        chan.send((ERR, "ProtocolError", f"expected init, got {cmd!r}", ""))
        return 2
    if failed is not None:
        chan.send(failed)
        return 1
    try:
        output.install(args[0])  # the env's warnings, logs and prints reach the user
        fswatch.warn_if_blind()
        server = EnvServer(build_env(args[0]))
        output.identify(server.env)
        fswatch.built()
        output.flush(chan)
        chan.send((OK, server.cmd_meta()))
    except Exception as exc:  # noqa: BLE001
        output.flush(chan)
        chan.send(_error_reply(exc))
        return 1
    serve(chan, server)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

"""What every backend provides, and the two kinds of worker handle.

A *handle* is how a ForkableEnv talks to the process (or object) that runs its env:
``request(cmd, *args)`` sends one protocol command and returns its result.
A *backend* starts handles, snapshots them, restores snapshots into new handles, and owns what
a snapshot holds (its *payload*): in memory, in a bundle, in a store.
"""

from __future__ import annotations

import abc
import logging
import os
import select
import signal
import socket
import subprocess
import threading
import time
import weakref
from typing import Any, Callable

from gym_fork.interrupts import held
from gym_fork.snapshots import sessiondir
from gym_fork.errors import (ConcurrentUseError, BundleError, IncompleteStepError, NotSendableError, StoreError,
                             WorkerDiedError, WorkerError, remote_exception)
from gym_fork.worker import exits, files
from gym_fork.worker import ring as rings
from gym_fork.worker import ring_slots
from gym_fork.worker.channel import OK, PACKED_OLDEST, PACKED_VERSION, Channel, ChannelClosed, SpinWait, send_fds, spin_cap, step_parts
from gym_fork.worker.commands import EnvServer, EnvSource
from gym_fork.worker.resources import kill_env_descendants

log = logging.getLogger("gym_fork")


def _in_use_error(handle: "Handle", what: str) -> ConcurrentUseError:
    who = f"its worker (pid {handle.pid})" if handle.pid else "it"
    return ConcurrentUseError(
        f"{what} from this thread while another thread's call to the same env is in flight: an env "
        f"takes one call at a time (one request and its reply on the channel to {who}). Give each "
        "thread its own env (env.fork() makes copies), or serialize the calls with a lock. Nothing "
        "was sent for this call; the other thread's call and the env go on.")


class Handle(abc.ABC):
    """A running env: requests go to it one at a time.

    One thread's request at a time, checked: ``_gate`` is held from a request's send to its
    reply (across :meth:`send` and :meth:`receive` too), so a second thread's call is refused
    with :class:`~gym_fork.errors.ConcurrentUseError` instead of reading the first one's reply (or
    waiting forever for its own). A request made within one (a ring offered during a step) passes.
    """

    pid: int | None = None
    closed: bool = False
    #: the worker takes ``request("step", action, True)``: a step, then at once a reset if it
    #: ended the episode (``EnvServer.cmd_step``'s ``reset_at_end``), so a vector env's
    #: auto-reset costs no round trip of its own; False for a worker of an older gym_fork
    autoreset_steps: bool = False
    # an RLock: which thread holds it is known atomically with taking it (``_is_owned``), so a
    # hold an interrupt left behind (Ctrl-C right after the gate was taken, before the code that
    # lets it go was entered) is told apart from another thread's call and let go (recover_gate)
    _gate: Any
    _send_holds = False  # _gate was taken by send(): receive() (or the next request) lets it go

    def _claim(self, what: str) -> bool:
        """Take ``_gate`` for this thread's request: True when taken here (the caller lets it go),
        False when this thread holds it already (a request within a request). Raises
        ConcurrentUseError when another thread holds it."""
        gate = self._gate
        if not gate._is_owned():
            if not gate.acquire(False):
                raise _in_use_error(self, what)
            return True
        if self._send_holds:  # after this thread's send() whose reply it has not read
            if getattr(self, "_pending", False):  # still in the channel: a request now would drop it
                raise ConcurrentUseError(
                    f"{what} while this thread's {getattr(self, '_cmd', '')!r} request, sent with step_send() or "
                    "rollout_send(), waits for its reply: read it first (step_receive() / rollout_receive()), "
                    "which returns it as it was. Nothing was sent for this call.")
            self._send_holds = False  # its reply was read or dropped: this call takes over
            return True
        return False

    def _release(self) -> None:
        self._send_holds = False
        if self._gate._is_owned():  # (recover_gate may have let it go already)
            self._gate.release()

    def _claim_for_send(self, cmd: str) -> None:
        if self._claim(f"{cmd!r} was sent"):
            self._send_holds = True  # until its reply is read
        # else: within this thread's request, which lets _gate go

    def _release_after_reply(self) -> None:
        """The reply of a request sent with send() was read (or will never be): let go of
        ``_gate`` where send() took it."""
        if self._send_holds and self._gate._is_owned():
            self._release()

    def recover_gate(self) -> None:
        """After an interrupt (Ctrl-C) came out of a call into this handle: let go of every hold
        this thread still has on ``_gate`` -- none is a call in progress any more -- except the
        one a send() keeps until its reply is read. Without this, an interrupt that fell right
        after the gate was taken left it taken: every other thread's call was refused from then
        on, for good."""
        if self._send_holds and getattr(self, "_pending", False):
            return
        self._send_holds = False
        gate = self._gate
        while gate._is_owned():
            gate.release()

    @abc.abstractmethod
    def request(self, cmd: str, *args: Any) -> Any: ...

    def refused(self, error: BaseException) -> bool:
        """Whether ``error``, raised by :meth:`receive`, says the request was not carried out (the
        env raised, or it was refused): a ``step_send()``'s step is then not counted. From a
        worker: a WorkerError (a NotSendableError is a step taken whose answer could not come back)."""
        return isinstance(error, WorkerError) and not isinstance(error, NotSendableError)

    def interrupted(self, on_drain: Any) -> bool:
        """After the caller of a request was interrupted before its reply (:meth:`recover_gate`
        first): whether the channel must be resynced (then ``on_drain()`` is called after, see
        ``RemoteHandle.interrupted``). An env in this process has no channel: nothing waits."""
        self.recover_gate()
        return False

    @abc.abstractmethod
    def kill(self) -> None:
        """Stop the env's process (or drop the in-process env) without asking it."""

    #: host pids of the processes of the worker's tree that a restore left stopped
    #: (``Backend.restore(..., hold_tree=True)``) until :meth:`release_held`
    held: list[int] | tuple[()] = ()

    def release_held(self) -> None:
        """Let the processes a ``hold_tree`` restore left stopped go on (once; a no-op after, and
        for a handle that holds none)."""
        held, self.held = self.held, ()
        for pid in held:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    #: whether the worker polls for its next request (worker.channel.SpinWait); see set_worker_polling
    worker_polls = True

    def set_worker_polling(self, on: bool, *, tell_only: bool = False) -> None:
        """Let the worker poll for its next request before sleeping, or not (in process: nothing
        polls)."""
        self.worker_polls = on

    def adopt_pace(self, other: "Handle") -> None:
        """Take over what ``other``, the handle this one replaces, learned about step timing
        (nothing to learn in process)."""

    #: a polite ``close`` was sent by :meth:`begin_close`; :meth:`close` reads its reply
    _close_sent = False

    def begin_close(self) -> None:
        """First half of :meth:`close`, where closing is a round trip worth overlapping with
        others' (a worker's); here nothing: :meth:`close` does it all."""

    def close(self) -> None:
        """Close the env politely (``env.close()``), then stop the process."""
        if self.closed:
            return
        try:
            if self._close_sent:
                self.receive()
            else:
                self.request("close")
        except Exception:  # noqa: BLE001 - closing a dead worker is not an error
            pass
        self.kill()


#: in-process commands that only read (an interrupt inside one leaves the env as it was)
_READS = frozenset({"last", "steps", "meta", "ping", "hello", "rollout_progress", "getattr", "ref_get", "ref_value",
                    "order_hazard", "render"})
#: ... and those that go on from the env's state: refused after a cut (see LocalHandle.cut)
_GOES_ON = frozenset({"step", "rollout", "policy_rollout", "replay"})


class LocalHandle(Handle):
    """The env lives in this process (pickle backend)."""

    autoreset_steps = True  # (this process's own EnvServer)

    #: the command that Ctrl-C cut inside the env's own code, leaving its state unknown (half a
    #: step may have run); a worker would have finished it, this process cannot. Until a
    #: ``reset`` completes (or a restore replaces this handle), :meth:`check_whole` refuses to
    #: go on from it: a step, a rollout, a snapshot
    cut: str | None = None

    def __init__(self, server: EnvServer):
        self._gate = threading.RLock()
        self.server = server
        self._result: Any = None
        self._error: BaseException | None = None
        # the files the env writes outside its workspace, recorded during its calls only
        self.written = files.Record()
        files.install(in_process=True)

    def send(self, cmd: str, *args: Any) -> None:
        # In-process: do the work now, hand it over in receive() (keeps one code path for callers).
        claimed = self._claim(f"{cmd!r} was sent")
        self._raised = None  # (an earlier request's: not kept, with its traceback, any longer)
        try:
            self._result, self._error = self.request(cmd, *args), None
        except Exception as e:  # noqa: BLE001
            self._result, self._error = None, e
        finally:
            # held until receive(): another thread's send would replace the result
            self._send_holds = claimed

    def receive(self) -> Any:
        gate = self._gate
        if not gate._is_owned():  # (not this thread's send: refused while another thread's call runs)
            if not gate.acquire(False):
                raise _in_use_error(self, "a reply was read")
            gate.release()
        self._release_after_reply()
        if self._error is not None:
            err, self._error = self._error, None
            self._raised = err
            raise err
        return self._result

    _raised: BaseException | None = None  # the last error receive() handed on: the request's own

    def refused(self, error: BaseException) -> bool:
        """In process, the env's own exception comes as it is (and any refusal of the request is
        raised by it too): every error :meth:`send` kept and :meth:`receive` handed on."""
        return error is self._raised

    #: ``ForkableEnv``'s accounting of a call that Ctrl-C interrupted outside the env's code (the
    #: env did what it was asked, the count may not say so): run before the next request
    _on_drain: Any = None
    _settling = False

    def interrupted(self, on_drain: Any) -> bool:
        """As ``RemoteHandle.interrupted``, with no channel to resync: ``on_drain()`` runs before
        the next request and asks this process's env what the interrupted call did. Not after a
        :attr:`cut` (there is nothing whole to account for: the env refuses to go on)."""
        self.recover_gate()
        if self.closed or on_drain is None or self.cut is not None:
            return False
        if self._on_drain is None:
            self._on_drain = on_drain
        return True

    def _settle(self) -> None:
        self._settling = True  # (on_drain makes requests of its own)
        try:
            self._on_drain()
        except BaseException as e:
            if isinstance(e, Exception):
                self._on_drain = None  # (else interrupted in turn: it runs again, and accounts once)
            raise
        finally:
            self._settling = False
        self._on_drain = None

    def request(self, cmd: str, *args: Any) -> Any:
        if self.closed:
            raise WorkerDiedError("the in-process env was closed")
        if self._on_drain is not None and not self._settling:
            self._settle()
        if self.cut is not None and cmd in _GOES_ON:
            self.check_whole(f"{cmd}()")
        claimed = self._claim(repr(cmd))
        previous = files.track(self.written)
        try:
            out = self.server.dispatch(cmd, args)
        except BaseException as e:
            if not isinstance(e, Exception) and cmd not in _READS:  # Ctrl-C, inside the env's code
                self.cut = cmd
            raise
        finally:
            files.untrack(previous)
            if claimed:
                self._release()
        if cmd == "reset":
            self.cut = None  # a whole state again
        return out

    def check_whole(self, what: str) -> None:
        """Raise IncompleteStepError if Ctrl-C cut a call inside the env's code (:attr:`cut`)."""
        if self.cut is not None:
            raise IncompleteStepError(
                f"{what} refused: Ctrl-C cut the env's {self.cut!r} inside the env's own code (backend='pickle' "
                "runs the env in this process, where an interrupt stops it wherever it is), so its state may be "
                "half-updated and a step or snapshot from it could not be replayed. Call reset() first, or "
                "restore() a snapshot; nothing was done. (A worker process finishes an interrupted call "
                "instead: backend='criu'.)")

    def kill(self) -> None:
        self.closed = True


#: the default cap, in µs, on how long a handle polls for a step's reply (``GYM_FORK_SPIN_US``)
SPIN_US = 250
#: how long a handle polls for a fork-tier snapshot's answer (the worker's scan) before sleeping
SNAPSHOT_SPIN_S = 0.002


class RemoteHandle(Handle):
    """The env runs in a worker process at the other end of ``chan``.

    ``ino`` is the inode of the *worker's* end of the channel: CRIU names that socket
    ``unix[ino]`` when it dumps the worker, and re-attaches a fresh socket in its place on restore.
    """

    def __init__(self, chan: Channel, pid: int, ino: int, *, popen: subprocess.Popen | None = None,
                 child: bool = False, ns_root: bool = False, fork_tier: bool = False):
        self._gate = threading.RLock()
        self.chan = chan
        self.pid = pid
        self.ino = ino
        self.ns_root = ns_root  # PID 1 of its namespace: killing it kills the whole namespace
        self.fork_tier = fork_tier  # copy-on-write snapshots: its namespace may hold other processes
        self._popen = popen  # set when we spawned it (the process is `unshare`, the worker its child)
        self._child = child  # set when the worker itself is our child (restored with rst_sibling)
        # a worker that is our child and whose handle is dropped unclosed (an interrupt between
        # its restore and the env that would own it) exits on its channel's EOF: waited for then,
        # through a pidfd (never another process that got its pid), else a zombie for good
        self._orphan_reaper = _orphan_reaper(self, pid) if child and pid else None
        self._pending = False  # a request was sent but its reply never read (e.g. Ctrl-C)
        self._abandoned = False  # ... and given up by an interrupt: no receive() may read it
        self._in_sync = False  # ... forced by interrupted() while nothing was in flight (see there)
        # called with that reply when it is drained (ForkableEnv accounts for the step it was)
        self._on_drain: Any = None
        self.preloaded = 0  # how many policies its worker has unpickled ahead (load_policy)
        self.initial: list | None = None  # [obs, info, steps] from the first "hello", if any
        self.packed = False  # the worker reads packed step frames (learned from init/meta/hello)
        self.autoreset_steps = False  # ... and those that reset at an episode's end (version 3)
        self._cmd = ""  # the request in flight (its reply is read by receive())
        self._offered = False  # that request is a hello offering packed frames
        self._status: str | None = None
        self._born = time.time_ns()  # how it ended is looked up among the ends written down since
        # the shared-memory step ring (gym_fork.worker.ring), opened after RING_AFTER steps made
        # one request at a time (short-lived copies never pay for one); None: the socket only
        self.ring: rings.Ring | None = None
        self._sync_steps = 0
        # steps take _step(): packed frames, no ring and none to be offered (the usual case)
        self._fast_steps = False
        # how long _step polls for the reply before sleeping (only while steps come back fast).
        # 250 µs: a MuJoCo or Box2D step (50-150 µs) plus the round trip stays under it, so its
        # reply is polled for too, not slept for (measured: HalfCheetah 0.67-0.94x the overhead
        # of a 100 µs cap, LunarLander 0.84-0.87x, CartPole unchanged)
        self._spin = SpinWait(spin_cap("GYM_FORK_SPIN_US", SPIN_US))
        self._sent_at = 0.0  # when the request in flight was sent (its wait, for _spin)
        self._deferred: list[Callable[[], None]] | None = None  # see defer()
        self._replied_at = 0.0  # when the last reply was read (see worker_sleeps())

    #: whether replies are polled for (a local socket); a network channel (TLS) is not
    POLLS = True

    #: steps made through :meth:`request` before a ring is offered (when rings are wanted)
    #: (opening one costs a fresh copy ~0.7 ms, which its steps repay after ~50: copies in a
    #: search loop, a few steps each, never pay for one)
    RING_AFTER = int(os.environ.get("GYM_FORK_RING_AFTER", "64"))

    def request(self, cmd: str, *args: Any) -> Any:
        gate = self._gate
        if cmd == "step" and self._fast_steps and not (self._pending or self.closed):
            # every step's path: Handle._claim inline (a step makes no request within itself;
            # any other thread's call is refused while the gate is held)
            if gate.acquire(False):
                try:
                    return self._step(args[0])
                finally:
                    gate.release()
        if not gate._is_owned():
            if not gate.acquire(False):
                raise _in_use_error(self, repr(cmd))
            try:
                return self._request(cmd, args)
            finally:
                self._send_holds = False
                gate.release()
        if self._claim(repr(cmd)):  # after this thread's send() whose reply it never read
            try:
                return self._request(cmd, args)
            finally:
                self._release()
        return self._request(cmd, args)  # a request within this thread's request

    def _request(self, cmd: str, args: tuple) -> Any:
        if cmd == "step":
            if self._fast_steps and not (self._pending or self.closed):
                return self._step(args[0])
            if self.ring is None and self._sync_steps <= self.RING_AFTER:
                # rings.wanted() reads the CPU affinity (a system call): asked at the first step
                # and when the ring is due, not at every step between
                first = self._sync_steps == 0
                self._sync_steps += 1
                due = self._sync_steps > self.RING_AFTER
                if (first or due) and not rings.wanted():  # no ring: fast at once
                    self._sync_steps = self.RING_AFTER + 1
                    self._fast_steps = self.packed
                elif due:
                    if self.packed:
                        self._open_ring()
                    self._fast_steps = self.packed and self.ring is None
                elif self.packed and not (self._pending or self.closed):
                    # until the ring is offered, steps poll for their replies as fast steps do
                    return self._step(args[0])
        self._send(cmd, args)  # (send() and receive() without their gate: request() holds it)
        return self._receive()

    def set_worker_polling(self, on: bool, *, tell_only: bool = False) -> None:
        """Let the worker poll for its next request before sleeping (its own cap,
        ``GYM_FORK_WORKER_SPIN_US``), or sleep at once: a round trip. A worker from before this
        request existed answers that it does not know it: it keeps polling, and says so here.

        ``tell_only``: sent without an answer (a fresh copy's first round trip costs ~0.3 ms:
        restore() 0.39 -> 0.66 ms), for a worker known to take it -- one restored from a
        snapshot this process took with polling off. Never while a request is in flight or a
        ring is open (then the round trip)."""
        if tell_only and self.ring is None and not self._pending and not self.closed:
            frame = self.chan.encode(("poll", (None if on else 0.0, False)))
            try:
                with held():  # (a torn frame is garbage to the worker: see _send_plain)
                    self.chan.send_encoded(frame)
            except (ChannelClosed, OSError) as e:
                raise WorkerDiedError(f"the env worker (pid {self.pid}) died: {self.exit_status()}") from e
            self.worker_polls = on
            return
        try:
            self.request("poll", None if on else 0.0)
        except ValueError as e:
            if "unknown worker command" not in str(e):
                raise
            on = True
        self.worker_polls = on

    def defer(self, notice: Callable[[], None]) -> None:
        """Run ``notice`` (it sends one message, e.g. a restore's "taken" to the frozen snapshot,
        or the replaced worker's EOF) right after this worker's next request is sent, while the
        worker computes its answer, instead of now: each such message wakes a sleeping process,
        which costs the sender 0.1-0.2 ms on this 2-vCPU guest (a restore sent two before its
        copy's first step). Run at the latest when this handle is retired or killed."""
        if self._deferred is None:
            self._deferred = []
        self._deferred.append(notice)

    def worker_sleeps(self) -> bool:
        """Whether the worker has most likely stopped polling for its next request and sleeps: a
        message then wakes it, which costs the sender (worth deferring, :meth:`defer`), whereas
        a worker still polling reads it at once and is better told now (a replaced copy told
        later would poll on beside the new copy until its cap runs out)."""
        ring = self.ring
        if ring is not None and not ring.closed:
            return bool(ring.w[rings.W_SLEEP])  # (the worker sets it before it sleeps)
        if not self.worker_polls:
            return True
        return time.perf_counter() - self._replied_at > spin_cap("GYM_FORK_WORKER_SPIN_US", 500)

    def _run_deferred(self) -> None:
        # (Ctrl-C waits until all are sent: one cut off would leave a replaced copy running
        # until its handle is collected, or a frozen snapshot with no ready copy coming)
        with held():
            todo, self._deferred = self._deferred, None
            for notice in todo or ():
                try:
                    notice()
                except Exception as e:  # noqa: BLE001 - a notice never fails the request it rides on
                    log.debug("gym_fork: a deferred notice failed: %s", e)

    def adopt_pace(self, other: Handle) -> None:
        """Poll for step replies as ``other`` (the worker this one replaces) had learned to: a
        restored copy steps like its predecessor, and a learner that restores every few steps
        would otherwise sleep through each copy's first dozen steps while it learns again."""
        ring = getattr(other, "ring", None)
        # with a ring, steps went through it: its pace is what was learned (the socket's is stale)
        spin = ring.pace if ring is not None and not ring.closed else getattr(other, "_spin", None)
        if spin is not None:
            self._spin = SpinWait(self._spin.cap, spin.avg)

    def _step(self, action: Any) -> Any:
        """A step, as ``send("step", action)`` + ``receive()`` do it, without their general cases:
        the worker reads packed frames and there is no ring (one request and one reply on the
        socket; the reply is read in one system call where it is all there)."""
        chan, spin = self.chan, self._spin
        self._cmd = "step"
        t0 = time.perf_counter()
        self._pending = True  # (before the send: see _resync)
        try:
            try:
                chan.send_step(action)
            finally:
                if self._deferred:
                    self._run_deferred()
            reply = chan.recv_reply(spin.budget)  # polls first where steps come back fast
        except (ChannelClosed, OSError) as e:
            raise WorkerDiedError(f"the env worker (pid {self.pid}) died during 'step': {self.exit_status()}") from e
        self._pending = False
        self._replied_at = now = time.perf_counter()
        spin.observe(now - t0)
        if reply[0] == OK:
            return reply[1]
        _, type_name, message, tb = reply
        raise remote_exception(type_name, message, tb)

    def _open_ring(self) -> None:
        """Offer the worker a step ring; the socket stays in use when it cannot take one."""
        if self.chan.sock.family != socket.AF_UNIX or self.closed:
            return  # a relayed (network) worker: no memory to share
        slot = ring_slots.claim()  # a CPU to spin on, counted across the machine's processes
        if slot is None:
            return
        ring = fd = None
        try:
            ring, fd = rings.Ring.create()
            ring.slot = slot
            self.request_with_fd("ring", fd, ring.spin_ns)
        except BaseException as e:
            # unmapped and its slot freed whatever went wrong (a ring left mapped on Ctrl-C would
            # hold its slot, one of the machine's few, until this process ends)
            if ring is not None:
                ring.slot = slot
                ring.close()
            else:
                slot.release()
            if isinstance(e, WorkerDiedError) or not isinstance(e, Exception):
                raise
            return  # no memfd or mapping here, or an older worker without rings: the socket it is
        finally:
            if fd is not None:
                os.close(fd)
        self.ring = ring

    def _drop_ring(self) -> None:
        if self.ring is not None:
            self.ring.close()
            self.ring = None
            self._sync_steps = 0  # offered again after RING_AFTER more steps
            self._fast_steps = False

    def _read(self, spin: float = 0.0) -> Any:
        """The reply to the request in flight (through the ring when it has one); ``spin``:
        seconds to poll for it before sleeping."""
        if self.ring is not None:
            return self.ring.wait_reply(self.chan, int(spin * 1e9))
        return self.chan.recv_reply(spin)  # a worker sends nothing after a reply: read ahead safely

    def _send_plain(self, msg: Any) -> None:
        """Send a pickled request on the socket (announced in the ring first, if any). Pickled
        before anything is announced or sent: a request that does not pickle leaves the channel
        and the ring in step (announced but never sent, the worker's next read hung)."""
        try:
            frame = self.chan.encode(msg)
        except Exception as e:  # noqa: BLE001 - whatever pickle raises (PicklingError, AttributeError, TypeError)
            raise NotSendableError(
                f"cannot send this call to the env's worker (pid {self.pid}): an argument does not pickle "
                f"({type(e).__name__}: {e}); define what it refers to at module level (not inside a "
                "function or as a lambda), or keep it in this process. Nothing was sent; the env goes on."
            ) from e
        self._pending = True  # (before the send: see _resync)
        # Ctrl-C waits until the whole frame is sent (a large one takes several writes): a torn
        # frame is garbage to the worker, which then dies -- and a namespace's init takes its
        # frozen snapshots with it
        with held():
            if self.ring is not None:
                self.ring.announce()
            self.chan.send_encoded(frame)

    def send(self, cmd: str, *args: Any) -> None:
        """First half of a request: send it, so several workers can compute at the same time
        (and a new copy's ``hello`` can wait in its socket while the copy is being made)."""
        self._claim_for_send(cmd)  # held until receive() has read the reply
        try:
            self._send(cmd, args)
        except BaseException:
            self._release_after_reply()  # nothing is in flight for it
            raise

    def _send(self, cmd: str, args: tuple) -> None:
        if self.closed:
            raise WorkerDiedError(f"worker {self.pid} was already stopped")
        try:
            self._post(cmd, args)
        except (ChannelClosed, OSError) as e:
            raise WorkerDiedError(f"the env worker (pid {self.pid}) died during {cmd!r}: {self.exit_status()}") from e
        finally:
            if self._deferred:  # (a restore's notices: see defer())
                self._run_deferred()

    def begin_close(self) -> None:
        """Ask the worker to close its env without waiting, so that many workers close at once
        (a polite close is a round trip: ~0.6 ms a worker here, which closing explore()'s 16
        branches one after another spent in the learner); :meth:`close` reads the answer.
        Nothing while a request's reply is unread (``close`` then does it all, as before)."""
        if self.closed or self._close_sent or self._pending:
            return
        try:
            self.send("close")
        except Exception:  # noqa: BLE001 - a dead worker: close() stops it
            return
        self._close_sent = True

    def receive(self) -> Any:
        """Second half of a request sent with :meth:`send`."""
        if self._abandoned:
            raise RuntimeError(
                "nothing to receive: Ctrl-C interrupted the receive of this request, and its reply was given up "
                "(the env accounts for what the worker did at its next call); make a new call")
        if not self._pending:  # (reading would wait forever for a reply that will never come)
            raise RuntimeError(
                "nothing to receive: no request is waiting for its reply (it was received already, or given up "
                "after Ctrl-C and the env has since accounted for what the worker did); make a new call")
        gate = self._gate
        if not gate._is_owned():  # (not this thread's send: refused while another thread's call runs)
            if not gate.acquire(False):
                raise _in_use_error(self, "a reply was read")
            gate.release()
        try:
            return self._receive()
        finally:
            self._release_after_reply()

    def _receive(self) -> Any:
        cmd = self._cmd
        try:
            if cmd == "step" and self.ring is None and self.POLLS:
                # a vector env's step (its workers step concurrently): poll while replies come
                # fast, as a single env's steps do, so that the learner is not put to sleep and
                # woken for each reply not there yet
                spin = self._spin
                reply = self.chan.recv_reply(spin.budget)
                self._replied_at = now = time.perf_counter()
                spin.observe(now - self._sent_at)
            else:
                reply = self._read()
                self._replied_at = time.perf_counter()
            self._pending = False
            if cmd == "hello" and self._offered:
                self._offered = False
                if reply[0] != OK and reply[1] == "TypeError":  # an older worker: hello takes no argument
                    self._send_plain(("hello", ()))
                    self._pending = True
                    reply = self._read()
                    self._pending = False
        except (ChannelClosed, OSError) as e:
            raise WorkerDiedError(f"the env worker (pid {self.pid}) died during {cmd!r}: {self.exit_status()}") from e
        if cmd == "resources":  # a CRIU dump may follow: the worker has dropped the ring too
            self._drop_ring()
        result = _result(reply)
        if cmd == "hello" and len(result) == 5:  # the worker reads packed step frames
            self.learn_packed(result[4])
            return result[:4]
        if cmd in ("init", "meta") and type(result) is dict:
            self.learn_packed(result.get("packed"))
        return result

    def learn_packed(self, version: Any) -> None:
        """The packed step frames the worker says it reads (``init``, ``meta``, ``hello``): of a
        version this module writes, or none (pickles)."""
        self.packed = type(version) is int and PACKED_OLDEST <= version <= PACKED_VERSION
        self.autoreset_steps = self.packed and version >= 3
        self._fast_steps &= self.packed

    def _post(self, cmd: str, args: tuple) -> None:
        """Send one request: a step as a packed frame where the worker reads them, a plain
        ``hello`` offering them. An unread reply of an interrupted request is drained first
        (one request in flight, always)."""
        chan = self.chan
        if self._pending:
            self._resync()
        self._cmd, self._offered = cmd, False
        ring = self.ring
        if cmd == "step" and ring is None:
            self._sent_at = time.perf_counter()  # receive() polls from here (a ring times itself)
        if cmd == "step" and self.packed:
            self._pending = True  # (before the send: see _resync)
            if ring is None:
                chan.send_step(*args)  # (action,) or (action, reset_at_end): see autoreset_steps
            elif not ring.post(chan, step_parts(*args)):
                ring.announce()  # larger than the ring: on the socket
                chan.send_step(*args)
        elif cmd == "hello" and len(args) <= 1:  # args: () or (whether the obs and info are wanted,)
            self._send_plain(("hello", (PACKED_VERSION, *args)))  # an older worker refuses the arguments
            self._offered = True
        else:
            self._send_plain((cmd, args))

    def _resync(self) -> None:
        """Bring the channel back to one request, one reply, after a request whose caller was
        interrupted (Ctrl-C, a signal handler that raised) between setting ``_pending`` and
        reading the whole reply. Whether the request went out, whether its reply was read, and
        whether the interrupt fell in the middle of reading a frame depends on where it fell,
        and nothing here can tell: reading one reply blindly waited forever for one that had
        been read, or (with ``_pending`` set after the send, as it was) left one unread, and from
        then on every request got the previous one's reply, silently.

        So: a request of a name no worker has, ``resync-<random>``; every worker (of any gym_fork
        version) answers an unknown command with an error naming it, and everything up to that
        answer is dropped, as raw bytes (:meth:`Channel.skip_to`). A ring is dropped first (the
        worker takes requests that come on the socket unannounced) and offered again later.
        Then :meth:`interrupted`'s function asks the worker what the interrupted request did."""
        if self._in_sync:
            # nothing was in flight when the interrupt fell (its reply had been read whole, and
            # nothing was sent since): no marker, and none of skip_to()'s 20 ms of quiet
            self._in_sync = False
        else:
            self._drop_ring()
            marker = f"resync-{os.urandom(8).hex()}"
            self._send_plain((marker, ()))
            self.chan.skip_to(marker.encode())
        self._pending = self._abandoned = False
        on_drain = self._on_drain
        if on_drain is not None:
            # kept until it has run to the end: interrupted in turn (Ctrl-C twice), it runs again
            # at the next resync (it asks the worker, so running twice accounts once)
            try:
                on_drain()
            except BaseException as e:
                if isinstance(e, Exception):
                    self._on_drain = None  # (a dead worker: nothing left to account for)
                raise
            self._on_drain = None

    def interrupted(self, on_drain: Any) -> bool:
        """After the caller of a request was interrupted (Ctrl-C) before it had read its reply,
        or accounted for it: whether the channel must be resynced (the worker may have got the
        request, and runs it all the same). If so, ``on_drain()`` is called once the next request has resynced it,
        from within that request: it may ask the worker (``request``) what was done."""
        self.recover_gate()
        if self.closed or not (self._pending or on_drain is not None):
            return False
        # Also when nothing is in flight: the interrupt may have fallen after the reply was read
        # and before the caller accounted for it (the step taken, not counted), and only the
        # worker can say. Then the resync drains nothing but still runs ``on_drain`` first.
        if self._on_drain is None:  # (else an earlier request's, still to run: the one that may
            self._on_drain = on_drain  # have reached the worker; this one was never sent)
        if not self._pending:
            # ``_pending`` is cleared only once a reply has been read whole: the channel holds
            # nothing, so the resync only runs ``on_drain`` (a marker's round trip and 20 ms of
            # quiet saved). Set until that resync: every send resyncs first while ``_pending``.
            self._in_sync = True
        self._pending = True
        self._abandoned = True  # receive() must not read what follows: the next request resyncs
        return True

    def request_with_fd(self, cmd: str, fd: int, *args: Any) -> Any:
        """A request that hands the worker one file descriptor (SCM_RIGHTS, right after it)."""
        if self.closed:
            raise WorkerDiedError(f"worker {self.pid} was already stopped")
        claimed = self._claim(repr(cmd))
        try:
            return self._request_with_fd(cmd, fd, args)
        finally:
            if claimed:
                self._release()

    def _request_with_fd(self, cmd: str, fd: int, args: tuple) -> Any:
        try:
            if self._pending:  # after an interrupted request
                self._resync()
            with held():  # (a request cut from its fd: the worker reads the next frame's first byte for it)
                self._send_plain((cmd, args))
                send_fds(self.chan.sock, b"F", [fd])
            if self._deferred:
                self._run_deferred()
            # A fork snapshot is answered before the worker forks, within ~0.5 ms (its scan): a
            # learner asleep by then was woken onto the worker's CPU and waited there for the
            # fork too (~1.3 ms more). Polling, it reads the answer at once and goes on (its
            # policy's next action) while the worker forks.
            reply = self._read(SNAPSHOT_SPIN_S if cmd == "fork_snapshot" and self._spin.cap > 0.0 else 0.0)
            self._replied_at = time.perf_counter()
            self._pending = False
        except (ChannelClosed, OSError) as e:
            raise WorkerDiedError(f"the process {self.pid} died during {cmd!r}: {self.exit_status()}") from e
        if reply[0] == OK:
            if cmd == "fork_snapshot" and reply[1] is not None:
                self._drop_ring()  # the worker found what fork() cannot copy: a dump may follow
            return reply[1]
        _, type_name, message, tb = reply
        raise remote_exception(type_name, message, tb)

    def exit_status(self) -> str:
        """How the worker ended, as words (waits up to 2 s for it to be reaped)."""
        if self._status is not None:
            return self._status
        # (pid 0: a clone that ended before its hello, which names it: nothing tells how)
        status = "it is still running but closed its channel" if self.pid else "it ended before it said its pid"
        try:
            if self._popen is not None:
                rc = self._popen.wait(timeout=2)
                status = _describe_returncode(rc)
            elif self._child:
                deadline = time.monotonic() + 2
                while True:
                    wpid, st = os.waitpid(self.pid, os.WNOHANG)
                    if wpid:
                        status = _describe_returncode(os.waitstatus_to_exitcode(st))
                        break
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.01)
            elif self.pid:
                # another process's child (a copy-on-write copy: its frozen snapshot's, or its
                # namespace's reaper's): not ours to wait for, but /proc tells a zombie's status
                deadline = time.monotonic() + 2
                while (found := _ended_as(self.pid)) is None and time.monotonic() < deadline:
                    time.sleep(0.01)
                if found == _REAPED:  # its parent wrote down how, unless it exited with 0
                    found = _logged_end(self.pid, self._born) or found
                if found is not None:
                    status = found
        except (subprocess.TimeoutExpired, ChildProcessError):
            pass
        self._status = status
        return status

    def retire(self) -> None:
        """Stop a worker that a restore replaces, off the learner's path where it can: a
        worker waiting for its next request only has its channel closed (on that EOF it lowers
        its own priority, stops its env's processes and exits: ``worker/loop.py``), instead of
        being killed here after a ``/proc`` scan for those processes (~100 µs of the restore).
        A worker with a request in flight, a namespace's init, one this process reaps, or one
        whose env has started processes (they would run on until the worker gets to them, beside
        the restored copy: those are killed here, at once) is killed (:meth:`kill`)."""
        if self._deferred:
            self._run_deferred()
        if self.closed:
            return
        if not self.retires_by_eof():
            self.kill()
            return
        self.closed = True
        if self.ring is not None:
            self.ring.announce()  # a worker spinning on the ring reads the socket now: the EOF
        self._drop_ring()
        self.chan.close()

    def retires_by_eof(self) -> bool:
        """Whether :meth:`retire` only closes the channel (one message's cost, worth deferring to
        the next worker's first request), rather than killing the worker and waiting for it."""
        return not (self._pending or self.ns_root or self._popen is not None or self._child or not self.pid
                    or self.chan.spawned or type(self) is not RemoteHandle)  # (a network handle: its kill())

    #: a weak reference to the last fork-tier snapshot this worker answered for (see kill())
    _last_fork: Any = None
    #: set by a caller about to put files back (a restore's switch): :meth:`kill` of a retiring
    #: fork-tier worker whose env started processes then waits until those are dead
    await_env_exit = False

    def kill(self) -> None:
        if self._deferred:
            self._run_deferred()
        if self.closed:
            return
        last = self._last_fork() if self._last_fork is not None else None
        self._last_fork = None
        if last is not None and getattr(last, "_pid", 0) is None and getattr(last, "chan", None) is not None:
            # A worker answers a fork_snapshot request first and forks right after (the learner
            # goes on meanwhile): killed in between, the snapshot it answered for would have no
            # frozen process, ever. So wait until that one answers (it exists once forked).
            try:
                last.pid
            except Exception:  # noqa: BLE001 - the worker died first: that snapshot says so when used
                pass
        self.closed = True
        _deprioritize(self.pid)
        if self.ns_root and self.fork_tier:
            # Its namespace may hold clones and frozen snapshots that must live on: ask it to
            # retire (exec a reaper that exits with the last of them) instead of killing it.
            try:
                self._send_plain(("retire", ()))
                if self.chan.spawned and self.await_env_exit:
                    # Its env's processes (a tool server, a file watcher) run until the worker
                    # gets to them; beside a restored copy they would still write into files
                    # about to be put back. The worker kills them first and, once they are dead,
                    # shuts its end of the channel down: that EOF says they are gone.
                    _await_eof(self.chan.sock, _RETIRE_WAIT_S)
            except OSError:
                pass
            self._drop_ring()
            self.chan.close()
            _reap_in_background(self._popen, self.pid if self._child else None)
            _drop_orphan_reaper(self)  # (only now: interrupted before, it still waits for the worker)
            return
        if not self.ns_root and self.pid:
            # not its namespace's init: its env's children would outlive it (orphaned to that init)
            kill_env_descendants(self.pid)
        self._drop_ring()
        self.chan.close()
        try:
            # SIGKILL: a PID-namespace init ignores SIGTERM, and killing it ends its namespace.
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            if self._popen is not None:
                self._popen.wait(timeout=5)
            elif self._child:
                os.waitpid(self.pid, 0)
        except (ChildProcessError, subprocess.TimeoutExpired):
            pass
        _drop_orphan_reaper(self)


def _deprioritize(pid: int) -> None:
    """Give a worker that is being stopped the smallest share of the CPU that still ends it:
    its exit -- tearing down tens of MB of memory, a last Python loop -- would otherwise preempt
    the learner and the worker that replaces it (a restore stops the old worker on the critical
    path). ``SCHED_BATCH`` (never preempts on waking) at nice 19: about 1.5 % of a CPU against
    one busy process. Not ``SCHED_IDLE``, which it was: that runs only on an idle CPU, so while a
    learner kept every CPU busy the dying workers never finished exiting and piled up (measured:
    a 50 ms exit not done after 30 s next to two busy loops; 7 s at nice 19)."""
    if pid > 0:
        try:
            os.sched_setscheduler(pid, os.SCHED_BATCH, os.sched_param(0))
            os.setpriority(os.PRIO_PROCESS, pid, 19)
        except OSError:
            pass  # gone already, or not ours to change


def _result(reply: tuple) -> Any:
    """The result of an ``(OK, result)`` reply; an ``(ERR, ...)`` reply raised as its exception."""
    if reply[0] == OK:
        return reply[1]
    _, type_name, message, tb = reply
    raise remote_exception(type_name, message, tb)


def _orphan_reaper(handle: Handle, pid: int) -> Any:
    """A finalizer that waits for ``pid`` (our child) once ``handle`` is garbage-collected
    unclosed; :meth:`RemoteHandle.kill` and ``retire`` detach it (they reap it themselves)."""
    try:
        pidfd = os.pidfd_open(pid)
    except (OSError, AttributeError):  # gone already, or no pidfds here
        return None
    return weakref.finalize(handle, _wait_pidfd_in_background, pidfd)


def _wait_pidfd_in_background(pidfd: int) -> None:
    def wait() -> None:
        try:
            os.waitid(os.P_PIDFD, pidfd, os.WEXITED)
        except (ChildProcessError, OSError):
            pass
        finally:
            os.close(pidfd)

    try:
        threading.Thread(target=wait, daemon=True, name="gym_fork-reap").start()
    except RuntimeError:  # at interpreter shutdown: this process ends too
        os.close(pidfd)


def _drop_orphan_reaper(handle: Any) -> None:
    """The handle reaps its worker itself (kill, retire): no finalizer waits for it."""
    reaper = getattr(handle, "_orphan_reaper", None)
    if reaper is not None:
        detached = reaper.detach()
        if detached is not None:
            os.close(detached[2][0])


#: how long :meth:`RemoteHandle.kill` waits for a retiring worker to have stopped its env's processes
_RETIRE_WAIT_S = 5.0


def _await_eof(sock: socket.socket, timeout: float) -> None:
    """Read ``sock`` (discarding what arrives: a reply the worker was still sending) until its peer
    has shut its end down or closed it (EOF), or ``timeout`` seconds have passed."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([sock], [], [], left)[0]:
            return
        try:
            if not sock.recv(65536):
                return
        except BlockingIOError:
            continue
        except OSError:
            return


def _reap_in_background(popen: subprocess.Popen | None, child_pid: int | None) -> None:
    def wait() -> None:
        try:
            if popen is not None:
                popen.wait()
            elif child_pid is not None:
                os.waitpid(child_pid, 0)
        except ChildProcessError:
            pass

    if popen is not None or child_pid is not None:
        try:
            threading.Thread(target=wait, daemon=True, name="gym_fork-reap").start()
        except RuntimeError:  # "can't create new thread at interpreter shutdown" (Python >= 3.12):
            pass  # an env left open until exit; it is ending, and this process too, which nobody waits for


_REAPED = ("it has exited, and no signal or error exit was recorded for it (it exited with 0, or its parent "
           "process ended with it, e.g. with its PID namespace: see gym_fork.worker.exits)")


def _logged_end(pid: int, since_ns: int) -> str | None:
    """How process ``pid``, a copy this handle has talked to since ``since_ns``, ended, as its
    parent wrote it down (:mod:`gym_fork.worker.exits`): waits up to half a second for the
    line, written as the parent collects it. None where there is none (it exited with 0, or
    its parent could not write)."""
    path = sessiondir.exit_log(create=False)
    if path is None:
        return None
    deadline = time.monotonic() + 0.5
    while (rc := exits.ended(path, pid, since_ns)) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return None if rc is None else _describe_returncode(rc)


def _ended_as(pid: int) -> str | None:
    """How process ``pid``, not our child, ended, read from ``/proc`` while it is a zombie (its
    ``exit_code`` field, as ``waitpid`` reports it); "it has exited" once its parent has reaped
    it; None while it runs."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return _REAPED
    except OSError:
        return None
    fields = data[data.rindex(b")") + 2:].split()  # from field 3, the state, on
    if fields[0] not in (b"Z", b"X"):
        return None
    try:
        return _describe_returncode(os.waitstatus_to_exitcode(int(fields[49])))  # field 52: exit_code
    except (IndexError, ValueError):
        return "it has exited"


def _describe_returncode(rc: int) -> str:
    if rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
        return f"killed by {name}"
    if rc > 128 and rc - 128 < 65:  # `unshare --fork` reports a killed child as 128+sig on some versions
        try:
            return f"exit code {rc} (killed by {signal.Signals(rc - 128).name}?)"
        except ValueError:
            pass
    return f"exited with code {rc}"


class Backend(abc.ABC):
    """Starts env workers, snapshots them and restores snapshots.

    Besides the worker side, a backend owns its *payloads* (what a snapshot holds): how they are
    persisted, freed, written into a bundle and read back (``bundle_write`` / ``bundle_read`` /
    ``check_compatible``), and, for backends whose payloads are image files (``storable``), how a
    :class:`~gym_fork.SnapshotStore` keeps them (``store_images`` / ``payload_at`` /
    ``chunk_lengths``).  The data layer (:mod:`gym_fork.snapshots`) calls only these methods and
    never looks inside a payload.
    """

    name: str
    storable: bool = False  # payloads are image files that a SnapshotStore can keep

    @abc.abstractmethod
    def start(self, source: EnvSource) -> tuple[Handle, dict]:
        """Start the env; returns its handle and its metadata (spaces, spec, ...)."""

    @abc.abstractmethod
    def snapshot(self, handle: Handle, snap_id: str, *, ready_copy: bool = True) -> tuple[Any, int]:
        """Capture the env's whole state; returns (payload, size in bytes). ``ready_copy``: a
        hint that a restore of it is likely (a backend may prepare one ahead; the criu backend's
        fork tier does)."""

    @abc.abstractmethod
    def restore(self, payload: Any, binds: Any = None, *, hold_tree: bool = False) -> Handle:
        """Start a new env from a snapshot payload; the caller retires the old handle.  ``binds``:
        private directories the new worker sees (criu backend only, :mod:`gym_fork.worker.mounts`).
        ``hold_tree``: the worker's other processes, where the payload holds any, do not run until
        the caller's ``handle.release_held()`` (it puts their files back first)."""

    def persist(self, payload: Any) -> Any:
        """Make an in-memory snapshot durable (e.g. write CRIU images); returns the payload."""
        return payload

    def evict(self, payload: Any) -> None:
        """Drop the in-memory part of a persisted snapshot (no-op where there is none)."""

    def memory_bytes(self, payload: Any) -> int | None:
        """Memory the snapshot holds privately now (None when not measurable)."""
        return None

    def reopens_paths(self, payload: Any, binds: Any = None) -> bool:
        """Whether restoring ``payload`` (with ``binds``) reopens the processes' files and
        directories by their paths (a CRIU restore), so those must exist first; a copy-on-write
        clone inherits them, an in-process env holds none."""
        return False

    def restore_many(self, payload: Any, n: int, binds: Any = None, policies: Any = None,
                     restoring: bool = True, *, hold_tree: bool = False, reseed: bool = False) -> list[Handle]:
        """``n`` independent restores (backends may run them concurrently); ``binds[i]`` for the i-th.
        ``policies``: pickled policies the new workers will run, which a backend may unpickle
        ahead (see ``CriuBackend.restore_many``); here they are not. ``restoring`` false: copies
        for ``fork()`` (a hint, as ``snapshot``'s ``ready_copy``). ``hold_tree``: as for :meth:`restore`.
        ``reseed``: each copy's next request will be ``reseed`` (a hint: a backend may find the
        generators once for all of them, see ``EnvServer.generators``)."""
        return [self.restore(payload, None if binds is None else binds[i], hold_tree=hold_tree) for i in range(n)]

    def restore_verified(self, payload: Any) -> Handle:
        """Like :meth:`restore`, for a payload whose integrity the caller has just checked
        (e.g. :func:`gym_fork.load_snapshot` hashed every image): the backend does not check again."""
        return self.restore(payload)

    @abc.abstractmethod
    def release(self, payload: Any) -> None:
        """Free what a snapshot holds (files, processes). Idempotent."""

    def is_persisted(self, payload: Any) -> bool:
        """Whether the snapshot is on disk (restorable without the memory it may hold)."""
        return False

    def dies_with(self, payload: Any, handle: Handle) -> bool:
        """Whether ``payload`` and every copy made from it live in ``handle``'s worker's PID
        namespace while that worker is its init: a copy-on-write snapshot it just froze (the
        namespace, and all in it, ends with that worker). Nowhere else, as a rule."""
        return False

    def describe(self) -> str:
        return self.name

    # --- bundles: Snapshot.save / load_snapshot -------------------------------------------------
    def bundle_write(self, payload: Any, dest_dir: str) -> dict:
        """Write ``payload`` into the new bundle directory ``dest_dir`` (private, not yet visible).

        Returns:
            The fields this backend adds to ``bundle.json`` (signed with the rest): everything
            :meth:`bundle_read` and :meth:`check_compatible` need, with sizes and digests of what
            was written.

        Raises:
            BundleError: this backend's snapshots cannot be saved.
        """
        raise BundleError(f"backend {self.name!r} cannot be saved as a bundle")

    def bundle_read(self, bundle_dir: str, meta: dict, received: dict | None = None) -> tuple[Any, int]:
        """The payload of the bundle at ``bundle_dir`` (``meta``: its HMAC-verified bundle.json),
        checked against the digests in ``meta`` before anything uses it.

        Args:
            received: digests computed while the files arrived (streamed migration): they must
                equal the signed ones, and the files are not read again.

        Returns:
            ``(payload, size in bytes)``.

        Raises:
            SnapshotCorruptedError: a file is missing or fails its check.
        """
        raise BundleError(f"{bundle_dir}: backend {self.name!r} cannot load bundles")

    def check_compatible(self, meta: dict, path: str) -> None:
        """Raise BundleError, with the reason, when this machine cannot restore the bundle or store
        entry described by ``meta`` (at ``path``); nothing is started."""

    # --- SnapshotStore ------------------------------------------------------------------------
    def store_images(self, payload: Any) -> tuple[str, dict]:
        """For a persisted payload: ``(directory of its image files, fields for bundle.json)``.
        The images carry a manifest (:func:`gym_fork.snapshots.sessiondir.write_manifest`); callers
        that sign them take their sha256 from :func:`gym_fork.snapshots.sessiondir.verify` with
        ``digests=True``.

        Raises:
            StoreError: this backend's snapshots cannot be stored.
        """
        raise StoreError(f"only criu snapshots can be stored, not {self.name!r}")

    def payload_at(self, path: str, meta: dict) -> Any:
        """A payload (not owning its files) for the images at ``path`` that ``meta`` describes."""
        raise StoreError(f"backend {self.name!r} has no image files")

    def chunk_lengths(self, images_dir: str, name: str, chunk_size: int) -> list[int] | None:
        """How a deduplicating store cuts the image file ``name`` into chunks (their lengths, in
        order), or None to keep it whole."""
        return None

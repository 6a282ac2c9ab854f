"""A shared-memory step ring beside a worker's socket: steps without system calls.

A step through the socket costs two wake-ups and four system calls however lean its frame is.
A *ring* is one small shared mapping per worker (a memfd the controller creates and hands over
with ``SCM_RIGHTS``): a header of sequence numbers and flags, a request area and a reply area.
Packed step frames (:func:`gym_fork.worker.channel.step_parts`) go through it; each side, having
written its frame, *publishes* it by bumping its sequence number, and the other side spins
briefly on that number before it falls back to sleeping on the socket.

Every message while a ring is in use is announced in the ring: either the frame is in the ring
(``IN_RING``) or it follows on the socket (``ON_SOCKET``: every other command, frames larger
than an area, replies with the env's output ahead of them).  So each side only ever waits on
its peer's sequence number, and the socket order stays request/reply as before.

Sleeping without losing a wake-up: the sleeper sets its *sleeping* flag, fences, and reads the
sequence number again before it blocks on the socket; the publisher bumps the number, fences and
reads the flag, and sends a 1-frame wake-up (:data:`gym_fork.worker.channel.WAKE`) when it is
set.  The fences (``mfence``) make this store-then-load pattern safe on x86-64; the blocking
wait also has a bounded timeout after which the number is read again, so even a lost wake-up
would only delay.  Rings are used on x86-64 only.

Lifecycle: a ``fork()`` shares ``MAP_SHARED`` memory with the parent, so every process drops
the rings it inherited right after a fork (an at-fork hook unmaps them); a copy that becomes a
worker gets a ring of its own from its controller.  A CRIU image never holds a ring: both sides
drop it after answering ``resources`` or a ``fork_snapshot`` that found what ``fork()`` cannot
copy (the requests that come before a dump).

On by default since stop 30 (``GYM_FORK_RING=0`` in the controller's environment turns it off):
an env gets a ring once it has made ``GYM_FORK_RING_AFTER`` (64) steps one request at a time
(``ForkableEnv.step``) -- opening one costs a fresh copy ~0.7 ms, which a search loop's short
branches would not repay -- never a vector env, whose workers step concurrently.  Spinning
needs a free CPU, so a machine has at most ``cpu_count - 1`` rings (slots claimed across
processes: :mod:`gym_fork.worker.ring_slots`), a controller no more, none where it may run
on one CPU only; while its waits are short on average, each side spins, then sleeps: the
controller for up to ``GYM_FORK_RING_SPIN_US`` (default 300) for a reply, the worker for a
request as long as it would poll its socket (``GYM_FORK_WORKER_SPIN_US``, 500; the learner's own
work between steps is part of that wait).

Example::

    >>> import os, socket
    >>> from gym_fork.worker.channel import Channel, step_parts
    >>> ring, fd = Ring.create()
    >>> other = Ring.attach(fd)
    >>> a, b = socket.socketpair()
    >>> ring.post(Channel(a), step_parts(3))
    True
    >>> other.wait_request(Channel(b))
    (('step', (3,)), True)
    >>> ring.close(); other.close(); a.close(); b.close()
"""

from __future__ import annotations

import ctypes
import os
import platform
import select
import socket
import time
import weakref
from typing import Any

from gym_fork import atfork
from gym_fork.worker import resources, ring_slots
from gym_fork.worker.channel import WAKE, Channel, ChannelClosed, SpinWait, spin_cap, unpack_frame

AREA = 1 << 16  # bytes per direction; larger frames go on the socket
_HEAD = 128  # two cache lines of 8-byte words, one written by each side
SIZE = _HEAD + 2 * AREA
# header words: the controller writes the first cache line, the worker the second
REQ_SEQ, REQ_KIND, REQ_LEN, CTL_SLEEP = 0, 1, 2, 3
REP_SEQ, REP_KIND, REP_LEN, W_SLEEP = 8, 9, 10, 11
IN_RING, ON_SOCKET = 0, 1
NAME = b"gym_fork-ring"

_MAX_SLEEP_S = 0.1  # the longest blocking wait before the sequence number is read again

_PROT_RW, _PROT_RWX, _MAP_SHARED, _MAP_PRIVATE_ANON = 0x3, 0x7, 0x01, 0x22
_libc: Any = None
_fence: Any = None
_live: "weakref.WeakSet[Ring]" = weakref.WeakSet()
_owned = 0  # controller rings open in this process


def _init() -> bool:
    """Load libc's mmap/munmap and build the ``mfence`` the wake-up protocol needs (x86-64)."""
    global _libc, _fence
    if _fence is not None:
        return True
    if platform.machine() not in ("x86_64", "AMD64") or not hasattr(os, "memfd_create"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                          ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    code = libc.mmap(None, 4096, _PROT_RWX, _MAP_PRIVATE_ANON, -1, 0)
    if code in (None, ctypes.c_void_p(-1).value):
        return False
    ctypes.memmove(code, b"\x0f\xae\xf0\xc3", 4)  # mfence; ret
    _libc, _fence = libc, ctypes.CFUNCTYPE(None)(code)
    return True


def supported() -> bool:
    """Whether this machine can use rings (x86-64 Linux with ``memfd_create``)."""
    try:
        return _init()
    except OSError:
        return False


def wanted() -> bool:
    """Whether the controller should open a ring for one more env now: not turned off
    (``GYM_FORK_RING=0``), a supported machine, and a CPU left to spin on."""
    value = os.environ.get("GYM_FORK_RING", "1")
    if value not in ("0", "1", ""):
        import warnings

        warnings.warn(f"GYM_FORK_RING={value!r}: use 1 (rings on, the default) or 0 (off); "
                      "taking it as 1", RuntimeWarning, stacklevel=2)
    if value in ("", "0") or not supported():
        return False
    try:
        cpus = len(os.sched_getaffinity(0))
    except OSError:
        cpus = os.cpu_count() or 1
    return _owned < cpus - 1


def _spin_ns() -> int:
    """The spin cap in ns, read as the socket's polling caps are (:func:`spin_cap`: a value that
    is not a number warns and falls back to the default; 0 where this process has one CPU)."""
    return round(spin_cap("GYM_FORK_RING_SPIN_US", SPIN_US) * 1e9)


#: the default cap, in µs, on how long each side spins for its peer (``GYM_FORK_RING_SPIN_US``)
SPIN_US = 300


class Ring:
    """One side's view of a worker's step ring (see the module docstring).

    The controller calls :meth:`post` / :meth:`announce` and :meth:`wait_reply`; the worker
    :meth:`wait_request` and :meth:`reply` / :meth:`announce_reply`.
    """

    __slots__ = ("addr", "w", "req", "rep", "sent", "seen", "pace", "pace_ns", "spin_ns", "owner", "mapping",
                 "slot", "__weakref__")

    def __init__(self, fd: int, owner: bool):
        if not _init():
            raise OSError("shared-memory step rings need x86-64 Linux")
        # its name in /proc/self/maps, known to the fork-tier scan as gym_fork's own before the
        # mapping exists (Ctrl-C right after the mmap then leaves no stray "shared memory")
        self.mapping = os.readlink(f"/proc/self/fd/{fd}").encode()
        resources.OWN_MAPPINGS.add(self.mapping)
        addr = _libc.mmap(None, SIZE, _PROT_RW, _MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            err = ctypes.get_errno()
            resources.OWN_MAPPINGS.discard(self.mapping)
            raise OSError(err, f"mmap of the step ring failed: {os.strerror(err)}")
        self.addr = addr
        try:
            mv = memoryview((ctypes.c_char * SIZE).from_address(addr)).cast("B")
            self.w = mv[:_HEAD].cast("q")
            self.req = mv[_HEAD:_HEAD + AREA]
            self.rep = mv[_HEAD + AREA:]
            self.sent = 0  # the last sequence number this side published
            self.seen = 0  # the last sequence number read from the peer
            self.spin_ns = _spin_ns()  # the cap on a spin (the controller hands its own to the worker)
            self.pace, self.pace_ns = _pace(self.spin_ns), self.spin_ns
            self.owner = owner
            self.slot: ring_slots.Slot | None = None  # the controller's claim on a CPU to spin on
            _live.add(self)
        except BaseException:
            self.owner = False  # (no slot, not counted in _owned)
            self.w = self.req = self.rep = memoryview(b"")
            self.close()
            raise

    @classmethod
    def create(cls) -> tuple["Ring", int]:
        """A new ring for a worker, and the descriptor to hand it (the caller closes it). The
        caller claims a slot for it first (:mod:`gym_fork.worker.ring_slots`) and sets
        :attr:`slot`, which :meth:`close` releases.

        Raises:
            OSError: no memfd or mapping could be made.
        """
        global _owned
        fd = os.memfd_create(NAME.decode() + "-" + os.urandom(6).hex(), os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, SIZE)
            ring = cls(fd, owner=True)
        except BaseException:
            os.close(fd)
            raise
        _owned += 1
        return ring, fd

    @classmethod
    def attach(cls, fd: int) -> "Ring":
        """The worker's side of the ring behind ``fd`` (closed here: the mapping is all it keeps)."""
        try:
            return cls(fd, owner=False)
        finally:
            os.close(fd)

    @property
    def closed(self) -> bool:
        return self.addr is None

    def close(self) -> None:
        """Unmap the ring (idempotent). Nothing of it may be used afterwards."""
        global _owned
        if self.addr is None:
            return
        addr, self.addr = self.addr, None
        for v in (self.w, self.req, self.rep):
            try:
                v.release()
            except BufferError:
                pass  # a view of it is still exported; nothing reads it after close
        _libc.munmap(addr, SIZE)
        resources.OWN_MAPPINGS.discard(self.mapping)
        if self.owner:
            _owned -= 1
            if self.slot is not None:
                self.slot.release()  # a no-op in a child forked meanwhile: the claim is its parent's
                self.slot = None

    # --- controller side --------------------------------------------------------------------
    def post(self, chan: Channel, parts: list) -> bool:
        """Write a packed frame (``parts`` as :func:`~gym_fork.worker.channel.step_parts` makes
        them) into the request area and publish it; False (nothing done) when it does not fit."""
        n = _put(self.req, parts)
        if n is None:
            return False
        w = self.w
        w[REQ_LEN] = n
        w[REQ_KIND] = IN_RING
        self._publish(chan, REQ_SEQ, W_SLEEP)
        return True

    def announce(self) -> None:
        """Say that the next request comes on the socket (send it right after)."""
        self.w[REQ_KIND] = ON_SOCKET
        self.sent += 1
        self.w[REQ_SEQ] = self.sent  # the message that follows wakes a sleeping worker

    def wait_reply(self, chan: Channel, spin_ns: int = 0) -> Any:
        """The worker's reply to the request published last. ``spin_ns``: spin at least that long
        before sleeping, whatever the pace says (a request known to be answered soon)."""
        if self._wait(chan, REP_SEQ, CTL_SLEEP, spin_ns):
            return chan.recv()  # the worker broke the protocol: the message is the reply
        w = self.w
        if w[REP_KIND] == ON_SOCKET:
            return chan.recv()
        return unpack_frame(self.rep[:w[REP_LEN]])

    # --- worker side ------------------------------------------------------------------------
    def wait_request(self, chan: Channel) -> tuple[Any, bool]:
        """The controller's next request, and whether it came through the ring (a packed step,
        to be answered with :meth:`reply`). Raises ChannelClosed when the controller went away."""
        if self._wait(chan, REQ_SEQ, W_SLEEP):
            return chan.recv(), False  # unannounced (the controller stopped using the ring)
        w = self.w
        if w[REQ_KIND] == ON_SOCKET:
            return chan.recv(), False
        return unpack_frame(self.req[:w[REQ_LEN]]), True

    def reply(self, chan: Channel, parts: list) -> bool:
        """Write a packed reply into the reply area and publish it; False when it does not fit
        (then :meth:`announce_reply` and answer on the socket)."""
        n = _put(self.rep, parts)
        if n is None:
            return False
        w = self.w
        w[REP_LEN] = n
        w[REP_KIND] = IN_RING
        self._publish(chan, REP_SEQ, CTL_SLEEP)
        return True

    def announce_reply(self) -> None:
        """Say that the reply comes on the socket (send it, and any output ahead of it, after)."""
        self.w[REP_KIND] = ON_SOCKET
        self.sent += 1
        self.w[REP_SEQ] = self.sent

    # --- both -------------------------------------------------------------------------------
    def _publish(self, chan: Channel, seq: int, peer_sleeping: int) -> None:
        w = self.w
        self.sent += 1
        w[seq] = self.sent
        _fence()  # the bump must be visible before the flag is read (see the module docstring)
        if w[peer_sleeping]:
            chan.send_wake()

    def _wait(self, chan: Channel, seq: int, sleeping: int, spin_ns: int = 0) -> bool:
        """Wait until the peer publishes the next sequence number: spin, then sleep on the
        socket. True when a real message arrived on the socket instead (left unread).

        Whether to spin is learned like the socket's polling (:class:`SpinWait`: while the
        average wait is under the cap ``spin_ns``, with its probes while not); when it spins, it
        spins up to the cap. A fixed 100 µs spin, given up for 64 waits after 8 that outlasted
        it, slept through most of HalfCheetah's ~100 µs steps (2.5-3x slower than the socket)."""
        w, target = self.w, self.seen + 1
        if w[seq] != target:
            clock = time.perf_counter_ns
            t0 = clock()
            pace = self.pace
            if self.pace_ns != self.spin_ns:  # the cap was set anew (the controller's, a test's)
                pace, self.pace_ns = _pace(self.spin_ns), self.spin_ns
                self.pace = pace
            # on: spin up to the whole cap (a step's jitter exceeds twice its average often
            # enough that sleeping then costs more here than the socket's polling saves)
            budget = self.spin_ns if pace.budget > 0.0 else 0
            if spin_ns:
                budget = max(budget, spin_ns)
            if budget > 0:
                deadline, yield_ = t0 + budget, os.sched_yield
                while w[seq] != target:
                    # a peer that waits for this CPU gets it at once (with few CPUs, spinning
                    # would otherwise hold it for a whole time slice)
                    yield_()
                    now = clock()
                    # past the cap, or the clock went back (restored by CRIU on another machine
                    # mid-spin: it would spin until the peer publishes, however long that takes)
                    if now > deadline or now < t0:
                        break
            if w[seq] != target and self._sleep(chan, seq, sleeping, target):
                return True
            if not spin_ns:  # (a step's wait is what the pace learns; not such a request's)
                pace.observe((clock() - t0) * 1e-9)
        elif not spin_ns:
            self.pace.observe(0.0)
        self.seen = target
        return False

    def _sleep(self, chan: Channel, seq: int, sleeping: int, target: int) -> bool:
        w, timeout = self.w, 0.001
        sock = chan.sock
        while True:
            w[sleeping] = 1
            _fence()  # the flag must be visible before the number is read again
            if w[seq] == target:
                w[sleeping] = 0
                return False
            ready = select.select([sock], [], [], timeout)[0]
            w[sleeping] = 0
            if w[seq] == target:
                return False  # a wake frame, if one was sent, is skipped by a later recv
            if ready:
                # a stale wake frame (from a wake-up that crossed a re-check), or a message
                # that was not announced (left for the caller), or EOF
                try:
                    head = sock.recv(len(WAKE), socket.MSG_PEEK)
                    if not head:
                        raise ChannelClosed("peer closed the channel")
                    if head != WAKE:
                        return True
                    sock.recv(len(WAKE))
                except (ConnectionResetError, BrokenPipeError) as e:
                    raise ChannelClosed(str(e)) from None
            timeout = min(timeout * 2, _MAX_SLEEP_S)


def _pace(spin_ns: int) -> SpinWait:
    """A ring's spin pace: rings are opened for envs stepped in a tight loop, so it starts
    spinning (at half the cap) instead of waiting to learn that."""
    return SpinWait(spin_ns * 1e-9, spin_ns * 0.5e-9)


def _drop_inherited() -> None:
    """In a forked child: unmap every ring inherited from the parent (shared memory that the
    parent and its worker go on using)."""
    global _owned
    for ring in list(_live):
        ring.close()
    _live.clear()
    _owned = 0


atfork.in_child(_drop_inherited)


def _put(area: Any, parts: list) -> int | None:
    """Copy a frame's ``parts`` one after another into ``area``; its length, or None (nothing
    written) when it does not fit."""
    n = sum(map(len, parts))
    if n > AREA:
        return None
    pos = 0
    for p in parts:
        k = len(p)
        area[pos:pos + k] = p
        pos += k
    return n

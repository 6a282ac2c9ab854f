"""The wire protocol between a ForkableEnv and its worker process.

One ``AF_UNIX SOCK_STREAM`` socket carries length-prefixed pickles, strictly request/reply:
the controller sends ``(command, args)`` and waits for ``(OK, result)`` or
``(ERR, type_name, message, traceback)``.  Because there is never more than one request in
flight, the worker is always blocked in ``recv`` when a snapshot is taken, so nothing is queued
in the socket (CRIU would drop queued bytes in restored copies).  One exception: a frozen
snapshot (:func:`gym_fork.worker.loop.frozen_loop`) offers its ready copies unasked, a
``(READY, pid)`` message and the copy's channel, only between requests on its own channel.

Steps take a faster road: a *packed* frame (the header's top bit set) carries a ``step``
request or its reply as raw bytes -- arrays as their dtype, shape and memory, Python and NumPy
scalars by type and value, anything else (a non-empty ``info``) as a pickle of that part only --
because pickling NumPy objects costs several times what the step of a small env does.  Decoding
gives back objects of the same types and bit-identical values.  A controller sends packed frames
only to a worker that said it reads them (``PACKED_VERSION`` in its ``init`` or ``hello`` reply),
and a worker answers packed only to a packed request, so either side may be older.

With a shared-memory step ring (:mod:`gym_fork.worker.ring`) the socket also carries *wake*
frames: a header with the packed flag and length 0, which a side sends to wake a peer that went to
sleep on the socket waiting for the ring.  They carry nothing; :meth:`Channel.recv` skips them.

File descriptors travel with ``SCM_RIGHTS`` (:func:`send_fds` / :func:`recv_fds`).
"""

from __future__ import annotations

import array
import os
import pickle
import socket
import struct
import time
from typing import Any

import numpy as np

OK = 0
ERR = 1
# (2 is gym_fork.worker.output's OUTPUT: the env's prints and warnings, ahead of a reply)
READY = 3  # a frozen snapshot's unsolicited (READY, copy's host pid): its channel follows (SCM_RIGHTS)
#: the packed step frames this module reads and writes (2: scalar-dict schemas; 3: a step request
#: that also resets at the episode's end, kind "A"). A peer that reads frames says its version; one
#: of 2 reads all but kind "A", and a controller sends it none.
PACKED_VERSION = 3
PACKED_OLDEST = 2  # the oldest version whose frames this module still writes (and reads)

_HEADER = struct.Struct("!Q")
_PACKED = 1 << 63  # header flag: the payload is a packed step frame, not a pickle
_MAX_MESSAGE = 1 << 34  # 16 GiB: a sanity bound against a corrupted length header
_KEEP_BUFFER = 1 << 20  # receive buffers up to this size are kept for the next message
WAKE = _HEADER.pack(_PACKED)  # a wake frame: packed, length 0 (a real packed frame is never empty)
_JOIN_MAX = 4096  # packed frames up to this size are joined and sent with one sendall


def spin_cap(var: str, default_us: float) -> float:
    """The polling cap in seconds from the environment variable ``var`` (microseconds; 0: never
    poll). 0 where this process may run on one CPU only: the peer could not answer while it polls."""
    try:
        if len(os.sched_getaffinity(0)) < 2:
            return 0.0
    except (AttributeError, OSError):
        pass
    raw = os.environ.get(var)
    if raw is None:
        return default_us * 1e-6
    try:
        return max(0.0, float(raw)) * 1e-6
    except ValueError:
        import warnings

        warnings.warn(f"{var}={raw!r} is not a number of microseconds; using {default_us:g} "
                      f"(set it to 0 to turn polling off)", RuntimeWarning, stacklevel=2)
        return default_us * 1e-6


class SpinWait:
    """How long to poll a socket for the next message before sleeping on it, learned from the
    waits seen so far.

    Sleeping and being woken costs 10-20 µs per message on a 2-vCPU virtual machine (the
    hypervisor's wake-up), 100 µs to a millisecond once the CPU went idle, more than CartPole's
    whole step; polling instead keeps a CPU busy. So poll only where messages usually come fast:
    while the average wait (an EWMA of the last few) is under ``cap`` seconds, poll for up to
    twice that average, else sleep at once. A learner that trains or runs its policy between
    steps, or a slow env, waits longer than the cap: no polling then, so no CPU is taken from it.

    Two things keep an env with *occasional* slow steps (a reset, a render, a contact-heavy
    step) polling for its fast ones. A wait counts for at most twice the average, so one slow
    step moves the average by a quarter, not past the cap; a lasting change still moves it
    (by x1.25 a wait). And while not polling, every :data:`PROBE_EVERY`-th wait polls for up to
    ``cap`` anyway: waits measured asleep include the wake-up, which not polling makes slow, so
    they alone would keep polling off for good; a probe answered while polling shows the
    messages are fast after all, and polling resumes at that pace.

    Example:
        >>> w = SpinWait(cap=100e-6)
        >>> for _ in range(50):
        ...     w.observe(30e-6)  # the reply comes 30 µs after the request
        >>> round(w.budget * 1e6)  # poll for up to 60 µs before sleeping
        60
        >>> w.observe(2e-3)  # one slow step: still polling for the next
        >>> round(w.budget * 1e6)
        75
        >>> for _ in range(10):
        ...     w.observe(5e-3)  # the learner now trains between messages
        >>> w.budget
        0.0
        >>> for _ in range(10):
        ...     w.observe(5e-3)
        >>> round(w.budget * 1e6)  # while not polling, one wait in PROBE_EVERY polls (a probe) ...
        100
        >>> w.observe(5e-3)  # ... not answered while it polled: still slow
        >>> w.budget
        0.0
        >>> round(SpinWait(cap=100e-6, avg=30e-6).budget * 1e6)  # a copy that goes on at its predecessor's pace
        60
    """

    __slots__ = ("cap", "avg", "budget", "idle")

    def __init__(self, cap: float, avg: float | None = None):
        self.cap = cap
        self.avg = 4.0 * cap  # no polling until waits have been seen to be short ...
        self.budget = 0.0
        self.idle = 0  # waits in a row without polling; -1: the current wait is a probe
        # ... unless a predecessor's pace is known (a restored copy); not one of 0, which a
        # predecessor that did not poll (cap 0) leaves, and which no wait would ever move
        if avg is not None and avg > 0.0:
            self.avg = min(avg, 4.0 * cap)
            self.budget = min(2.0 * self.avg, cap) if self.avg < cap else 0.0

    def observe(self, wait: float) -> None:  # every step, on both sides: kept inline
        cap, avg = self.cap, self.avg
        if wait < 0.0:  # the clock went back (restored by CRIU on another machine): a negative
            wait = 0.0  # wait would drive the average below zero, and polling off for good
        if self.idle < 0 and wait <= cap:  # a probe answered while it polled: fast after all
            avg = wait
        else:
            w = 2.0 * avg
            if wait < w:
                w = wait
            if w > 4.0 * cap:
                w = 4.0 * cap
            avg += (w - avg) * 0.25
        self.avg = avg
        if avg < cap:
            self.idle = 0
            self.budget = 2.0 * avg if 2.0 * avg < cap else cap
        elif self.idle >= PROBE_EVERY - 1:
            self.idle, self.budget = -1, cap
        else:
            self.idle = self.idle + 1 if self.idle >= 0 else 1
            self.budget = 0.0


#: while a SpinWait does not poll, every this many waits one polls for up to its cap (a probe)
PROBE_EVERY = 16


class ChannelClosed(EOFError):
    """The peer closed the channel (or died)."""


class Channel:
    """A framed request/reply channel over a connected stream socket: pickles, and packed step
    frames (:meth:`send_step`, :meth:`reply`)."""

    __slots__ = ("sock", "_buf", "_extra", "packed_in", "files", "spawned")

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._buf = bytearray(4096)  # reused: a step's frame needs no allocation
        self._extra = b""  # bytes read ahead of the frame being decoded (read before the socket)
        self.packed_in = False  # whether the last message received was a packed frame
        self.files: dict | None = None  # the worker's record of files it wrote (gym_fork.worker.files)
        self.spawned = False  # the env started processes: they write at any time (gym_fork.worker.fswatch)

    @classmethod
    def from_fd(cls, fd: int) -> "Channel":
        return cls(socket.socket(fileno=fd))

    def fileno(self) -> int:
        return self.sock.fileno()

    def unread(self, data: bytes) -> None:
        """Put bytes read from the socket back in front of it: the next read starts with them."""
        self._extra = bytes(data) + self._extra

    def send(self, obj: Any) -> None:
        data = pickle.dumps(obj, protocol=5)  # (encode() + send_encoded(), inline: replies take this path)
        # One sendall of header+payload: small messages (every step) cost one syscall.
        self.sock.sendall(_HEADER.pack(len(data)) + data)

    @staticmethod
    def encode(obj: Any) -> bytes:
        """``obj`` as :meth:`send` frames it (pickling happens here: a sender that must announce
        a message first, in a ring, encodes before it announces)."""
        data = pickle.dumps(obj, protocol=5)
        return _HEADER.pack(len(data)) + data

    def send_encoded(self, frame: bytes) -> None:
        self.sock.sendall(frame)

    def send_step(self, action: Any, reset_at_end: bool = False) -> None:
        """Send ``("step", (action,))`` as a packed frame (the peer must read them); with
        ``reset_at_end``, ``("step", (action, True))``, a kind "A" frame (the peer must read version 3)."""
        head = (_INT_STEP_RESET if reset_at_end else _INT_STEP).get(type(action))
        if head is not None and _INT64_MIN <= action <= _INT64_MAX:  # a discrete action
            self.sock.sendall(head + _I64.pack(action))
            return
        self._send_packed(step_parts(action, reset_at_end))

    def reply(self, reply: tuple) -> None:
        """Send a worker's reply: packed when the request was packed and the reply is a step's
        result ``(OK, (obs, reward, terminated, truncated, info))``, else pickled."""
        parts = reply_parts(reply) if self.packed_in else None
        if parts is not None:
            self._send_packed(parts)
        else:
            self.send(reply)

    def send_wake(self) -> None:
        """Wake a peer asleep on this socket while it waits for the step ring."""
        self.sock.sendall(WAKE)

    def _send_packed(self, parts: list) -> None:
        n = sum(map(len, parts))
        parts[0] = _HEADER.pack(n | _PACKED)
        if n <= _JOIN_MAX:  # a small frame: joining is cheaper than sendmsg's scatter list
            self.sock.sendall(b"".join(parts))
            return
        sent = self.sock.sendmsg(parts)  # arrays go out from their own memory, uncopied
        if sent < n + _HEADER.size:  # a partial send (a big observation): the rest in one go
            self.sock.sendall(memoryview(b"".join(parts))[sent:])

    def recv(self, spin: float = 0.0) -> Any:
        """The next message (wake frames are skipped). ``spin``: seconds to poll the socket before
        going to sleep on it (:class:`SpinWait`)."""
        msg = self._next(_FIRST_READ, spin)
        while msg is WAKE:
            msg = self.recv_or_wake()
        return msg

    def recv_reply(self, spin: float = 0.0) -> Any:
        """The reply to the request just sent, like :meth:`recv`, in one ``recv`` system call
        in the usual case (the whole reply is in the socket).

        It reads as much as is there, which is safe only where the peer sends nothing after the
        message being read: a worker's reply, on a channel without a step ring (an active worker
        sends nothing more until the next request). Elsewhere a file descriptor may follow a
        message (SCM_RIGHTS: reading into it would drop it) and ``select`` must see every unread
        byte, so :meth:`recv` never reads past a frame that could be followed by one.
        """
        msg = self._next(0, spin)
        while msg is WAKE:
            msg = self._next(0)
        return msg

    def recv_or_wake(self) -> Any:
        """The next message, or :data:`WAKE` when the next frame is a wake frame."""
        return self._next(_FIRST_READ)

    def skip_to(self, marker: bytes, quiet: float = 0.02) -> None:
        """Drop everything the peer sent up to and including the frame that holds ``marker``
        (unique bytes in the peer's answer to a request just sent), reading raw bytes: after an
        interrupt (Ctrl-C) the channel may be in the middle of a frame, where a frame's length
        cannot be trusted. The frame that holds ``marker`` is the peer's last until the next
        request; what follows it arrives within ``quiet`` seconds (it is one write)."""
        import select

        self._extra = b""  # (read ahead before the interrupt: stale)
        sock, data = self.sock, b""
        try:
            while marker not in data:
                chunk = sock.recv(1 << 16)
                if not chunk:
                    raise ChannelClosed("peer closed the channel")
                data = data[-len(marker):] + chunk  # (the marker may straddle two reads)
            while (getattr(sock, "pending", None) and sock.pending()) or select.select([sock], [], [], quiet)[0]:
                if not sock.recv(1 << 16):
                    raise ChannelClosed("peer closed the channel")
        except (ConnectionResetError, BrokenPipeError) as e:
            raise ChannelClosed(str(e)) from None

    def _next(self, first: int, spin: float = 0.0) -> Any:
        """Read and decode one frame. The first read takes up to ``first`` bytes (0: as many as
        the buffer holds), the rest of the frame is read exactly; bytes read past the frame are
        kept in ``_extra`` and read before the socket next time. With ``spin`` > 0 the first read
        polls the socket for up to that many seconds before it sleeps on it.

        ``first`` is :data:`_FIRST_READ` for :meth:`recv`: a whole step request for an int
        action, the header and start of anything else. Never more, because a file descriptor
        may follow a message and every message one follows is longer than that (a pickled
        ``(command, args)`` or ``(READY, pid)``).
        """
        buf = self._buf
        extra = self._extra
        if extra:  # read ahead before: these bytes come first
            k = min(len(extra), len(buf))
            buf[:k] = extra[:k]
            self._extra = extra[k:]
        else:
            try:
                k = self._poll_into(buf, first, spin) if spin > 0.0 else self.sock.recv_into(buf, first)
            except (ConnectionResetError, BrokenPipeError) as e:
                raise ChannelClosed(str(e)) from None
            if not k:
                raise ChannelClosed("peer closed the channel")
        if k < _HEADER.size:
            self._recv_exact_into(memoryview(buf)[k:_HEADER.size])
            k = _HEADER.size
        (n,) = _HEADER.unpack_from(buf)
        if n == _INT_STEP_LENGTH and k == _FIRST_READ and buf[8] in _STEP_KINDS and buf[9] in _INT_TYPES:
            # the usual request: a step with an int action (np.int64 from Gymnasium's spaces)
            self.packed_in = True
            action = _INT_TYPES[buf[9]](_I64.unpack_from(buf, 10)[0])
            return ("step", (action,)) if buf[8] == 0x53 else ("step", (action, True))
        if n == _PACKED:  # a wake frame
            if k > _HEADER.size:
                self._extra = bytes(memoryview(buf)[_HEADER.size:k]) + self._extra
            return WAKE
        packed = n > _PACKED
        if packed:
            n -= _PACKED
        if n > _MAX_MESSAGE:
            raise ChannelClosed(f"corrupt message header (length {n})")
        end = n + _HEADER.size
        if k < end:  # the rest of the frame
            if end > len(buf):
                big = bytearray(end)
                big[:k] = memoryview(buf)[:k]
                buf = big
                if end <= _KEEP_BUFFER:
                    self._buf = buf
            self._recv_exact_into(memoryview(buf)[k:end])
        elif k > end:  # read past this frame: the start of the next one
            self._extra = bytes(memoryview(buf)[end:k]) + self._extra
        view = memoryview(buf)[_HEADER.size:end]
        self.packed_in = packed
        if packed:
            return _unpack_frame(view)
        msg = pickle.loads(view)  # copies out what it needs: the buffer is reused
        if type(msg) is tuple and len(msg) == 4 and msg[0] == 2:  # (OUTPUT, ...): the env's prints, warnings
            from gym_fork.worker import output  # and logs, sent just ahead of the reply

            output.emit(msg, self)
            return self.recv()
        return msg

    def _poll_into(self, buf: bytearray, first: int, spin: float) -> int:
        """``recv_into`` that polls (non-blocking reads) for up to ``spin`` seconds, then sleeps.
        A peer on another core answers within microseconds; going to sleep and being woken costs
        the kernel's (a virtual machine's: the hypervisor's) wake-up, 10-20 µs here, per message."""
        sock, clock = self.sock, time.perf_counter
        start = clock()
        deadline = start + spin
        while True:
            try:
                return sock.recv_into(buf, first, socket.MSG_DONTWAIT)
            except BlockingIOError:
                now = clock()
                # a clock that went back (a process restored by CRIU on another machine, in the
                # middle of this poll) would otherwise keep it polling until a message comes
                if now >= deadline or now < start:
                    return sock.recv_into(buf, first)
                os.sched_yield()  # whatever else wants this CPU (a sibling worker, the learner) runs first

    def _recv_exact_into(self, buf: bytearray | memoryview) -> None:
        extra = self._extra
        if extra:  # what was read ahead comes first
            n = min(len(buf), len(extra))
            buf[:n] = extra[:n]
            self._extra = extra[n:]
            if n == len(buf):
                return
            buf = memoryview(buf)[n:]
        # The usual case, a whole small message in the socket, costs one recv_into.
        try:
            k = self.sock.recv_into(buf)
            if k == len(buf):
                return
            view = memoryview(buf)[k:]
            while k:
                k = self.sock.recv_into(view)
                view = view[k:]
                if not view:
                    return
        except (ConnectionResetError, BrokenPipeError) as e:
            raise ChannelClosed(str(e)) from None
        raise ChannelClosed("peer closed the channel")

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


# --- packed step frames ------------------------------------------------------------------------
# A frame is b"S" + one value (a step request's action), b"A" + one value (the same, and the
# worker resets right after a step that ends the episode: EnvServer.cmd_step's reset_at_end;
# version 3) or b"R" + five values (a step's result).
# A value is a tag byte and its bytes:
#   N None | T, F a bool | i a Python int (<q) | f a Python float (<d)
#   g an np.float64 (<d) | j an np.int64 (<q) | b an np.bool_ (one byte)
#   s any other NumPy scalar: dtype length, dtype.str, its bytes
#   a an ndarray: dtype length, dtype.str, ndim, shape (<q each), its C-order bytes
#   d an empty dict | D a dict of str keys holding NumPy values (np.float64 pickles slowly):
#     count (<H), then per item its key (<H length, UTF-8) and its value
#   p anything else: length (<I), its pickle
# Encoders are picked by the value's exact type and decoders by the tag (one dict lookup each);
# an array's header is built once per dtype and shape.
_I64 = struct.Struct("<q")
_F64 = struct.Struct("<d")
_U32 = struct.Struct("<I")
_U16 = struct.Struct("<H")
_NUMERIC = frozenset("biufc")  # dtype kinds whose bytes are the whole value
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
# a whole step request for an int or np.int64 action, but its 8 bytes (what _pack would write)
_INT_STEP = {int: _HEADER.pack(10 | _PACKED) + b"Si", np.int64: _HEADER.pack(10 | _PACKED) + b"Sj"}
_INT_STEP_RESET = {t: head[:8] + b"A" + head[9:] for t, head in _INT_STEP.items()}  # ... kind "A"
_STEP_KINDS = frozenset(b"SA")
_FIRST_READ = _HEADER.size + 10  # its length: what Channel.recv reads before it knows a length
_INT_STEP_LENGTH = 10 | _PACKED  # its header
_INT_TYPES = {ord("i"): int, ord("j"): np.int64}  # its tags (as _UNPACKERS decode them)


def step_parts(action: Any, reset_at_end: bool = False) -> list:
    """The packed frame of a step request, as a list of byte chunks; the first is an empty
    placeholder for the socket's length header. ``reset_at_end``: kind "A" (see above)."""
    parts = [b"", b"A" if reset_at_end else b"S"]
    _pack(action, parts)
    return parts


def reply_parts(reply: tuple) -> list | None:
    """The packed frame of a step's result ``(OK, (obs, reward, terminated, truncated, info))``
    like :func:`step_parts`, or None for any other reply (it travels as a pickle)."""
    if reply[0] != OK or type(reply[1]) is not tuple or len(reply[1]) != 5:
        return None
    obs, reward, terminated, truncated, info = reply[1]
    parts = [b"", b"R"]
    _pack(obs, parts)
    _pack(reward, parts)
    if type(terminated) is bool and type(truncated) is bool and type(info) is dict and not info:
        parts.append(_TAILS[terminated, truncated])  # the usual end of a step: what _pack writes
        return parts
    _pack(terminated, parts)
    _pack(truncated, parts)
    _pack(info, parts)
    return parts


# the packed (terminated, truncated, info) of most steps: two bools and an empty dict
_TAILS = {(t, u): (b"T" if t else b"F") + (b"T" if u else b"F") + b"d" for t in (False, True) for u in (False, True)}
_TAIL_VALUES = {v: k for k, v in _TAILS.items()}


def unpack_frame(view: memoryview) -> tuple:
    """Decode one packed frame (without its length header) into the message it carries; arrays
    and values are copied out of ``view``."""
    return _unpack_frame(view)


def _pack_pickle(x: Any, parts: list) -> None:
    data = pickle.dumps(x, protocol=5)
    parts.append(b"p" + _U32.pack(len(data)))
    parts.append(data)


_ARRAY_HEADERS: dict[tuple, bytes] = {}


def _pack_array(x: np.ndarray, parts: list) -> None:
    if not x.flags.c_contiguous:
        return _pack_pickle(x, parts)
    key = (x.dtype, x.shape)
    head = _ARRAY_HEADERS.get(key)
    if head is None:
        if x.dtype.kind not in _NUMERIC:
            return _pack_pickle(x, parts)
        ds = x.dtype.str.encode()
        head = b"a%c%s%c" % (len(ds), ds, x.ndim) + struct.pack(f"<{x.ndim}q", *x.shape)
        if len(_ARRAY_HEADERS) < 256:
            _ARRAY_HEADERS[key] = head
    parts.append(head)
    # a small array's bytes are copied (cheaper than a view, and the frame is joined anyway);
    # a large one goes out from its own memory (sendmsg), uncopied
    parts.append(x.tobytes() if x.nbytes <= _JOIN_MAX else memoryview(x).cast("B"))


def _pack_int(x: int, parts: list) -> None:
    if _INT64_MIN <= x <= _INT64_MAX:
        parts.append(b"i" + _I64.pack(x))
    else:
        _pack_pickle(x, parts)


# An ``info`` of scalars only (MuJoCo's ``x_position``, ``reward_ctrl``, ...) travels as one
# *schema* -- its keys and each value's type, cached on both sides -- and one struct of values:
# about a third of what the key-by-key frame below costs to pack and unpack (~5 vs ~15 us for
# HalfCheetah's four).  The types whose values struct carries bit for bit (float32 through a double
# and back, except a NaN, whose payload a double might not keep: such a dict goes key by key).
_SCHEMA_TYPES: dict[type, tuple[bytes, str, Any]] = {
    float: (b"f", "d", None), np.float64: (b"g", "d", np.float64), np.float32: (b"h", "f", np.float32),
    int: (b"i", "q", None), np.int64: (b"j", "q", np.int64), bool: (b"T", "?", None), np.bool_: (b"b", "?", np.bool_),
}
_SCHEMA_DECODE = {code: (fmt, conv) for code, fmt, conv in _SCHEMA_TYPES.values()}
_DICT_SCHEMAS: dict[tuple, Any] = {}  # (keys, types) -> (frame head, Struct, float32 positions) or False
_SCHEMA_LAYOUTS: dict[bytes, tuple] = {}  # schema bytes -> (keys, Struct, converters)
_SCHEMA_CACHE_MAX = 256


def _dict_schema(key: tuple) -> Any:
    keys, types = key
    if len(keys) > 64 or not all(type(k) is str and len(k) < 1 << 14 for k in keys) \
            or not all(t in _SCHEMA_TYPES for t in types):
        return False
    desc = b"".join(_U16.pack(len(kb)) + kb + _SCHEMA_TYPES[t][0] for kb, t in zip((k.encode() for k in keys), types))
    if len(desc) >= 1 << 16:
        return False
    st = struct.Struct("<" + "".join(_SCHEMA_TYPES[t][1] for t in types))
    f32 = tuple(i for i, t in enumerate(types) if t is np.float32)
    return b"K" + _U16.pack(len(desc)) + desc, st, f32


def _pack_dict(x: dict, parts: list) -> None:
    if not x:
        parts.append(b"d")
        return
    key = (tuple(x), tuple(map(type, x.values())))
    schema = _DICT_SCHEMAS.get(key)
    if schema is None:
        schema = _dict_schema(key)
        if len(_DICT_SCHEMAS) < _SCHEMA_CACHE_MAX:
            _DICT_SCHEMAS[key] = schema
    if schema is not False:
        head, st, f32 = schema
        vals = tuple(x.values())
        if not f32 or all(vals[i] == vals[i] for i in f32):  # no float32 NaN
            try:
                parts.append(head + st.pack(*vals))
                return
            except (struct.error, OverflowError):  # an int beyond 64 bits
                pass
    _pack_dict_keys(x, parts)


def _pack_dict_keys(x: dict, parts: list) -> None:
    if (len(x) < 1 << 16 and all(type(k) is str and len(k) < 1 << 14 for k in x)
          and any(isinstance(v, (np.generic, np.ndarray)) for v in x.values())):
        parts.append(b"D" + _U16.pack(len(x)))
        for k, v in x.items():
            kb = k.encode()
            parts.append(_U16.pack(len(kb)) + kb)
            _pack(v, parts)
    else:  # plain Python values: pickle is as fast
        _pack_pickle(x, parts)


def _pack_scalar(x: np.generic, parts: list) -> None:
    ds = x.dtype.str.encode()
    parts.append(b"s%c%s" % (len(ds), ds) + x.tobytes())


_PACKERS: dict[type, Any] = {
    np.ndarray: _pack_array,
    bool: lambda x, parts: parts.append(b"T" if x else b"F"),
    float: lambda x, parts: parts.append(b"f" + _F64.pack(x)),
    int: _pack_int,
    type(None): lambda x, parts: parts.append(b"N"),
    dict: _pack_dict,
    # the NumPy scalars envs return most (rewards, MuJoCo's info), without NumPy's slow paths;
    # struct copies a double's bits as they are (NaN payloads too)
    np.float64: lambda x, parts: parts.append(b"g" + _F64.pack(x)),
    np.int64: lambda x, parts: parts.append(b"j" + _I64.pack(x)),
    np.bool_: lambda x, parts: parts.append(b"b\x01" if x else b"b\x00"),
}


def _pack(x: Any, parts: list) -> None:
    t = type(x)
    packer = _PACKERS.get(t)
    if packer is None:
        # NumPy scalars (np.float64, np.int64, np.bool_, ...) are learned as they come
        numeric = isinstance(x, np.generic) and t is x.dtype.type and x.dtype.kind in _NUMERIC
        packer = _pack_scalar if numeric else _pack_pickle
        if numeric:
            _PACKERS[t] = packer
    packer(x, parts)


_DTYPES: dict[bytes, np.dtype] = {}
_ARRAY_LAYOUTS: dict[bytes, tuple] = {}


def _dtype(name: bytes) -> np.dtype:
    dt = _DTYPES.get(name)
    if dt is None:
        dt = _DTYPES[name] = np.dtype(name.decode())
    return dt


def _unpack_array(view: memoryview, pos: int) -> tuple[Any, int]:
    k = view[pos]
    ndim = view[pos + 1 + k]
    end = pos + 2 + k + 8 * ndim
    head = bytes(view[pos:end])
    layout = _ARRAY_LAYOUTS.get(head)
    if layout is None:
        dt = _dtype(head[1:1 + k])
        shape = struct.unpack_from(f"<{ndim}q", head, 2 + k)
        count = 1
        for d in shape:
            count *= d
        layout = (dt, shape if ndim != 1 else None, count, count * dt.itemsize)
        if len(_ARRAY_LAYOUTS) < 256:
            _ARRAY_LAYOUTS[head] = layout
    dt, shape, count, nbytes = layout
    if shape is None:  # 1-D: frombuffer's shape already
        return np.frombuffer(view, dt, count, end).copy(), end + nbytes
    return np.frombuffer(view, dt, count, end).reshape(shape).copy(), end + nbytes


def _unpack_scalar(view: memoryview, pos: int) -> tuple[Any, int]:
    k = view[pos]
    dt = _dtype(bytes(view[pos + 1:pos + 1 + k]))
    pos += 1 + k
    return np.frombuffer(view, dt, 1, pos)[0], pos + dt.itemsize


def _unpack_dict(view: memoryview, pos: int) -> tuple[Any, int]:
    (n,) = _U16.unpack_from(view, pos)
    pos += 2
    out = {}
    for _ in range(n):
        (k,) = _U16.unpack_from(view, pos)
        key = str(view[pos + 2:pos + 2 + k], "utf-8")
        out[key], pos = _unpack(view, pos + 2 + k)
    return out, pos


def _unpack_schema_dict(view: memoryview, pos: int) -> tuple[Any, int]:
    (n,) = _U16.unpack_from(view, pos)
    desc = bytes(view[pos + 2:pos + 2 + n])
    layout = _SCHEMA_LAYOUTS.get(desc)
    if layout is None:
        keys, fmt, convs, i = [], "<", [], 0
        try:
            while i < n:
                (k,) = _U16.unpack_from(desc, i)
                keys.append(desc[i + 2:i + 2 + k].decode())
                f, conv = _SCHEMA_DECODE[desc[i + 2 + k:i + 3 + k]]
                fmt += f
                convs.append(conv)
                i += 3 + k
        except (KeyError, struct.error, UnicodeDecodeError):
            raise ChannelClosed("corrupt packed frame (dict schema)") from None
        layout = (tuple(keys), struct.Struct(fmt), tuple(convs) if any(convs) else None)
        if len(_SCHEMA_LAYOUTS) < _SCHEMA_CACHE_MAX:
            _SCHEMA_LAYOUTS[desc] = layout
    keys, st, convs = layout
    vals = st.unpack_from(view, pos + 2 + n)
    if convs is not None:
        vals = [v if c is None else c(v) for c, v in zip(convs, vals)]
    return dict(zip(keys, vals)), pos + 2 + n + st.size


def _unpack_pickle(view: memoryview, pos: int) -> tuple[Any, int]:
    (n,) = _U32.unpack_from(view, pos)
    pos += 4
    return pickle.loads(view[pos:pos + n]), pos + n


_UNPACKERS: dict[int, Any] = {
    ord("a"): _unpack_array,
    ord("f"): lambda view, pos: (_F64.unpack_from(view, pos)[0], pos + 8),
    ord("i"): lambda view, pos: (_I64.unpack_from(view, pos)[0], pos + 8),
    ord("T"): lambda view, pos: (True, pos),
    ord("F"): lambda view, pos: (False, pos),
    ord("N"): lambda view, pos: (None, pos),
    ord("d"): lambda view, pos: ({}, pos),
    ord("D"): _unpack_dict,
    ord("K"): _unpack_schema_dict,
    ord("s"): _unpack_scalar,
    ord("g"): lambda view, pos: (np.float64(_F64.unpack_from(view, pos)[0]), pos + 8),
    ord("j"): lambda view, pos: (np.int64(_I64.unpack_from(view, pos)[0]), pos + 8),
    ord("b"): lambda view, pos: (np.bool_(view[pos]), pos + 1),
    ord("p"): _unpack_pickle,
}


def _unpack(view: memoryview, pos: int) -> tuple[Any, int]:
    unpacker = _UNPACKERS.get(view[pos])
    if unpacker is None:
        raise ChannelClosed(f"corrupt packed frame (tag {view[pos]:#x})")
    return unpacker(view, pos + 1)


def _unpack_frame(view: memoryview) -> tuple:
    kind = view[0]
    if kind == 0x53:  # S: a step request
        action, _ = _unpack(view, 1)
        return ("step", (action,))
    if kind == 0x41:  # A: a step request, and a reset if that step ends the episode
        action, _ = _unpack(view, 1)
        return ("step", (action, True))
    if kind == 0x52:  # R: a step's result
        obs, pos = _unpack(view, 1)
        reward, pos = _unpack(view, pos)
        if len(view) == pos + 3:  # the usual tail: two bools and an empty dict
            tail = _TAIL_VALUES.get(bytes(view[pos:]))
            if tail is not None:
                return (OK, (obs, reward, tail[0], tail[1], {}))
        terminated, pos = _unpack(view, pos)
        truncated, pos = _unpack(view, pos)
        info, _ = _unpack(view, pos)
        return (OK, (obs, reward, terminated, truncated, info))
    raise ChannelClosed(f"corrupt packed frame (kind {kind:#x})")


def send_fds(sock: socket.socket, payload: bytes, fds: list[int]) -> None:
    sock.sendmsg([payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])


def recv_fds(sock: socket.socket, maxfds: int = 4) -> tuple[bytes, list[int]]:
    """A message and the descriptors that came with it, close-on-exec like every descriptor
    Python opens (received ones are not, by default: then every program this process starts --
    criu, a user's ``os.system`` -- would hold workers' channels open, and a worker would not see
    its controller go)."""
    msg, anc, _flags, _addr = sock.recvmsg(1024, socket.CMSG_SPACE(maxfds * 4), socket.MSG_CMSG_CLOEXEC)
    fds: list[int] = []
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            a = array.array("i")
            a.frombytes(data[: len(data) - (len(data) % a.itemsize)])
            fds.extend(a)
    return msg, fds


def socket_inode(fd: int) -> int:
    """The inode CRIU names an external unix socket by (``unix[INO]``)."""
    return os.fstat(fd).st_ino


# --- canonical digests (live migration's catch-up check) -------------------------------------
def canonical_digest(obj: Any) -> bytes:
    """A 16-byte digest of a command's result that is the same for the object and for its
    unpickled copy (pickle's own bytes are not: they depend on which objects are shared, e.g.
    numpy dtypes). Live migration compares what the source worker answered with what the
    target answers when it replays the same commands (:mod:`gym_fork.migration.live`)."""
    import hashlib

    h = hashlib.blake2b(digest_size=16)
    _feed(h, obj)
    return h.digest()


def _feed(h: Any, obj: Any) -> None:
    import numpy as np

    if obj is None or isinstance(obj, (bool, int, str)):
        h.update(f"{type(obj).__name__}:{obj!r};".encode())
    elif isinstance(obj, float):
        h.update(b"f" + struct.pack("!d", obj))
    elif isinstance(obj, np.ndarray):
        a = np.ascontiguousarray(obj)
        h.update(f"a{a.dtype.str}{a.shape};".encode())
        if a.dtype.hasobject:
            for x in a.ravel():
                _feed(h, x)
        else:
            h.update(a.tobytes())
    elif isinstance(obj, np.generic):
        h.update(f"s{obj.dtype.str};".encode() + obj.tobytes())
    elif isinstance(obj, (bytes, bytearray)):
        h.update(b"b%d;" % len(obj) + bytes(obj))
    elif isinstance(obj, (tuple, list)):
        h.update(b"%c%d;" % (b"t" if isinstance(obj, tuple) else b"l", len(obj)))
        for x in obj:
            _feed(h, x)
    elif isinstance(obj, dict):
        h.update(b"d%d;" % len(obj))
        for k, v in obj.items():
            _feed(h, k)
            _feed(h, v)
    else:  # anything else: its pickle (a false mismatch only costs a fallback, never a wrong result)
        h.update(b"p" + pickle.dumps(obj, protocol=5))

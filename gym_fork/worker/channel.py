"""The wire protocol between a ForkableEnv and its worker process.

One ``AF_UNIX SOCK_STREAM`` socket carries length-prefixed pickles, strictly request/reply:
the controller sends ``(command, args)`` and waits for ``(OK, result)`` or
``(ERR, type_name, message, traceback)``.  Because there is never more than one request in
flight, the worker is always blocked in ``recv`` when a snapshot is taken, so nothing is queued
in the socket (CRIU would drop queued bytes in restored copies).

File descriptors travel with ``SCM_RIGHTS`` (:func:`send_fds` / :func:`recv_fds`).
"""

from __future__ import annotations

import array
import os
import pickle
import socket
import struct
from typing import Any

OK = 0
ERR = 1

_HEADER = struct.Struct("!Q")
_MAX_MESSAGE = 1 << 34  # 16 GiB: a sanity bound against a corrupted length header


class ChannelClosed(EOFError):
    """The peer closed the channel (or died)."""


class Channel:
    """A framed, pickled request/reply channel over a connected stream socket."""

    __slots__ = ("sock", "_hdr")

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._hdr = bytearray(_HEADER.size)

    @classmethod
    def from_fd(cls, fd: int) -> "Channel":
        return cls(socket.socket(fileno=fd))

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, obj: Any) -> None:
        data = pickle.dumps(obj, protocol=5)
        # One sendall of header+payload: small messages (every step) cost one syscall.
        self.sock.sendall(_HEADER.pack(len(data)) + data)

    def recv(self) -> Any:
        self._recv_exact_into(self._hdr)
        (n,) = _HEADER.unpack(self._hdr)
        if n > _MAX_MESSAGE:
            raise ChannelClosed(f"corrupt message header (length {n})")
        buf = bytearray(n)
        self._recv_exact_into(buf)
        msg = pickle.loads(buf)
        if type(msg) is tuple and len(msg) == 4 and msg[0] == 2:  # (OUTPUT, ...): the env's prints, warnings
            from gym_fork.worker import output  # and logs, sent just ahead of the reply

            output.emit(msg)
            return self.recv()
        return msg

    def _recv_exact_into(self, buf: bytearray) -> None:
        view = memoryview(buf)
        while view:
            try:
                k = self.sock.recv_into(view)
            except (ConnectionResetError, BrokenPipeError) as e:
                raise ChannelClosed(str(e)) from None
            if k == 0:
                raise ChannelClosed("peer closed the channel")
            view = view[k:]

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def send_fds(sock: socket.socket, payload: bytes, fds: list[int]) -> None:
    sock.sendmsg([payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])


def recv_fds(sock: socket.socket, maxfds: int = 4) -> tuple[bytes, list[int]]:
    msg, anc, _flags, _addr = sock.recvmsg(1024, socket.CMSG_SPACE(maxfds * 4))
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

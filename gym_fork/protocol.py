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
        return pickle.loads(buf)

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

"""Control messages: a 4-byte big-endian length, then a UTF-8 JSON object (at most 1 MiB)."""

from __future__ import annotations

import json
import socket
import struct

MAX_CONTROL = 1 << 20
_LEN = struct.Struct("!I")


def send_msg(sock: socket.socket, obj: dict) -> None:
    """Send one control message (``obj`` must be JSON-serialisable)."""
    data = json.dumps(obj).encode()
    sock.sendall(_LEN.pack(len(data)) + data)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes from ``sock``. Raises EOFError when the peer closes first."""
    buf = bytearray(n)
    view = memoryview(buf)
    while view:
        k = sock.recv_into(view)
        if k == 0:
            raise EOFError(f"connection closed after {n - len(view)} of {n} bytes")
        view = view[k:]
    return bytes(buf)


def recv_msg(sock: socket.socket) -> dict:
    """One control message. Raises EOFError (peer closed) or ValueError (too large, not a JSON
    object)."""
    (n,) = _LEN.unpack(recv_exact(sock, _LEN.size))
    if n > MAX_CONTROL:
        raise ValueError(f"control message of {n} bytes refused (limit {MAX_CONTROL})")
    obj = json.loads(recv_exact(sock, n))
    if not isinstance(obj, dict):
        raise ValueError("control message is not a JSON object")
    return obj

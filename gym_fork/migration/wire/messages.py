"""Control messages: a 4-byte big-endian length, then a UTF-8 JSON object (at most 1 MiB; the
handshake's, before the peer is authenticated, at most :data:`MAX_PREAUTH`).

Nothing is allocated for a length before its bytes arrive (a peer that announces 1 MiB and
sends a byte now and then holds a few bytes here, not 1 MiB), and a ``deadline`` bounds a
whole exchange, not each read (a peer that trickles bytes cannot hold it open).
"""

from __future__ import annotations

import json
import socket
import struct
import time

MAX_CONTROL = 1 << 20
MAX_PREAUTH = 4096  # the handshake's messages are a few hundred bytes
_CHUNK = 1 << 16
_LEN = struct.Struct("!I")


def arm(sock: socket.socket, deadline: float | None) -> None:
    """Set ``sock``'s timeout to what is left until ``deadline`` (``time.monotonic()``; None:
    leave it as it is).

    Raises:
        TimeoutError: the deadline has passed.
    """
    if deadline is None:
        return
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the handshake's time is up")
    sock.settimeout(left)


def send_msg(sock: socket.socket, obj: dict, *, deadline: float | None = None) -> None:
    """Send one control message (``obj`` must be JSON-serialisable)."""
    data = json.dumps(obj).encode()
    arm(sock, deadline)
    sock.sendall(_LEN.pack(len(data)) + data)


def recv_exact(sock: socket.socket, n: int, *, deadline: float | None = None) -> bytes:
    """Exactly ``n`` bytes from ``sock``, buffered as they arrive (at most 64 KiB per read).

    Raises:
        EOFError: the peer closed first.
        TimeoutError: ``deadline`` passed first.
    """
    buf = bytearray()
    while len(buf) < n:
        arm(sock, deadline)
        chunk = sock.recv(min(n - len(buf), _CHUNK))
        if not chunk:
            raise EOFError(f"connection closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def recv_msg(sock: socket.socket, *, limit: int = MAX_CONTROL, deadline: float | None = None) -> dict:
    """One control message of at most ``limit`` bytes.

    Raises:
        EOFError: the peer closed.
        TimeoutError: ``deadline`` passed.
        ValueError: too large, not a JSON object, or nested too deeply to decode.
    """
    (n,) = _LEN.unpack(recv_exact(sock, _LEN.size, deadline=deadline))
    if n > limit:
        raise ValueError(f"control message of {n} bytes refused (limit {limit})")
    try:
        obj = json.loads(recv_exact(sock, n, deadline=deadline))
    except RecursionError:  # e.g. [[[[...]]]]: refused like any other malformed message
        raise ValueError("control message nested too deeply") from None
    if not isinstance(obj, dict):
        raise ValueError("control message is not a JSON object")
    return obj

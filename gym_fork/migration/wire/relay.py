"""A worker's channel carried over TCP: bytes copied both ways between two sockets. The worker
keeps its unix socket (what CRIU dumps as an external ``unix[INO]``), and TLS stays on the
relaying side."""

from __future__ import annotations

import os
import select
import socket
import ssl


def relay(a: socket.socket, b: socket.socket, *, pause_fd: int | None = None) -> bool:
    """Copy bytes both ways between ``a`` (may be TLS) and ``b``.

    Args:
        pause_fd: a pipe's read end; a byte written to it stops the relay between two reads
            (consumed here), with nothing in flight on a request/reply channel.

    Returns:
        True when paused through ``pause_fd``; False when either side closed or failed.
    """
    pair = {a: b, b: a}
    watch = [a, b] if pause_fd is None else [a, b, pause_fd]
    while True:
        if isinstance(a, ssl.SSLSocket) and a.pending():  # decrypted bytes select() cannot see
            ready = [a]
        else:
            ready = select.select(watch, [], [])[0]
        if pause_fd is not None and pause_fd in ready:
            os.read(pause_fd, 64)
            return True
        for s in ready:
            try:
                data = s.recv(1 << 16)
                if not data:
                    return False
                pair[s].sendall(data)
            except (OSError, ssl.SSLError):  # SSLError is an OSError; named for the reader
                return False

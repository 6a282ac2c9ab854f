"""Connecting to an agent: its ``host:port`` address, TCP (+ TLS) and the handshake, optionally
in a background thread so that it overlaps the CRIU dump."""

from __future__ import annotations

import socket
import ssl
import threading
import time
from typing import Any, Callable

from gym_fork.errors import AgentUnreachableError, AuthenticationError
from gym_fork.migration.wire.auth import client_handshake
from gym_fork.migration.wire.netns import in_netns


def parse_host_port(address: str) -> tuple[str, int]:
    """``"host:port"`` (``"[::1]:7000"`` for IPv6) as ``(host, port)``.

    Raises:
        ValueError: not of that form.
    """
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"target must be 'host:port', not {address!r}")
    return host.strip("[]"), int(port)


def connect(address: str, token: bytes, *, tls: bool | str = False, timeout: float = 10.0,
            netns: str | None = None) -> tuple[socket.socket, dict]:
    """Connect to the agent at ``address`` and authenticate both ways.

    Args:
        address: ``"host:port"``.
        token: the shared token.
        tls: False, True (system CAs) or the path of a CA file to pin.
        timeout: for the TCP connect and every later blocking call on the socket.
        netns: a network namespace to connect from.

    Returns:
        ``(sock, hello)``: the authenticated socket and the agent's hello (``node``, ``nonce``).

    Raises:
        AgentUnreachableError: nothing answers, or the handshake broke off.
        AuthenticationError: either side refused the other's token.
    """
    host, port = parse_host_port(address)

    def make() -> socket.socket:
        return socket.create_connection((host, port), timeout=timeout)

    try:
        sock = in_netns(netns, make)
    except OSError as e:
        raise AgentUnreachableError(f"no gym_fork agent reachable at {address}: {e}") from e
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if tls:
            ctx = ssl.create_default_context(cafile=tls if isinstance(tls, str) else None)
            if isinstance(tls, str):
                ctx.check_hostname = False  # a pinned CA file: the peer is the cert's holder
            sock = ctx.wrap_socket(sock, server_hostname=host)
        hello = client_handshake(sock, token)
    except AuthenticationError:
        sock.close()
        raise
    except (OSError, EOFError, ValueError, ssl.SSLError) as e:
        sock.close()
        raise AgentUnreachableError(f"agent at {address} did not complete the handshake: {e}") from e
    return sock, hello


class Background:
    """``call()`` -- a connect returning a connection -- running in a thread, so that it overlaps
    other work. ``result()`` joins it (re-raising its error); ``discard()`` closes what it made
    (with ``close``; default: element 0 of the tuple it returned), for a caller that failed before
    using it. ``elapsed``: seconds the call took.
    """

    def __init__(self, call: Callable[[], Any], close: Callable[[Any], None] | None = None):
        self._box: dict = {}
        self._close = close or (lambda v: v[0].close())
        self.elapsed = 0.0

        def run() -> None:
            t0 = time.monotonic()
            try:
                self._box["v"] = call()
            except BaseException as e:  # noqa: BLE001 - re-raised by result()
                self._box["e"] = e
            self.elapsed = time.monotonic() - t0

        self._thread = threading.Thread(target=run, name="gym_fork-connect", daemon=True)
        self._thread.start()

    def result(self) -> Any:
        self._thread.join()
        if "e" in self._box:
            raise self._box["e"]
        return self._box["v"]

    def discard(self) -> None:
        self._thread.join()
        if "v" in self._box:
            self._close(self._box["v"])


def connect_in_background(address: str, token: bytes, **kw: Any) -> Background:
    """:func:`connect` (same arguments) in a thread; ``result()`` is its ``(sock, hello)``."""
    return Background(lambda: connect(address, token, **kw))

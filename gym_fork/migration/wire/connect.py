"""Connecting to an agent: its ``host:port`` address, TCP, TLS (unless ``insecure``) and the
handshake bound to it, optionally in a background thread so that it overlaps the CRIU dump."""

from __future__ import annotations

import socket
import ssl
import threading
import time
from typing import Any, Callable

from gym_fork.backends.netns import in_netns
from gym_fork.errors import AgentUnreachableError, AuthenticationError
from gym_fork.migration.wire.auth import client_handshake
from gym_fork.migration.wire.messages import arm
from gym_fork.migration.wire.tls import client_context, peer_binding


def parse_host_port(address: str) -> tuple[str, int]:
    """``"host:port"`` (``"[::1]:7000"`` for IPv6) as ``(host, port)``.

    Raises:
        ValueError: not of that form.
    """
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"target must be 'host:port', not {address!r}")
    return host.strip("[]"), int(port)


def connect(address: str, token: bytes, *, tls: bool | str = False, insecure: bool = False,
            timeout: float = 10.0, netns: str | None = None) -> tuple[socket.socket, dict]:
    """Connect to the agent at ``address`` over TLS and authenticate both ways.

    Args:
        address: ``"host:port"``.
        token: the shared token.
        tls: how the agent's certificate is checked besides the token handshake, which covers
            it in every case (:mod:`.tls`): False (only that: agents make their own
            certificate), True (also the system CAs and the host name) or the path of a CA file
            to pin.
        insecure: plain TCP, for an agent started with ``--insecure``: nothing after the
            handshake is authenticated or encrypted (anyone on the path can read the stream
            and inject commands).
        timeout: for the TCP connect, for the whole TLS + token handshake, and for every later
            blocking call on the socket.
        netns: a network namespace to connect from.

    Returns:
        ``(sock, hello)``: the authenticated socket and the agent's hello (``node``, ``nonce``).

    Raises:
        AgentUnreachableError: nothing answers, or the handshake broke off.
        AuthenticationError: either side refused the other's token.
        ValueError: both ``insecure`` and ``tls``.
    """
    if insecure and tls:
        raise ValueError("insecure=True is plain TCP: it cannot be combined with tls=...")
    host, port = parse_host_port(address)

    def make() -> socket.socket:
        return socket.create_connection((host, port), timeout=timeout)

    try:
        sock = in_netns(netns, make)
    except OSError as e:
        raise AgentUnreachableError(f"no gym_fork agent reachable at {address}: {e}") from e
    deadline = time.monotonic() + timeout
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        binding = None
        if not insecure:
            arm(sock, deadline)
            try:
                sock = client_context(tls).wrap_socket(sock, server_hostname=host if tls is True else None)
            except ssl.SSLError as e:
                raise AgentUnreachableError(
                    f"the agent at {address} did not complete the TLS handshake ({e}); an agent started "
                    "with --insecure speaks plain TCP: connect with insecure=True only if you accept what "
                    "that gives up (see `gym-fork agent --help`)") from e
            binding = peer_binding(sock)
        hello = client_handshake(sock, token, binding=binding, deadline=deadline)
        sock.settimeout(timeout)
    except (AuthenticationError, AgentUnreachableError):
        sock.close()
        raise
    except (OSError, EOFError, ValueError) as e:
        sock.close()
        hint = (" (an agent started without --insecure speaks TLS: drop insecure=True)"
                if insecure and isinstance(e, (EOFError, TimeoutError)) else "")
        raise AgentUnreachableError(f"agent at {address} did not complete the handshake: {e}{hint}") from e
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

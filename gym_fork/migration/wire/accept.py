"""The listener's side of a connection (an agent, a plugin's host): TLS, then the token
handshake bound to it, all within one deadline."""

from __future__ import annotations

import socket
import time

from gym_fork.migration.wire.auth import server_handshake
from gym_fork.migration.wire.messages import arm
from gym_fork.migration.wire.tls import ServerTLS

HANDSHAKE_TIMEOUT_S = 10.0


def accept(conn: socket.socket, token: bytes, node: str, tls: ServerTLS | None, *,
           deadline: float | None = None) -> tuple[socket.socket, str]:
    """Secure and authenticate an accepted connection.

    Args:
        conn: the accepted TCP socket (consumed: on failure it is closed).
        token: the shared token.
        node: our name, for the hello.
        tls: the listener's TLS; None: plain TCP (``--insecure``).
        deadline: ``time.monotonic()`` by which TLS and the handshake must be done (default
            :data:`HANDSHAKE_TIMEOUT_S` from now): a peer that sends a byte now and then is
            dropped then, however it paces them.

    Returns:
        ``(sock, nonce)``: the connection to use from now on (TLS-wrapped unless plain) and
        the session's nonce (what a checkpoint sent on it must be signed for). Its timeout is
        what was left of the deadline; the caller sets the next one.

    Raises:
        AuthenticationError: the peer failed the challenge-response.
        OSError (ssl.SSLError, TimeoutError included), EOFError, ValueError: not a gym_fork
            client, a broken handshake, or time up.
    """
    if deadline is None:
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
    try:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        arm(conn, deadline)  # the TLS handshake is one call, bounded by this timeout as a whole
        if tls is not None:
            conn = tls.context.wrap_socket(conn, server_side=True)
        nonce = server_handshake(conn, token, node, binding=tls.binding if tls else None, deadline=deadline)
    except BaseException:
        conn.close()
        raise
    return conn, nonce

"""The shared token, the bundle key derived from it, and the mutual challenge-response every
connection to an agent (or a plugin's host) passes before anything else.

Over TLS both proofs also cover the channel binding (:mod:`.tls`): ``HMAC(token,
"client|A|C|tls-server-end-point:SHA256")`` and ``HMAC(token, "agent|C|A|...")``; on plain TCP
(``insecure``) the binding part is absent. Nonces are hex, so no part can contain ``|``.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import socket

from gym_fork.errors import AuthenticationError
from gym_fork.migration.wire.messages import MAX_PREAUTH, recv_msg, send_msg

PROTOCOL = 1


def load_token(token: str | bytes | None = None, token_file: str | None = None) -> bytes:
    """The shared token: ``token``, else ``token_file``, else ``$GYM_FORK_TOKEN``, else the file
    named by ``$GYM_FORK_TOKEN_FILE``.

    Raises:
        ValueError: there is none, or the file is empty (agents never run without a token).
        OSError: the token file cannot be read.
    """
    if token:
        return token if isinstance(token, bytes) else token.encode()
    path = token_file or os.environ.get("GYM_FORK_TOKEN_FILE")
    if token_file is None and os.environ.get("GYM_FORK_TOKEN"):
        return os.environ["GYM_FORK_TOKEN"].encode()
    if path:
        with open(path, "rb") as f:
            data = f.read().strip()
        if not data:
            raise ValueError(f"token file {path} is empty")
        return data
    raise ValueError("no token: pass --token-file FILE or set $GYM_FORK_TOKEN")


def bundle_key(token: bytes) -> bytes:
    """The HMAC key for checkpoints shipped between nodes (derived, so the token itself never
    signs data an attacker chose)."""
    return hmac.new(token, b"gym_fork bundle key v1", hashlib.sha256).digest()


_NONCE = re.compile(r"[0-9a-f]{32,128}")


def _mac(token: bytes, role: str, first: str, second: str, binding: str | None) -> str:
    parts = [role, first, second] + ([binding] if binding else [])
    return hmac.new(token, "|".join(parts).encode(), hashlib.sha256).hexdigest()


def _same(expected: str, got: object) -> bool:
    """Constant-time comparison of a MAC with what the peer sent (anything: it is untrusted)."""
    return isinstance(got, str) and got.isascii() and hmac.compare_digest(expected, got)


def server_handshake(sock: socket.socket, token: bytes, node: str, *, binding: str | None = None,
                     deadline: float | None = None) -> str:
    """The agent's side: prove the peer knows ``token`` and prove that we do.

    Args:
        binding: the TLS channel binding of our certificate (:func:`.tls.binding_of`); both
            proofs cover it, so a relay that ends TLS itself fails them. None on plain TCP.
        deadline: ``time.monotonic()`` by which the whole exchange must be over.

    Returns:
        This session's nonce: a checkpoint streamed on this connection must be signed for it.

    Raises:
        AuthenticationError: the peer failed (it was told so first).
        EOFError, ValueError, OSError: the connection broke, carried garbage or took too long.
    """
    nonce_a = os.urandom(32).hex()
    send_msg(sock, {"hello": "gym_fork-agent", "v": PROTOCOL, "node": node, "nonce": nonce_a}, deadline=deadline)
    msg = recv_msg(sock, limit=MAX_PREAUTH, deadline=deadline)
    nonce_c, mac = msg.get("nonce"), msg.get("mac")
    if not (isinstance(nonce_c, str) and _NONCE.fullmatch(nonce_c)
            and _same(_mac(token, "client", nonce_a, nonce_c, binding), mac)):
        try:
            send_msg(sock, {"ok": False, "error": "AuthenticationError",
                            "message": "the agent refused the token (challenge-response failed)"},
                     deadline=deadline)
        except OSError:
            pass
        raise AuthenticationError("peer failed the challenge-response (wrong token, not a gym_fork client, "
                                  "or a relay that ended TLS in between)")
    send_msg(sock, {"ok": True, "mac": _mac(token, "agent", nonce_c, nonce_a, binding)}, deadline=deadline)
    return nonce_a


def client_handshake(sock: socket.socket, token: bytes, *, binding: str | None = None,
                     deadline: float | None = None) -> dict:
    """The client's side of :func:`server_handshake`.

    Args:
        binding: the TLS channel binding of the certificate the server presented
            (:func:`.tls.peer_binding`); None on plain TCP.
        deadline: ``time.monotonic()`` by which the whole exchange must be over.

    Returns:
        The agent's hello (``node``, ``nonce``).

    Raises:
        AuthenticationError: the peer is no gym_fork agent, refused us, or does not know the token.
    """
    hello = recv_msg(sock, limit=MAX_PREAUTH, deadline=deadline)
    nonce_a = hello.get("nonce")
    if hello.get("hello") != "gym_fork-agent" or hello.get("v") != PROTOCOL \
            or not (isinstance(nonce_a, str) and _NONCE.fullmatch(nonce_a)):
        raise AuthenticationError(f"the peer is not a gym_fork agent of protocol {PROTOCOL}: {hello!r:.200}")
    nonce_c = os.urandom(32).hex()
    send_msg(sock, {"nonce": nonce_c, "mac": _mac(token, "client", nonce_a, nonce_c, binding)}, deadline=deadline)
    reply = recv_msg(sock, limit=MAX_PREAUTH, deadline=deadline)
    if not reply.get("ok"):
        raise AuthenticationError(f"agent {hello.get('node')!r} refused us: {reply.get('message')}")
    if not _same(_mac(token, "agent", nonce_c, nonce_a, binding), reply.get("mac")):
        raise AuthenticationError(f"agent {hello.get('node')!r} could not prove it knows the token"
                                  + (" (or a relay ended TLS in between)" if binding else ""))
    return hello

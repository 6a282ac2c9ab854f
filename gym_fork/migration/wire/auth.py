"""The shared token, the bundle key derived from it, and the mutual challenge-response every
connection to an agent (or a plugin's host) passes before anything else."""

from __future__ import annotations

import hashlib
import hmac
import os
import socket

from gym_fork.errors import AuthenticationError
from gym_fork.migration.wire.messages import recv_msg, send_msg

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


def _mac(token: bytes, *parts: str) -> str:
    return hmac.new(token, "|".join(parts).encode(), hashlib.sha256).hexdigest()


def server_handshake(sock: socket.socket, token: bytes, node: str) -> str:
    """The agent's side: prove the peer knows ``token`` and prove that we do.

    Returns:
        This session's nonce: a checkpoint streamed on this connection must be signed for it.

    Raises:
        AuthenticationError: the peer failed (it was told so first).
        EOFError, ValueError, OSError: the connection broke or carried garbage.
    """
    nonce_a = os.urandom(32).hex()
    send_msg(sock, {"hello": "gym_fork-agent", "v": PROTOCOL, "node": node, "nonce": nonce_a})
    msg = recv_msg(sock)
    nonce_c, mac = str(msg.get("nonce", "")), str(msg.get("mac", ""))
    if len(nonce_c) < 32 or not hmac.compare_digest(_mac(token, "client", nonce_a, nonce_c), mac):
        try:
            send_msg(sock, {"ok": False, "error": "AuthenticationError",
                            "message": "the agent refused the token (challenge-response failed)"})
        except OSError:
            pass
        raise AuthenticationError("peer failed the challenge-response (wrong token or not a gym_fork client)")
    send_msg(sock, {"ok": True, "mac": _mac(token, "agent", nonce_c, nonce_a)})
    return nonce_a


def client_handshake(sock: socket.socket, token: bytes) -> dict:
    """The client's side of :func:`server_handshake`.

    Returns:
        The agent's hello (``node``, ``nonce``).

    Raises:
        AuthenticationError: the peer is no gym_fork agent, refused us, or does not know the token.
    """
    hello = recv_msg(sock)
    if hello.get("hello") != "gym_fork-agent" or hello.get("v") != PROTOCOL:
        raise AuthenticationError(f"the peer is not a gym_fork agent of protocol {PROTOCOL}: {hello!r:.200}")
    nonce_c = os.urandom(32).hex()
    send_msg(sock, {"nonce": nonce_c, "mac": _mac(token, "client", hello["nonce"], nonce_c)})
    reply = recv_msg(sock)
    if not reply.get("ok"):
        raise AuthenticationError(f"agent {hello.get('node')!r} refused us: {reply.get('message')}")
    if not hmac.compare_digest(_mac(token, "agent", nonce_c, hello["nonce"]), str(reply.get("mac", ""))):
        raise AuthenticationError(f"agent {hello.get('node')!r} could not prove it knows the token")
    return hello

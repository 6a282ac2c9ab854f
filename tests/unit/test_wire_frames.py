"""The migration wire's control frames (4-byte big-endian length + a UTF-8 JSON object, at most
1 MiB) and the mutual challenge-response built on them, over real socketpairs."""

from __future__ import annotations

import json
import socket
import struct
import threading

import pytest

from gym_fork.errors import AuthenticationError
from gym_fork.migration.wire.auth import bundle_key, client_handshake, load_token, server_handshake
from gym_fork.migration.wire.connect import parse_host_port
from gym_fork.migration.wire.messages import MAX_CONTROL, recv_exact, recv_msg, send_msg

LEN = struct.Struct("!I")



class Peer(threading.Thread):
    """Runs ``fn()`` in a thread; ``result()`` returns its value or re-raises its error."""

    def __init__(self, fn):
        super().__init__(daemon=True)
        self.fn, self.box = fn, {}
        self.start()

    def run(self):
        try:
            self.box["v"] = self.fn()
        except BaseException as e:  # noqa: BLE001
            self.box["e"] = e

    def result(self):
        self.join(30)
        assert not self.is_alive(), "peer thread hung"
        if "e" in self.box:
            raise self.box["e"]
        return self.box["v"]


# --- framing ------------------------------------------------------------------------------------
def test_round_trip(pair):
    a, b = pair
    msgs = [{"op": "env", "size": 123, "stream": 3, "hash": "blake3"}, {"ok": False, "error": "X", "message": "ünï ✓"},
            {}, {"nested": {"l": [1, 2.5, None, True]}}]
    for m in msgs:
        send_msg(a, m)
    for m in msgs:
        assert recv_msg(b) == m


def test_wire_layout(pair):
    a, b = pair
    send_msg(a, {"k": "é"})
    (n,) = LEN.unpack(recv_exact(b, 4))
    assert json.loads(recv_exact(b, n).decode("utf-8")) == {"k": "é"}


def test_frame_split_into_single_bytes(pair):
    a, b = pair
    body = json.dumps({"op": "ping", "pad": "x" * 100}).encode()
    frame = LEN.pack(len(body)) + body
    t = Peer(lambda: [a.sendall(frame[i:i + 1]) for i in range(len(frame))])
    assert recv_msg(b) == {"op": "ping", "pad": "x" * 100}
    t.result()


def test_largest_allowed_message(pair):
    a, b = pair
    msg = {"pad": "x" * (MAX_CONTROL - len('{"pad": ""}'))}
    assert len(json.dumps(msg).encode()) == MAX_CONTROL
    t = Peer(lambda: send_msg(a, msg))
    assert recv_msg(b) == msg
    t.result()


def test_oversized_length_refused_without_reading_the_body(pair):
    """Only the header is sent: the receiver must refuse from the length alone (neither wait
    for nor buffer a body an attacker says is 4 GiB)."""
    a, b = pair
    a.sendall(LEN.pack(MAX_CONTROL + 1))
    with pytest.raises(ValueError, match="refused"):
        recv_msg(b)
    a.sendall(LEN.pack(0xFFFFFFFF))
    with pytest.raises(ValueError, match="refused"):
        recv_msg(b)


def test_oversized_message_from_send_msg_is_refused(pair):
    a, b = pair
    t = Peer(lambda: send_msg(a, {"pad": "x" * MAX_CONTROL}))
    with pytest.raises(ValueError, match="refused"):
        recv_msg(b)
    b.close()  # the sender may be blocked on the unread body
    with pytest.raises(OSError):
        t.result()


@pytest.mark.parametrize("body", [
    b"not json",
    b"{\"a\": 1",            # truncated JSON
    b"\xff\xfe{}",            # not UTF-8
    b"[1, 2]",               # JSON, but not an object
    b"\"ok\"",
    b"null",
    b"",
])
def test_malformed_body_refused(pair, body):
    a, b = pair
    a.sendall(LEN.pack(len(body)) + body)
    with pytest.raises(ValueError):
        recv_msg(b)


def test_eof_mid_header_and_mid_body(pair):
    a, b = pair
    a.sendall(LEN.pack(50) + b'{"op": ')
    a.shutdown(socket.SHUT_WR)
    with pytest.raises(EOFError, match="7 of 50"):
        recv_msg(b)
    c, d = socket.socketpair()
    with c, d:
        c.sendall(b"\x00\x00")
        c.shutdown(socket.SHUT_WR)
        with pytest.raises(EOFError):
            recv_msg(d)


# --- the handshake ------------------------------------------------------------------------------
def test_handshake_same_token(pair):
    a, b = pair
    agent = Peer(lambda: server_handshake(a, b"s3cret", "node-b"))
    hello = client_handshake(b, b"s3cret")
    nonce = agent.result()
    assert hello["node"] == "node-b" and hello["nonce"] == nonce and len(nonce) == 64


def test_handshake_wrong_token_fails_on_both_sides(pair):
    a, b = pair
    agent = Peer(lambda: server_handshake(a, b"s3cret", "node-b"))
    with pytest.raises(AuthenticationError, match="refused us"):
        client_handshake(b, b"guess")
    with pytest.raises(AuthenticationError, match="challenge-response"):
        agent.result()


def test_client_refuses_an_agent_that_does_not_know_the_token(pair):
    """Mutual: an impostor agent that accepts anyone is caught by the client."""
    a, b = pair

    def impostor():
        send_msg(a, {"hello": "gym_fork-agent", "v": 1, "node": "evil", "nonce": "0" * 64})
        recv_msg(a)
        send_msg(a, {"ok": True, "mac": "0" * 64})

    t = Peer(impostor)
    with pytest.raises(AuthenticationError, match="could not prove"):
        client_handshake(b, b"s3cret")
    t.result()


@pytest.mark.parametrize("hello", [{"hello": "something-else", "v": 1, "nonce": "x"},
                                   {"hello": "gym_fork-agent", "v": 999, "nonce": "x"}])
def test_client_refuses_a_peer_that_is_no_agent(pair, hello):
    a, b = pair
    send_msg(a, hello)
    with pytest.raises(AuthenticationError, match="not a gym_fork agent"):
        client_handshake(b, b"s3cret")


def test_agent_refuses_a_short_client_nonce(pair):
    """A client nonce shorter than 32 characters is refused even with a correct MAC for it."""
    import hashlib
    import hmac

    a, b = pair
    agent = Peer(lambda: server_handshake(a, b"s3cret", "node-b"))
    hello = recv_msg(b)
    mac = hmac.new(b"s3cret", f"client|{hello['nonce']}|x".encode(), hashlib.sha256).hexdigest()
    send_msg(b, {"nonce": "x", "mac": mac})
    assert recv_msg(b)["ok"] is False
    with pytest.raises(AuthenticationError):
        agent.result()


# --- tokens and addresses -----------------------------------------------------------------------
def test_load_token_sources(tmp_path, monkeypatch):
    monkeypatch.delenv("GYM_FORK_TOKEN", raising=False)
    monkeypatch.delenv("GYM_FORK_TOKEN_FILE", raising=False)
    assert load_token("abc") == b"abc"
    f = tmp_path / "token"
    f.write_bytes(b"from-file\n")
    assert load_token(token_file=str(f)) == b"from-file"
    monkeypatch.setenv("GYM_FORK_TOKEN_FILE", str(f))
    assert load_token() == b"from-file"
    monkeypatch.setenv("GYM_FORK_TOKEN", "from-env")
    assert load_token() == b"from-env"
    assert load_token(token_file=str(f)) == b"from-file"  # an explicit file wins over the env
    (tmp_path / "empty").write_bytes(b"\n")
    with pytest.raises(ValueError, match="empty"):
        load_token(token_file=str(tmp_path / "empty"))
    monkeypatch.delenv("GYM_FORK_TOKEN")
    monkeypatch.delenv("GYM_FORK_TOKEN_FILE")
    with pytest.raises(ValueError, match="no token"):
        load_token()


def test_bundle_key_is_derived():
    k = bundle_key(b"tok")
    assert len(k) == 32 and k != b"tok" and k == bundle_key(b"tok") and k != bundle_key(b"tok2")


@pytest.mark.parametrize("address,want", [("10.0.0.2:7000", ("10.0.0.2", 7000)), ("[::1]:7000", ("::1", 7000)),
                                          ("host.example:1", ("host.example", 1))])
def test_parse_host_port(address, want):
    assert parse_host_port(address) == want


@pytest.mark.parametrize("address", ["10.0.0.2", "host:", "host:port", ":x", "10.0.0.2:-1"])
def test_parse_host_port_refuses(address):
    with pytest.raises(ValueError, match="host:port"):
        parse_host_port(address)

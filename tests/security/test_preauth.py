"""Malformed input before (and right after) authentication: a JSON nesting bomb, a MAC that is
not ASCII, a nonce of the wrong type, an image name with a trailing newline. Each is refused with
a "REFUSED" log line and the socket closed; nothing escapes as an uncaught exception in the
connection's thread, and the agent keeps serving."""

from __future__ import annotations

import json
import os
import struct
import time

import pytest

from gym_fork.migration.wire.connect import connect
from gym_fork.migration.wire.messages import recv_msg, send_msg
from tests.security.rig import AgentProc, closed_by_peer, open_raw, recv_frame, send_frame, wait_for

CLOSE_WITHIN_S = 20.0  # far beyond the agent's reaction; a socket left open fails the test


@pytest.fixture
def agent():
    a = AgentProc()
    yield a
    a.stop()


def _clean_log(agent: AgentProc) -> None:
    log = agent.log()
    for bad in ("Traceback", "RecursionError", "Exception in thread", "TypeError"):
        assert bad not in log, f"{bad} in the agent's log:\n{log[-3000:]}"


def _ping(agent: AgentProc) -> None:
    sock, _hello = connect(agent.target, agent.token.encode())
    with sock:
        send_msg(sock, {"op": "ping"})
        assert recv_msg(sock)["ok"]


@pytest.mark.parametrize("body", [
    b"[" * 4000,                                  # deep enough for a RecursionError, small enough to be read
    b"[" * (1 << 20),                             # the largest control message of old: refused by size now
    b'{"nonce": "' + b"a" * 64 + b'", "mac": "' + "é".encode() * 64 + b'"}',   # not ASCII: compare_digest raises
    b'{"nonce": ' + b"1" * 70 + b', "mac": "00"}',  # a number for the nonce
    json.dumps({"nonce": ["x"] * 40, "mac": {"a": 1}}).encode(),
], ids=["nesting-bomb", "megabyte-bomb", "non-ascii-mac", "int-nonce", "wrong-types"])
def test_malformed_handshake_answer_is_refused_and_closed(agent, body):
    before = agent.log().count("REFUSED")
    s = open_raw(agent.target)
    with s:
        hello = recv_frame(s)
        assert hello["hello"] == "gym_fork-agent"
        try:
            send_frame(s, body)
        except OSError:
            pass  # the agent may close before it read everything: that is a refusal too
        assert closed_by_peer(s, CLOSE_WITHIN_S), "the agent left the connection open"
    assert wait_for(lambda: agent.log().count("REFUSED") > before), agent.log()[-2000:]
    _clean_log(agent)
    _ping(agent)


def test_nesting_bomb_as_the_request_after_authentication(agent):
    before = agent.log().count("REFUSED")
    sock, _hello = connect(agent.target, agent.token.encode())
    with sock:
        bomb = b"[" * 4000
        sock.sendall(struct.pack("!I", len(bomb)) + bomb)
        assert closed_by_peer(sock, CLOSE_WITHIN_S)
    assert wait_for(lambda: agent.log().count("REFUSED") > before)
    _clean_log(agent)
    _ping(agent)


def test_image_name_with_a_trailing_newline_is_refused(agent):
    """``$`` matches before a trailing newline; names are checked with fullmatch."""
    sock, _hello = connect(agent.target, agent.token.encode())
    with sock:
        send_msg(sock, {"op": "env", "size": 4096, "stream": 3, "hash": "sha256"})
        assert recv_msg(sock)["ok"]
        frame = struct.Struct("!BIQ")
        name = b"pages-1.img\n"
        sock.sendall(frame.pack(1, 0, len(name)) + name + frame.pack(2, 0, 4) + b"evil" + frame.pack(3, 0, 0))
        reply = recv_msg(sock)
    assert not reply["ok"] and "refusing image name" in reply["message"], reply
    assert wait_for(lambda: not [d for d in os.listdir(agent.state_dir) if d.startswith("in-")])
    _clean_log(agent)


def test_a_flood_of_refusals_is_logged_in_summary(agent):
    """Refused connections are logged at most once a second with a count of the others, so a
    flood of them cannot fill the disk with log lines."""
    bad = json.dumps({"nonce": "a" * 64, "mac": "0" * 64}).encode()

    def refused_once() -> None:
        s = open_raw(agent.target, tls=True)
        with s:
            recv_frame(s)
            send_frame(s, bad)
            assert closed_by_peer(s, CLOSE_WITHIN_S)

    for _ in range(60):
        refused_once()
    time.sleep(1.1)  # past the once-a-second window: the next refusal reports the ones held back
    refused_once()
    assert wait_for(lambda: "more like it" in agent.log()), agent.log()[-2000:]
    assert agent.log().count("REFUSED") < 30
    _ping(agent)

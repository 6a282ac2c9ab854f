"""Slowloris: many connections that never finish their handshake, each sending a byte now and
then -- some announce a 1 MiB control message, some trickle their TLS ClientHello. The agent
bounds the whole handshake in time (not each read), allocates nothing for an announced size
before the bytes arrive, and caps the connections still in their handshake: every attacker is
dropped within the handshake bound, and the agent's threads and memory (read from /proc) stay
bounded while it goes on serving."""

from __future__ import annotations

import socket
import struct
import threading
import time
import tracemalloc

from gym_fork.migration.wire.connect import connect
from gym_fork.migration.wire.messages import recv_msg, send_msg
from tests.security.rig import AgentProc, closed_by_peer, open_raw

CONNECTIONS = 100
GIVE_UP_S = 45.0  # an attacker stops on its own after this: far beyond the agent's 10 s handshake bound
PACE_S = 0.5  # one byte every PACE_S: each read sees data long before any per-read timeout
DEFAULT_MAX_UNAUTHENTICATED = 32


def _attack(target: str, kind: str, results: list, i: int) -> None:
    try:
        if kind == "announce":  # a control message of 1 MiB, inside TLS
            s = open_raw(target, timeout=GIVE_UP_S)
            s.sendall(struct.pack("!I", 1 << 20))
        else:  # a TLS record header announcing a 16 KiB ClientHello, then its bytes one by one
            host, port = target.rsplit(":", 1)
            s = socket.create_connection((host, int(port)), timeout=GIVE_UP_S)
            s.sendall(b"\x16\x03\x01\x40\x00")
    except OSError:
        results[i] = "closed"  # refused at once (over the cap): dropped too
        return
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < GIVE_UP_S:
            if closed_by_peer(s, PACE_S):
                results[i] = "closed"
                return
            try:
                s.send(b"[")
            except OSError:
                results[i] = "closed"
                return
        results[i] = "still open"
    finally:
        s.close()


def test_trickling_connections_are_dropped_and_the_agent_stays_bounded():
    agent = AgentProc()
    try:
        base = agent.status()
        results: list = [None] * CONNECTIONS
        threads = [threading.Thread(target=_attack, args=(agent.target, ("announce", "clienthello")[i % 2], results, i),
                                    daemon=True) for i in range(CONNECTIONS)]
        for t in threads:
            t.start()
        peak = dict(base)
        while any(t.is_alive() for t in threads):
            st = agent.status()
            peak = {k: max(peak[k], st[k]) for k in peak}
            time.sleep(0.2)
        assert results.count("closed") == CONNECTIONS, \
            f"{results.count('still open')} of {CONNECTIONS} trickling connections were still open after {GIVE_UP_S} s"
        assert peak["Threads"] <= base["Threads"] + DEFAULT_MAX_UNAUTHENTICATED + 4, (base, peak)
        assert peak["VmRSS"] - base["VmRSS"] < 48 * 1024, (base, peak)  # KiB
        assert agent.alive()
        sock, _hello = connect(agent.target, agent.token.encode())  # still serving
        with sock:
            send_msg(sock, {"op": "ping"})
            assert recv_msg(sock)["ok"]
        log = agent.log()
        assert "REFUSED" in log and "Traceback" not in log
    finally:
        agent.stop()


def test_an_announced_size_is_not_allocated_before_its_bytes_arrive():
    """A control message announced as 1 MiB of which 10 bytes come: what is held is what came."""
    a, b = socket.socketpair()
    with a, b:
        a.sendall(struct.pack("!I", 1 << 20) + b"x" * 10)
        a.shutdown(socket.SHUT_WR)
        tracemalloc.start()
        try:
            try:
                recv_msg(b)
            except EOFError:
                pass
            _now, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert peak < 256 * 1024, f"{peak} bytes allocated for a message of which 10 bytes arrived"


def test_the_handshake_deadline_holds_however_the_bytes_are_paced():
    """One connection that sends a valid-looking handshake byte every 0.5 s is dropped within the
    handshake bound (2 s here) although no single read ever waits long."""
    agent = AgentProc("--handshake-timeout", "2")
    try:
        s = open_raw(agent.target, timeout=30)
        with s:
            body = b'{"nonce": "' + b"0" * 64 + b'", "mac": "' + b"0" * 64 + b'"}'
            s.sendall(struct.pack("!I", len(body)))
            closed = False
            for byte in body:  # ~75 s for all of it
                if closed_by_peer(s, 0.5):
                    closed = True
                    break
                s.send(bytes([byte]))
        assert closed, "the agent waited for the whole trickled message"
        deadline = time.monotonic() + 5  # the socket may close a moment before the line is written
        while "REFUSED" not in agent.log() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "REFUSED" in agent.log()
    finally:
        agent.stop()

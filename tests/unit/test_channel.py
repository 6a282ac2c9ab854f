"""The worker channel: length-prefixed pickled frames and SCM_RIGHTS fd passing, over real
socketpairs (the same AF_UNIX stream sockets a ForkableEnv and its worker use)."""

from __future__ import annotations

import os
import pickle
import socket
import struct
import threading
import time

import numpy as np
import pytest

from gym_fork.worker.channel import (
    ERR, OK, Channel, ChannelClosed, SpinWait, recv_fds, send_fds, socket_inode, spin_cap)

HEADER = struct.Struct("!Q")  # the frame header: 8-byte big-endian payload length



def _in_thread(fn, *args):
    t = threading.Thread(target=fn, args=args, daemon=True)
    t.start()
    return t


def test_round_trip_keeps_values_and_order(pair):
    a, b = pair
    tx, rx = Channel(a), Channel(b)
    msgs = [("step", (1,)), (OK, {"obs": np.arange(5, dtype=np.float32)}), (ERR, "ValueError", "bad", "tb"),
            None, b"", "x" * 10_000]
    for m in msgs:
        tx.send(m)
    for want in msgs:
        got = rx.recv()
        if isinstance(want, tuple) and len(want) == 2 and isinstance(want[1], dict):
            assert got[0] == want[0] and got[1]["obs"].dtype == np.float32
            assert got[1]["obs"].tobytes() == want[1]["obs"].tobytes()
        else:
            assert got == want


def test_one_frame_is_header_plus_pickle(pair):
    """The on-wire layout: an 8-byte big-endian length, then exactly that many pickle bytes."""
    a, b = pair
    Channel(a).send({"k": 1})
    (n,) = HEADER.unpack(b.recv(HEADER.size, socket.MSG_WAITALL))
    body = b.recv(n, socket.MSG_WAITALL)
    assert len(body) == n and pickle.loads(body) == {"k": 1}
    b.setblocking(False)
    with pytest.raises(BlockingIOError):  # nothing after the frame
        b.recv(1)


def test_frame_arriving_byte_by_byte(pair):
    """recv() assembles a frame from many short reads (header and payload split anywhere)."""
    a, b = pair
    data = pickle.dumps(("reset", {"seed": 7}), protocol=5)
    frame = HEADER.pack(len(data)) + data

    def trickle():
        for i in range(len(frame)):
            a.sendall(frame[i:i + 1])
            time.sleep(0.0005)

    t = _in_thread(trickle)
    assert Channel(b).recv() == ("reset", {"seed": 7})
    t.join()


def test_frame_larger_than_the_socket_buffer(pair):
    """A frame several times the kernel buffer needs many partial recv_into calls."""
    a, b = pair
    big = np.random.default_rng(0).integers(0, 255, size=8 << 20, dtype=np.uint8)
    t = _in_thread(Channel(a).send, big)
    got = Channel(b).recv()
    t.join()
    assert got.dtype == np.uint8 and got.tobytes() == big.tobytes()


def test_clean_eof_before_a_frame(pair):
    a, b = pair
    a.close()
    with pytest.raises(ChannelClosed, match="closed"):
        Channel(b).recv()


def test_eof_inside_the_header(pair):
    a, b = pair
    a.sendall(HEADER.pack(100)[:3])
    a.close()
    with pytest.raises(ChannelClosed):
        Channel(b).recv()


def test_eof_inside_the_payload(pair):
    """A peer that dies mid-frame is a ChannelClosed, never a truncated (mis-unpickled) message."""
    a, b = pair
    data = pickle.dumps(list(range(1000)), protocol=5)
    a.sendall(HEADER.pack(len(data)) + data[: len(data) // 2])
    a.close()
    with pytest.raises(ChannelClosed):
        Channel(b).recv()


def test_oversized_length_is_refused_before_allocating(pair):
    """A corrupted header claiming more than the bound is refused at once (no 2**60-byte buffer,
    no wait for a payload that never comes)."""
    a, b = pair
    a.sendall(HEADER.pack(1 << 60))
    with pytest.raises(ChannelClosed, match="corrupt message header"):
        Channel(b).recv()


def test_peer_reset_is_channel_closed(pair):
    """A peer that closes with unread data resets the connection: still a ChannelClosed."""
    a, b = pair
    b.sendall(b"unread by a")
    a.close()
    with pytest.raises(ChannelClosed):
        Channel(b).recv()


def test_channel_from_fd_and_close(pair):
    a, b = pair
    fd = os.dup(b.fileno())
    ch = Channel.from_fd(fd)
    assert ch.fileno() == fd
    Channel(a).send("via a dup'd fd")
    assert ch.recv() == "via a dup'd fd"
    ch.close()
    ch.close()  # closing twice is harmless
    assert ch.sock.fileno() == -1


def test_fd_passing_shares_the_open_file(pair, tmp_path):
    """send_fds/recv_fds: the received descriptors are the same open files (a write through one
    is seen through the other), and the payload arrives with them."""
    a, b = pair
    r, w = os.pipe()
    p = tmp_path / "f"
    f = os.open(p, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        send_fds(a, b"two fds", [w, f])
        msg, fds = recv_fds(b)
        assert msg == b"two fds" and len(fds) == 2
        assert all(x not in (r, w, f) for x in fds)  # new numbers in this process...
        os.write(fds[0], b"through the passed fd")
        assert os.read(r, 100) == b"through the passed fd"  # ...for the same pipe
        assert os.fstat(fds[1]).st_ino == os.stat(p).st_ino
        for x in fds:
            os.close(x)
    finally:
        for x in (r, w, f):
            os.close(x)


def test_recv_fds_without_fds(pair):
    a, b = pair
    a.sendall(b"plain")
    assert recv_fds(b) == (b"plain", [])


def test_socket_inode_names_the_socket(pair):
    a, b = pair
    ino = socket_inode(a.fileno())
    assert ino == os.fstat(a.fileno()).st_ino
    assert ino != socket_inode(b.fileno())  # each end is its own socket inode


# --- polling before sleeping (SpinWait) ---------------------------------------------------------


@pytest.mark.parametrize("delay", [0.0, 0.0002, 0.02])  # within the poll, just after it, long after
def test_a_polling_read_gets_every_message_whether_it_comes_within_the_poll_or_after(pair, delay):
    a, b = pair
    tx, rx = Channel(a), Channel(b)

    def later():
        time.sleep(delay)
        tx.send_step(np.int64(7))
        tx.send((OK, "after"))

    t = _in_thread(later)
    assert rx.recv(0.001) == ("step", (np.int64(7),))
    assert rx.recv_reply(0.001) == (OK, "after")
    t.join()


def test_polling_survives_occasional_slow_waits_and_follows_a_lasting_change():
    """One slow step in ten does not turn polling off for the fast ones; waits that stay slow
    still do, within a dozen waits."""
    w = SpinWait(cap=250e-6)
    for _ in range(100):
        w.observe(60e-6)
    off = 0
    for i in range(1000):
        w.observe(2e-3 if i % 10 == 9 else 60e-6)  # an env whose every tenth step takes 2 ms
        off += w.budget == 0.0
    assert off == 0
    for i in range(12):
        w.observe(5e-3)  # the learner now trains between steps
    assert w.budget == 0.0


def test_polling_off_comes_back_once_a_probe_is_answered_while_it_polls():
    """Waits measured asleep include the wake-up, so with polling off they alone would keep it
    off even where replies are fast: a probe (one wait in PROBE_EVERY polls for up to the cap)
    answered while polling turns it back on; one not answered leaves it off."""
    from gym_fork.worker.channel import PROBE_EVERY

    def run(reply_s: float, asleep_s: float) -> list[float]:
        w = SpinWait(cap=250e-6, avg=1e-3)  # polling off, as after a burst of slow steps
        budgets = []
        for _ in range(3 * PROBE_EVERY):
            # a reply that comes within the poll is seen at once; one waited for asleep costs
            # the wake-up on top
            w.observe(reply_s if w.budget >= reply_s else reply_s + asleep_s)
            budgets.append(w.budget)
        return budgets

    fast = run(40e-6, 300e-6)  # replies in 40 µs, each wake-up 300 µs
    assert fast[:PROBE_EVERY - 2] == [0.0] * (PROBE_EVERY - 2)  # all asleep, all "slow"
    assert all(b > 0.0 for b in fast[PROBE_EVERY + 1:])  # the probe found them fast: polling again
    slow = run(2e-3, 300e-6)  # a slow env: probes time out, polling stays off between them
    assert sum(b > 0.0 for b in slow) == 3 and slow[-2] == 0.0  # one probe in PROBE_EVERY waits


def test_a_peer_closing_while_the_reader_polls_is_channel_closed(pair):
    a, b = pair
    rx = Channel(b)
    t = _in_thread(lambda: (time.sleep(0.001), a.close()))
    with pytest.raises(ChannelClosed):
        rx.recv_reply(0.05)
    t.join()


def test_spin_wait_polls_only_while_messages_come_fast_and_never_beyond_its_cap():
    w = SpinWait(cap=100e-6)
    assert w.budget == 0.0  # nothing seen yet: sleep
    for _ in range(50):
        w.observe(20e-6)
    assert w.budget == pytest.approx(40e-6, rel=0.01)
    for _ in range(50):
        w.observe(90e-6)  # under the cap, but twice it is not
    assert w.budget == pytest.approx(100e-6)
    w.observe(10.0)  # the learner trained for 10 s: one long wait stops the polling at once
    assert w.budget == 0.0
    for _ in range(50):
        w.observe(20e-6)
    assert w.budget > 0.0  # and short waits bring it back
    never = SpinWait(cap=0.0)
    never.observe(1e-6)
    assert never.budget == 0.0


def test_spin_cap_reads_microseconds_and_warns_on_nonsense(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setenv("GYM_FORK_SPIN_US", "0")
    assert spin_cap("GYM_FORK_SPIN_US", 100) == 0.0
    monkeypatch.setenv("GYM_FORK_SPIN_US", "250")
    assert spin_cap("GYM_FORK_SPIN_US", 100) == pytest.approx(250e-6)
    monkeypatch.setenv("GYM_FORK_SPIN_US", "fast")
    with pytest.warns(RuntimeWarning, match="GYM_FORK_SPIN_US='fast' is not a number"):
        assert spin_cap("GYM_FORK_SPIN_US", 100) == pytest.approx(100e-6)
    monkeypatch.delenv("GYM_FORK_SPIN_US")
    assert spin_cap("GYM_FORK_SPIN_US", 100) == pytest.approx(100e-6)


def test_spin_cap_is_zero_on_a_single_cpu(monkeypatch):
    monkeypatch.setenv("GYM_FORK_SPIN_US", "250")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert spin_cap("GYM_FORK_SPIN_US", 100) == 0.0


def test_a_handle_polls_for_the_reply_of_a_mujoco_sized_step_by_default(monkeypatch):
    """A HalfCheetah step plus the round trip takes 100-200 µs here; a reply that slow must still
    be polled for (waking the learner costs 20-50 µs more), while one from a learner-sized wait
    (a slow env, seconds) is slept for."""
    from gym_fork.backends.base import SPIN_US

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.delenv("GYM_FORK_SPIN_US", raising=False)
    spin = SpinWait(spin_cap("GYM_FORK_SPIN_US", SPIN_US))
    for _ in range(20):
        spin.observe(180e-6)
    assert spin.budget > 180e-6
    for _ in range(20):
        spin.observe(2e-3)
    assert spin.budget == 0.0


class _ClockGoingBack:
    """``time`` for a module under test whose perf_counter reads far ahead once, then far back:
    a process restored by CRIU on a machine booted later, in the middle of a wait."""

    def __init__(self, ahead: float):
        self.calls, self.ahead = 0, ahead

    def perf_counter(self) -> float:
        self.calls += 1
        return self.ahead if self.calls == 1 else 0.0

    def perf_counter_ns(self) -> int:
        return round(self.perf_counter())

    def __getattr__(self, name):
        return getattr(time, name)


def test_a_poll_whose_clock_goes_back_sleeps_instead_of_polling_on(monkeypatch):
    """A poll that started before the clock went back would otherwise poll (a CPU busy) until
    the next message, however long the learner leaves it idle."""
    from gym_fork.worker import channel as channel_mod

    a, b = socket.socketpair()
    clock = _ClockGoingBack(1e6)
    monkeypatch.setattr(channel_mod, "time", clock)
    later = threading.Timer(0.3, lambda: Channel(a).send(("step", (1,))))
    later.start()
    try:
        assert Channel(b).recv(spin=1e-3) == ("step", (1,))
        assert clock.calls <= 3, f"polled on after the clock went back ({clock.calls} clock reads)"
    finally:
        later.cancel()
        a.close()
        b.close()


def test_a_wait_that_reads_as_negative_does_not_turn_polling_off_for_good():
    """A wait measured across a clock that went back is negative; taken as it is, it drove the
    average below zero, and every later wait further down (no polling, no probes, ever)."""
    w = SpinWait(cap=100e-6, avg=30e-6)
    w.observe(-1e3)
    for _ in range(20):
        w.observe(30e-6)
    assert 0.0 < w.avg < 100e-6 and w.budget > 0.0

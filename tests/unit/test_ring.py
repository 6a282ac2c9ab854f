"""The shared-memory step ring (gym_fork.worker.ring): frames through it, wake-ups after a
sleep, the socket for big frames and other commands, fork children without the parent's ring,
and the fork-tier scan not refusing it."""

from __future__ import annotations

import contextlib
import os
import socket
import time

import numpy as np
import pytest

from gym_fork.worker import resources
from gym_fork.worker import ring as rings
from gym_fork.worker.channel import OK, Channel, reply_parts, step_parts

pytestmark = pytest.mark.skipif(not rings.supported(), reason="step rings need x86-64 Linux")


@pytest.fixture
def pair():
    """A controller ring + channel and a worker ring + channel over one socketpair, in-process."""
    a, b = socket.socketpair()
    ctl, fd = rings.Ring.create()
    wrk = rings.Ring.attach(fd)
    yield ctl, Channel(a), wrk, Channel(b)
    ctl.close()
    wrk.close()
    a.close()
    b.close()


def _step_result(obs):
    return (OK, (obs, np.float64(1.5), False, True, {"x": np.int64(3)}))


def test_step_frames_through_the_ring(pair):
    ctl, cc, wrk, wc = pair
    action = np.array([0.25, -1.0], np.float32)
    assert ctl.post(cc, step_parts(action))
    (cmd, args), in_ring = wrk.wait_request(wc)
    assert in_ring and cmd == "step"
    assert args[0].dtype == action.dtype and args[0].tobytes() == action.tobytes()
    obs = np.arange(12, dtype=np.float64).reshape(3, 4)
    assert wrk.reply(wc, reply_parts(_step_result(obs)))
    status, (o, r, te, tr, info) = ctl.wait_reply(cc)
    assert status == OK and o.tobytes() == obs.tobytes() and o.shape == (3, 4)
    assert type(r) is np.float64 and r == 1.5 and te is False and tr is True
    assert type(info["x"]) is np.int64 and info["x"] == 3
    # nothing went through the socket
    cc.sock.setblocking(False)
    wc.sock.setblocking(False)
    with pytest.raises(BlockingIOError):
        cc.sock.recv(1)
    with pytest.raises(BlockingIOError):
        wc.sock.recv(1)


def test_big_frames_and_other_commands_go_on_the_socket(pair):
    ctl, cc, wrk, wc = pair
    big = np.ones(rings.AREA // 8 + 16, np.float64)  # a little more than the area
    assert not ctl.post(cc, step_parts(big))
    ctl.announce()
    cc.send_step(big)
    (cmd, args), in_ring = wrk.wait_request(wc)
    assert not in_ring and cmd == "step" and np.array_equal(args[0], big)
    assert not wrk.reply(wc, reply_parts(_step_result(big)))
    wrk.announce_reply()
    wc.packed_in = True
    wc.reply(_step_result(big))
    assert np.array_equal(ctl.wait_reply(cc)[1][0], big)
    ctl.announce()
    cc.send(("ping", ()))
    assert wrk.wait_request(wc) == (("ping", ()), False)
    wrk.announce_reply()
    wc.send((OK, 7))
    assert ctl.wait_reply(cc) == (OK, 7)


@contextlib.contextmanager
def _forked_worker(busy_s: float = 0.0, sleep_s: float = 0.0, spin_ns: int | None = None):
    """A worker process on a ring that answers each step with its action + 1, after
    ``busy_s`` of CPU and ``sleep_s`` asleep; yields the controller's ring and channel
    (``spin_ns``: both sides' spin cap, None for the default), and stops the worker after."""
    a, b = socket.socketpair()
    ctl, fd = rings.Ring.create()
    os.set_inheritable(fd, True)
    pid = os.fork()
    if pid == 0:
        try:
            a.close()
            wrk = rings.Ring.attach(fd)
            if spin_ns is not None:
                wrk.spin_ns = spin_ns
            wc = Channel(b)
            while True:
                (cmd, args), in_ring = wrk.wait_request(wc)
                if cmd == "exit":
                    os._exit(0)
                end = time.perf_counter() + busy_s
                while time.perf_counter() < end:
                    pass
                time.sleep(sleep_s)
                wrk.reply(wc, reply_parts((OK, (np.int64(args[0] + 1), 0.0, False, False, {}))))
        finally:
            os._exit(1)
    os.close(fd)
    b.close()
    cc = Channel(a)
    if spin_ns is not None:
        ctl.spin_ns = spin_ns
    try:
        yield ctl, cc
        ctl.announce()
        cc.send(("exit", ()))
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        ctl.close()
        a.close()


def test_wake_up_after_a_sleep():
    """A worker that spun out and sleeps on its socket is woken by the next step; the reply
    wakes a controller asleep likewise (no spinning at all: every wait sleeps)."""
    with _forked_worker(sleep_s=0.002, spin_ns=0) as (ctl, cc):  # the controller goes to sleep meanwhile
        for i in range(20):
            time.sleep(0.002)  # the worker sleeps on its socket by now
            assert ctl.post(cc, step_parts(i))
            assert ctl.wait_reply(cc)[1][0] == i + 1


@pytest.mark.alone
def test_a_peer_slower_than_a_short_spin_is_still_spun_for():
    """A worker whose steps take ~120 µs (a MuJoCo step): the controller keeps spinning for its
    replies -- it learns when to spin, and spins up to the cap -- instead of sleeping through
    them (a fixed 100 µs spin, given up for 64 waits after 8 misses, spun for at most one wait in
    nine here, and slept through most of HalfCheetah's). A loaded machine can push some waits
    past the cap (300 µs): hence 70 %, not all."""
    with _forked_worker(busy_s=120e-6) as (ctl, cc):
        spinning, slow = 0, 0
        for i in range(200):
            t = time.perf_counter()
            assert ctl.post(cc, step_parts(i))
            assert ctl.wait_reply(cc)[1][0] == i + 1
            slow += time.perf_counter() - t > 450e-6  # past the cap even with a wake-up: held off its CPU
            spinning += ctl.pace.budget > 0.0
        if spinning < 140 and slow >= 30:  # a controller that slept instead: ~120 µs + a wake-up
            pytest.skip(f"inconclusive: {slow} of 200 replies took over 450 µs (the machine is busy)")
        assert spinning >= 140, f"spun for only {spinning} of 200 replies ({slow} took over 450 µs)"


def test_fork_child_drops_the_parents_ring(pair):
    ctl, cc, wrk, wc = pair
    name = wrk.mapping
    assert any(path == name for path, _w in resources._shared_maps_text("self"))
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        maps = [path for path, _w in resources._shared_maps_text("self")]
        ok = wrk.closed and ctl.closed and name not in maps and ctl.mapping not in maps
        os.write(w, b"1" if ok else repr(maps).encode())
        os._exit(0)
    os.close(w)
    got = os.read(r, 65536)
    os.close(r)
    os.waitpid(pid, 0)
    assert got == b"1", got
    # the parent's ring is untouched
    assert ctl.post(cc, step_parts(5))
    assert wrk.wait_request(wc) == (("step", (5,)), True)


def test_scan_exempts_the_ring_but_not_other_shared_memory(pair):
    assert not [x for x in resources._scan_maps("self", os.getpid()) if "gym_fork-ring" in x.what]
    import mmap

    m = mmap.mmap(-1, 4096)  # anonymous shared memory of the env's own is still found
    try:
        assert [x for x in resources._scan_maps("self", os.getpid()) if x.kind == "shared-memory"]
    finally:
        m.close()


def test_a_spin_cap_that_is_not_a_number_warns_and_keeps_the_default(monkeypatch):
    monkeypatch.setenv("GYM_FORK_RING_SPIN_US", "fast")
    with pytest.warns(RuntimeWarning, match="GYM_FORK_RING_SPIN_US='fast' is not a number"):
        assert rings._spin_ns() == rings.SPIN_US * 1000
    monkeypatch.setenv("GYM_FORK_RING_SPIN_US", "50")
    assert rings._spin_ns() == 50_000


def test_rings_are_wanted_by_default_with_a_cpu_to_spin_on(monkeypatch):
    """On by default; GYM_FORK_RING=0 turns rings off; a controller that may run on one CPU
    opens none (its peer could not answer while it spins) and one with two CPUs at most one."""
    monkeypatch.delenv("GYM_FORK_RING", raising=False)
    monkeypatch.setattr(rings, "_owned", 0)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert rings.wanted()
    monkeypatch.setenv("GYM_FORK_RING", "0")
    assert not rings.wanted()
    monkeypatch.setenv("GYM_FORK_RING", "1")
    assert rings.wanted()
    monkeypatch.setattr(rings, "_owned", 1)  # one ring open already: the second CPU is taken
    assert not rings.wanted()
    monkeypatch.setattr(rings, "_owned", 0)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert not rings.wanted()


def test_a_ring_setting_that_is_not_0_or_1_warns(monkeypatch):
    monkeypatch.setattr(rings, "_owned", 0)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setenv("GYM_FORK_RING", "maybe")
    with pytest.warns(RuntimeWarning, match="GYM_FORK_RING='maybe'"):
        assert rings.wanted()


def test_a_spin_whose_clock_goes_back_sleeps_instead_of_spinning_on(pair, monkeypatch):
    """A worker restored by CRIU on a machine booted later, mid-spin, reads a clock far behind
    the spin's start: it sleeps at once (and is woken by the next request) instead of spinning
    until that request comes, however long the learner leaves it idle."""
    import threading

    ctl, cc, wrk, wc = pair
    reads = []

    class ClockGoingBack:
        def perf_counter_ns(self) -> int:
            reads.append(1)
            return 10**15 if len(reads) == 1 else 0

        def __getattr__(self, name):
            return getattr(time, name)

    assert wrk.pace.budget > 0.0  # a fresh ring spins for its first wait
    monkeypatch.setattr(rings, "time", ClockGoingBack())
    later = threading.Timer(0.3, lambda: ctl.post(cc, step_parts(5)))
    later.start()
    try:
        (cmd, args), in_ring = wrk.wait_request(wc)
        assert (cmd, args, in_ring) == ("step", (5,), True)
        assert len(reads) <= 3, f"spun on after the clock went back ({len(reads)} clock reads)"
    finally:
        later.cancel()

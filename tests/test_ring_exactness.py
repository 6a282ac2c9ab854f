"""Steps through the shared-memory step ring (gym_fork.worker.ring) are bit-identical to steps
through the socket: in a fresh worker, after fork-tier and CRIU restores, in forked copies and
around CRIU dumps (which drop the ring; it is offered again after)."""

from __future__ import annotations

import os
import time

import gymnasium as gym
import numpy as np
import pytest
from conftest import assert_same_traj, process_alive, run_actions

import gym_fork
from gym_fork.backends.base import RemoteHandle
from gym_fork.worker import ring as rings
from gym_fork.worker import ring_slots
from gym_fork.worker.channel import Channel, SpinWait

pytestmark = pytest.mark.skipif(not rings.supported(), reason="step rings need x86-64 Linux")

ENVS = [("CartPole-v1", 30), ("LunarLander-v3", 60), ("HalfCheetah-v5", 40)]


@pytest.fixture
def ring_on(monkeypatch):
    """Call it to give every env stepped one request at a time a ring at its first step (and
    before: none, whatever the environment says)."""
    monkeypatch.setattr(rings, "wanted", lambda: False)

    def enable() -> None:
        monkeypatch.setattr(RemoteHandle, "RING_AFTER", 0)
        monkeypatch.setattr(rings, "wanted", lambda: True)
        monkeypatch.setattr(ring_slots, "claim", lambda: ring_slots.Slot(None))  # whatever else runs

    return enable


def _reference(env_id: str, k: int, actions: list) -> tuple[list, list]:
    """Trajectories through the socket only: the k-step prefix, then ``actions``."""
    env = gym_fork.ForkableEnv(env_id)
    try:
        env.reset(seed=7)
        prefix, _ = run_actions(env, actions[:k])
        after, _ = run_actions(env, actions[k:])
        assert env._handle.ring is None
        return prefix, after
    finally:
        env.close()


def _actions(env_id: str, n: int) -> list:
    space = gym_fork.ForkableEnv(env_id)
    try:
        space.action_space.seed(123)
        return [space.action_space.sample() for _ in range(n)]
    finally:
        space.close()


def _uses_ring(env) -> bool:
    return env._handle.ring is not None and not env._handle.ring.closed


@pytest.mark.parametrize("env_id,k", ENVS, ids=[e for e, _ in ENVS])
def test_ring_steps_restore_fork_exact(env_id, k, ring_on):
    actions = _actions(env_id, k + 80)
    ref_prefix, ref_after = _reference(env_id, k, actions)
    ring_on()
    env = gym_fork.ForkableEnv(env_id)
    try:
        env.reset(seed=7)
        prefix, _ = run_actions(env, actions[:k])
        assert _uses_ring(env)
        assert_same_traj(ref_prefix, prefix)
        snap = env.snapshot()  # fork tier: the worker keeps its ring, the frozen copy has none
        assert _uses_ring(env)
        after, _ = run_actions(env, actions[k:])
        assert_same_traj(ref_after, after)
        env.restore(snap)  # the restored copy gets a ring of its own
        again, _ = run_actions(env, actions[k:])
        assert _uses_ring(env)
        assert_same_traj(ref_after, again)
        copies = env.fork(snap, 2)
        try:
            for c in copies:
                branch, _ = run_actions(c, actions[k:])
                assert _uses_ring(c)
                assert_same_traj(ref_after, branch)
        finally:
            for c in copies:
                c.close()
    finally:
        env.close()


@pytest.mark.criu
def test_ring_around_criu_dumps_exact(ring_on):
    """A CRIU-dumped worker (fork_tier=False) drops its ring before the dump: the image holds
    none, restores from it get their own, and the dumped worker gets one again."""
    env_id, k = "LunarLander-v3", 60
    actions = _actions(env_id, k + 80)
    ref_prefix, ref_after = _reference(env_id, k, actions)
    ring_on()
    env = gym_fork.ForkableEnv(env_id, fork_tier=False)
    try:
        env.reset(seed=7)
        prefix, _ = run_actions(env, actions[:k])
        assert _uses_ring(env)
        assert_same_traj(ref_prefix, prefix)
        snap = env.snapshot()
        assert env._handle.ring is None  # dropped for the dump
        after, _ = run_actions(env, actions[k:])
        assert _uses_ring(env)  # offered again
        assert_same_traj(ref_after, after)
        for _ in range(2):
            env.restore(snap)
            again, _ = run_actions(env, actions[k:])
            assert _uses_ring(env)
            assert_same_traj(ref_after, again)
    finally:
        env.close()


def test_ring_survives_env_output(ring_on):
    """Steps whose env warns (output ahead of the reply) answer on the socket, in order."""
    ring_on()
    env = gym_fork.ForkableEnv("CartPole-v1")
    try:
        env.reset(seed=0)
        ended = False
        for _ in range(200):
            _obs, _r, term, trunc, _info = env.step(0)
            ended = ended or term or trunc
            if ended:
                break
        assert _uses_ring(env)
        with pytest.warns(UserWarning):
            out = env.step(0)  # stepping past the end: gymnasium warns in the worker
        assert isinstance(out[0], np.ndarray)
        obs, _ = env.reset(seed=1)
        assert env.step(1)[0].shape == obs.shape
    finally:
        env.close()


def test_output_while_a_snapshot_is_answered_keeps_the_ring_in_step(ring_on, capsys):
    """What the worker prints while it answers snapshot() (here an env's own audit hook, which
    sees gym_fork's scan before the fork) rides ahead of that answer, which the ring announces
    once: announced twice, the next steps waited on both sides forever."""
    import signal
    import sys

    class AuditedCartPole(gym.Wrapper):
        def __init__(self):
            super().__init__(gym.make("CartPole-v1"))
            sys.addaudithook(self.hook)

        @staticmethod
        def hook(event, args):
            if event == "os.listdir" and args and str(args[0]) == "/proc/self/task":
                print("env: the worker looked at its threads")

    def hung(_sig, _frame):
        env._handle.kill()  # a polite close would hang the same way
        raise TimeoutError("the steps after a snapshot hung")

    ring_on()
    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)
    env = gym_fork.ForkableEnv(AuditedCartPole, fork_tier=True)
    try:
        env.reset(seed=0)
        run_actions(env, [0, 1] * 5)
        assert _uses_ring(env)
        capsys.readouterr()
        snap = env.snapshot()
        assert "the worker looked at its threads" in capsys.readouterr().out
        after = run_actions(env, [0, 1, 1, 0, 0])
        assert _uses_ring(env)
        env.restore(snap)
        assert_same_traj(run_actions(env, [0, 1, 1, 0, 0]), after)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        env.close()


def test_a_restored_copy_polls_at_its_predecessors_ring_pace(monkeypatch):
    """Steps through a ring teach the ring's pace, not the socket's: a restored copy's handle
    polls for its first replies at that pace (they go on the socket until its own ring is
    offered) instead of sleeping through them, and its branch is the snapshot's."""
    monkeypatch.setattr(RemoteHandle, "RING_AFTER", 3)
    monkeypatch.setattr(rings, "wanted", lambda: True)
    monkeypatch.setattr(ring_slots, "claim", lambda: ring_slots.Slot(None))
    env = gym_fork.ForkableEnv("CartPole-v1", fork_tier=True)
    try:
        env.reset(seed=0)
        snap = env.snapshot()
        expected = [env.step(a)[0] for a in (0, 1, 1, 0, 1, 0)]
        old = env._handle
        assert old.ring is not None
        old.ring.pace = SpinWait(old.ring.pace.cap, 30e-6)  # as learned over 30 µs replies
        env.restore(snap)
        new = env._handle
        assert new is not old
        assert new._spin.avg == pytest.approx(30e-6) and new._spin.budget > 0.0
        polled = []
        step = new._step
        new._step = lambda action: (polled.append(action), step(action))[1]
        got = [env.step(a)[0] for a in (0, 1, 1, 0, 1, 0)]
        assert len(polled) == RemoteHandle.RING_AFTER  # the steps before its ring: polled
        assert _uses_ring(env)  # then a ring of its own
        for a, b in zip(expected, got):
            assert np.array_equal(a, b)
    finally:
        env.close()


def test_whether_a_ring_is_wanted_is_asked_twice_per_handle_not_at_every_step(monkeypatch):
    """rings.wanted() reads the CPU affinity (a system call): a handle asks at its first step and
    when its ring is due, not at each step before it (a search loop's short-lived copies make
    nothing but such steps). Its steps are the same either way."""
    asked = []

    def wanted() -> bool:
        asked.append(1)
        return True

    monkeypatch.setattr(RemoteHandle, "RING_AFTER", 20)
    monkeypatch.setattr(rings, "wanted", wanted)
    monkeypatch.setattr(ring_slots, "claim", lambda: ring_slots.Slot(None))
    env = gym_fork.ForkableEnv("CartPole-v1")
    try:
        env.reset(seed=0)
        for i in range(30):
            env.step(i % 2)
        assert len(asked) == 2 and _uses_ring(env) and env.step_path == "ring"
    finally:
        env.close()
    monkeypatch.setattr(rings, "wanted", lambda: (asked.append(1), False)[1])
    asked.clear()
    env = gym_fork.ForkableEnv("CartPole-v1")
    try:
        env.reset(seed=0)
        for i in range(30):
            env.step(i % 2)
        assert len(asked) == 1 and not _uses_ring(env) and env._handle._fast_steps
        assert env.step_path == "socket"
    finally:
        env.close()
    env = gym_fork.ForkableEnv("CartPole-v1", backend="pickle")
    try:
        assert env.step_path == "in-process"
    finally:
        env.close()


@pytest.mark.alone
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a ring spins only with a second CPU")
def test_a_worker_spins_for_requests_through_the_learners_work_between_steps(ring_on, monkeypatch):
    """A learner that works ~330 µs between steps (a policy, a replay buffer) is answered by a
    worker that waited for the request spinning, not asleep: the worker spins as long as the
    socket would poll (GYM_FORK_WORKER_SPIN_US, 500 µs), not just the controller's 300 µs, so
    the learner seldom has to wake it. (With the controller's cap it slept for nearly every
    step: ~330 µs waits are over that cap; 200 wake-ups in 200 steps.)"""
    wakes = []
    send_wake = Channel.send_wake
    monkeypatch.setattr(Channel, "send_wake", lambda self: (wakes.append(1), send_wake(self))[1])
    ring_on()
    env = gym_fork.ForkableEnv("CartPole-v1")
    try:
        env.reset(seed=0)
        steps, starts = 0, []

        def work_then_step() -> None:
            nonlocal steps
            until = time.perf_counter() + 330e-6
            while time.perf_counter() < until:
                pass
            t = time.perf_counter()
            if any(env.step(steps % 2)[2:4]):
                env.reset()
            starts.append((t, time.perf_counter()))
            steps += 1

        for _ in range(100):  # the worker learns the pace
            work_then_step()
        assert _uses_ring(env)
        seen = []
        for window in range(5):  # a window with another process on a CPU may sleep through; not all
            if window:
                time.sleep(0.3)  # (what else ran -- a test's leftovers exiting -- may be done by then)
            wakes.clear()
            starts.clear()
            for _ in range(200):
                work_then_step()
            # the worker's waits: from a reply to the next request (the learner's work, ~330 µs)
            wait = float(np.median([nxt[0] - prev[1] for prev, nxt in zip(starts, starts[1:])]))
            if wait > 450e-6:  # the learner itself was held off the CPU: too long for any spin
                pytest.skip(f"inconclusive on a machine this busy: the worker waited {wait * 1e6:.0f} µs a request")
            seen.append(len(wakes))
            if len(wakes) < 100:
                break
        assert min(seen) < 100, f"the learner had to wake the worker for {seen} of 200 steps"
    finally:
        env.close()


def test_a_ring_waits_for_a_slot_another_process_holds(monkeypatch, tmp_path):
    """Rings are counted across the machine's processes (gym_fork.worker.ring_slots): with
    another process (a second training script, one env process of SB3's SubprocVecEnv) already
    spinning on the only spare CPU, an env steps through its socket -- rings in every process
    made SubprocVecEnv(4) of ForkableEnvs 1.1-1.3x slower on 2 CPUs -- and gets a ring once
    that process is gone (killed: its slot is taken over). Its steps are the same throughout."""
    monkeypatch.setenv("GYM_FORK_RING_SLOTS_DIR", str(tmp_path / "slots"))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)  # one slot
    monkeypatch.setattr(RemoteHandle, "RING_AFTER", 3)
    monkeypatch.setattr(rings, "wanted", lambda: True)
    r, w = os.pipe()
    other = os.fork()
    if other == 0:  # the other process: an env of its own, stepping through a ring
        try:
            os.close(r)
            e = gym_fork.ForkableEnv("CartPole-v1")
            e.reset(seed=1)
            for _ in range(6):
                e.step(0)
            os.write(w, e.step_path.encode())
            time.sleep(60)
        finally:
            os._exit(0)
    os.close(w)
    try:
        assert os.read(r, 16) == b"ring"
        env = gym_fork.ForkableEnv("CartPole-v1")
        try:
            env.reset(seed=0)
            snap = env.snapshot()
            first = [env.step(i % 2)[0] for i in range(8)]
            assert env.step_path == "socket"
            os.kill(other, 9)
            os.waitpid(other, 0)
            other = 0
            env.restore(snap)  # a new worker: its handle asks for a ring again
            again = [env.step(i % 2)[0] for i in range(8)]
            assert env.step_path == "ring"
            assert all(np.array_equal(a, b) for a, b in zip(first, again))
        finally:
            env.close()
        assert os.listdir(tmp_path / "slots") == []  # closing the env freed its slot
    finally:
        os.close(r)
        if other:
            os.kill(other, 9)
            os.waitpid(other, 0)


def test_a_copy_replaced_while_it_spins_on_its_ring_exits_at_once(ring_on, monkeypatch):
    """A restore closes the replaced copy's channel and announces a message in its ring, so a
    copy spinning there for its next step reads the socket -- the EOF -- instead of spinning on
    (at full priority, beside the new copy's first step) until its cap runs out. The cap is 6 s
    here, so that a copy that spun on would still be running when the test looks."""
    monkeypatch.setenv("GYM_FORK_WORKER_SPIN_US", "6000000")
    ring_on()
    env = gym_fork.ForkableEnv("CartPole-v1", fork_tier=True)
    try:
        env.reset(seed=0)
        snap = env.snapshot()
        env.restore(snap)
        for i in range(20):
            env.step(i % 2)
        assert _uses_ring(env)
        copy = env.worker_pid
        env.restore(snap)
        deadline = time.monotonic() + 1.5
        while process_alive(copy) and time.monotonic() < deadline:
            time.sleep(0.001)
        assert time.monotonic() < deadline, "the replaced copy spun on instead of exiting"
    finally:
        env.close()


def test_a_slot_directory_that_cannot_hold_slots_warns_once_and_the_env_steps_through_its_socket(
        monkeypatch, tmp_path):
    """``GYM_FORK_RING_SLOTS_DIR`` naming a place where no slot can be made gives no ring -- and
    says so once, naming the directory and what to do -- instead of silently running slower."""

    monkeypatch.setattr(ring_slots, "_warned", set())
    monkeypatch.setenv("GYM_FORK_RING_SLOTS_DIR", str(tmp_path / "nonexistent" / "slots"))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(RemoteHandle, "RING_AFTER", 3)
    monkeypatch.setattr(rings, "wanted", lambda: True)
    ref = gym.make("CartPole-v1")
    ref.reset(seed=0)
    with pytest.warns(RuntimeWarning, match="nonexistent/slots cannot be used") as seen:
        env = gym_fork.ForkableEnv("CartPole-v1")
        try:
            env.reset(seed=0)
            for i in range(12):
                got, want = env.step(i % 2), ref.step(i % 2)
                assert np.array_equal(got[0], want[0]) and got[1:4] == want[1:4]
            assert env.step_path == "socket"
        finally:
            env.close()
    (warned,) = [w for w in seen if "ring slot directory" in str(w.message)]
    assert warned.filename == __file__  # it points at the step that opened the ring, not into gym_fork

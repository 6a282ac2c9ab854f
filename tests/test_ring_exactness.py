"""Steps through the shared-memory step ring (gym_fork.worker.ring) are bit-identical to steps
through the socket: in a fresh worker, after fork-tier and CRIU restores, in forked copies and
around CRIU dumps (which drop the ring; it is offered again after)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_same_traj, run_actions

import gym_fork
from gym_fork.backends.base import RemoteHandle
from gym_fork.worker import ring as rings

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

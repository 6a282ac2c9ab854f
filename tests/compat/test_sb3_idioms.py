"""The Stable-Baselines3 idioms keep the copy-on-write fast path, exactly.

``make_vec_env(id, vec_env_cls=ForkableVecEnv)`` wraps every env in SB3's ``Monitor``; its
workers must neither import torch nor lose the fork tier, and must step bit for bit as SB3's own
``DummyVecEnv`` does.  A worker that imports torch but starts no thread keeps the fork tier (and
its snapshots stay exact while torch computes); one that does start threads gets a WARNING that
says why snapshots are slower and what it costs.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.monitor import Monitor
from stable_baselines3.common.vec_env import DummyVecEnv

from gym_fork.vec_env import ForkableVecEnv

pytestmark = pytest.mark.criu


def same(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def episode_stats(infos: list) -> list:
    """Monitor's episode return and length per slot (its wall-clock ``t`` differs run to run)."""
    return [(i["episode"]["r"], i["episode"]["l"]) if "episode" in i else None for i in infos]


def actions(n: int, steps: int, *, same: bool = False) -> list:
    """Random actions, one per slot; ``same``: every slot gets the same action."""
    rng = np.random.default_rng(0)
    return [np.repeat(rng.integers(0, 2, 1), n) if same else rng.integers(0, 2, n) for _ in range(steps)]


def test_make_vec_env_keeps_workers_lean_and_steps_like_dummy_vec_env():
    venv = make_vec_env("CartPole-v1", n_envs=2, seed=5, vec_env_cls=ForkableVecEnv)
    ref = make_vec_env("CartPole-v1", n_envs=2, seed=5, vec_env_cls=DummyVecEnv)
    try:
        for env in venv.envs:
            assert env._meta["torch_loaded"] is False  # Monitor came without SB3's algorithms and torch
            assert env._handle.fork_tier is True
        assert venv.env_is_wrapped(Monitor) == [True, True]
        assert same(venv.reset(), ref.reset())
        ends = 0
        for a in actions(2, 60):
            o1, r1, d1, i1 = venv.step(a)
            o2, r2, d2, i2 = ref.step(a)
            # rewards: DummyVecEnv keeps float32, SubprocVecEnv (and ForkableVecEnv) float64
            assert same(o1, o2) and np.array_equal(r1, r2) and same(d1, d2)
            assert episode_stats(i1) == episode_stats(i2)
            ends += int(d1.sum())
        assert ends > 0  # Monitor's episode statistics were compared
    finally:
        venv.close()
        ref.close()


def test_make_vec_env_snapshot_restore_is_exact_with_monitor():
    venv = make_vec_env("CartPole-v1", n_envs=2, seed=1, vec_env_cls=ForkableVecEnv)
    try:
        venv.reset()
        for a in actions(2, 10):
            venv.step(a)
        snap = venv.snapshot(0)
        tail = actions(2, 40, same=True)
        first = [venv.step(a) for a in tail]
        venv.restore(0, snap)
        venv.restore(1, snap)
        again = [venv.step(a) for a in tail]
        for (o1, r1, d1, i1), (o2, r2, d2, i2) in zip(first, again):
            assert same(o1[0], o2[0]) and r1[0] == r2[0] and d1[0] == d2[0]
            assert episode_stats(i1)[0] == episode_stats(i2)[0]  # Monitor's counters are in the snapshot
            assert same(o2[0], o2[1])  # slot 1 continues from slot 0's snapshot identically
        assert any(d[0] for _, _, d, _ in first)
    finally:
        venv.close()


def test_start_method_is_accepted_as_subproc_vec_env_accepts_it():
    venv = make_vec_env("CartPole-v1", n_envs=2, vec_env_cls=ForkableVecEnv,
                        vec_env_kwargs=dict(start_method="spawn"))
    try:
        assert venv.reset().shape == (2, 4)
    finally:
        venv.close()
    with pytest.raises(ValueError, match="cannot find context"):
        ForkableVecEnv("CartPole-v1", n_envs=1, start_method="no-such-method")


def torch_env_factory():
    """A Monitor-wrapped env whose step computes with torch (single-threaded)."""

    def make():
        import gymnasium as gym
        import torch
        from stable_baselines3.common.monitor import Monitor

        class TorchNoise(gym.Wrapper):
            def __init__(self, env):
                super().__init__(env)
                self.gen = torch.Generator().manual_seed(0)
                self.w = torch.randn(4, 4, generator=self.gen, dtype=torch.float64)

            def step(self, action):
                obs, r, term, trunc, info = self.env.step(action)
                noise = torch.tanh(self.w @ torch.randn(4, generator=self.gen, dtype=torch.float64))
                return (obs + noise.numpy().astype(np.float32)), r, term, trunc, info

        return Monitor(TorchNoise(gym.make("CartPole-v1")))

    return make


def test_torch_imported_but_idle_keeps_the_fork_tier_and_stays_exact():
    venv = ForkableVecEnv([torch_env_factory()] * 2, seed=2)
    try:
        env = venv.envs[0]
        assert env._meta["torch_loaded"] is True and env._meta["threads"] == 1
        assert env._handle.fork_tier is True
        venv.reset()
        for a in actions(2, 5):
            venv.step(a)
        snap = venv.snapshot(0)
        tail = actions(2, 30, same=True)
        first = [venv.step(a)[0][0] for a in tail]
        venv.fork_into(snap, [0, 1])
        again = [venv.step(a)[0] for a in tail]
        for x, y in zip(first, again):
            assert same(x, y[0]) and same(x, y[1])
        assert len(os.listdir(f"/proc/{venv.envs[1].worker_pid}/task")) == 1  # torch computed, no pool started
    finally:
        venv.close()


def test_losing_the_fast_path_is_a_warning_that_says_why_and_what_it_costs(caplog):
    def make():
        import threading

        import gymnasium as gym

        stop = threading.Event()
        threading.Thread(target=stop.wait, daemon=True, name="env-helper").start()
        env = gym.make("CartPole-v1")
        env.unwrapped._stop = stop
        return env

    caplog.set_level(logging.WARNING, logger="gym_fork")
    venv = ForkableVecEnv([make], seed=0)
    try:
        assert venv.envs[0]._handle.fork_tier is False
        msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any("2 threads" in m and "CRIU dumps" in m and "milliseconds" in m for m in msgs), msgs
    finally:
        venv.close()

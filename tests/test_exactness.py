"""The exactness contract: restore() continues bit-identically, for every env and backend.

reset(seed) -> k random steps -> snapshot -> 100 fixed actions (crossing an episode end where
the env allows) -> restore -> the same 100 actions: obs, rewards, flags and info identical.
Then again from the restored copy, and from a snapshot *of* the restored copy.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
from conftest import assert_same_traj, run_actions, same

import gym_fork
from gym_fork.errors import UnsupportedEnvError


class CounterWalk(gym.Env):
    """A pure-Python env with plain Python state: a history list, a dict and np_random draws."""

    metadata = {"render_modes": []}

    def __init__(self, size: int = 7):
        self.size = size
        self.observation_space = gym.spaces.Box(-100.0, 100.0, (2,), np.float64)
        self.action_space = gym.spaces.Discrete(3)
        self.history: list[int] = []
        self.visits: dict[int, int] = {}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.pos = int(self.np_random.integers(-2, 3))
        self.history, self.visits = [self.pos], {self.pos: 1}
        return self._obs(), {"visits": dict(self.visits)}

    def _obs(self):
        return np.array([self.pos, len(self.history)], dtype=np.float64)

    def step(self, action):
        noise = int(self.np_random.integers(-1, 2))
        self.pos += int(action) - 1 + noise
        self.history.append(self.pos)
        self.visits[self.pos] = self.visits.get(self.pos, 0) + 1
        term = abs(self.pos) >= self.size
        trunc = len(self.history) > 30
        return self._obs(), float(-abs(self.pos)), term, trunc, {"visits": len(self.visits)}


def make_counter_walk():
    return CounterWalk()


# (env, gymnasium.make kwargs, k prefix steps chosen so the 100 steps cross an episode end, must_cross)
MATRIX = [
    ("CartPole-v1", {}, 20, True),
    ("Acrobot-v1", {}, 450, True),
    ("Pendulum-v1", {}, 150, True),
    ("MountainCarContinuous-v0", {}, 950, True),
    ("FrozenLake-v1", {"is_slippery": True}, 5, True),
    ("Taxi-v4", {}, 150, True),  # Taxi-v3 is deprecated in gymnasium 1.4
    ("Blackjack-v1", {}, 3, True),
    ("LunarLander-v3", {}, 60, True),
    ("BipedalWalker-v3", {}, 40, False),
    ("HalfCheetah-v5", {}, 950, True),
    ("ALE/Pong-v5", {"repeat_action_probability": 0.25}, 50, False),  # an episode is thousands of steps
    (make_counter_walk, {}, 10, True),
]
EZPICKLE = {"LunarLander-v3", "BipedalWalker-v3", "HalfCheetah-v5", "ALE/Pong-v5"}


def _ids(p):
    return p[0] if isinstance(p[0], str) else p[0].__name__


def check_exact(env_src, kwargs, k, must_cross, backend, **opts):
    env = gym_fork.ForkableEnv(env_src, backend=backend, env_kwargs=kwargs or None, **opts)
    try:
        env.action_space.seed(123)
        env.reset(seed=7)
        prefix = [env.action_space.sample() for _ in range(k)]
        _, ends_before = run_actions(env, prefix)
        snap = env.snapshot()
        assert snap.steps == env.steps
        actions = [env.action_space.sample() for _ in range(100)]
        original, ends = run_actions(env, actions)
        if must_cross:
            assert ends >= 1, "the fixed actions should cross an episode end"

        obs0, info0 = env.restore(snap)
        assert env.steps == snap.steps
        first, _ = run_actions(env, actions)
        assert_same_traj(original, first)

        obs1, info1 = env.restore(snap)  # the same snapshot, a second time
        assert same(obs0, obs1) and same(info0, info1)
        second, _ = run_actions(env, actions)
        assert_same_traj(original, second)

        env.restore(snap)  # a snapshot taken of a restored copy restores exactly too
        snap2 = env.snapshot()
        assert snap2.parent_id == snap.id
        run_actions(env, actions[:10])
        env.restore(snap2)
        third, _ = run_actions(env, actions)
        assert_same_traj(original, third)
    finally:
        env.close()


@pytest.mark.criu
@pytest.mark.parametrize("env_src,kwargs,k,must_cross", MATRIX, ids=[_ids(p) for p in MATRIX])
def test_criu_exact(env_src, kwargs, k, must_cross):
    """Every snapshot is a CRIU dump (fork_tier=False)."""
    check_exact(env_src, kwargs, k, must_cross, "criu", fork_tier=False)


@pytest.mark.criu
@pytest.mark.parametrize("env_src,kwargs,k,must_cross", MATRIX, ids=[_ids(p) for p in MATRIX])
def test_fork_tier_exact(env_src, kwargs, k, must_cross):
    """Copy-on-write fork() snapshots (fork_tier=True), the default for single-threaded workers."""
    check_exact(env_src, kwargs, k, must_cross, "criu", fork_tier=True)


PICKLABLE = [p for p in MATRIX if _ids(p) not in EZPICKLE]


@pytest.mark.parametrize("env_src,kwargs,k,must_cross", PICKLABLE, ids=[_ids(p) for p in PICKLABLE])
def test_pickle_exact(env_src, kwargs, k, must_cross):
    check_exact(env_src, kwargs, k, must_cross, "pickle")


@pytest.mark.parametrize("env_id", sorted(EZPICKLE))
def test_pickle_refuses_ezpickle_envs(env_id):
    if env_id.startswith("ALE/"):
        import ale_py

        gym.register_envs(ale_py)
    with pytest.raises(UnsupportedEnvError, match="EzPickle.*criu"):
        gym_fork.ForkableEnv(env_id, backend="pickle")

"""``copy.deepcopy(env)`` is an exact fork; ``pickle.dumps(env)`` refuses, naming what to do.

A deep copy of a ForkableEnv must continue exactly as the original does (not be a fresh env, not
share its worker), also when it is reached through Gymnasium wrappers or through ``env.unwrapped``;
a pickle must never silently become a fresh env.
"""

from __future__ import annotations

import copy
import pickle

import cloudpickle
import gymnasium as gym
import numpy as np
import pytest

import gym_fork

pytestmark = pytest.mark.criu


def same(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def run(env, actions) -> list:
    out = []
    for a in actions:
        obs, r, term, trunc, _ = env.step(a)
        out.append((obs, r, term, trunc))
        if term or trunc:
            out.append(env.reset()[0])
    return out


def same_runs(x: list, y: list) -> bool:
    return len(x) == len(y) and all(
        same(a, b) if not isinstance(a, tuple) else (same(a[0], b[0]) and a[1:] == b[1:]) for a, b in zip(x, y))


@pytest.mark.parametrize("backend,env_id", [("criu", "LunarLander-v3"), ("pickle", "CartPole-v1")])
def test_deepcopy_is_an_exact_fork(backend, env_id):
    env = gym_fork.make(env_id, backend=backend)
    try:
        env.reset(seed=0)
        env.action_space.seed(0)
        for _ in range(15):
            env.step(env.action_space.sample())
        twin = copy.deepcopy(env)
        try:
            assert isinstance(twin, gym_fork.ForkableEnv) and twin is not env
            assert twin.steps == env.steps == 15
            if backend == "criu":
                assert twin.worker_pid != env.worker_pid  # its own worker
            actions = [env.action_space.sample() for _ in range(120)]  # past an episode end
            assert same_runs(run(env, actions), run(twin, actions))
        finally:
            twin.close()
        env.step(env.action_space.sample())  # the original is unchanged and usable
    finally:
        env.close()


def test_deepcopy_through_wrappers_and_unwrapped():
    env = gym.wrappers.RecordEpisodeStatistics(gym_fork.make("CartPole-v1", backend="criu"))
    try:
        env.reset(seed=1)
        for a in (0, 1, 1):
            env.step(a)
        twin = copy.deepcopy(env)  # Gymnasium deep-copies the wrapper, whose env is a fork
        assert isinstance(twin.env, gym_fork.ForkableEnv) and twin.env.worker_pid != env.env.worker_pid
        assert same(twin.step(0)[0], env.step(0)[0])
        base = copy.deepcopy(env.unwrapped)  # the base env of a fork
        assert same(base.state, env.unwrapped.state)
        assert same(base.step(1)[0], env.step(1)[0])
        base.close()
        twin.close()
    finally:
        env.close()


@pytest.mark.parametrize("dumps", [pickle.dumps, cloudpickle.dumps])
def test_pickle_refuses_naming_snapshot_save(dumps):
    env = gym_fork.make("CartPole-v1", backend="criu")
    try:
        env.reset(seed=0)
        with pytest.raises(TypeError, match=r"snapshot\(\)\.save"):
            dumps(env)
        with pytest.raises(TypeError, match=r"snapshot\(\)\.save"):
            dumps(env.unwrapped)
        with pytest.raises(TypeError, match="deepcopy"):
            copy.copy(env)  # would share the worker
        env.step(0)  # still fine
    finally:
        env.close()

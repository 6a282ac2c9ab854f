"""Envs that draw their randomness from somewhere other than ``self.np_random``, as envs in the
wild do: Python's ``random`` module, NumPy's legacy global ``np.random.*``, generators of their
own, a generator inside a component object.  Each step adds one draw of noise to ``x``, so two
copies given the same actions have the same observations exactly when their streams agree."""

from __future__ import annotations

import random

import gymnasium as gym
import numpy as np


class _NoisyWalk(gym.Env):
    observation_space = gym.spaces.Box(-1e6, 1e6, (1,), np.float64)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.x = 0.0
        self._seed_noise(seed)
        return np.array([self.x]), {}

    def step(self, action):
        self.x += float(action) + self._noise()
        return np.array([self.x]), self.x, False, False, {}

    def _seed_noise(self, seed):
        raise NotImplementedError

    def _noise(self) -> float:
        raise NotImplementedError


class GlobalRandomEnv(_NoisyWalk):
    """``random.gauss``: the random module's hidden global generator."""

    def _seed_noise(self, seed):
        random.seed(seed)

    def _noise(self):
        return random.gauss(0.0, 1.0)


class LegacyNumpyEnv(_NoisyWalk):
    """``np.random.randn``: NumPy's legacy global RandomState."""

    def _seed_noise(self, seed):
        np.random.seed(seed)

    def _noise(self):
        return float(np.random.randn())


class _Wind:
    """A component holding the env's generator (the same object as the env's ``noise``)."""

    def __init__(self, rng: np.random.Generator):
        self.rng = rng

    def gust(self) -> float:
        return float(self.rng.normal())


class OwnGeneratorsEnv(_NoisyWalk):
    """Generators of its own, under its own names: a Generator shared with a component, a
    ``random.Random`` in a list, a legacy ``RandomState`` in a dict."""

    def _seed_noise(self, seed):
        self.noise = np.random.default_rng(seed)
        self.wind = _Wind(self.noise)
        self.dice = [random.Random(seed)]
        self.legacy = {"rs": np.random.RandomState(seed)}

    def _noise(self):
        return self.wind.gust() + self.dice[0].random() + float(self.legacy["rs"].rand())


class NoRandomnessEnv(_NoisyWalk):
    """Draws nothing: every reset starts at 0, every step adds the action."""

    def _seed_noise(self, seed):
        pass

    def _noise(self):
        return 0.0


class LateGeneratorEnv(_NoisyWalk):
    """Makes a generator of its own only at its first step (a lazily built component): a copy
    forked before that step has no such generator yet."""

    def _seed_noise(self, seed):
        self.late = None

    def _noise(self):
        if self.late is None:
            self.late = np.random.default_rng(12345)
        return float(self.late.random())


class HugeHistoryEnv(OwnGeneratorsEnv):
    """Holds more objects than the reseed walk visits (a long history of small records)."""

    def _seed_noise(self, seed):
        super()._seed_noise(seed)
        self.history = [[i] for i in range(60_000)]


def no_randomness():
    return NoRandomnessEnv()


def huge_history():
    return HugeHistoryEnv()


def late_generator():
    return LateGeneratorEnv()


def global_random():
    return GlobalRandomEnv()


def legacy_numpy():
    return LegacyNumpyEnv()


def own_generators():
    return OwnGeneratorsEnv()

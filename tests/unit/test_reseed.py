"""gym_fork.worker.reseed: which generators a reseeded copy gets new streams for, and where."""

from __future__ import annotations

import weakref

import gymnasium as gym
import numpy as np

import random_envs
from gym_fork.worker import reseed

_MODULE_RNG = np.random.default_rng(0)  # a generator at module level, beside the env's class


class ModuleNoiseEnv(random_envs.OwnGeneratorsEnv):
    def _noise(self):
        return float(_MODULE_RNG.normal())


def _stacked(env: gym.Env, layers: int) -> gym.Env:
    for _ in range(layers):
        env = gym.wrappers.ClipReward(env, -1e9, 1e9)
    return env


def test_an_envs_own_generators_are_found_once_each_with_where_they_hang():
    env = random_envs.OwnGeneratorsEnv()
    env.reset(seed=0)
    found = reseed.generators_of(env, process_wide=False)
    where = [w for w, _ in found]
    assert where == ["env._np_random", "env.noise", "env.dice[0]", "env.legacy['rs']"]
    assert env.wind.rng is env.noise  # the component's generator is the same object: listed once


def test_a_deep_wrapper_stack_does_not_hide_the_env():
    env = _stacked(random_envs.OwnGeneratorsEnv(), 2 * reseed.WALK_DEPTH)
    env.reset(seed=0)
    gens = {id(g) for _, g in reseed.generators_of(env, process_wide=False)}
    assert id(env.unwrapped.noise) in gens and id(env.unwrapped.dice[0]) in gens


def test_process_wide_adds_module_globals_and_the_global_generators():
    env = ModuleNoiseEnv()
    env.reset(seed=0)
    where = [w for w, _ in reseed.generators_of(env, process_wide=True)]
    assert f"{__name__}._MODULE_RNG" in where
    assert "random (the module's generator)" in where
    assert "numpy.random (the legacy global RandomState)" in where
    assert not any(w.startswith(f"{__name__}.") for w, _ in reseed.generators_of(env, process_wide=False))


def test_reseeding_is_in_place_reproducible_and_keeps_each_generators_kind():
    def draws(seed):
        env = random_envs.OwnGeneratorsEnv()
        env.reset(seed=0)
        bits = type(env.noise.bit_generator)
        noise, dice = env.noise, env.dice[0]
        reseed._own_process, was = False, reseed._own_process  # (as in a learner: no globals)
        try:
            reseed.reseed_env(env, seed)
        finally:
            reseed._own_process = was
        assert env.noise is noise and env.dice[0] is dice and type(env.noise.bit_generator) is bits
        return [env.step(0)[0][0] for _ in range(5)]

    assert draws(3) == draws(3)
    assert draws(3) != draws(4)


def test_a_torch_generator_the_env_keeps_is_reseeded():
    torch = __import__("torch")
    env = random_envs.OwnGeneratorsEnv()
    env.reset(seed=0)
    env.world_model_noise = torch.Generator().manual_seed(0)
    assert "env.world_model_noise" in [w for w, _ in reseed.generators_of(env, process_wide=False)]

    def draw(seed):
        env.world_model_noise.manual_seed(0)
        reseed.reseed_env(env, seed)
        return torch.rand(3, generator=env.world_model_noise).tolist()

    assert draw(1) == draw(1) != draw(2)


def test_objects_that_refuse_to_be_looked_into_are_passed_over():
    class Stubborn:
        @property
        def __dict__(self):
            raise RuntimeError("not telling")

    class Gone:
        pass

    env = random_envs.OwnGeneratorsEnv()
    env.reset(seed=0)
    gone = Gone()
    env.helpers = [Stubborn(), weakref.proxy(gone)]
    del gone  # a proxy whose object is gone raises ReferenceError on any attribute
    assert len(reseed.generators_of(env, process_wide=False)) == 4


def test_np_random_seed_no_longer_claims_the_reset_seed():
    env = gym.make("CartPole-v1")
    env.reset(seed=5)
    assert env.unwrapped.np_random_seed == 5
    reseed.reseed_env(env, 1)
    assert env.unwrapped.np_random_seed == -1  # as Gymnasium says of a generator set by hand


def test_the_walk_stops_at_its_limit(monkeypatch):
    """An env holding a huge structure is not walked whole: the walk visits WALK_LIMIT objects."""
    env = random_envs.OwnGeneratorsEnv()
    env.reset(seed=0)
    assert len(reseed.generators_of(env, process_wide=False)) == 4
    monkeypatch.setattr(reseed, "WALK_LIMIT", 3)  # the env, its _np_random, its noise
    assert [w for w, _ in reseed.generators_of(env, process_wide=False)] == ["env._np_random", "env.noise"]

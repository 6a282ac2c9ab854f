"""gym_fork.worker.reseed: which generators a reseeded copy gets new streams for, and where."""

from __future__ import annotations

import random
import weakref

import cloudpickle
import gymnasium as gym
import numpy as np
import pytest

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
    with pytest.warns(RuntimeWarning, match="stopped after 3 objects"):  # (said: before, silently)
        assert [w for w, _ in reseed.generators_of(env, process_wide=False)] == ["env._np_random", "env.noise"]


class _Holder:
    def __init__(self):
        self.rng = np.random.default_rng(1)

    def act(self, obs):
        return int(self.rng.integers(2))


def test_a_policys_generators_are_found_in_each_form_a_callable_keeps_them():
    import functools

    closed = np.random.default_rng(2)
    default = random.Random(3)
    forms = {
        "object": (_Holder(), "policy.rng"),
        "bound method": (_Holder().act, "policy.__self__.rng"),
        "closure": ((lambda obs: closed.integers(2)), "policy.<closure>.closed"),
        "default": ((lambda obs, r=default: r.random()), "policy.__defaults__[0]"),
        "partial": (functools.partial(lambda obs, g: g.integers(2), g=np.random.default_rng(4)),
                    "policy.keywords['g']"),
    }
    for name, (policy, where) in forms.items():
        got = reseed.reseed_policy(policy, 9, {}, own_generators=True)
        assert got == [where], name


def test_reseed_policy_leaves_what_was_reseeded_alone_and_is_reproducible():
    shared = np.random.default_rng(5)  # the env's and the policy's both: reseeded with the env
    env_done = {id(shared): shared}
    a, b = _Holder(), _Holder()
    a.shared = b.shared = shared
    before = shared.bit_generator.state
    assert reseed.reseed_policy(a, 7, dict(env_done), own_generators=True) == ["policy.rng"]
    assert reseed.reseed_policy(b, 7, dict(env_done), own_generators=True) == ["policy.rng"]
    assert shared.bit_generator.state == before
    assert a.rng.bit_generator.state == b.rng.bit_generator.state  # the same seed, the same stream
    c = _Holder()
    reseed.reseed_policy(c, 8, {}, own_generators=True)
    assert c.rng.bit_generator.state != a.rng.bit_generator.state
    # never the stream of one of the env's generators with the same seed (spawn keys differ)
    env = random_envs.OwnGeneratorsEnv()
    env.reset(seed=0)
    reseed.reseed_env(env, 7)
    assert all(g.bit_generator.state != a.rng.bit_generator.state
               for _, g in reseed.generators_of(env, process_wide=False) if isinstance(g, np.random.Generator))
    # not own_generators: the policy's are kept (one policy per branch keeps its author's seed)
    d = _Holder()
    kept = d.rng.bit_generator.state
    reseed.reseed_policy(d, 7, {}, own_generators=False)
    assert d.rng.bit_generator.state == kept


class _Slotted:
    __slots__ = ("rng", "name")

    def __init__(self):
        self.rng = np.random.default_rng(5)
        self.name = "component"


def test_a_generator_in_an_object_with_slots_is_found():
    """Before: the walk looked only into ``__dict__``, so a generator kept by a component with
    ``__slots__`` kept the snapshot's stream in every copy (branches identical, silently)."""
    env = random_envs.OwnGeneratorsEnv()
    env.reset(seed=0)
    env.comp = _Slotted()
    assert "env.comp.rng" in [w for w, _ in reseed.generators_of(env, process_wide=False)]


def test_a_generator_in_the_globals_of_a_class_shipped_by_value_is_found():
    """A class from the user's script reaches the worker by value (cloudpickle): its methods keep
    globals of their own, with their own copy of a module-level generator. Before, the walk looked
    in the module of that name in the worker (another object, or none), so that copy was missed."""

    def make_class():
        class ByValue(ModuleNoiseEnv):
            def step(self, action):
                return np.array([_MODULE_RNG.random()]), 0.0, False, False, {}

        return ByValue

    shipped = cloudpickle.loads(cloudpickle.dumps(make_class()))
    env = shipped()
    env.reset(seed=0)
    found = {w: g for w, g in reseed.generators_of(env, process_wide=True)}
    theirs = shipped.step.__globals__["_MODULE_RNG"]
    assert theirs is not _MODULE_RNG and any(g is theirs for g in found.values())

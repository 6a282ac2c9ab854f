"""What a user does through ``env.unwrapped``, ``get_wrapper_attr``/``set_wrapper_attr`` and
``env.call`` reaches the env in the worker -- or raises; it never changes a local copy.

Each behaviour is compared with the same operation on a plain ``gymnasium.make`` env in this
process, step for step, bit for bit.
"""

from __future__ import annotations

import copy
import pickle

import gymnasium as gym
import numpy as np
import pytest

import gym_fork
from gym_fork.proxy import RemoteObject

pytestmark = pytest.mark.criu
BACKENDS = ["criu", "pickle"]


def same(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.fixture(params=BACKENDS)
def cartpole(request):
    env = gym_fork.make("CartPole-v1", backend=request.param)
    ref = gym.make("CartPole-v1")
    env.reset(seed=3)
    ref.reset(seed=3)
    yield env, ref
    env.close()


def test_attribute_write_changes_the_physics(cartpole):
    env, ref = cartpole
    plain = gym.make("CartPole-v1")
    plain.reset(seed=3)
    env.unwrapped.force_mag = 30.0
    ref.unwrapped.force_mag = 30.0
    assert env.unwrapped.force_mag == 30.0 and env.get_wrapper_attr("force_mag") == 30.0
    for a in (1, 0, 1):
        obs, *_ = env.step(a)
        assert same(obs, ref.step(a)[0])
    assert not same(obs, [plain.step(a)[0] for a in (1, 0, 1)][-1])  # the write did matter


def test_array_reads_are_read_only_copies_and_item_writes_reach_the_worker(cartpole):
    env, ref = cartpole
    state = env.unwrapped.state
    assert same(state, ref.unwrapped.state)
    with pytest.raises(ValueError, match="read-only"):
        state += 1.0  # would change a copy only
    with pytest.raises(ValueError, match="read-only"):
        state.fill(0.0)
    state[2] = 0.15  # forwarded: the worker's pole angle changes
    ref.unwrapped.state[2] = 0.15
    assert same(state, ref.unwrapped.state) and same(env.unwrapped.state, ref.unwrapped.state)
    assert same(env.step(0)[0], ref.step(0)[0])
    derived = state * 2  # computations give plain arrays of the user's own
    assert type(derived) is np.ndarray and type(state[1:]) is np.ndarray and type(state.copy()) is np.ndarray
    assert type(pickle.loads(pickle.dumps(state))) is np.ndarray


def test_method_calls_and_objects_act_in_the_worker(cartpole):
    env, ref = cartpole
    rng = env.unwrapped.np_random
    assert isinstance(rng, RemoteObject)
    draws = [int(rng.integers(1000)) for _ in range(3)]
    assert draws == [int(ref.unwrapped.np_random.integers(1000)) for _ in range(3)]
    env.reset()  # unseeded: draws from the worker's (advanced) RNG, as the reference does
    ref.reset()
    assert same(env.unwrapped.state, ref.unwrapped.state)
    assert env.unwrapped.np_random.bit_generator.state == ref.unwrapped.np_random.bit_generator.state
    local = copy.deepcopy(rng)  # a local copy on request
    assert isinstance(local, np.random.Generator)


def test_mujoco_set_state_and_model_writes():
    env = gym_fork.make("HalfCheetah-v5", backend="criu")  # EzPickle: the pickle backend refuses it
    ref = gym.make("HalfCheetah-v5")
    try:
        env.reset(seed=0)
        ref.reset(seed=0)
        qpos, qvel = np.linspace(0.0, 0.5, 9), np.linspace(-1.0, 1.0, 9)
        assert env.unwrapped.set_state(qpos, qvel) is None
        ref.unwrapped.set_state(qpos, qvel)
        assert same(env.unwrapped.state_vector(), np.concatenate([qpos, qvel]))
        assert same(env.call("state_vector"), ref.unwrapped.state_vector())
        env.unwrapped.model.body_mass[1] = 20.0  # domain randomisation, in the worker's model
        ref.unwrapped.model.body_mass[1] = 20.0
        env.unwrapped.data.qvel[:] = 0.5
        ref.unwrapped.data.qvel[:] = 0.5
        action = np.full(6, 0.3, np.float32)
        for _ in range(3):
            assert same(env.step(action)[0], ref.step(action)[0])
        assert "MjData" in repr(env.unwrapped.data)
    finally:
        env.close()


def test_wrapper_attrs_reach_the_worker_stack(cartpole):
    env, _ = cartpole
    assert env.get_wrapper_attr("_max_episode_steps") == 500  # TimeLimit, inside the worker
    assert env.set_wrapper_attr("_max_episode_steps", 3) is True
    ends = [env.step(0)[3] for _ in range(3)]
    assert ends == [False, False, True]  # the worker's TimeLimit truncates at 3
    assert env.has_wrapper_attr("force_mag") and not env.has_wrapper_attr("no_such_attr")
    with pytest.raises(AttributeError):
        env.get_wrapper_attr("no_such_attr")
    assert env.set_wrapper_attr("no_such_attr", 1, force=False) is False
    assert env.set_wrapper_attr("brand_new", 7) is True and env.get_wrapper_attr("brand_new") == 7
    assert "brand_new" not in env.__dict__  # created in the worker, not on the local wrapper


def test_call_like_gymnasium_vector_call(cartpole):
    env, ref = cartpole
    assert env.call("force_mag") == 10.0
    assert env.call("get_wrapper_attr", "_max_episode_steps") == 500
    obs, *_ = env.call("step", 1)  # through the ForkableEnv: its step count is kept
    assert env.steps == 1 and same(obs, ref.step(1)[0])
    with pytest.raises(TypeError):
        env.call("force_mag", 2)  # not callable, with arguments


def test_what_cannot_be_forwarded_raises_and_the_env_goes_on(cartpole):
    env, ref = cartpole
    if env.backend == "pickle":
        pytest.skip("in-process: nothing is pickled")
    with pytest.raises(Exception, match="pickle|Pickl"):
        env.unwrapped.callback = lambda: None  # a lambda does not pickle
    assert not env.has_wrapper_attr("callback")
    assert same(env.step(1)[0], ref.step(1)[0])  # the channel is still in step


def test_containers_refuse_local_changes():
    def make():
        class Hist(gym.Env):
            observation_space = gym.spaces.Discrete(100)
            action_space = gym.spaces.Discrete(2)

            def reset(self, *, seed=None, options=None):
                super().reset(seed=seed)
                self.history, self.counts = [], {"steps": 0}
                return 0, {}

            def step(self, action):
                self.history.append(int(action))
                self.counts["steps"] += 1
                return len(self.history), 0.0, False, False, {}

        return Hist()

    env = gym_fork.ForkableEnv(make)
    try:
        env.reset()
        env.step(1)
        hist = env.unwrapped.history
        assert hist == [1] and isinstance(hist, list)
        with pytest.raises(TypeError, match="read-only copy"):
            hist.append(5)
        with pytest.raises(TypeError, match="read-only copy"):
            env.unwrapped.counts["steps"] = 9
        env.unwrapped.counts = {"steps": 9}  # assigning a new value is forwarded
        env.step(0)
        assert env.unwrapped.counts == {"steps": 10} and env.unwrapped.history == [1, 0]
        assert type(copy.copy(hist)) is list and pickle.loads(pickle.dumps(hist)) == [1]
    finally:
        env.close()

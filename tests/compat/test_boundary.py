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
from gym_fork.errors import NotSendableError
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
    """A value that does not pickle cannot reach the worker: a typed error (a TypeError too) that
    says so, on every Python (3.13 words pickle's error without "pickle"), and the channel stays
    in step -- also once the step ring is on, where the request used to be announced before it
    failed to pickle, and the next step hung."""
    env, ref = cartpole
    if env.backend == "pickle":
        pytest.skip("in-process: nothing is pickled")
    with pytest.raises(NotSendableError, match="does not pickle.*Nothing was sent"):
        env.unwrapped.callback = lambda: None  # a lambda does not pickle
    assert not env.has_wrapper_attr("callback")
    assert same(env.step(1)[0], ref.step(1)[0])  # the channel is still in step
    for i in range(80):  # past the steps after which the ring is offered
        if i % 20 == 19:
            env.reset(seed=i), ref.reset(seed=i)
        assert same(env.step(i % 2)[0], ref.step(i % 2)[0])
    with pytest.raises(TypeError, match="does not pickle"):
        env.unwrapped.callback = lambda: None
    for a in (0, 1, 1):
        assert same(env.step(a)[0], ref.step(a)[0])


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


# --- what the env prints, warns and logs in the worker reaches the user ---------------------------
def broken_env_factory(wrap=None):
    """An env that violates the Gymnasium API in four ways the passive checker warns about, and
    logs and prints as it goes (a closure: shipped by value)."""

    def make():
        import logging

        class Broken(gym.Env):
            observation_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
            action_space = gym.spaces.Discrete(2)

            def reset(self, seed=None, options=None):
                print("reset", seed)
                logging.getLogger("broken.env").warning("reset with seed=%s", seed)
                logging.getLogger("broken.env").info("not shown: below WARNING")
                return np.zeros(2, np.float64), {}  # wrong dtype

            def step(self, action):
                print("step", action)
                return np.zeros(3, np.float32), 1, 0, 0, {}  # wrong shape, int flags

        env = Broken()
        return gym.wrappers.PassiveEnvChecker(env) if wrap is None else wrap(env)

    return make


def _warnings_of(make) -> list[str]:
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        env = make()
        try:
            env.reset(seed=0)
            env.step(0)
        finally:
            env.close()
    return [(w.category, str(w.message)) for w in caught]


def test_worker_warnings_reach_the_user_as_gymnasium_shows_them():
    ref = _warnings_of(broken_env_factory())  # the env in this process
    pid = {}

    def make():
        env = gym_fork.ForkableEnv(broken_env_factory(), backend="criu")
        pid["w"] = env.worker_pid
        return env

    got = _warnings_of(make)
    assert len(ref) >= 4 and len(got) == len(ref)
    prefix = f"(worker Broken, pid {pid['w']}) "
    assert [(c, prefix + m) for c, m in ref] == got


def test_worker_logging_and_prints_reach_the_user(caplog, capsys):
    import logging

    caplog.set_level(logging.DEBUG)
    env = gym_fork.ForkableEnv(broken_env_factory(wrap=lambda e: e), backend="criu")
    try:
        env.reset(seed=7)
        env.step(1)
        out = capsys.readouterr().out
        assert f"(worker Broken, pid {env.worker_pid}) reset 7\n" in out
        assert f"(worker Broken, pid {env.worker_pid}) step 1\n" in out
        recs = [r for r in caplog.records if r.name == "gym_fork.worker.Broken"]
        assert [(r.levelno, r.getMessage(), r.worker_logger, r.process) for r in recs] == [
            (logging.WARNING, "reset with seed=7", "broken.env", env.worker_pid)]
    finally:
        env.close()


def test_forked_copies_print_once_with_their_own_pid(capsys):
    env = gym_fork.ForkableEnv(broken_env_factory(wrap=lambda e: e), backend="criu")
    try:
        env.reset(seed=0)
        snap = env.snapshot()
        env.step(0)
        env.restore(snap)
        env.step(1)
        out = capsys.readouterr().out.splitlines()
        steps = [line for line in out if line.endswith(("step 0", "step 1"))]
        assert len(steps) == 2 and steps[1] == f"(worker Broken, pid {env.worker_pid}) step 1"
        assert steps[0].split(") ")[0] != steps[1].split(") ")[0]  # another process
    finally:
        env.close()


class BrokenReg(gym.Env):
    """Registered by class (at module level: the worker imports this module by name, from the
    sys.path this process shipped to it)."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, seed=None, options=None):
        return np.zeros(2, np.float64), {}

    def step(self, action):
        return np.zeros(3, np.float32), 1, 0, 0, {}


def test_passive_checker_speaks_through_gym_fork_make_as_through_gymnasium_make():
    gym.register("BrokenCompat-v0", entry_point=BrokenReg)
    try:
        ref = _warnings_of(lambda: gym.make("BrokenCompat-v0"))
        envs = []
        got = _warnings_of(lambda: envs.append(gym_fork.make("BrokenCompat-v0", backend="criu")) or envs[0])
        assert len(ref) >= 4
        prefix = f"(worker BrokenCompat-v0, pid {envs[0].worker_pid}) "
        assert got == [(c, prefix + m) for c, m in ref]
    finally:
        del gym.registry["BrokenCompat-v0"]


@pytest.mark.parametrize("fork_tier", [True, False])
def test_spaces_set_through_unwrapped_go_back_with_a_restore(fork_tier):
    """The learner's mirror of the worker's spaces, metadata and render_mode follows restores and
    forks: a space set after a snapshot is gone again after restoring it, as in the worker."""
    env = gym_fork.ForkableEnv("CartPole-v1", fork_tier=fork_tier)
    try:
        env.reset(seed=0)
        original = env.observation_space
        snap = env.snapshot()
        narrow = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)
        env.unwrapped.observation_space = narrow
        env.unwrapped.metadata = {"render_modes": [], "render_fps": 1}
        assert env.observation_space == narrow
        after = env.snapshot()

        env.restore(snap)
        worker_side = env.unwrapped.__getattr__("observation_space")  # asked of the worker itself
        assert worker_side == original
        assert env.observation_space == original and env.unwrapped.observation_space == original
        assert env.metadata == env.unwrapped.__getattr__("metadata") != {"render_modes": [], "render_fps": 1}

        (kid,) = env.fork(after)
        try:
            assert kid.observation_space == narrow == kid.unwrapped.__getattr__("observation_space")
            assert kid.metadata == {"render_modes": [], "render_fps": 1}
        finally:
            kid.close()
        env.restore(after)
        assert env.observation_space == narrow == env.unwrapped.__getattr__("observation_space")
    finally:
        env.close()


def test_a_loaded_snapshot_restored_into_an_env_brings_the_workers_spaces(tmp_path):
    env = gym_fork.ForkableEnv("CartPole-v1", backend="criu")
    try:
        env.reset(seed=0)
        narrow = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)
        env.unwrapped.observation_space = narrow
        env.snapshot().save(str(tmp_path / "b"))
        env.unwrapped.observation_space = gym.spaces.Box(-2.0, 2.0, (4,), np.float32)
        env.restore(gym_fork.load_snapshot(str(tmp_path / "b")))
        assert env.observation_space == narrow == env.unwrapped.__getattr__("observation_space")
    finally:
        env.close()


def test_the_spaces_generators_are_the_learners_a_restore_does_not_rewind_them(cartpole):
    """docs/guide/boundary.md, "Spaces and their generators": random exploration from a restored
    state draws fresh actions; fork children share the parent's spaces (one stream)."""
    cartpole, _ref = cartpole
    cartpole.action_space.seed(5)
    snap = cartpole.snapshot()
    first = [int(cartpole.action_space.sample()) for _ in range(16)]
    cartpole.restore(snap)
    assert [int(cartpole.action_space.sample()) for _ in range(16)] != first
    cartpole.action_space.seed(5)  # seeding it again replays the same draws
    assert [int(cartpole.action_space.sample()) for _ in range(16)] == first
    kids = cartpole.fork(snap, 2)
    try:
        assert all(k.action_space is cartpole.action_space for k in kids)
    finally:
        for k in kids:
            k.close()


def test_a_step_whose_result_does_not_pickle_still_counts():
    """The env's step() ran in the worker, but its info held a lambda, which cannot come back: a
    NotSendableError saying the step ran -- and the step is counted, so ``env.steps``, the action
    log and every snapshot agree with the worker (the count stayed behind by one, while the
    env's TimeLimit had moved on). A reset likewise; and ``step_send``/``step_receive`` count
    like ``step()`` (they counted a step the env raised in)."""
    import agent_envs

    env = gym_fork.ForkableEnv(agent_envs.unsendable_info, backend="criu")
    try:
        env.reset(seed=0)
        env.step(0)
        env.set_wrapper_attr("bad", True)
        with pytest.raises(NotSendableError, match=r"step\(\) ran.*does not pickle"):
            env.step(1)
        env.set_wrapper_attr("bad", False)
        assert env.steps == 2 == env.get_wrapper_attr("_elapsed_steps")
        snap = env.snapshot()
        assert snap.steps == 2 and list(snap.actions)[-2:] == [0, 1]
        env.set_wrapper_attr("bad", True)
        env.step_send(0)  # the two halves (vector envs, explore()) count alike
        with pytest.raises(NotSendableError):
            env.step_receive()
        assert env.steps == 3 == env.get_wrapper_attr("_elapsed_steps")
        env.step_send(7)  # CartPole raises on an invalid action: no step taken, as step() counts
        with pytest.raises(AssertionError):
            env.step_receive()
        assert env.steps == 3 == env.get_wrapper_attr("_elapsed_steps")
        with pytest.raises(NotSendableError, match=r"reset\(\) ran"):
            env.reset(seed=1)
        env.set_wrapper_attr("bad", False)
        assert env.steps == 0 == env.get_wrapper_attr("_elapsed_steps")
    finally:
        env.close()


def test_recorded_actions_are_copies_of_the_callers_buffers(cartpole):
    """Before: a snapshot's ``actions`` held the caller's own action objects, so a policy that
    writes each action into one reused buffer (a preallocated array; a Dict action's arrays, rows
    of the vector env's batch) left every recorded action equal to the buffer's last content, and
    replaying a snapshot's ``actions`` reached another state, silently."""
    env_cp, _ = cartpole
    backend = env_cp.backend
    env = gym_fork.make("Pendulum-v1", backend=backend)
    try:
        env.reset(seed=0)
        s0 = env.snapshot()
        buf = np.zeros(1, np.float32)
        for t in range(3):
            buf[0] = t + 0.5
            env.step(buf)
        buf[0] = 1.25
        env.step_send(buf)
        env.step_receive()
        s1 = env.snapshot()
        assert [a.tolist() for a in s1.actions] == [[0.5], [1.5], [2.5], [1.25]]
        want = env.step(np.zeros(1, np.float32))[0]
        env.restore(s0)
        for a in s1.actions:
            env.step(a)
        assert same(env.step(np.zeros(1, np.float32))[0], want)
    finally:
        env.close()


def _dict_action_env():
    class DictAction(gym.Env):
        observation_space = gym.spaces.Box(-1e6, 1e6, (1,), np.float64)
        action_space = gym.spaces.Dict({"u": gym.spaces.Box(-10.0, 10.0, (1,), np.float64)})

        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            self.x = 0.0
            return np.array([self.x]), {}

        def step(self, action):
            self.x = self.x * 2 + float(action["u"][0])
            return np.array([self.x]), 0.0, False, False, {}

    return DictAction()


def test_a_vector_envs_recorded_dict_actions_are_copies():
    from gym_fork.vector import ForkableVectorEnv

    envs = ForkableVectorEnv([_dict_action_env] * 2)
    try:
        envs.reset(seed=0)
        acts = {"u": np.zeros((2, 1))}
        for t in range(3):
            acts["u"][:] = t + 1  # the policy's output written into one reused batch buffer
            envs.step(acts)
        assert [a["u"].tolist() for a in envs.snapshot(0).actions] == [[1.0], [2.0], [3.0]]
    finally:
        envs.close()


def _filling_env():
    class Filling(gym.Env):
        observation_space = gym.spaces.Box(-1e6, 1e6, (3,), np.float64)
        action_space = gym.spaces.Discrete(2)

        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            self.x = np.arange(3.0) + 7
            return self.x.copy(), {}

        def step(self, action):
            self.x += action
            return self.x.copy(), 0.0, False, False, {}

        def fill(self, out, *, scale=None):
            """Writes the state into ``out`` (and ``scale`` times it into ``scale``); returns ``out``."""
            out[:] = self.x
            if scale is not None:
                scale *= self.x
            return out

    return Filling()


@pytest.mark.parametrize("backend", BACKENDS)
def test_arrays_a_call_fills_in_place_are_filled_in_the_callers_arrays(backend):
    """Before: arguments went to the worker as copies, so a method that fills an array it is
    given (an out-parameter: ALE's ``getScreenGrayscale(buf)``, which Gymnasium's
    ``AtariPreprocessing`` calls on ``env.unwrapped.ale``) filled the worker's copy only, and the
    caller's buffer stayed as it was -- all-zero frames, silently. Now every writeable array
    argument comes back filled, and a result that is one of them is the caller's array."""
    env = gym_fork.ForkableEnv(_filling_env, backend=backend)
    ref = _filling_env()
    try:
        env.reset(seed=0)
        ref.reset(seed=0)
        env.step(1)
        ref.step(1)
        out, scale = np.zeros(3), np.full(3, 2.0)
        want_out, want_scale = np.zeros(3), np.full(3, 2.0)
        got = env.unwrapped.fill(out, scale=scale)
        assert ref.fill(want_out, scale=want_scale) is want_out
        assert got is out and same(out, want_out) and same(scale, want_scale)
        frozen = np.zeros(3)
        frozen.flags.writeable = False
        with pytest.raises(Exception):
            env.unwrapped.fill(frozen)  # (the worker's copy is writeable: its error, as in-process)
        out2 = np.zeros(3)
        assert env.call("fill", out2) is out2 and same(out2, want_out)
    finally:
        env.close()


def test_ale_fills_the_callers_screen_buffer():
    ale_py = pytest.importorskip("ale_py")
    gym.register_envs(ale_py)
    env, ref = gym_fork.make("ALE/Pong-v5"), gym.make("ALE/Pong-v5")
    try:
        env.reset(seed=0)
        ref.reset(seed=0)
        for a in (2, 3, 2):
            env.step(a)
            ref.step(a)
        buf, want = np.zeros((210, 160), np.uint8), np.zeros((210, 160), np.uint8)
        env.unwrapped.ale.getScreenGrayscale(buf)
        ref.unwrapped.ale.getScreenGrayscale(want)
        assert want.sum() > 0 and same(buf, want)
        rgb, want_rgb = np.zeros((210, 160, 3), np.uint8), np.zeros((210, 160, 3), np.uint8)
        env.unwrapped.ale.getScreenRGB(rgb)
        ref.unwrapped.ale.getScreenRGB(want_rgb)
        assert same(rgb, want_rgb)
    finally:
        env.close()
        ref.close()


def test_unwrapped_mirrors_the_base_envs_spaces_and_render_mode_not_the_outer_stacks():
    """Before: ``env.unwrapped`` showed the worker's *outer* stack's spaces and render_mode
    (a FrameStackObservation's (4, 4) space, RenderCollection's "rgb_array_list") as the base
    env's, and a space written through it replaced the outer one here (while the worker's outer
    stack kept its own): ``observation_space.contains(obs)`` then failed for every observation."""
    from gymnasium.wrappers import FrameStackObservation

    stack = [lambda e: FrameStackObservation(e, 4)]
    env = gym_fork.make("CartPole-v1", wrappers=stack, render_mode="rgb_array_list")
    ref = FrameStackObservation(gym.make("CartPole-v1", render_mode="rgb_array_list"), 4)
    try:
        for e in (env, ref):
            assert e.observation_space.shape == (4, 4) and e.unwrapped.observation_space.shape == (4,)
            assert (e.render_mode, e.unwrapped.render_mode) == ("rgb_array_list", "rgb_array")
        assert env.unwrapped.action_space == ref.unwrapped.action_space
        assert env.unwrapped.spec == ref.unwrapped.spec
        narrow = gym.spaces.Box(-5.0, 5.0, (4,), np.float32)
        env.unwrapped.observation_space = narrow
        ref.unwrapped.observation_space = narrow
        assert env.unwrapped.observation_space == ref.unwrapped.observation_space == narrow
        assert env.observation_space == ref.observation_space != narrow  # the outer stack's own
        obs, _ = env.reset(seed=0)
        assert env.observation_space.contains(obs)
        plain = gym_fork.make("CartPole-v1")  # no layer with a space of its own: the outer follows
        try:
            plain.unwrapped.observation_space = narrow
            assert plain.observation_space == narrow == plain.get_wrapper_attr("observation_space")
        finally:
            plain.close()
    finally:
        env.close()
        ref.close()


def test_make_takes_an_env_spec_as_gymnasium_make_does():
    """Before: ``gym_fork.make(gym.spec("CartPole-v1"))`` raised TypeError."""
    spec = gym.spec("CartPole-v1")
    env, ref = gym_fork.make(spec, max_episode_steps=5), gym.make(spec, max_episode_steps=5)
    try:
        assert env.spec == ref.spec and env.spec.max_episode_steps == 5
        assert same(env.reset(seed=1)[0], ref.reset(seed=1)[0])
        for _ in range(5):
            got, want = env.step(0), ref.step(0)
            assert same(got[0], want[0]) and got[1:4] == want[1:4]
        assert got[3]  # truncated at 5, as asked
    finally:
        env.close()
        ref.close()

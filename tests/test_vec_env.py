"""ForkableVecEnv: an SB3 VecEnv that matches DummyVecEnv/SubprocVecEnv bit for bit, plus
per-slot snapshot / restore / fork_into. Real CRIU workers, real SB3, no mocks."""

from __future__ import annotations

import doctest
import os
import signal
import threading
import time

import gymnasium as gym
import numpy as np
import pytest
from conftest import eventually, process_alive, same
from gymnasium.envs.classic_control.cartpole import CartPoleEnv
from gymnasium.wrappers import ClipAction, RecordEpisodeStatistics, TimeLimit
from stable_baselines3 import PPO
from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv

import gym_fork
import gym_fork.vec_env
from gym_fork.errors import ForeignSnapshotError, WorkerDiedError, WorkerError
from gym_fork.vec_env import ForkableVecEnv


def make_cartpole():
    return gym.make("CartPole-v1")


def make_lunar():
    # short episodes: truncations too, so PPO bootstraps from info["terminal_observation"]
    return gym.make("LunarLander-v3", max_episode_steps=60)


def walk_factory():
    """A factory for a tiny custom env with its own method and attribute (for env_method and
    get_attr). Defined in a closure so cloudpickle ships it by value: the worker then need not
    import this test module (and with it SB3 and torch)."""

    def make_walk():
        class Walk(gym.Env):
            metadata = {"render_modes": []}

            def __init__(self):
                self.observation_space = gym.spaces.Box(-100.0, 100.0, (1,), np.float64)
                self.action_space = gym.spaces.Discrete(2)
                self.offset = 0

            def reset(self, *, seed=None, options=None):
                super().reset(seed=seed)
                self.pos = float(self.np_random.integers(-3, 4))
                return np.array([self.pos]), {}

            def step(self, action):
                self.pos += 2 * int(action) - 1 + self.offset
                return np.array([self.pos]), 1.0, abs(self.pos) > 5, False, {}

            def bump(self, k: int) -> int:
                self.offset += k
                return self.offset

        return RecordEpisodeStatistics(TimeLimit(Walk(), 20))

    return make_walk


_alive = process_alive


def _pidns_members(pid: int) -> set[int]:
    """Every process in ``pid``'s PID namespace (frozen snapshots, clones, reapers included)."""
    try:
        ns = os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return set()
    out = set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if os.readlink(f"/proc/{d}/ns/pid") == ns:
                    out.add(int(d))
            except OSError:
                pass
    return out


def assert_same_step(a, b, what=""):
    (o1, r1, d1, i1), (o2, r2, d2, i2) = a, b
    assert same(o1, o2), f"obs differ {what}"
    assert np.array_equal(r1, r2), f"rewards differ {what}"  # DummyVecEnv keeps float32, SubprocVecEnv float64
    assert same(d1, d2), f"dones differ {what}"
    assert same(list(i1), list(i2)), f"infos differ {what}:\n{i1}\n{i2}"


@pytest.fixture(scope="module")
def venv4():
    v = ForkableVecEnv("CartPole-v1", n_envs=4, backend="criu")
    yield v
    v.close()


# --- 1. the VecEnv contract, against DummyVecEnv ------------------------------------------------
@pytest.mark.criu
def test_matches_dummy_vec_env(venv4):
    ref = DummyVecEnv([make_cartpole] * 4)
    try:
        venv4.seed(3)
        ref.seed(3)
        assert same(venv4.reset(), ref.reset())
        assert same(venv4.reset_infos, ref.reset_infos)
        rng = np.random.default_rng(0)
        ends = 0
        for t in range(300):
            a = rng.integers(0, 2, size=4)
            out, expected = venv4.step(a), ref.step(a)
            assert_same_step(out, expected, f"at step {t}")
            assert same(venv4.reset_infos, ref.reset_infos)
            ends += int(out[2].sum())
        assert ends >= 20, "the random actions should cross many episode ends"
        assert same(venv4.current_obs, ref._obs_from_buf())
        # reset options apply once, as in SB3 (CartPole reads "low"/"high")
        venv4.set_options({"low": -0.2, "high": 0.2})
        ref.set_options({"low": -0.2, "high": 0.2})
        venv4.seed(9)
        ref.seed(9)
        assert same(venv4.reset(), ref.reset())
        assert venv4._options == [{}] * 4 and venv4._seeds == [None] * 4
        assert same(venv4.reset(), ref.reset())  # unseeded: the envs' own RNGs, still in step
        assert [e.steps for e in venv4.envs] == [0] * 4
    finally:
        ref.close()


@pytest.mark.criu
def test_truncation_infos_match_dummy():
    venv = ForkableVecEnv("CartPole-v1", 2, backend="criu", env_kwargs={"max_episode_steps": 8}, seed=2)
    ref = DummyVecEnv([lambda: gym.make("CartPole-v1", max_episode_steps=8)] * 2)
    try:
        ref.seed(2)
        assert same(venv.reset(), ref.reset())
        truncated = 0
        for t in range(40):
            a = np.array([t % 2, 1])
            out = venv.step(a)
            assert_same_step(out, ref.step(a), f"at step {t}")
            truncated += sum(i["TimeLimit.truncated"] for i in out[3])
        assert truncated >= 4
    finally:
        venv.close()
        ref.close()


def shaped_factory():
    """A stack whose inner wrapper overrides a method of the base env (HER-style reward shaping)
    and whose outer wrapper has a repr of its own; classes made in a closure (shipped by value)."""

    class Base(CartPoleEnv):
        def compute_reward(self, achieved, desired, info):
            return "base env"

    class RewardShaping(gym.Wrapper):
        def compute_reward(self, achieved, desired, info):
            return "inner wrapper"

    class Outer(gym.Wrapper):
        def __repr__(self) -> str:
            return "Outer"  # (gymnasium's repr names every layer: <Outer<RewardShaping<...>>>)

    class Stats(RecordEpisodeStatistics):
        pass

    classes = {"RewardShaping": RewardShaping, "Outer": Outer, "Stats": Stats}
    return (lambda: Outer(Stats(RewardShaping(TimeLimit(Base(), 50))))), classes


@pytest.mark.criu
def test_env_method_and_env_is_wrapped_see_the_stack_as_sb3_does():
    """Before: ``env_method`` called the outermost wrapper's method or else the base env's -- never
    an inner wrapper's (DummyVecEnv and SubprocVecEnv call ``get_wrapper_attr(name)``: here the
    reward-shaping wrapper's), silently; ``env_is_wrapped`` read class names out of ``repr()``,
    which an outer wrapper with a repr of its own hides."""
    make, classes = shaped_factory()
    venv, ref = ForkableVecEnv(make, n_envs=2, backend="criu"), DummyVecEnv([make, make])
    try:
        for v in (venv, ref):
            v.reset()
        assert venv.env_method("compute_reward", 0, 0, {}) == ref.env_method("compute_reward", 0, 0, {}) \
            == ["inner wrapper"] * 2
        for cls in (*classes.values(), RecordEpisodeStatistics, TimeLimit, ClipAction, gym.Wrapper):
            assert venv.env_is_wrapped(cls) == ref.env_is_wrapped(cls), cls
        assert venv.env_is_wrapped(classes["RewardShaping"]) == [True, True]
        assert venv.env_is_wrapped(ClipAction, indices=[1]) == [False]
    finally:
        venv.close()
        ref.close()


@pytest.mark.criu
def test_attributes_methods_wrappers_render():
    venv = ForkableVecEnv(walk_factory(), n_envs=2, backend="criu", seed=0)
    try:
        venv.reset()
        assert venv.get_attr("offset") == [0, 0]
        assert venv.get_attr("_max_episode_steps") == [20, 20]  # found on an inner wrapper
        assert venv.has_attr("offset") and not venv.has_attr("no_such_thing")
        with pytest.raises(AttributeError):
            venv.get_attr("no_such_thing")
        assert venv.env_method("bump", 2, indices=[1]) == [2]  # a method of the base env
        assert venv.get_attr("offset") == [0, 2]
        venv.set_attr("note", "hi", indices=0)  # SB3: on the outermost wrapper
        assert venv.get_attr("note", indices=[0]) == ["hi"]
        assert not venv.has_attr("note")
        assert venv.env_is_wrapped(TimeLimit) == [True, True]
        assert venv.env_is_wrapped(RecordEpisodeStatistics) == [True, True]
        assert venv.env_is_wrapped(ClipAction) == [False, False]
        venv.step(np.array([1, 1]))
        assert venv.envs[0].steps == 1
    finally:
        venv.close()

    venv = ForkableVecEnv(lambda: gym.make("CartPole-v1", render_mode="rgb_array"), 2, backend="criu")
    try:
        venv.reset()
        images = venv.get_images()
        assert len(images) == 2 and images[0].shape == (400, 600, 3)
        assert venv.render().shape == (800, 600, 3)  # SB3 tiles them (2 rows x 1 column)
    finally:
        venv.close()


@pytest.mark.criu
def test_env_error_keeps_channels_in_step(venv4):
    venv4.seed(1)
    obs = venv4.reset()
    with pytest.raises(AssertionError) as ei:  # CartPole asserts its action is valid
        venv4.step(np.array([0, 7, 1, 0]))
    assert isinstance(ei.value, WorkerError)
    assert [e.steps for e in venv4.envs] == [1, 0, 1, 1]  # the other slots did step
    # ... and current_obs says where they are (before: the observations from before the step)
    where = [venv4.envs[i].unwrapped.state for i in range(4)]
    for i in (0, 2, 3):
        assert same(venv4.current_obs[i], np.asarray(where[i], dtype=np.float32))
    assert same(venv4.current_obs[1], obs[1])  # (the slot that raised did not step)
    venv4.seed(1)
    assert same(venv4.reset(), obs)  # every worker answers in turn again
    venv4.step(np.array([0, 1, 1, 0]))
    # reset() also cancels a step_async() that was never waited for
    venv4.step_async(np.array([0, 0, 0, 0]))
    with pytest.raises(RuntimeError, match="in flight"):
        venv4.snapshot(0)
    venv4.seed(1)
    assert same(venv4.reset(), obs)


@pytest.mark.criu
def test_dead_worker_is_reported_and_slot_restorable():
    venv = ForkableVecEnv("CartPole-v1", 2, backend="criu", seed=0)
    try:
        venv.reset()
        snap, at_snap = venv.snapshot(0), venv.current_obs[0]
        os.kill(venv.worker_pids[1], signal.SIGKILL)
        with pytest.raises(WorkerDiedError, match="SIGKILL|died"):
            venv.step(np.array([0, 0]))
        assert venv.envs[0].steps == 1  # slot 0 stepped and its reply was read
        assert same(venv.restore(1, snap), at_snap)  # a snapshot revives the dead slot
        o, *_ = venv.step(np.array([1, 1]))
        assert o.shape == (2, 4) and venv.envs[1].steps == 1
    finally:
        venv.close()


def _sleeps() -> int:
    """How often this thread has blocked so far (and had to be woken)."""
    with open("/proc/thread-self/status") as f:
        return next(int(x.split()[1]) for x in f if x.startswith("voluntary_ctxt_switches:"))


@pytest.mark.alone
@pytest.mark.criu
def test_step_wait_polls_for_fast_replies_instead_of_sleeping_on_each(monkeypatch):
    """Read in turn, the replies of 4 workers on 2 CPUs put the learner to sleep about twice a
    batch (each a wake-up costing 10-20 µs here). Each handle polls for a step's reply while its
    replies come fast, as a single env's steps do; a cap of 0.1 s makes every reply fast here,
    whatever else runs on the machine (the default is 250 µs). Identical steps either way."""
    monkeypatch.setenv("GYM_FORK_SPIN_US", "100000")
    venv = ForkableVecEnv("CartPole-v1", n_envs=4, backend="criu", seed=0)
    ref = DummyVecEnv([make_cartpole] * 4)
    try:
        ref.seed(0)
        assert same(venv.reset(), ref.reset())
        rng = np.random.default_rng(2)
        for phase in ("learn the pace", "count"):
            n0 = _sleeps()
            for t in range(200):
                a = rng.integers(0, 2, size=4)
                assert_same_step(venv.step(a), ref.step(a), f"at step {t}")
        woken = _sleeps() - n0
        assert woken <= 100, f"the learner slept {woken} times in 200 batches"
        assert all(e._handle._spin.budget > 0 for e in venv.envs)
    finally:
        ref.close()
        venv.close()


def _worker_sleeps(pid: int) -> int:
    """How often the worker ``pid`` has blocked so far (and had to be woken)."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(x.split()[1]) for x in f if x.startswith("voluntary_ctxt_switches:"))


#: fewest sleeps per step (:func:`_sleeps_per_step`) of a worker that does not poll. A polling
#: one (a 0.1 s cap) measures 0.05-0.07 here. One that sleeps measures ~1 but down to 0.45 on a
#: loaded machine: since an episode's end costs no reset request of its own, a vector env's next
#: step is sometimes in the socket before its worker looks (its CPU per step stays ~50 us against
#: ~200 us of wall time, as before: it does not poll; 0.7 failed a CI run at 0.45).
SLEEPS = 0.3


def _sleeps_per_step(step, pids: list[int], n: int = 100, chunks: int = 4) -> list[float]:
    """How often each worker in ``pids`` slept per call of ``step()``: the fewest over ``chunks``
    runs of ``n`` calls. (A worker that polls may sleep for each request for a few hundred steps
    on a loaded machine, until its pace is learned again; one that does not poll sleeps for
    each request in every run.)"""
    for _ in range(50):
        step()
    fewest = [float("inf")] * len(pids)
    for _ in range(chunks):
        before = [_worker_sleeps(p) for p in pids]
        for _ in range(n):
            step()
        fewest = [min(f, (_worker_sleeps(p) - b) / n) for f, p, b in zip(fewest, pids, before)]
    return fewest


def _stepper(env):
    """One step of ``env`` (CartPole) a call, balancing the pole (long episodes: few resets, a
    request of another kind), and a reset at an episode's end."""
    last = [np.zeros(4)]

    def step():
        obs, _r, term, trunc, _i = env.step(int(last[0][2] > 0))
        last[0] = env.reset()[0] if term or trunc else obs
    return step


@pytest.mark.alone
@pytest.mark.criu
@pytest.mark.parametrize("fork_tier", [True, False], ids=["fork-tier", "criu"])
def test_workers_that_outnumber_the_cpus_sleep_between_requests_through_restores_and_forks(monkeypatch, fork_tier):
    """A vector env's workers that, with the learner, outnumber the CPUs do not poll for their
    next request (a polling worker holds a CPU another one waits for: CartPole, 4 slots on 2
    CPUs, ~1.2x SubprocVecEnv's time per batch, ~0.95x without). Measured as the workers' own
    sleeps: a polling worker (a cap of 0.1 s here: it seldom sleeps between fast requests)
    against one that sleeps for each. A slot restored from a snapshot a polling env took does
    not poll either; an env that is no vector env's slot, restored from a vector env's
    snapshot, polls again; a fork() copy polls as the snapshot's worker did. Before: every
    worker polled, wherever it ran."""
    from gym_fork.backends.base import RemoteHandle

    monkeypatch.setenv("GYM_FORK_WORKER_SPIN_US", "100000")  # (read by the workers started below)
    monkeypatch.setattr(RemoteHandle, "RING_AFTER", 10**9)  # (steps on the socket, where polling is)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})  # two CPUs, wherever this runs
    single = gym_fork.ForkableEnv("CartPole-v1", fork_tier=fork_tier)
    venv = None
    try:
        single.reset(seed=0)
        polls = single.snapshot()
        assert max(_sleeps_per_step(_stepper(single),
                                    [single.worker_pid])) < 0.5
        slots = single.fork(polls, 2)
        venv = ForkableVecEnv.from_envs(slots)  # 2 workers and the learner on 2 CPUs
        venv.reset()
        acts = np.zeros(2, dtype=int)
        assert min(_sleeps_per_step(lambda: venv.step(acts), venv.worker_pids)) > SLEEPS
        sleeps = venv.snapshot(0)
        venv.restore(1, polls)  # (a polling env's snapshot: its worker is told)
        venv.fork_into(sleeps, [0])
        assert min(_sleeps_per_step(lambda: venv.step(acts), venv.worker_pids)) > SLEEPS
        copy = single.fork(sleeps, 1)[0]  # a copy goes on as the snapshot's worker did ...
        try:
            assert min(_sleeps_per_step(_stepper(copy),
                                        [copy.worker_pid])) > SLEEPS
        finally:
            copy.close()
        single.restore(sleeps)  # ... and an env that is no vector env's slot polls again
        assert max(_sleeps_per_step(_stepper(single),
                                    [single.worker_pid])) < 0.5
    finally:
        if venv is not None:
            venv.close()
        single.close()


@pytest.mark.criu
def test_a_restore_whose_new_worker_cannot_be_told_its_polling_leaves_the_slot_as_it_was(monkeypatch):
    """A slot that does not poll, restored from a polling env's snapshot, tells the new worker
    before it switches to it. Where that fails (the new worker died), restore() raises, the new
    worker is stopped and the slot steps on from where it was, on its old worker."""
    from gym_fork.backends.base import RemoteHandle

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    single = gym_fork.ForkableEnv("CartPole-v1")
    venv = None
    try:
        single.reset(seed=0)
        polls = single.snapshot()
        venv = ForkableVecEnv.from_envs(single.fork(polls, 2))
        venv.reset()
        venv.step(np.array([0, 1]))
        before = venv.worker_pids[1]
        told = []

        def dies(self, on, *, tell_only=False):
            told.append(self.pid)
            raise WorkerDiedError(f"the env worker (pid {self.pid}) died")

        monkeypatch.setattr(RemoteHandle, "set_worker_polling", dies)
        ref = venv.envs[1].snapshot()
        with pytest.raises(WorkerDiedError):
            venv.restore(1, polls)
        assert told and told[0] != before and venv.worker_pids[1] == before
        assert eventually(lambda: not process_alive(told[0]), timeout=5)
        after = venv.envs[1].step(1)[0]
        monkeypatch.undo()
        venv.envs[1].restore(ref)  # the slot was where ref was: the same step from there
        assert same(venv.envs[1].step(1)[0], after)
    finally:
        if venv is not None:
            venv.close()
        single.close()


@pytest.mark.criu
def test_workers_are_told_their_polling_all_at_once_and_a_dead_one_is_reported_after_the_others(monkeypatch):
    """Vector envs and explore() tell their workers to stop polling together: every request is
    sent before any answer is read (one after another, 16 explore() copies waited 2.5-3 ms). A
    worker that died meanwhile is reported once the others have answered; they are told and
    step on in step: each next reply is its own step's."""
    from gym_fork.backends.base import RemoteHandle
    from gym_fork.env import set_workers_polling

    env = gym_fork.ForkableEnv("CartPole-v1")
    kids: list = []
    try:
        env.reset(seed=0)
        snap = env.snapshot()
        kids = env.fork(snap, 3, rng="same")
        order = []
        for name in ("send", "receive"):
            def spy(self, *args, _f=getattr(RemoteHandle, name), _name=name):
                order.append(_name)
                return _f(self, *args)
            monkeypatch.setattr(RemoteHandle, name, spy)
        set_workers_polling(kids[:2], False)
        assert order == ["send", "send", "receive", "receive"]
        assert [k._handle.worker_polls for k in kids] == [False, False, True]
        monkeypatch.undo()
        set_workers_polling(kids, True)  # (back on: told the same way)
        os.kill(kids[1].worker_pid, signal.SIGKILL)
        assert eventually(lambda: not process_alive(kids[1].worker_pid), timeout=5)
        with pytest.raises(WorkerDiedError):
            set_workers_polling(kids, False)
        assert kids[0]._handle.worker_polls is False and kids[2]._handle.worker_polls is False
        ref = env.step(1)[0]  # the env is where the snapshot is: the copies' steps are the same
        assert same(kids[0].step(1)[0], ref) and same(kids[2].step(1)[0], ref)
    finally:
        for k in kids:
            k.close()
        env.close()


_DOOMED_SEED = 1000


def reset_fails_once_factory(unsendable: bool = False, fail_at: int = 2):
    """A factory for an env whose episodes end after 3 steps and which, reset with the seed
    ``_DOOMED_SEED``, fails its reset number ``fail_at`` (once): it raises, or (``unsendable``)
    returns an info that does not pickle. In a closure: shipped by value (see walk_factory)."""

    def make():
        class ResetFailsOnce(gym.Env):
            def __init__(self):
                self.observation_space = gym.spaces.Box(-1e6, 1e6, (1,), np.float64)
                self.action_space = gym.spaces.Discrete(2)
                self.t, self.resets, self.doomed = 0, 0, False

            def reset(self, *, seed=None, options=None):
                super().reset(seed=seed)
                if seed is not None:
                    self.doomed = seed == _DOOMED_SEED
                self.resets += 1
                if self.doomed and self.resets == fail_at and not unsendable:
                    raise RuntimeError("this reset fails once")
                self.t = 0
                if self.doomed and self.resets == fail_at:
                    return np.array([0.0]), {"lock": threading.Lock()}
                return np.array([0.0]), {}

            def step(self, action):
                self.t += 1
                return np.array([10.0 * self.t + int(action)]), 1.0, self.t == 3, False, {}

        return ResetFailsOnce()

    return make


@pytest.mark.criu
@pytest.mark.parametrize("api,backend", [("sb3", "criu"), ("gymnasium", "criu"), ("sb3", "pickle")])
def test_a_reset_that_fails_right_after_the_step_that_ended_the_episode_leaves_that_step_counted(api, backend):
    """A vector env's worker resets right after a step that ends the episode, in the same request.
    Where that reset raises, the step was taken all the same: the env's error is raised (its own
    type, saying it was the reset after the step), and every sub-env's step count and action log
    are its worker's -- the failed one's with that step, the others' with the reset they made.
    Before, the whole reply was an error, the step was not counted and (Gymnasium) the other
    sub-envs' resets were not accounted for. After reset() all step on as before. The same for
    envs in this process (the pickle backend), whose server is this process's own."""
    from gymnasium.vector import AutoresetMode

    from gym_fork.vector import ForkableVectorEnv

    make = reset_fails_once_factory()
    if api == "sb3":
        venv = ForkableVecEnv(make, n_envs=3, backend=backend, seed=_DOOMED_SEED)
        venv.reset()
        step = venv.step
    else:
        venv = ForkableVectorEnv([make] * 3, backend=backend, autoreset_mode=AutoresetMode.SAME_STEP)
        venv.reset(seed=_DOOMED_SEED)
        step = venv.step
    counts = lambda: ([e.steps for e in venv.envs], [e._worker_steps() for e in venv.envs])  # noqa: E731
    try:
        for t in range(2):
            step(np.array([1, 0, 1]))
        with pytest.raises(RuntimeError, match="this reset fails once.*in the reset right after a step") as raised:
            step(np.array([0, 1, 1]))
        assert isinstance(raised.value, WorkerError) and raised.value.remote_type == "RuntimeError"
        mine, workers = counts()
        assert mine == workers == [3, 0, 0]
        assert [int(a) for a in venv.envs[0]._actions] == [1, 1, 0]  # (that step is in its log)
        assert [int(a) for a in venv.envs[1]._actions] == []  # (a new episode's: empty)
        venv.reset()
        for t in range(3):
            out = step(np.array([1, 1, 1]))
        assert list(out[2]) == [True] * 3  # (SB3's dones; Gymnasium's terminations)
        mine, workers = counts()
        assert mine == workers == [0, 0, 0]
    finally:
        venv.close()


@pytest.mark.criu
@pytest.mark.parametrize("api,older", [("sb3", False), ("sb3", True), ("gymnasium", False)])
def test_a_reset_whose_answer_cannot_come_back_is_accounted_for(api, older):
    """A sub-env's reset whose info does not pickle ran all the same: the vector env raises
    NotSendableError and accounts for that reset (and the step before it), as ForkableEnv.reset
    does. The reset made right after the step that ended the episode, in the same request (one
    reply for both), is settled by asking the worker its count (``steps``: ``last`` would send
    that info again); ``older``: a worker answered as an older gym_fork's, reset by a request of
    its own. Before, the slot kept counting the ended episode's steps."""
    from gymnasium.vector import AutoresetMode

    from gym_fork.errors import NotSendableError
    from gym_fork.vector import ForkableVectorEnv

    make = reset_fails_once_factory(unsendable=True)
    if api == "sb3":
        venv = ForkableVecEnv(make, n_envs=3, backend="criu", seed=_DOOMED_SEED)
        venv.reset()
    else:
        venv = ForkableVectorEnv([make] * 3, backend="criu", autoreset_mode=AutoresetMode.SAME_STEP)
        venv.reset(seed=_DOOMED_SEED)
    counts = lambda: ([e.steps for e in venv.envs], [e._worker_steps() for e in venv.envs])  # noqa: E731
    try:
        if older:
            old = venv.envs[0]._handle
            assert old.request("hello", 2, True)[0] == old.pid and not old.autoreset_steps
        for t in range(2):
            venv.step(np.array([1, 0, 1]))
        with pytest.raises(NotSendableError, match="does not pickle"):
            venv.step(np.array([0, 1, 1]))
        mine, workers = counts()
        assert mine == workers == [0, 0, 0]
        venv.reset()
        for t in range(3):
            out = venv.step(np.array([1, 1, 1]))
        assert list(out[2]) == [True] * 3
        mine, workers = counts()
        assert mine == workers == [0, 0, 0]
    finally:
        venv.close()


@pytest.mark.criu
def test_a_branch_whose_reset_after_its_episodes_end_fails_says_so_and_the_env_is_untouched():
    """explore() past episode ends (``stop_at_done=False``): a branch's worker resets right after
    the step that ended its episode. That reset raising stops explore() with the env's error,
    saying where it came from; the explored env itself is where it was."""
    from gym_fork import ForkableEnv, explore

    env = ForkableEnv(reset_fails_once_factory()(), backend="criu")
    try:
        env.reset(seed=_DOOMED_SEED)
        env.step(1)
        with pytest.raises(RuntimeError, match="this reset fails once.*in the reset right after a step"):
            explore(env, None, lambda obs: 0, n_branches=2, horizon=4, stop_at_done=False, progress=False)
        assert env.steps == env._worker_steps() == 1
        assert env.step(0)[0][0] == 20.0
    finally:
        env.close()


@pytest.mark.criu
@pytest.mark.parametrize("fork_tier", [True, False])
def test_episode_ends_reset_in_the_workers_with_their_step_and_an_older_ones_by_a_request(monkeypatch, fork_tier):
    """A slot whose episode ends is reset by its worker right after that step, in the same request
    (a step frame of kind "A"): no reset request of its own (before: a second round trip, ~6 % of a
    batch's wake-ups). Results match DummyVecEnv bit for bit and each slot counts its worker's steps.
    A worker that answers ``hello`` with frame version 2 (as one of an older gym_fork does) is
    reset by a request of its own, as before. A slot snapshotted and restored, or forked into
    others, steps on as any env: the reset is per request, no mode of the worker."""
    from gym_fork.backends.base import RemoteHandle

    kw = {"max_episode_steps": 7}
    venv = ForkableVecEnv("CartPole-v1", 3, backend="criu", env_kwargs=kw, seed=4, fork_tier=fork_tier)
    ref = DummyVecEnv([lambda: gym.make("CartPole-v1", **kw)] * 3)
    sent: list = []

    def spy(self, cmd, *args, _send=RemoteHandle.send):
        sent.append((self.pid, cmd, len(args)))
        return _send(self, cmd, *args)

    def run(steps: int, what: str) -> int:
        ends = 0
        for t in range(steps):
            a = np.array([t % 2, (t // 2) % 2, 1])
            out = venv.step(a)
            assert_same_step(out, ref.step(a), f"{what}, step {t}")
            assert same(venv.reset_infos, ref.reset_infos)
            ends += int(out[2].sum())
            assert [e.steps for e in venv.envs] == [e._worker_steps() for e in venv.envs]
        return ends

    try:
        ref.seed(4)
        assert same(venv.reset(), ref.reset())
        assert all(e._handle.autoreset_steps for e in venv.envs)
        # slot 2: a worker that reads frames of version 2 only (a controller offering 2 learns that)
        old = venv.envs[2]._handle
        assert old.request("hello", 2, True)[0] == old.pid and old.packed and not old.autoreset_steps
        monkeypatch.setattr(RemoteHandle, "send", spy)
        ends = run(30, "new and old workers")
        monkeypatch.undo()
        resets = [pid for pid, cmd, _ in sent if cmd == "reset"]
        assert ends >= 9 and resets and set(resets) == {old.pid}
        assert {n for pid, cmd, n in sent if cmd == "step" and pid != old.pid} == {2}  # (action, True)
        old.request("hello")  # (it reads version 3 after all)
        assert old.autoreset_steps
        # slot 0 at an episode's end: snapshotted, forked into the others and restored into itself
        while not venv.step(np.array([1, 1, 1]))[2][0]:
            pass
        snap = venv.snapshot(0)
        venv.fork_into(snap, [1, 2])
        venv.restore(0, snap)
        assert [e.steps for e in venv.envs] == [0, 0, 0]  # (right after an auto-reset)
        assert all(e._handle.autoreset_steps for e in venv.envs)  # (restored copies say version 3 too)
        for e in venv.envs:  # stepped directly, a restored worker does not reset on its own
            for _ in range(7):
                *_, term, trunc, _info = e.step(1)
                if term or trunc:
                    break
            assert e.steps == e._worker_steps() > 0 and (term or trunc)
    finally:
        venv.close()
        ref.close()


@pytest.mark.alone  # (a ring takes one of the machine's few ring slots)
@pytest.mark.criu
def test_a_slot_with_a_step_ring_resets_with_its_step_through_the_ring(monkeypatch):
    """A slot stepped directly often enough has a shared-memory step ring; the vector env's steps
    then go through it as kind "A" frames, and episode ends match DummyVecEnv's bit for bit."""
    from gym_fork.backends.base import RemoteHandle

    monkeypatch.setattr(RemoteHandle, "RING_AFTER", 2)
    kw = {"max_episode_steps": 9}
    venv = ForkableVecEnv("CartPole-v1", 1, backend="criu", env_kwargs=kw, seed=3)
    ref = DummyVecEnv([lambda: gym.make("CartPole-v1", **kw)])
    try:
        ref.seed(3)
        assert same(venv.reset(), ref.reset())
        slot, ref_slot = venv.envs[0], ref.envs[0]
        for t in range(6):  # directly: the ring opens after RING_AFTER steps
            assert same(slot.step(t % 2)[0], ref_slot.step(t % 2)[0])
        assert slot._handle.ring is not None, "no ring opened (another process holds the machine's ring slot?)"
        slot.reset(seed=5)
        ref_slot.reset(seed=5)
        venv._obs[0] = slot._request("last")[0]
        ends = 0
        for t in range(40):
            a = np.array([t % 2])
            out = venv.step(a)
            assert_same_step(out, ref.step(a), f"at step {t}")
            ends += int(out[2][0])
        assert ends >= 3 and slot._handle.ring is not None and slot.steps == slot._worker_steps()
    finally:
        venv.close()
        ref.close()


@pytest.mark.alone  # (a ring takes one of the machine's few ring slots)
@pytest.mark.criu
@pytest.mark.parametrize("unsendable", [False, True])
def test_a_failed_reset_after_a_step_through_the_ring_leaves_the_counts_the_workers(monkeypatch, unsendable):
    """The reset right after a step that ended the episode raises (or its info does not pickle)
    while the slot's steps go through its shared-memory ring: the same error and the same counts
    as over the socket (the tests above), and the ring stays in use."""
    from gym_fork.backends.base import RemoteHandle
    from gym_fork.errors import NotSendableError

    monkeypatch.setattr(RemoteHandle, "RING_AFTER", 2)
    venv = ForkableVecEnv(reset_fails_once_factory(unsendable, fail_at=3), 1, backend="criu", seed=_DOOMED_SEED)
    try:
        venv.reset()
        slot = venv.envs[0]
        for _ in range(6):  # directly: the ring opens after RING_AFTER steps
            slot.step(0)
        slot.reset()
        venv._obs[0] = slot._request("last")[0]
        assert slot._handle.ring is not None, "no ring opened (another process holds the machine's ring slot?)"
        venv.step(np.array([1]))
        venv.step(np.array([1]))
        with pytest.raises(NotSendableError if unsendable else RuntimeError):
            venv.step(np.array([1]))  # (the third step: the episode ends, its reset is the doomed one)
        assert slot.steps == slot._worker_steps() == (0 if unsendable else 3)
        venv.reset()
        for _ in range(3):
            out = venv.step(np.array([1]))
        assert out[2][0] and slot.steps == slot._worker_steps() == 0 and slot._handle.ring is not None
    finally:
        venv.close()


@pytest.mark.alone
@pytest.mark.criu
def test_gymnasium_vector_env_workers_that_outnumber_the_cpus_sleep_between_requests(monkeypatch):
    """The Gymnasium vector env (``ForkableVectorEnv``) follows the same rule as the SB3 one: two
    workers and the learner on two CPUs, so its workers sleep for each request. Before: they
    polled (0.1-0.2 sleeps a step)."""
    from gym_fork.vector import ForkableVectorEnv

    monkeypatch.setenv("GYM_FORK_WORKER_SPIN_US", "100000")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    envs = ForkableVectorEnv(["CartPole-v1"] * 2)
    try:
        envs.reset(seed=0)
        acts = np.zeros(2, dtype=np.int64)
        assert min(_sleeps_per_step(lambda: envs.step(acts), [e.worker_pid for e in envs.envs])) > SLEEPS
    finally:
        envs.close()


@pytest.mark.alone
@pytest.mark.criu
def test_closed_loop_branches_that_outnumber_the_cpus_sleep_and_the_env_restored_to_one_polls_again(monkeypatch):
    """explore()'s closed-loop branches step at once, as a vector env's slots do: where they
    and the learner outnumber the CPUs they sleep between steps (their snapshots say so). The
    env restored to a branch's end polls again -- told without a round trip, so its next
    replies must still be its own: the steps after the restore match a replay of the branch."""
    from gym_fork.backends.base import RemoteHandle

    monkeypatch.setenv("GYM_FORK_WORKER_SPIN_US", "100000")
    monkeypatch.setattr(RemoteHandle, "RING_AFTER", 10**9)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    env = gym_fork.ForkableEnv("CartPole-v1")
    try:
        env.reset(seed=3)
        root = env.snapshot()
        res = gym_fork.explore(env, root, lambda obs: int(obs[2] > 0), n_branches=2, horizon=8,
                               return_snapshots=True, stop_at_done=False, rng="same")
        end = res.branches[1].snapshot
        assert end._worker_polls is False and root._worker_polls is True
        env.restore(end)
        after = [env.step(a)[0] for a in (0, 1, 1, 0)]
        assert max(_sleeps_per_step(_stepper(env), [env.worker_pid])) < 0.5
        env.restore(root)  # the same branch again, step by step: the same observations after it
        for a in res.branches[1].actions:
            env.step(a)
        assert all(same(env.step(a)[0], o) for a, o in zip((0, 1, 1, 0), after))
    finally:
        env.close()


# --- 2. SB3 training: bit-identical to SubprocVecEnv --------------------------------------------
@pytest.fixture
def one_torch_thread():
    # Tiny MLPs: a second intra-op thread only spins, and on a busy 2-core box that costs seconds.
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _train(venv) -> PPO:
    model = PPO("MlpPolicy", venv, n_steps=64, batch_size=64, n_epochs=2, seed=7, device="cpu")
    model.learn(total_timesteps=256)  # 2 rollouts of 64 steps x 2 envs
    return model


@pytest.mark.criu
@pytest.mark.parametrize("env_id,kwargs,factory", [
    ("CartPole-v1", None, make_cartpole),
    ("LunarLander-v3", {"max_episode_steps": 60}, make_lunar),
], ids=["CartPole-v1", "LunarLander-v3"])
def test_ppo_identical_to_subproc(env_id, kwargs, factory, one_torch_thread):
    # "fork": forkserver/spawn workers would re-import this module (SB3, torch: seconds each)
    sub = SubprocVecEnv([factory] * 2, start_method="fork")
    try:
        ref = _train(sub)
    finally:
        sub.close()
    fork = ForkableVecEnv(env_id, n_envs=2, backend="criu", env_kwargs=kwargs)
    try:
        model = _train(fork)
    finally:
        fork.close()
    assert model.num_timesteps == ref.num_timesteps == 256
    for name in ("observations", "actions", "rewards", "episode_starts", "values", "log_probs",
                 "advantages", "returns"):
        assert same(getattr(model.rollout_buffer, name), getattr(ref.rollout_buffer, name)), name
    theirs = ref.policy.state_dict()
    for k, v in model.policy.state_dict().items():
        assert same(v.numpy(), theirs[k].numpy()), f"policy parameter {k} differs"


# --- 3. snapshots across slots -------------------------------------------------------------------
@pytest.mark.criu
@pytest.mark.parametrize("fork_tier", [False, "auto"], ids=["criu-dumps", "fork-tier"])
def test_restore_and_fork_into_other_slots(fork_tier):
    venv4 = ForkableVecEnv("CartPole-v1", n_envs=4, backend="criu", fork_tier=fork_tier)
    try:
        _check_restore_and_fork_into(venv4)
    finally:
        venv4.close()


def _check_restore_and_fork_into(venv4):
    venv4.seed(11)
    venv4.reset()
    rng = np.random.default_rng(5)
    for _ in range(15):
        venv4.step(rng.integers(0, 2, size=4))
    snap = venv4.snapshot(0)
    at_snap = venv4.current_obs[0]
    actions = rng.integers(0, 2, size=(80, 4))
    original = []  # slot 0 from the snapshot on
    for a in actions:
        o, r, d, i = venv4.step(a)
        original.append((o[0], r[0:1], d[0:1], [i[0]]))
    assert any(d[0] for _, _, d, _ in original), "slot 0 should cross an episode end"

    # restore slot 0's snapshot into slot 2; slot 2 then replays slot 0's path exactly
    assert same(venv4.restore(2, snap), at_snap)
    assert same(venv4.current_obs[2], at_snap) and venv4.envs[2].steps == snap.steps
    for t, a in enumerate(actions):
        a = a.copy()
        a[2] = a[0]
        o, r, d, i = venv4.step(a)
        assert_same_step((o[2], r[2:3], d[2:3], [i[2]]), original[t], f"slot 2, step {t}")

    # one snapshot into three slots at once: all three identical, and identical to the original
    forked = venv4.fork_into(snap, [1, 2, 3])
    assert forked.shape == (3, 4) and all(same(row, at_snap) for row in forked)
    for t, a in enumerate(actions):
        o, r, d, i = venv4.step(np.full(4, a[0]))
        for k in (1, 2, 3):
            assert_same_step((o[k], r[k:k + 1], d[k:k + 1], [i[k]]), original[t], f"slot {k}, step {t}")

    # rng="reseed": same state, own randomness (CartPole's reset draws differ after the first end)
    venv4.fork_into(snap, [1, 2], rng="reseed", seeds=[1, 2])
    first_end = next(t for t, (_, _, d, _) in enumerate(original) if d[0])
    for a in actions[: first_end + 1]:
        o, _, d, _ = venv4.step(np.full(4, a[0]))
    assert d[1] and d[2] and not same(o[1], o[2])

    other = ForkableVecEnv("CartPole-v1", n_envs=1, backend="criu")
    try:
        other.reset()
        with pytest.raises(ForeignSnapshotError):
            other.restore(0, snap)
    finally:
        other.close()


@pytest.mark.criu
@pytest.mark.parametrize("fork_tier", [False, "auto"], ids=["criu-dumps", "fork-tier"])
def test_make_vec_env_with_a_monitor_dir_snapshots_and_logs_every_episode(tmp_path, fork_tier):
    """SB3's ``make_vec_env(monitor_dir=...)`` wraps each env in a ``Monitor`` that keeps its CSV
    open. A snapshot of such a slot is taken (the CSV is a log, not state), a restore continues
    exactly, and each CSV stays well-formed: its header once, then a row for every episode that
    any copy of the slot finished -- none written over."""
    from stable_baselines3.common.env_util import make_vec_env

    venv = make_vec_env("CartPole-v1", n_envs=2, seed=0, monitor_dir=str(tmp_path), vec_env_cls=ForkableVecEnv,
                        vec_env_kwargs=dict(fork_tier=fork_tier))
    rng = np.random.default_rng(3)
    try:
        venv.reset()
        for _ in range(5):
            venv.step(rng.integers(0, 2, size=2))
        snap = venv.snapshot(0)
        assert type(snap._payload).__name__ == ("ForkPayload" if fork_tier else "CriuPayload")
        actions = rng.integers(0, 2, size=(80, 2))
        runs = []
        for _ in range(2):  # the original from the snapshot on, then the restored slot
            run = []
            for a in actions:
                o, r, d, i = venv.step(a)
                ep = i[0].get("episode")
                run.append((o[0], r[0], d[0], None if ep is None else (ep["r"], ep["l"])))  # not "t": wall time
            runs.append(run)
            venv.restore(0, snap)
        assert all(same(x, y) for x, y in zip(*runs)) and len(runs[0]) == 80
        ended = sum(bool(d) for _, _, d, _ in runs[0])
        assert ended >= 2
    finally:
        venv.close()
    with open(tmp_path / "0.monitor.csv") as f:
        lines = f.read().splitlines()
    assert lines[0].startswith("#{") and lines[1] == "r,l,t"
    rows = [tuple(map(float, line.split(","))) for line in lines[2:]]  # each a whole row
    assert len(rows) == 2 * ended  # no episode before the snapshot ended (5 steps)
    assert [(r, int(l)) for r, l, _t in rows] == [ep for run in runs for *_, ep in run if ep is not None]


# --- 4. close ------------------------------------------------------------------------------------
@pytest.mark.criu
@pytest.mark.parametrize("fork_tier", [False, "auto"], ids=["criu-dumps", "fork-tier"])
def test_close_leaves_no_worker(fork_tier):
    venv = ForkableVecEnv("CartPole-v1", n_envs=3, backend="criu", seed=0, fork_tier=fork_tier)
    venv.reset()
    first = venv.worker_pids
    snap = venv.snapshot(0)
    venv.fork_into(snap, [1, 2])  # new workers (clones or CRIU restores) replace slots 1 and 2
    venv.step_async(np.array([0, 1, 0]))  # close() with a step in flight
    now = venv.worker_pids
    assert not set(now[1:]) & set(first) and all(_alive(p) for p in now)
    # (the fork tier: slot 0 went on from a copy first, its first worker a reaper: env._spare_namespace)
    assert (now[0] != first[0] and _alive(first[0])) if fork_tier else now[0] == first[0]
    # with their namespaces: frozen snapshots, clones, retiring replaced workers, ...
    family = set(first + now).union(*(_pidns_members(p) for p in first + now))
    venv.close()
    venv.close()  # idempotent
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in family) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in family if _alive(p)], "worker processes outlived close()"
    with pytest.raises(gym_fork.errors.EnvClosedError):
        venv.reset()


# --- the in-process pickle backend: same contract, no parallelism --------------------------------
def test_pickle_backend_matches_dummy():
    venv = ForkableVecEnv([make_cartpole] * 3, backend="pickle", seed=4)
    ref = DummyVecEnv([make_cartpole] * 3)
    try:
        assert venv.worker_pids == [None] * 3
        ref.seed(4)
        assert same(venv.reset(), ref.reset())
        rng = np.random.default_rng(1)
        for t in range(120):
            a = rng.integers(0, 2, size=3)
            assert_same_step(venv.step(a), ref.step(a), f"at step {t}")
        snap = venv.snapshot(1)
        at_snap = venv.current_obs[1]
        forked = venv.fork_into(snap, [0, 2])
        assert same(forked[0], at_snap) and same(forked[1], at_snap)
        o, *_ = venv.step(np.array([1, 1, 1]))
        assert same(o[0], o[1]) and same(o[1], o[2])
    finally:
        venv.close()
        ref.close()


def test_from_envs_lineage():
    envs = [gym_fork.ForkableEnv("CartPole-v1", backend="pickle") for _ in range(2)]
    venv = ForkableVecEnv.from_envs(envs)
    try:
        venv.reset()
        with pytest.raises(ForeignSnapshotError):  # independent envs: independent lineages
            venv.restore(1, venv.snapshot(0))
    finally:
        venv.close()
    assert all(e.closed for e in envs)
    envs = [gym_fork.ForkableEnv("CartPole-v1", backend="pickle") for _ in range(2)]
    venv = ForkableVecEnv.from_envs(envs, share_lineage=True)
    try:
        venv.reset()
        snap = venv.snapshot(0)
        assert same(venv.restore(1, snap), venv.current_obs[0])
        with pytest.raises(ValueError, match="twice"):
            ForkableVecEnv.from_envs([envs[0], envs[0]])
    finally:
        venv.close()


@pytest.mark.criu
def test_docstring_example():
    failures, tried = doctest.testmod(gym_fork.vec_env, verbose=False)
    assert tried > 0 and failures == 0


@pytest.mark.criu
@pytest.mark.parametrize("fork_tier", [True, False], ids=["fork-tier", "criu-dumps"])
def test_fork_into_slots_with_workspaces_puts_their_files_back(tmp_path, fork_tier):
    """An agent env's slots each work in a workspace: fork_into() must put the snapshot's files
    back into every target slot's workspace, as restore() does (it brought back the process
    only, and the slot went on reading its old trajectory's notes)."""
    import functools

    import agent_envs

    ws = str(tmp_path / "ws")
    os.mkdir(ws)
    first = gym_fork.ForkableEnv(functools.partial(agent_envs.notes_in, ws), workspace=ws, fork_tier=fork_tier)
    first.reset(seed=0)
    for _ in range(3):
        first.step(0)
    snap = first.snapshot()
    kids = first.fork(snap, 2)
    venv = ForkableVecEnv.from_envs([first, *kids])
    try:
        venv.step(np.zeros(3, dtype=np.int64))
        venv.step(np.zeros(3, dtype=np.int64))  # every slot's notes.txt holds 5 notes now
        obs = venv.fork_into(snap, [1, 2])
        assert obs[:, 0].tolist() == [3.0, 3.0]
        for k in kids:
            with open(os.path.join(k.unwrapped.workspace, "notes.txt")) as f:
                assert len(f.read().splitlines()) == 3  # the snapshot's files, in the slot's own workspace
        after, *_ = venv.step(np.zeros(3, dtype=np.int64))
        assert after[:, 1].tolist() == [6.0, 4.0, 4.0]  # slot 0 went on; slots 1, 2 from the snapshot
    finally:
        venv.close()


@pytest.mark.criu
def test_fork_into_a_snapshot_kept_in_a_store(tmp_path):
    store = gym_fork.SnapshotStore(tmp_path / "store", max_in_memory=1)
    first = gym_fork.ForkableEnv("CartPole-v1", store=store)
    venv = ForkableVecEnv.from_envs([first, *first.fork(n=1)])
    try:
        venv.seed(3)
        venv.reset()
        venv.step(np.array([0, 1]))
        snap = venv.snapshot(0)
        want = venv.step(np.array([1, 1]))[0][0]
        venv.snapshot(1)  # over the budget: the first snapshot goes to disk
        assert store.stats["spilled"] >= 1 and snap.persisted
        venv.fork_into(snap, [0, 1])  # its images reassembled from the store's chunks
        got = venv.step(np.array([1, 1]))[0]
        assert same(got[0], want) and same(got[1], want)
    finally:
        venv.close()


def _random_slot_operations(backend: str, seed: int, n_ops: int) -> None:
    """Random steps, snapshots, restores and fork_into()s against DummyVecEnv, whose slots are
    modelled by deep copies of its in-process sub-envs (CartPole copies exactly): every batch,
    reward, done flag, TimeLimit.truncated and terminal observation must match bit for bit."""
    import copy
    import random

    rng = random.Random(seed)
    make = lambda: gym.make("CartPole-v1", max_episode_steps=15)  # noqa: E731 (episode ends often)
    ref = DummyVecEnv([make] * 3)
    venv = ForkableVecEnv(make, n_envs=3, backend=backend)
    saved: list = []  # (snapshot, copy of the model's sub-env, its observation)
    log: list = []
    try:
        ref.seed(seed)
        venv.seed(seed)
        assert same(ref.reset(), venv.reset())
        for i in range(n_ops):
            r = rng.random()
            if r < 0.6:
                actions = np.array([rng.randrange(2) for _ in range(3)])
                log.append(("step", actions.tolist()))
                want, got = ref.step(actions), venv.step(actions)
                assert_same_step(want, got, f"at op {i}: {log[-8:]}")
            elif r < 0.75:
                j = rng.randrange(3)
                log.append(("snapshot", j))
                saved.append((venv.snapshot(j, restore_soon=rng.choice([None, True, False])),
                               copy.deepcopy(ref.envs[j]), ref.buf_obs[None][j].copy()))
            elif r < 0.9 and saved:
                j, k = rng.randrange(3), rng.randrange(len(saved))
                log.append(("restore", j, k))
                snap, env, obs = saved[k]
                assert same(venv.restore(j, snap), obs), f"restore at op {i}: {log[-8:]}"
                ref.envs[j] = copy.deepcopy(env)
                ref.buf_obs[None][j] = obs
            elif saved:
                k = rng.randrange(len(saved))
                slots = rng.sample(range(3), rng.randrange(1, 4))
                log.append(("fork_into", k, slots))
                snap, env, obs = saved[k]
                got = venv.fork_into(snap, slots)
                for row, j in enumerate(slots):
                    assert same(got[row], obs), f"fork_into at op {i}: {log[-8:]}"
                    ref.envs[j] = copy.deepcopy(env)
                    ref.buf_obs[None][j] = obs
            assert same(venv.current_obs, ref.buf_obs[None]), f"current_obs at op {i}: {log[-8:]}"
    finally:
        venv.close()
        ref.close()


@pytest.mark.criu
def test_random_slot_operations_match_dummy_vec_env():
    for seed in range(2):
        _random_slot_operations("criu", seed, 150)


def test_random_slot_operations_match_dummy_vec_env_pickle():
    _random_slot_operations("pickle", 5, 150)


def _info_factory():
    class Infos(gym.Wrapper):
        def reset(self, **kwargs):
            obs, _ = self.env.reset(**kwargs)
            return obs, {"level": "start-of-episode"}

        def step(self, action):
            obs, r, term, trunc, _ = self.env.step(action)
            return obs, r, term, trunc, {"step_only": True}

    return Infos(gym.make("CartPole-v1"))


@pytest.mark.criu
def test_a_restored_slots_reset_info_is_its_last_resets():
    """SB3 keeps ``reset_infos[i]`` = the info of slot i's last reset. Before, restore() and
    fork_into() put the info of the snapshot's last *step* there."""
    venv = ForkableVecEnv(_info_factory, n_envs=2, backend="criu", seed=1)
    try:
        venv.reset()
        venv.step(np.array([0, 0]))
        assert venv.reset_infos == [{"level": "start-of-episode"}] * 2
        snap = venv.snapshot(0)
        venv.reset_infos[0]["level"] = "changed later"  # (the snapshot keeps its own copy)
        venv.restore(0, snap)
        venv.fork_into(snap, [1])
        assert venv.reset_infos == [{"level": "start-of-episode"}] * 2
        single = venv.envs[0].snapshot()  # taken outside the vector env, mid-episode: unknown
        venv.restore(1, single)
        assert venv.reset_infos[1] == {}
    finally:
        venv.close()


@pytest.mark.criu
def test_restore_reached_through_an_sb3_wrapper_says_what_it_does_not_restore():
    """``VecFrameStack(venv).restore(0, snap)`` reaches the ForkableVecEnv through SB3's attribute
    forwarding: the slot is restored, the wrapper's stacked frames are not, and the observation
    returned is unstacked. Before: silently. Now a RuntimeWarning says so, at the caller's line;
    a call on the ForkableVecEnv itself says nothing."""
    import warnings

    from stable_baselines3.common.vec_env import VecFrameStack, VecMonitor

    inner = ForkableVecEnv("CartPole-v1", n_envs=2, seed=0)
    venv = VecMonitor(VecFrameStack(inner, n_stack=3))
    try:
        venv.reset()
        snap = venv.snapshot(0)  # (a snapshot through them is fine: it changes nothing)
        with pytest.warns(RuntimeWarning, match=r"restore\(\) reached through VecMonitor\(VecFrameStack\(ForkableVecEnv\)\)") as w:
            venv.restore(0, snap)
        assert w[0].filename == __file__
        with pytest.warns(RuntimeWarning, match="fork_into\\(\\) reached through"):
            venv.fork_into(snap, [1])
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            inner.restore(0, snap)
    finally:
        venv.close()


def test_a_fork_into_whose_slot_fails_to_switch_leaves_no_copy_running(monkeypatch):
    """A fork_into() whose first slot fails to take its restored worker (here: the switch raises):
    the copies made for the slots are killed, not left to the garbage collector (a traceback that
    a notebook or debugger keeps holds them, running); the slots keep their workers and
    observations, and step on."""
    from gym_fork.env import ForkableEnv
    from gym_fork.testing.campaigns import worker_processes

    venv = ForkableVecEnv(lambda: gym.make("CartPole-v1"), n_envs=3)
    try:
        venv.seed(0)
        venv.reset()
        venv.step(np.array([1, 1, 1]))
        snap = venv.snapshot(2)
        venv.step(np.array([0, 0, 0]))
        before, pids, obs = worker_processes(), venv.worker_pids, venv.current_obs.copy()

        def fails(*args, **kwargs):
            raise RuntimeError("the switch failed")

        monkeypatch.setattr(ForkableEnv, "_adopt_restored", fails)
        with pytest.raises(RuntimeError, match="the switch failed"):
            venv.fork_into(snap, [0, 1])
        monkeypatch.undo()
        assert venv.worker_pids == pids and same(venv.current_obs, obs)
        snap.release()  # (its frozen process, and the ready copy it made anew, go with it)
        assert eventually(lambda: worker_processes() <= before, timeout=5), worker_processes() - before
        venv.step(np.array([1, 1, 1]))
    finally:
        venv.close()

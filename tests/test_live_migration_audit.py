"""Live migration (``env.migrate(target, live=True)``): what the learner does meanwhile must not
break an exact move, and what the answers cannot show must not slip through (real CRIU, a real
``gym-fork agent`` on 127.0.0.1: the conftest's ``agent`` fixture)."""

from __future__ import annotations

import random

import gymnasium as gym
import numpy as np
import pytest

import gym_fork
from gym_fork.errors import ConcurrentUseError, DivergedError, MigrationError
from gym_fork.migration.client import NetworkHandle
from tests.conftest import assert_same_traj, run_actions
from tests.test_migration import _actions, _clean, _pair

pytestmark = pytest.mark.criu


def _until_switched(mig, step, limit: int = 20000) -> int:
    """Call ``step(i)`` until the live migration ends; returns how many steps that took."""
    for i in range(limit):
        step(i)
        if mig.done():
            return i + 1
    return limit


def test_live_migration_of_a_vec_env_slot_switches_exact(agent):
    """ForkableVecEnv.step_wait() adds 'TimeLimit.truncated' to each answer's info after the
    answer came back: recorded by reference, every slot's move was refused as diverged."""
    from gym_fork.vec_env import ForkableVecEnv

    venv, ref = (ForkableVecEnv("LunarLander-v3", n_envs=2, seed=0) for _ in range(2))
    rng = np.random.default_rng(0)
    try:
        assert np.array_equal(venv.reset(), ref.reset())
        for _ in range(10):
            a = rng.integers(0, 4, size=2)
            assert np.array_equal(venv.step(a)[0], ref.step(a)[0])
        mig = venv.envs[0].migrate(agent.target["B"], token=agent.token, live=True)

        def step(_i: int) -> None:
            a = rng.integers(0, 4, size=2)
            got, want = venv.step(a), ref.step(a)
            for x, y in zip(got[:3], want[:3]):
                assert np.array_equal(x, y)

        _until_switched(mig, step)
        rep = mig.result(timeout=60)  # raised DivergedError: "depends on something outside its process"
        assert rep["node"] == "B" and isinstance(venv.envs[0]._handle, NetworkHandle)
        for _ in range(200):  # crosses episode ends (auto-reset) on the target
            step(0)
    finally:
        venv.close()
        ref.close()
    _clean(agent.agents["B"])


def test_live_migration_with_a_reused_action_buffer_switches_exact(agent):
    """A learner that fills one action array for every step: the recorded actions were all the
    buffer's latest content, so the target's replay took other steps and the move was refused."""
    envs = [gym_fork.make("Pendulum-v1") for _ in range(2)]
    env, ref = envs
    acts = np.random.default_rng(1).uniform(-2, 2, size=(20000, 1)).astype(np.float32)
    buf = np.zeros(1, np.float32)
    try:
        for e in envs:
            e.reset(seed=5)
            for a in acts[:20]:
                buf[:] = a
                e.step(buf)
        mig = env.migrate(agent.target["B"], token=agent.token, live=True)

        def step(i: int) -> None:
            buf[:] = acts[20 + i]
            assert_same_traj([env.step(buf)], [ref.step(acts[20 + i].copy())])

        n = _until_switched(mig, step)
        rep = mig.result(timeout=60)
        assert rep["node"] == "B" and rep["replayed_ops"] >= n > 1
        for i in range(n, n + 100):
            step(i)
        assert env.steps == ref.steps
    finally:
        env.close()
        ref.close()
    _clean(agent.agents["B"])


def test_live_migration_with_obs_normalised_in_place_switches_exact(agent):
    """A learner that changes the observation it got in place (obs -= mean): the answer, digested
    later, was no longer the one the worker gave."""
    env, ref = _pair(_actions(30))
    acts = _actions(20000, seed=2)
    try:
        mig = env.migrate(agent.target["B"], token=agent.token, live=True)

        def step(i: int) -> None:
            out, want = env.step(acts[i]), ref.step(acts[i])
            assert_same_traj([out], [want])
            obs = out[0]
            obs -= 1.0  # in place, after use
            if out[2] or out[3]:
                env.reset()
                ref.reset()

        n = _until_switched(mig, step)
        rep = mig.result(timeout=60)
        assert rep["node"] == "B" and rep["replayed_ops"] >= n > 1
        after = _actions(100, seed=3)
        assert_same_traj(run_actions(env, after)[0], run_actions(ref, after)[0])
    finally:
        env.close()
        ref.close()
    _clean(agent.agents["B"])


@pytest.mark.parametrize("closed_loop", [False, True], ids=["actions", "policy"])
def test_live_migration_with_rollouts_meanwhile_switches_exact(agent, closed_loop):
    """Rollouts in the worker (``env.rollout``: open loop, or a policy in the worker) while the
    snapshot travels. Each rollout's answer carries the worker's name for it, drawn afresh
    (``os.urandom``) for settling after Ctrl-C: the target's replay drew another, its digest
    differed, and every such move was refused as "depends on something outside its process"
    (found by the random-operations harness, seed 55). The replay now takes the source's names,
    and the env's record of its last rollout names the target worker's."""
    env, ref = _pair(_actions(30))
    policy = (lambda obs: int(obs[0] > 0) * 2 + int(obs[4] > 0))  # noqa: E731 (LunarLander, 4 actions)
    acts = _actions(20000, seed=4)
    try:
        mig = env.migrate(agent.target["B"], token=agent.token, live=True)

        def roll(i: int) -> None:
            if closed_loop:
                got, want = (e.rollout(policy=policy, steps=3) for e in (env, ref))
            else:
                got, want = (e.rollout(acts[3 * i:3 * i + 3]) for e in (env, ref))
            assert got["rewards"] == want["rewards"] and np.array_equal(got["final_obs"], want["final_obs"])
            if got["terminated"] or got["truncated"]:
                env.reset(seed=i)
                ref.reset(seed=i)

        n = _until_switched(mig, roll, limit=3000)
        rep = mig.result(timeout=60)  # raised DivergedError (the replay of request 0, 'rollout')
        assert rep["node"] == "B" and rep["replayed_ops"] >= 1 and n < 3000
        assert isinstance(env._handle, NetworkHandle)
        assert env._handle.request("rollout_progress")["id"] == env._rollout_id is not None
        assert env.steps == ref.steps
        after = _actions(60, seed=5)
        assert_same_traj(run_actions(env, after)[0], run_actions(ref, after)[0])
    finally:
        env.close()
        ref.close()
    _clean(agent.agents["B"])


def test_result_with_a_step_in_flight_is_refused_and_loses_nothing(agent):
    """result() between step_send() and step_receive() switched and lost that step (the reply
    stayed with the stopped local worker: step_receive() raised, env.steps counted it)."""
    env, ref = _pair(_actions(30))
    acts = _actions(60, seed=4)
    try:
        mig = env.migrate(agent.target["B"], token=agent.token, live=True)
        assert_same_traj(run_actions(env, acts[:10])[0], run_actions(ref, acts[:10])[0])
        mig._ready.wait(60)  # (the target has caught up: the next switch would happen now)
        env.step_send(acts[10])
        with pytest.raises(ConcurrentUseError, match=r"step_receive\(\)"):
            mig.result(timeout=60)
        assert not mig.done() and env._live is mig  # intact: nothing switched, nothing cancelled
        assert_same_traj([env.step_receive()], [ref.step(acts[10])])
        rep = mig.result(timeout=60)
        assert rep["node"] == "B" and rep["replayed_ops"] >= 11 and isinstance(env._handle, NetworkHandle)
        assert env.steps == ref.steps
        assert_same_traj(run_actions(env, acts[11:])[0], run_actions(ref, acts[11:])[0])
    finally:
        env.close()
        ref.close()
    _clean(agent.agents["B"])


def test_unseeded_first_reset_during_live_migration_is_refused(agent):
    """reset() without a seed on an env never seeded draws its seed from the OS: the target's
    replay draws another one. FrozenLake's answers still matched (start state 0), so the move
    switched with another generator on the target, silently."""
    env = gym_fork.make("FrozenLake-v1", is_slippery=True)
    try:
        mig = env.migrate(agent.target["B"], token=agent.token, live=True)
        env.reset()
        differ = r"random generators differ from the source.s \(\d:FrozenLakeEnv\._np_random\)"
        with pytest.raises(DivergedError, match=differ):
            mig.result(timeout=60)
        assert mig.state == "failed" and env._live is None and not isinstance(env._handle, NetworkHandle)
        snap = env.snapshot()  # the env runs here, unchanged, and stays exact
        a = run_actions(env, [1, 2, 2, 1, 0] * 10)[0]
        env.restore(snap)
        assert_same_traj(run_actions(env, [1, 2, 2, 1, 0] * 10)[0], a)
    finally:
        env.close()
    _clean(agent.agents["B"])


class _SeedsRandomFromTheOS(gym.Env):
    """Reseeds the process-wide ``random`` from the OS at each reset; its answers do not show it."""

    observation_space = gym.spaces.Box(0.0, 1.0, (1,), np.float64)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        random.seed()
        return np.zeros(1), {}

    def step(self, action):
        return np.zeros(1), 0.0, False, False, {}


def test_process_wide_generator_seeded_from_the_os_during_live_migration_is_refused(agent):
    env = gym_fork.ForkableEnv(_SeedsRandomFromTheOS)
    try:
        env.reset(seed=0)
        mig = env.migrate(agent.target["B"], token=agent.token, live=True)
        env.reset(seed=0)
        env.step(0)
        with pytest.raises(DivergedError, match=r"random generators differ from the source.s \(random\)"):
            mig.result(timeout=60)
        assert env._live is None and not isinstance(env._handle, NetworkHandle)
        env.step(0)
    finally:
        env.close()
    _clean(agent.agents["B"])


def test_seeded_env_drawing_randomness_still_switches(agent):
    """The generator check is no obstacle to an env that draws from seeded generators: the
    slippery FrozenLake, seeded, with its process-wide generators drawn from too."""
    env, ref = (gym_fork.make("FrozenLake-v1", is_slippery=True) for _ in range(2))
    acts = [1, 2, 2, 1, 0, 3] * 4000
    try:
        for e in (env, ref):
            e.reset(seed=7)
        mig = env.migrate(agent.target["B"], token=agent.token, live=True)

        def step(i: int) -> None:
            out, want = env.step(acts[i]), ref.step(acts[i])
            assert_same_traj([out], [want])
            if out[2] or out[3]:
                env.reset()
                ref.reset()

        n = _until_switched(mig, step)
        rep = mig.result(timeout=60)
        assert rep["node"] == "B" and rep["replayed_ops"] >= n > 1
        assert_same_traj(run_actions(env, acts[:300])[0], run_actions(ref, acts[:300])[0])
    finally:
        env.close()
        ref.close()
    _clean(agent.agents["B"])


@pytest.mark.parametrize("live", [False, True])
def test_env_migrate_inside_a_managed_job_is_refused_up_front(agent, monkeypatch, live):
    """Inside `gym-fork run` env workers have no CRIU checkpoints of their own: env.migrate()
    connected, then failed late in persist() ("needs CRIU images"). Refused before anything is
    done now, naming the way that works (move the whole job)."""
    monkeypatch.setenv("GYM_FORK_CONTROL_FD", "999")  # what `gym-fork run` gives its job
    env, ref = gym_fork.make("LunarLander-v3"), gym.make("LunarLander-v3")
    try:
        assert env._backend.mode == "fork"
        for e in (env, ref):
            e.reset(seed=3)
        with pytest.raises(MigrationError, match=r"not available inside a managed job.*LiveMigrationCallback"):
            env.migrate(agent.target["B"], token=agent.token, live=live)
        assert env._live is None and not isinstance(env._handle, NetworkHandle)
        acts = _actions(50, seed=1)
        assert_same_traj(run_actions(env, acts)[0], run_actions(ref, acts)[0])
    finally:
        env.close()
        ref.close()
    _clean(agent.agents["B"])

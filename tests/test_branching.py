"""Branching: fork() copies and explore(), on real envs."""

from __future__ import annotations

import os
import random
import time

import gymnasium as gym
import numpy as np
import pytest
from conftest import process_alive, assert_same_traj, run_actions, same

import gym_fork
import random_envs

pytestmark = pytest.mark.criu


def _traj(env, actions):
    return [env.step(a) for a in actions]


@pytest.mark.parametrize("fork_tier", [True, False])
def test_same_rng_branches_are_identical(fork_tier):
    env = gym_fork.make("LunarLander-v3", backend="criu", fork_tier=fork_tier)
    try:
        env.action_space.seed(0)
        env.reset(seed=0)
        run_actions(env, [env.action_space.sample() for _ in range(30)])
        snap = env.snapshot()
        actions = [env.action_space.sample() for _ in range(60)]
        original, _ = run_actions(env, actions)
        kids = env.fork(snap, 3, rng="same")
        try:
            for k in kids:
                assert k.steps == snap.steps
                assert_same_traj(original, run_actions(k, actions)[0])
        finally:
            for k in kids:
                k.close()
    finally:
        env.close()


@pytest.mark.parametrize("env_id,kwargs", [("FrozenLake-v1", {"is_slippery": True}),
                                           ("ALE/Pong-v5", {"repeat_action_probability": 0.25})])
def test_reseeded_branches_differ_and_reproduce(env_id, kwargs):
    env = gym_fork.make(env_id, backend="criu", **kwargs)
    try:
        env.reset(seed=0)
        for _ in range(3):
            env.step(0)
        snap = env.snapshot()
        n = 60 if env_id.startswith("ALE") else 30
        actions = [int(a) for a in np.random.default_rng(0).integers(0, env.action_space.n, n)]

        def traj_of(seed):
            k = env.fork(snap, 1, rng="reseed", seeds=[seed])[0]
            try:
                return run_actions(k, actions)[0]
            finally:
                k.close()

        a1, a2, b = traj_of(1), traj_of(1), traj_of(2)
        assert_same_traj(a1, a2)  # a branch is reproducible from its seed
        assert not all(same(x, y) for x, y in zip(a1, b)) or len(a1) != len(b), "reseeded branches must differ"
    finally:
        env.close()


@pytest.mark.parametrize("backend", ["fork", "criu"])
@pytest.mark.parametrize("factory", [random_envs.global_random, random_envs.legacy_numpy,
                                     random_envs.own_generators], ids=lambda f: f.__name__)
def test_reseed_reaches_generators_beyond_np_random(factory, backend):
    """rng="reseed" used to reseed only np_random: copies of an env drawing from random, np.random
    or a generator of its own stayed identical -- explore(n_branches=8) returned one branch 8 times."""
    env = gym_fork.ForkableEnv(factory, fork_tier=backend == "fork", backend="criu")
    try:
        env.reset(seed=0)
        env.step(1)
        snap = env.snapshot()
        acts = [0, 1, 1, 0, 1]
        kids = env.fork(snap, 3, rng="reseed", seeds=[7, 7, 8])
        try:
            a, a_again, b = (run_actions(k, acts)[0] for k in kids)
        finally:
            for k in kids:
                k.close()
        assert_same_traj(a, a_again)  # reproducible from its seed
        assert not same(a, b), "copies reseeded differently went on alike"
        env.restore(snap)
        assert not same(a, run_actions(env, acts)[0]), "a reseeded copy went on like the snapshot"
        res = gym_fork.explore(env, snap, lambda obs: 0, n_branches=4, horizon=3, progress=False)
        assert len({b.ret for b in res.branches}) == 4, "explore's branches are not each their own"
    finally:
        env.close()


def test_copies_reseeded_from_their_snapshots_list_of_generators_draw_as_after_a_walk():
    """The copies of a fork(rng="reseed") batch take the list of generators their frozen snapshot
    found once for all of them (EnvServer.generators) instead of each walking the env's objects:
    they must be reseeded exactly as a copy that walks the env itself is, and a copy that has run
    the env since it was forked must walk it (a generator made since would be missed)."""
    env = gym_fork.ForkableEnv(random_envs.own_generators, fork_tier=True)
    try:
        env.reset(seed=0)
        env.step(1)
        snap = env.snapshot()
        listed = env.fork(snap, 1, rng="reseed", seeds=[7])[0]  # (its batch had the list made)
        walked = env.fork(snap, 1, rng="same")[0]
        try:
            walked._request("rng_digests")  # any request that is not a copy's first words: no list
            walked._request("reseed", 7)
            assert listed._request("rng_digests") == walked._request("rng_digests")
            acts = [0, 1, 1, 0, 1]
            assert_same_traj(run_actions(listed, acts)[0], run_actions(walked, acts)[0])
        finally:
            listed.close()
            walked.close()
    finally:
        env.close()
    env = gym_fork.ForkableEnv(random_envs.late_generator, fork_tier=True)
    try:
        env.reset(seed=0)
        snap = env.snapshot()
        env.fork(snap, 1, rng="reseed", seeds=[1])[0].close()  # the frozen snapshot lists: no `late`
        kids = env.fork(snap, 2, rng="same")
        try:
            for k in kids:
                k.step(0)  # makes `late` (and the copy must forget the list it was forked with)
            kids[0]._request("reseed", 5)
            assert not same(run_actions(kids[0], [0, 0])[0], run_actions(kids[1], [0, 0])[0]), \
                "a generator the env made after the fork was not reseeded"
        finally:
            for k in kids:
                k.close()
    finally:
        env.close()


def test_a_reseed_walk_cut_short_still_says_so_with_the_list_made_once():
    """The walk that finds an env's generators stops after WALK_LIMIT objects and says so (a
    RuntimeWarning). Made once in the frozen snapshot for all its copies, that warning would reach
    nobody: there the list is not kept, and each copy walks and says it, as before."""
    env = gym_fork.ForkableEnv(random_envs.huge_history, fork_tier=True)
    try:
        env.reset(seed=0)
        snap = env.snapshot()
        with pytest.warns(RuntimeWarning, match="stopped after") as said:
            kids = env.fork(snap, 2, rng="reseed", seeds=[1, 2])
        for k in kids:
            k.close()
        told = {str(k._handle.pid) for k in kids if any(f"pid {k._handle.pid})" in str(w.message) for w in said)}
        assert len(told) == 2, [str(w.message) for w in said]  # each copy says it of its own walk
    finally:
        env.close()


def test_explore_says_when_reseeded_branches_all_went_on_alike():
    """16 branches that cannot differ (a deterministic policy, an env with no randomness after
    the snapshot) are 15 wasted: explore() says so; branches that differ pass without a word."""
    import warnings

    for factory, alike in [(random_envs.no_randomness, True), (random_envs.own_generators, False)]:
        env = gym_fork.ForkableEnv(factory, fork_tier=True)
        try:
            env.reset(seed=0)
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                gym_fork.explore(env, None, lambda obs: 1, n_branches=4, horizon=5, progress=False)
                gym_fork.explore(env, None, lambda obs: 1, n_branches=4, horizon=5, rng="same", progress=False)
            told = [w for w in said if "branches went on identically" in str(w.message)]
            assert len(told) == (1 if alike else 0), [str(w.message) for w in said]
        finally:
            env.close()


def test_in_process_reseed_leaves_the_learners_global_generators_alone():
    """A pickle-backend copy lives in the learner's process: its reseed gives the env's own
    generators new streams but must not touch the learner's random / np.random."""
    env = gym_fork.ForkableEnv(random_envs.own_generators, backend="pickle")
    try:
        env.reset(seed=0)
        snap = env.snapshot()
        before = (random.getstate(), np.random.get_state(legacy=False)["state"]["key"].tobytes())
        kids = env.fork(snap, 2, rng="reseed", seeds=[1, 2])
        after = (random.getstate(), np.random.get_state(legacy=False)["state"]["key"].tobytes())
        try:
            assert before == after
            assert not same(run_actions(kids[0], [0, 0])[0], run_actions(kids[1], [0, 0])[0])
        finally:
            for k in kids:
                k.close()
    finally:
        env.close()


def test_16_concurrent_lunarlander_branches_from_a_criu_snapshot():
    env = gym_fork.make("LunarLander-v3", backend="criu", fork_tier=False)
    env.reset(seed=0)
    for _ in range(20):
        env.step(0)
    snap = env.snapshot()
    path = snap.payload().path
    kids = env.fork(snap, 16, rng="same")
    pids = {k.worker_pid for k in kids}
    assert len(pids) == 16
    outs = [k.step(2)[0] for k in kids]
    assert all(same(outs[0], o) for o in outs)
    res = [run_actions(k, [1, 2, 3, 0] * 10)[0] for k in kids]
    for r in res[1:]:
        assert_same_traj(res[0], r)
    for k in kids:
        k.close()
    env.close()
    time.sleep(0.2)
    assert not any(process_alive(p) for p in pids)
    assert not os.path.exists(path)


def test_explore_returns_branches_and_end_snapshots():
    env = gym_fork.make("CartPole-v1", backend="criu")
    try:
        env.reset(seed=0)
        for _ in range(5):
            env.step(0)
        root = env.snapshot()
        res = gym_fork.explore(env, root, lambda obs: int(obs[2] > 0), n_branches=4, horizon=40,
                               rng="same", return_snapshots=True)
        assert len(res.branches) == 4 and res.steps == sum(b.length for b in res.branches)
        for b in res.branches:
            assert same(b.actions, res.branches[0].actions) and b.ret == res.branches[0].ret
            s = b.snapshot
            assert s.parent_id == root.id and s.steps == root.steps + b.length and s.actions == b.actions
        # return to the best branch's end and continue from there
        best = res.best()
        env.restore(best.snapshot)
        assert env.steps == root.steps + best.length
        replay = env.fork(root, 1)[0]
        try:
            t = _traj(replay, best.actions)
            assert same(t[-1][0], best.final_obs)
        finally:
            replay.close()
    finally:
        env.close()


def test_explore_with_sb3_model_and_random_policy():
    from stable_baselines3 import PPO

    env = gym_fork.make("CartPole-v1", backend="criu")
    try:
        env.reset(seed=0)
        model = PPO("MlpPolicy", gym.make("CartPole-v1"), n_steps=32, device="cpu", seed=0)
        res = gym_fork.explore(env, None, model, n_branches=3, horizon=20, seeds=[1, 2, 3])
        assert [b.seed for b in res.branches] == [1, 2, 3] and res.steps > 0
        with pytest.raises(ValueError):
            gym_fork.explore(env, None, model, n_branches=0)
        with pytest.raises(TypeError):
            gym_fork.explore(env, None, "not a policy", n_branches=1, horizon=1)
    finally:
        env.close()


@pytest.mark.parametrize("stop_at_done", [True, False])
def test_closed_loop_explore_calls_the_policy_branch_by_branch_at_every_step(stop_at_done):
    """A policy of one observation with state of its own (a random generator) is called in the
    same order as ever -- branch 0, 1, ... at step 0, then again at step 1 -- although each
    branch's next step now goes out as soon as its reply is read; every branch is exactly the
    steps its actions give, one call at a time from the same snapshot."""
    env = gym_fork.make("LunarLander-v3", backend="criu", fork_tier=True)
    try:
        env.reset(seed=4)
        run_actions(env, [0, 1, 2, 3] * 5)
        root = env.snapshot()
        rng = np.random.default_rng(11)
        calls = []

        def policy(obs):
            calls.append(np.array(obs, copy=True))
            return int(rng.integers(0, 4))

        seeds = [101, 102, 103, 104, 105, 106]
        res = gym_fork.explore(env, root, policy, n_branches=6, horizon=120, rng="reseed", seeds=seeds,
                               stop_at_done=stop_at_done, progress=False)
        draws = np.random.default_rng(11).integers(0, 4, len(calls))  # what the calls drew, in order
        assert len(calls) == sum(len(b.actions) for b in res.branches)
        pos = 0
        seen: dict[int, list] = {b.index: [] for b in res.branches}
        for t in range(120):  # round t: the branches still running, in index order
            for b in res.branches:
                if len(b.actions) > t:
                    assert b.actions[t] == draws[pos], (t, b.index)
                    seen[b.index].append(calls[pos])
                    pos += 1
        assert pos == len(calls)
        if stop_at_done:
            assert any(len(b.actions) < 120 for b in res.branches), "some branch should end early"
        for b, seed in zip(res.branches, seeds):
            k = env.fork(root, 1, rng="reseed", seeds=[seed])[0]
            try:
                obs = k._request("last")[0]
                rewards = []
                for t, a in enumerate(b.actions):
                    assert same(obs, seen[b.index][t]), f"branch {b.index}: the policy saw another obs at step {t}"
                    obs, r, term, trunc, _ = k.step(a)
                    rewards.append(float(r))
                    if (term or trunc) and not stop_at_done:
                        obs, _ = k.reset()
                assert rewards == b.rewards
            finally:
                k.close()
    finally:
        env.close()


@pytest.mark.parametrize("stop_at_done", [True, False])
def test_open_loop_explore_equals_stepping(stop_at_done):
    env = gym_fork.make("LunarLander-v3", backend="criu")
    try:
        env.reset(seed=1)
        for _ in range(10):
            env.step(0)
        root = env.snapshot()
        rng = np.random.default_rng(0)
        seqs = [[int(a) for a in rng.integers(0, 4, 150)] for _ in range(4)]
        fast = gym_fork.explore(env, root, None, n_branches=4, horizon=150, rng="same", actions=seqs,
                                stop_at_done=stop_at_done, return_snapshots=True)
        for seq, b in zip(seqs, fast.branches):
            k = env.fork(root, 1)[0]  # the same branch, stepped one call at a time
            try:
                rewards, last, ended = [], None, (False, False)
                for a in seq:
                    last = k.step(a)
                    rewards.append(float(last[1]))
                    if last[2] or last[3]:
                        ended = (bool(last[2]), bool(last[3]))  # the last episode end seen
                        if stop_at_done:
                            break
                        k.reset()
                assert rewards == b.rewards and b.actions == seq[: len(rewards)]
                assert same(last[0], b.final_obs) and (b.terminated, b.truncated) == ended
                assert b.snapshot.steps == k.steps
            finally:
                k.close()
        with pytest.raises(ValueError, match="either a policy"):
            gym_fork.explore(env, root, lambda o: 0, n_branches=4, actions=seqs)
        with pytest.raises(ValueError, match="one sequence per branch"):
            gym_fork.explore(env, root, None, n_branches=3, actions=seqs)
        # rollout keeps the env's step counter and action path consistent
        env.restore(root)
        out = env.rollout(seqs[0][:5])
        assert env.steps == root.steps + 5 == out["steps"] and len(env.snapshot().actions) == 5
    finally:
        env.close()


def test_closing_many_envs_at_once_closes_every_workers_env_and_stops_every_worker(tmp_path):
    """close_envs (and explore() for its branches) sends every worker its polite close before
    reading any reply: each worker still runs its env's close(), and every worker is gone after."""
    marks = str(tmp_path)

    def make():
        import uuid

        class Closing(gym.Env):
            observation_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)
            action_space = gym.spaces.Discrete(2)

            def reset(self, *, seed=None, options=None):
                super().reset(seed=seed)
                return np.zeros(1, np.float32), {}

            def step(self, action):
                return np.zeros(1, np.float32), 1.0, False, False, {}

            def close(self):
                open(os.path.join(marks, uuid.uuid4().hex), "w").close()

        return Closing()

    env = gym_fork.ForkableEnv(make, backend="criu", untracked_paths=[marks])
    try:
        env.reset(seed=0)
        kids = env.fork(env.snapshot(), 4)
        for k in kids:
            k.step(0)
        pids = [k.worker_pid for k in kids]
        handles = [k._handle for k in kids]
        sent_before_first_stop = []
        real_kill = type(handles[0]).kill

        def kill(self):
            if not sent_before_first_stop:
                sent_before_first_stop.append(sum(h._close_sent for h in handles))
            real_kill(self)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(type(handles[0]), "kill", kill)
            gym_fork.env.close_envs(kids)
        assert sent_before_first_stop == [4]  # all four closes were on their way before any stop
        assert all(k.closed for k in kids)
        assert len(os.listdir(marks)) == 4  # each copy's env.close() ran, in its worker
        deadline = time.monotonic() + 10
        while any(process_alive(p) for p in pids):
            assert time.monotonic() < deadline, "a closed copy's worker is still running"
            time.sleep(0.02)
        env.step(0)  # the env they were forked from is untouched
    finally:
        env.close()
    assert len(os.listdir(marks)) == 5



def _normalising_policy(o):
    o -= 0.01  # an in-place "normalisation" of the observation it is given
    return int(o[0] > -0.02)


class _BufferPolicy:
    """Returns one action array it fills anew at every step (a preallocated output buffer)."""

    def __init__(self):
        self.out = np.zeros(1, np.float32)
        self.t = 0

    def __call__(self, obs):
        self.t += 1
        self.out[0] = -1.0 + 0.25 * (self.t % 8)
        return self.out


@pytest.mark.criu
@pytest.mark.parametrize("policy_in_worker", [False, True], ids=["learner", "workers"])
def test_branches_own_their_observations_and_actions(policy_in_worker):
    """Before, with the policy in the learner, every branch's first step was chosen from one shared
    observation object, so a policy that changes its observation in place changed it for the
    branches after it (rng="same" branches differed); and a policy returning one reused action
    array left ``Branch.actions`` (and the branch snapshots' ``actions``) all equal to its last
    content, in both modes, so replaying them gave another return."""
    env = gym_fork.make("CartPole-v1")
    try:
        env.reset(seed=0)
        snap = env.snapshot()
        res = gym_fork.explore(env, snap, _normalising_policy, n_branches=4, horizon=20, rng="same",
                               policy_in_worker=policy_in_worker)
        assert len({tuple(b.actions) for b in res.branches}) == 1
    finally:
        env.close()
    env = gym_fork.make("Pendulum-v1")
    try:
        env.reset(seed=0)
        snap = env.snapshot()
        res = gym_fork.explore(env, snap, _BufferPolicy(), n_branches=1, horizon=6, rng="same",
                               policy_in_worker=policy_in_worker, return_snapshots=True)
        b = res.branches[0]
        assert [float(a[0]) for a in b.actions] == [-0.75, -0.5, -0.25, 0.0, 0.25, 0.5]
        assert [float(a[0]) for a in b.snapshot.actions] == [-0.75, -0.5, -0.25, 0.0, 0.25, 0.5]
        env.restore(snap)
        replayed = [env.step(a)[1] for a in b.actions]
        assert replayed == b.rewards
        out = env.rollout(policy=_BufferPolicy(), steps=3)
        assert [float(a[0]) for a in out["actions"]] == [-0.75, -0.5, -0.25]
    finally:
        env.close()


@pytest.mark.criu
def test_explore_and_fork_from_now_leave_the_envs_timeline_alone():
    """``explore(env, None, ...)`` and ``fork(None)`` snapshot the env's present state for the
    branches. Before, that snapshot became the env's parent (then released), so the env's next
    snapshot had a released parent and lost the actions since its real one."""
    env = gym_fork.make("CartPole-v1")
    try:
        env.reset(seed=0)
        s1 = env.snapshot()
        env.step(0)
        gym_fork.explore(env, None, lambda o: 1, n_branches=2, horizon=3)
        env.step(1)
        for kid in env.fork(None, 1):
            kid.close()
        env.step(0)
        s2 = env.snapshot()
        assert (s2.parent_id, s2.actions, s2.steps) == (s1.id, [0, 1, 0], 3)
    finally:
        env.close()


@pytest.mark.criu
def test_a_branch_snapshot_after_an_auto_reset_starts_a_new_timeline():
    """With ``stop_at_done=False`` a branch resets at its episode end and goes on. Before, its
    snapshot still named the root as parent, with only the actions since the reset: a path from
    the root that reached another state."""
    env = gym_fork.make("CartPole-v1", max_episode_steps=10)
    try:
        env.reset(seed=0)
        root = env.snapshot()
        res = gym_fork.explore(env, root, lambda o: 0, n_branches=1, horizon=14, rng="same",
                               stop_at_done=False, return_snapshots=True)
        b = res.branches[0]
        assert len(b.actions) == 14 and b.snapshot.steps == 4
        assert b.snapshot.parent_id is None and b.snapshot.actions == [0, 0, 0, 0]
    finally:
        env.close()


@pytest.mark.criu
@pytest.mark.parametrize("fork_tier", [True, False])
def test_branches_that_go_on_past_episode_ends_reset_in_their_workers_and_their_snapshots_do_not(
        fork_tier, monkeypatch):
    """With ``stop_at_done=False`` each branch's worker resets right after the step that ends an
    episode and sends the new episode's start with it: the learner makes no reset round trip
    (before: one per episode end, waited for while the other branches' steps queued up). The
    branches still match a replay in one process. The reset rides on each step request (packed
    kind "A"), it is no mode of the worker: a branch's end snapshot (a fork, or a CRIU dump),
    restored and stepped, runs to the episode's end and stays there, as any env does."""
    from gym_fork.worker.commands import AUTORESET_KEY

    env = gym_fork.make("CartPole-v1", max_episode_steps=10, fork_tier=fork_tier)
    try:
        env.reset(seed=0)
        root = env.snapshot()
        resets = []
        real_reset = gym_fork.ForkableEnv.reset
        monkeypatch.setattr(gym_fork.ForkableEnv, "reset", lambda self, **kw: resets.append(1) or real_reset(self, **kw))
        policy = lambda o: int(o[2] > 0)  # noqa: E731
        res = gym_fork.explore(env, root, policy, n_branches=2, horizon=25, rng="same", stop_at_done=False,
                               return_snapshots=True)
        monkeypatch.undo()
        assert resets == []
        plain = gym.make("CartPole-v1", max_episode_steps=10)
        for b in res.branches:
            obs, _ = plain.reset(seed=0)
            rewards = []
            for a in b.actions:
                obs, r, term, trunc, info = plain.step(a)
                rewards.append(r)
                final = obs
                if term or trunc:
                    obs, _ = plain.reset()
            assert b.rewards == rewards and same(b.final_obs, final) and AUTORESET_KEY not in b.final_info
            # the branch's end, restored: 25 steps = 2 episodes of 10 + 5 steps into the third
            env.restore(b.snapshot)
            for _ in range(5):
                obs, _r, term, trunc, info = env.step(0)
                ref = plain.step(0)
                assert same(obs, ref[0]) and AUTORESET_KEY not in info
            assert trunc  # ... and the env stays at that end (a reset after it would start anew)
            assert same(env.step(0)[0], plain.step(0)[0])
    finally:
        env.close()


def _dict_obs_env():
    class DictObs(gym.Env):
        observation_space = gym.spaces.Dict({"a": gym.spaces.Box(-1.0, 1.0, (3,), np.float32),
                                             "b": gym.spaces.Discrete(4)})
        action_space = gym.spaces.Discrete(2)

        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            self.t = 0
            return self.observation_space.sample(), {}

        def step(self, action):
            self.t += 1
            return self.observation_space.sample(), float(action), self.t >= 50, False, {}

    return DictObs()


@pytest.mark.criu
def test_explore_with_an_sb3_model_of_a_dict_observation_space():
    """Before: the branches' observations were stacked as arrays (np.stack), which a Dict space's
    are not: IndexError, though the model's own predict took them (MultiInputPolicy)."""
    from stable_baselines3 import PPO

    env = gym_fork.ForkableEnv(_dict_obs_env)
    try:
        env.reset(seed=0)
        model = PPO("MultiInputPolicy", _dict_obs_env(), n_steps=64, seed=0, device="cpu")
        res = gym_fork.explore(env, env.snapshot(), model, n_branches=3, horizon=5)
        assert [b.length for b in res.branches] == [5, 5, 5]
    finally:
        env.close()

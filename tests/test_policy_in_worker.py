"""Closed-loop branches whose policy runs inside the env's worker: ``ForkableEnv.rollout(policy=)``
and ``explore(..., policy_in_worker=True)`` must equal the same policy run here, step by step."""

from __future__ import annotations

import os
import warnings

import gymnasium as gym
import numpy as np
import pytest
from conftest import eventually, process_alive, process_states, same

import gym_fork
from gym_fork.errors import PolicyError, WorkerError


def lean(obs) -> int:
    """A deterministic closed-loop CartPole policy: push towards where the pole leans (it drops the
    pole after ~40 steps, so branches cross episode ends)."""
    return int(obs[2] > 0)


class Noisy:
    """A stochastic policy with its own generator (one per branch)."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def __call__(self, obs) -> int:
        return int(self.rng.random() < 0.5 + 0.4 * np.tanh(obs[2] * 10))


class FailsAt:
    def __init__(self, n: int):
        self.n, self.calls = n, 0

    def __call__(self, obs) -> int:
        self.calls += 1
        if self.calls == self.n:
            raise KeyError("no action for this state")
        return 0


@pytest.fixture
def cartpole():
    """A CartPole ForkableEnv, reset with seed 0; closed after the test."""
    env = gym_fork.make("CartPole-v1")
    env.reset(seed=0)
    yield env
    env.close()


def stepped(env, policy, steps: int, stop_at_done: bool) -> dict:
    """The rollout, one ``step()`` call per action, the policy run here."""
    actions, rewards, ended, last = [], [], (False, False), None
    obs = env._request("last")[0]  # the observation the env last returned
    for _ in range(steps):
        a = policy(obs)
        actions.append(a)
        last = env.step(a)
        rewards.append(float(last[1]))
        obs = last[0]
        if last[2] or last[3]:
            ended = (bool(last[2]), bool(last[3]))
            if stop_at_done:
                break
            obs, _ = env.reset()
    return {"actions": actions, "rewards": rewards, "terminated": ended[0], "truncated": ended[1],
            "final_obs": last[0], "final_info": last[4], "steps": env.steps}


@pytest.mark.parametrize("stop_at_done", [True, False])
def test_rollout_with_a_policy_in_the_worker_equals_stepping_it_here(stop_at_done):
    env = gym_fork.make("LunarLander-v3")
    try:
        env.reset(seed=3)
        root = env.snapshot()

        def policy(obs):  # closes over a value; the worker gets its own copy
            return int(np.argmax(np.abs(obs[:4]))) % 4

        fast = env.rollout(policy=policy, steps=400, stop_at_done=stop_at_done)
        after_fast = env.step(1)
        snap_fast = env.snapshot()
        env.restore(root)
        slow = stepped(env, policy, 400, stop_at_done)
        after_slow = env.step(1)
        snap_slow = env.snapshot()
        assert fast.keys() == slow.keys()
        for key in fast:
            assert same(fast[key], slow[key]), key
        assert same(after_fast, after_slow)  # the env went on from the same state
        assert snap_fast.steps == snap_slow.steps and snap_fast.actions == snap_slow.actions
        assert snap_fast.parent_id == snap_slow.parent_id
    finally:
        env.close()


@pytest.mark.parametrize("kind", [{"fork_tier": True}, {"fork_tier": False}, {"backend": "pickle"}],
                         ids=["fork-tier", "criu", "pickle"])
@pytest.mark.parametrize("stop_at_done", [True, False])
def test_explore_with_the_policy_in_the_workers_equals_the_learner_side_loop(kind, stop_at_done):
    env = gym_fork.make("CartPole-v1", **kind)
    try:
        env.reset(seed=0)
        for _ in range(5):
            env.step(0)
        root = env.snapshot()
        here = gym_fork.explore(env, root, lean, n_branches=3, horizon=300, rng="same", stop_at_done=stop_at_done,
                                return_snapshots=True)
        there = gym_fork.explore(env, root, lean, n_branches=3, horizon=300, rng="same",
                                 stop_at_done=stop_at_done, return_snapshots=True, policy_in_worker=True)
        for a, b in zip(here.branches, there.branches):
            assert a.actions == b.actions and a.rewards == b.rewards and a.length > 9
            assert (a.terminated, a.truncated) == (b.terminated, b.truncated)
            assert same(a.final_obs, b.final_obs) and same(a.final_info, b.final_info)
            assert a.snapshot.steps == b.snapshot.steps and a.snapshot.actions == b.snapshot.actions
            ka, kb = env.fork(a.snapshot, 1)[0], env.fork(b.snapshot, 1)[0]
            try:  # the branches' end states are the same states
                assert same(ka.step(1), kb.step(1))
            finally:
                ka.close()
                kb.close()
        if not stop_at_done:  # the policy went on from the reset observation after episode ends
            assert all(b.length == 300 for b in there.branches) and there.branches[0].terminated
    finally:
        env.close()


def test_one_policy_per_branch_each_with_its_own_generator(cartpole):
    env = cartpole
    root = env.snapshot()
    runs = [gym_fork.explore(env, root, [Noisy(s) for s in range(4)], n_branches=4, horizon=40, rng="same",
                             policy_in_worker=True) for _ in range(2)]
    assert [b.actions for b in runs[0].branches] == [b.actions for b in runs[1].branches]  # reproducible
    assert len({tuple(b.actions) for b in runs[0].branches}) == 4  # and different per branch
    shared = Noisy(7)
    before = shared.rng.bit_generator.state
    with pytest.warns(UserWarning, match="all branches draw the same numbers"):
        one = gym_fork.explore(env, root, shared, n_branches=3, horizon=40, rng="same", policy_in_worker=True)
    # one policy object: every branch steps its own copy of it, so all draw the same numbers,
    # and the learner's object is not advanced
    assert len({tuple(b.actions) for b in one.branches}) == 1
    assert shared.rng.bit_generator.state == before
    gen = np.random.default_rng(0)
    with pytest.warns(UserWarning, match="same numbers"):  # a generator closed over, too
        gym_fork.explore(env, root, lambda o: int(gen.random() < 0.5), n_branches=2, horizon=5,
                         policy_in_worker=True, rng="same")
    import warnings

    with warnings.catch_warnings():
        # one policy per branch, or a deterministic one: no warning about the policy (a deterministic
        # policy in CartPole's deterministic steps does make alike branches, which explore() says)
        warnings.simplefilter("error", UserWarning)
        gym_fork.explore(env, root, [Noisy(1), Noisy(2)], n_branches=2, horizon=5, policy_in_worker=True)
        gym_fork.explore(env, root, lean, n_branches=2, horizon=5, policy_in_worker=True)
        # with rng="reseed" (the default) each copy of the one policy gets its branch's seed
        gym_fork.explore(env, root, shared, n_branches=2, horizon=5, policy_in_worker=True)


_GLOBAL_RNG = np.random.default_rng(3)


def global_noisy(obs) -> int:
    """A stochastic policy drawing from its module's generator (pickled by reference: a worker
    imports this module and has that generator of its own)."""
    return int(_GLOBAL_RNG.random() < 0.5 + 0.4 * np.tanh(obs[2] * 10))


def closed_over_noisy(seed: int):
    gen = np.random.default_rng(seed)
    return lambda obs: int(gen.random() < 0.5 + 0.4 * np.tanh(obs[2] * 10))


_KINDS = {"fork-tier": {"fork_tier": True}, "criu": {"fork_tier": False}, "pickle": {"backend": "pickle"}}


# (not module-global x pickle: in process, a policy pickled by reference is the learner's own
# function and generator)
@pytest.mark.parametrize("kind, policy", [(k, p) for p in ("object", "closure", "module-global") for k in _KINDS
                                          if (k, p) != ("pickle", "module-global")])
def test_one_stochastic_policy_shared_by_all_branches_draws_per_branch_with_reseed(kind, policy):
    """rng="reseed": each branch's copy of the one policy has its generators reseeded from the
    branch's seed, as the env's are: the branches differ (they were all alike, wasted work), and
    the same seeds give the same branches again (explore()'s reproducibility from Branch.seed)."""
    kind = _KINDS[kind]
    make = {"object": lambda: Noisy(7), "closure": lambda: closed_over_noisy(7),
            "module-global": lambda: global_noisy}[policy]
    env = gym_fork.make("CartPole-v1", **kind)
    try:
        env.reset(seed=0)
        root = env.snapshot()

        def run(seeds):
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # neither "same numbers" nor "all branches alike"
                res = gym_fork.explore(env, root, make(), n_branches=len(seeds), horizon=40, seeds=seeds,
                                       policy_in_worker=True, stop_at_done=False)
            return [tuple(b.actions) for b in res.branches]

        first = run([11, 12, 13, 14])
        assert len(set(first)) == 4  # each branch its own draws
        assert run([11, 12, 13, 14]) == first  # reproducible from the seeds
        assert run([13, 11]) == [first[2], first[0]]  # a branch's seed alone decides it
        if policy == "object":  # one policy per branch keeps its own seeds (not reseeded)
            # (to the episode's end: CartPole's reset draws from the env's reseeded generator)
            own = gym_fork.explore(env, root, [Noisy(1), Noisy(2)], n_branches=2, horizon=40, seeds=[11, 12],
                                   policy_in_worker=True)
            ref = gym_fork.explore(env, root, Noisy(2), n_branches=1, horizon=40, rng="same")
            assert own.branches[1].actions == ref.branches[0].actions
    finally:
        env.close()


@pytest.mark.parametrize("kind", [{}, {"backend": "pickle"}], ids=["worker", "in-process"])
def test_a_policy_that_raises_in_the_worker_says_so_and_the_env_accounts_for_the_steps_taken(kind):
    env = gym_fork.make("CartPole-v1", **kind)
    ref = gym_fork.make("CartPole-v1")
    try:
        for e in (env, ref):
            e.reset(seed=1)
        root = env.snapshot()
        with pytest.raises(PolicyError, match=r"KeyError: 'no action for this state' \(at step 6") as info:
            env.rollout(policy=FailsAt(7), steps=50)
        if kind:  # in process: the PolicyError itself, the policy's exception its cause
            assert isinstance(info.value.__cause__, KeyError)
        else:
            assert isinstance(info.value, WorkerError)
            assert 'raise KeyError("no action for this state")' in info.value.remote_traceback  # the policy's line
        for _ in range(6):
            ref.step(0)
        assert env.steps == 6 and env.snapshot().actions == [0] * 6  # the 6 steps it did take
        assert same(env.step(1), ref.step(1))  # and the env is where those 6 steps left it
        with pytest.raises(PolicyError, match="at step 2"):
            gym_fork.explore(env, root, [FailsAt(99), FailsAt(3)], n_branches=2, horizon=20,
                             policy_in_worker=True)
        assert env.steps == 7  # explore never touches the env itself
    finally:
        env.close()
        ref.close()


def test_policies_that_cannot_run_in_the_worker_are_refused_before_anything_runs(cartpole):
    import threading

    from stable_baselines3 import PPO

    env = cartpole
    lock = threading.Lock()
    with pytest.raises(TypeError, match="cannot send the policy .* to the worker process"):
        env.rollout(policy=lambda obs: 0 if lock else 1, steps=5)
    with pytest.raises(TypeError, match="policy must be a callable"):
        env.rollout(policy=3, steps=5)
    with pytest.raises(ValueError, match="needs steps=N"):
        env.rollout(policy=lean)
    with pytest.raises(ValueError, match="either open-loop `actions` or a `policy`"):
        env.rollout([0, 1], policy=lean, steps=2)
    with pytest.raises(ValueError, match="`steps` goes with a `policy`"):
        env.rollout([0, 1], steps=2)
    model = PPO("MlpPolicy", "CartPole-v1", n_steps=64)
    with pytest.raises(TypeError, match="Stable-Baselines3 model cannot run inside"):
        gym_fork.explore(env, None, model, n_branches=2, horizon=5, policy_in_worker=True)
    with pytest.raises(ValueError, match="one per branch \\(3\\), got 2"):
        gym_fork.explore(env, None, [lean, lean], n_branches=3, horizon=5, policy_in_worker=True)
    with pytest.raises(ValueError, match="needs a policy"):
        gym_fork.explore(env, None, None, n_branches=2, horizon=5, actions=[[0], [1]], policy_in_worker=True)
    assert env.steps == 0  # nothing ran
    env.step(0)


@pytest.mark.parametrize("fork_tier", [True, False])
def test_when_one_branch_fails_explore_stops_the_others_instead_of_waiting_for_them(fork_tier):
    env = gym_fork.make("CartPole-v1", fork_tier=fork_tier)
    try:
        env.reset(seed=1)
        # the other branches would step for hours (10**9 steps, auto-resetting): the test ends
        # only if explore() stops them when branch 0's policy raises, rather than waiting
        with pytest.raises(PolicyError) as info:
            gym_fork.explore(env, None, [FailsAt(2), FailsAt(0), FailsAt(0)], n_branches=3, horizon=10**9,
                             stop_at_done=False, policy_in_worker=True, progress=False)
        assert "(in explore()'s branch 0)" in info.value.__notes__
        assert env.step(0)[0].shape == (4,) and env.steps == 1  # the env itself is untouched
    finally:
        env.close()


def test_a_worker_stops_its_long_rollout_when_its_controller_dies():
    import os
    import subprocess
    import sys
    import time

    script = (
        "import os, sys, time, gym_fork\n"
        "sys.path.insert(0, 'tests')\n"
        "from test_policy_in_worker import FailsAt\n"
        "env = gym_fork.make('CartPole-v1', fork_tier=False)\n"
        "env.reset(seed=0)\n"
        "env.rollout_send(policy=FailsAt(0), steps=10**9, stop_at_done=False)  # hours of steps\n"
        "print(env.worker_pid, flush=True)\n"
        "time.sleep(0.3)\n"
        "os._exit(0)  # the controller dies mid-rollout\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=120)
    pid = int(out.stdout.split()[0])

    def running() -> bool:
        return process_alive(pid)

    for _ in range(200):  # it looks every 64 steps (~1 ms here) whether anyone still waits
        if not running():
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        pytest.fail("the worker went on with its rollout after its controller died")


def test_an_older_worker_without_rollout_actions_or_progress_still_keeps_the_counts(monkeypatch):
    """A worker restored from an older gym_fork's images runs that version's code: its rollout
    replies carry no ``actions`` and it knows no ``rollout_progress``. (The pickle backend runs
    the env's server in this process, so the older behaviour can be put in place here.)"""
    from gym_fork.worker.commands import EnvServer

    new_rollout = EnvServer.cmd_rollout

    def old_rollout(self, actions, stop_at_done):
        out = new_rollout(self, actions, stop_at_done)
        del out["actions"]
        return out

    monkeypatch.setattr(EnvServer, "cmd_rollout", old_rollout)
    monkeypatch.delattr(EnvServer, "cmd_rollout_progress")
    env = gym_fork.make("CartPole-v1", backend="pickle")
    try:
        env.reset(seed=0)
        out = env.rollout([0, 1, 0, 1, 1])
        assert env.steps == 5 and env.snapshot().actions == [0, 1, 0, 1, 1] and out["actions"] == [0, 1, 0, 1, 1]
        with pytest.raises(AssertionError, match="invalid"):  # the env's error, though its progress is unknown
            env.rollout([0, 7, 1])
    finally:
        env.close()


class StateBuffer(gym.Env):
    """Returns its own state array as the observation (no copy), as some envs do."""

    observation_space = gym.spaces.Box(-1e9, 1e9, (2,), np.float64)
    action_space = gym.spaces.Discrete(2)

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        self.state = np.zeros(2)
        return self.state, {}

    def step(self, action):
        self.state[0] += 1.0
        self.state[1] += action
        return self.state, float(self.state[0]), False, False, {}


def normalise_in_place(obs) -> int:
    obs -= 1.0  # what many preprocessing policies do
    return 1


def test_a_policy_that_changes_its_observation_in_place_does_not_change_the_env():
    env = gym_fork.ForkableEnv(StateBuffer)
    try:
        env.reset(seed=0)
        root = env.snapshot()
        here = gym_fork.explore(env, root, normalise_in_place, n_branches=1, horizon=5, rng="same")
        there = gym_fork.explore(env, root, normalise_in_place, n_branches=1, horizon=5, rng="same",
                                 policy_in_worker=True)
        assert here.branches[0].rewards == there.branches[0].rewards == [1.0, 2.0, 3.0, 4.0, 5.0]
        assert same(here.branches[0].final_obs, there.branches[0].final_obs)
    finally:
        env.close()


_POLICY_MODULE = '''
import os, time
{extra}
with open({log!r}, "a") as f:  # who imported this module
    f.write(f"{{os.getpid()}}\\n")
time.sleep(0.05)  # an expensive import (a policy module that imports torch takes seconds)


class Lean:
    def __call__(self, obs):
        return int(obs[2] > 0)


class TorchCoin:
    """A stochastic policy drawing from torch's global generator (the module needs torch)."""
    def __call__(self, obs):
        import torch
        return int(torch.rand(()).item() < 0.5)


class Seeded:
    """A stochastic policy with a generator of its own (one per branch)."""
    def __init__(self, seed):
        import numpy as np
        self.rng = np.random.default_rng(seed)

    def __call__(self, obs):
        return int(self.rng.random() < 0.5 + 0.4 * (obs[2] > 0))
'''


def _policy_module(tmp_path, monkeypatch, name: str, extra: str = ""):
    """A module defining ``Lean`` whose import takes 50 ms and appends the importing pid to a
    file; importable in the workers (on sys.path before the env starts). Returns (module, log)."""
    import importlib
    import os

    log = tmp_path / f"{name}.imports"
    (tmp_path / f"{name}.py").write_text(_POLICY_MODULE.format(extra=extra, log=str(log)))
    monkeypatch.syspath_prepend(str(tmp_path))
    mod = importlib.import_module(name)
    importers = lambda: [p for p in log.read_text().split() if int(p) != os.getpid()]  # noqa: E731
    return mod, log, importers


@pytest.mark.parametrize("preload", [True, False], ids=["preloaded", "each-branch"])
def test_a_policy_from_a_module_is_imported_once_for_all_branches(tmp_path, monkeypatch, preload):
    """A policy pickled by reference (its class lives in a module) makes each branch's worker
    import that module; explore() has the first branch import it and forks the others from there.
    With preloading off (an infinite threshold) every branch imports it, with the same branches."""
    from gym_fork.backends import criu

    mod, log, importers = _policy_module(tmp_path, monkeypatch, f"slow_policy_{preload}")
    if not preload:
        monkeypatch.setattr(criu, "PRELOAD_MIN_SAVING_S", float("inf"))
    env = gym_fork.make("CartPole-v1", fork_tier=True, untracked_paths=[str(log)])
    try:
        env.reset(seed=0)
        root = env.snapshot()
        here = gym_fork.explore(env, root, mod.Lean(), n_branches=6, horizon=30, rng="same")
        assert importers() == []  # the learner-side loop imports nothing in the workers
        there = gym_fork.explore(env, root, mod.Lean(), n_branches=6, horizon=30, rng="same",
                                 policy_in_worker=True, return_snapshots=True)
        assert len(importers()) == (1 if preload else 6)
        for a, b in zip(here.branches, there.branches):
            assert a.actions == b.actions and a.rewards == b.rewards and a.length > 9
            assert same(a.final_obs, b.final_obs)
            assert b.snapshot.actions == b.actions and b.snapshot.parent_id == root.id
        k = env.fork(there.branches[2].snapshot, 1)[0]  # a branch's end state restores as any other
        try:
            assert k.steps == there.branches[2].snapshot.steps and k.step(0)[0].shape == (4,)
        finally:
            k.close()
        # one policy per branch (distinct pickles, one module): the first branch imports the
        # module without making any policy; each branch unpickles its own
        before = len(importers())
        seeded = gym_fork.explore(env, root, [mod.Seeded(s) for s in range(6)], n_branches=6, horizon=30,
                                  policy_in_worker=True, rng="same")
        assert len(importers()) - before == (1 if preload else 6)
        for s, b in enumerate(seeded.branches):
            ref = gym_fork.explore(env, root, mod.Seeded(s), n_branches=1, horizon=30, rng="same").branches[0]
            assert b.actions == ref.actions and b.rewards == ref.rewards
        assert len({tuple(b.actions) for b in seeded.branches}) > 1  # each its own draws
        assert env.steps == 0  # the env itself never moved
    finally:
        env.close()


def test_a_policy_module_that_starts_a_thread_leaves_each_branch_to_import_it(tmp_path, monkeypatch):
    """The first branch's worker, once the module started a thread, cannot be forked: the other
    branches are cloned from the snapshot and import the module themselves -- slower, as exact."""
    mod, log, importers = _policy_module(
        tmp_path, monkeypatch, "threaded_policy",
        extra="import threading\nthreading.Thread(target=time.sleep, args=(600,), daemon=True).start()")
    env = gym_fork.make("CartPole-v1", fork_tier=True, untracked_paths=[str(log)])
    try:
        env.reset(seed=0)
        root = env.snapshot()
        there = gym_fork.explore(env, root, mod.Lean(), n_branches=4, horizon=60, policy_in_worker=True)
        here = gym_fork.explore(env, root, mod.Lean(), n_branches=4, horizon=60)
        assert len(importers()) == 4
        assert [b.actions for b in there.branches] == [b.actions for b in here.branches]
        assert [b.rewards for b in there.branches] == [b.rewards for b in here.branches]
    finally:
        env.close()


def test_a_policy_the_workers_cannot_unpickle_fails_as_without_preloading(tmp_path, monkeypatch):
    """A module on the learner's path only (added after the env started): every branch fails to
    unpickle the policy, with the same error whether or not the first one tried to preload it."""
    from gym_fork.backends import criu

    env = gym_fork.make("CartPole-v1", fork_tier=True)
    try:
        env.reset(seed=0)
        mod, _log, _importers = _policy_module(tmp_path, monkeypatch, "learner_only_policy")
        root = env.snapshot()
        errors = []
        for threshold in (0.0, float("inf")):
            monkeypatch.setattr(criu, "PRELOAD_MIN_SAVING_S", threshold)
            with pytest.raises(WorkerError) as info:
                gym_fork.explore(env, root, mod.Lean(), n_branches=3, horizon=10, policy_in_worker=True)
            errors.append((type(info.value), str(info.value).split("\n")[0]))
        assert errors[0] == errors[1] and "learner_only_policy" in errors[0][1]
        assert env.step(0)[0].shape == (4,) and env.steps == 1  # the env itself is untouched
    finally:
        env.close()


def test_preloaded_branches_leave_no_zombie_behind(tmp_path, monkeypatch):
    """Preloaded branches are clones of a snapshot of the first branch's worker, released while
    they run; they, that frozen process and the first branch end under the root snapshot's frozen
    process, which collects them -- the worker (which collects orphans only when it scans, at its
    next snapshot) never gets them, so explore() after explore() from one root leaves no zombie."""
    mod, log, importers = _policy_module(tmp_path, monkeypatch, "policy_for_zombies")
    env = gym_fork.make("CartPole-v1", fork_tier=True, untracked_paths=[str(log)])
    try:
        env.reset(seed=0)
        root = env.snapshot()
        for i in range(4):
            gym_fork.explore(env, root, mod.Lean(), n_branches=5, horizon=20, policy_in_worker=True)
            env.step(i % 2)  # steps: no scan in the worker
        assert len(importers()) == 4  # each explore() preloaded (once each)
        worker = env.worker_pid

        def settled() -> bool:  # all branch processes gone: the root's frozen process is left, with
            return len(process_states(worker, tree=True)) <= 3  # up to two ready copies (clones came in a burst)

        assert eventually(settled), process_states(worker, tree=True)
        assert "Z" not in process_states(worker, tree=True).values(), process_states(worker, tree=True)
    finally:
        env.close()


_WEIGHTS_MODULE = '''
import os
import numpy as np


class Weighted:
    """A policy with 64 MB of weights; says (in a file) which process unpickles it."""
    def __init__(self):
        self.w = np.ones((4096, 2048))

    def __setstate__(self, state):
        with open({log!r}, "a") as f:
            f.write(f"{{os.getpid()}}\\n")
        self.__dict__.update(state)

    def __call__(self, obs):
        return int(obs[2] * self.w[0, 0] > 0)
'''


def test_one_policy_with_heavy_state_shared_by_all_branches_is_unpickled_once(tmp_path, monkeypatch):
    """No imports to save, but a policy that is slow to unpickle and shared by every branch: the
    other branches use the first one's unpickled instance instead of each unpickling it."""
    import importlib

    log = tmp_path / "weights.unpickled"
    log.write_text("")
    (tmp_path / "weighted_policy.py").write_text(_WEIGHTS_MODULE.format(log=str(log)))
    monkeypatch.syspath_prepend(str(tmp_path))
    mod = importlib.import_module("weighted_policy")
    env = gym_fork.make("CartPole-v1", fork_tier=True, untracked_paths=[str(log)])
    try:
        env.reset(seed=0)
        root = env.snapshot()
        there = gym_fork.explore(env, root, mod.Weighted(), n_branches=6, horizon=20, policy_in_worker=True,
                                 rng="same")
        assert len(set(log.read_text().split())) == 1  # one process unpickled it (twice: timed)
        here = gym_fork.explore(env, root, mod.Weighted(), n_branches=6, horizon=20, rng="same")
        assert [b.actions for b in there.branches] == [b.actions for b in here.branches]
    finally:
        env.close()


def test_the_modules_a_pickle_would_import_are_read_from_its_opcodes():
    """What ``import_modules`` imports ahead: the modules unpickling would import (by-reference
    globals, and the modules a cloudpickled function refers to), nothing unpickled."""
    import json
    import pickle

    import cloudpickle

    from gym_fork.worker.commands import pickled_modules

    assert pickled_modules(cloudpickle.dumps(FailsAt(3))) == [FailsAt.__module__]  # by reference
    assert pickled_modules(pickle.dumps(FailsAt(3), protocol=2)) == [FailsAt.__module__]  # GLOBAL

    def local(obs):  # by value: cloudpickle brings back the modules it uses with subimport()
        return json.dumps(int(np.argmax(obs)))

    mods = pickled_modules(cloudpickle.dumps(local))
    assert {"numpy", "json"} <= set(mods) and FailsAt.__module__ not in mods
    assert pickled_modules(b"not a pickle") == []


def test_a_policy_whose_import_brings_torch_is_reproducible_from_the_branch_seeds(tmp_path, monkeypatch):
    """Unpickling the policy in each branch's worker imports torch there, after the reseed, and
    torch seeds its generator from fresh entropy at import: the branches were not reproducible
    from their seeds. The worker reseeds generators that appeared since from the branch's seed."""
    mod, log, _ = _policy_module(tmp_path, monkeypatch, "torch_policy", extra="import torch")
    env = gym_fork.make("CartPole-v1", fork_tier=False, untracked_paths=[str(log)])  # no preloading
    try:
        env.reset(seed=0)
        root = env.snapshot()
        runs = [[tuple(b.actions) for b in gym_fork.explore(
            env, root, mod.TorchCoin(), n_branches=2, horizon=30, seeds=[5, 6], policy_in_worker=True,
            stop_at_done=False).branches] for _ in range(2)]
        assert runs[0] == runs[1] and runs[0][0] != runs[0][1]
    finally:
        env.close()


def test_a_torch_policy_loaded_ahead_draws_as_one_unpickled_by_its_branch(tmp_path, monkeypatch):
    """On the fork tier, n_branches > 1 has the policy unpickled (torch imported) once ahead, before
    the copies are reseeded. Before, the env's reseed then took torch's generator as the env's and
    reseeded it from another key: the same seed gave another branch with n_branches=2 than with
    1, or than ``fork()`` + ``rollout(policy=...)`` (which unpickle it after the reseed)."""
    mod, log, _ = _policy_module(tmp_path, monkeypatch, "torch_ahead_policy", extra="import torch")
    env = gym_fork.make("CartPole-v1", untracked_paths=[str(log)])  # the fork tier: preloading
    try:
        env.reset(seed=0)
        root = env.snapshot()
        kw = dict(horizon=30, stop_at_done=False, policy_in_worker=True)
        two = gym_fork.explore(env, root, mod.TorchCoin(), n_branches=2, seeds=[11, 12], **kw)
        one = gym_fork.explore(env, root, mod.TorchCoin(), n_branches=1, seeds=[11], **kw)
        (kid,) = env.fork(root, 1, rng="reseed", seeds=[11])
        try:
            by_rollout = kid.rollout(policy=mod.TorchCoin(), steps=30, stop_at_done=False)["actions"]
        finally:
            kid.close()
        assert two.branches[0].actions == one.branches[0].actions == by_rollout
        assert two.branches[0].actions != two.branches[1].actions
    finally:
        env.close()


@pytest.mark.parametrize("kind", list(_KINDS))
def test_rollout_in_reseeded_fork_children_draws_as_explores_branches(kind):
    """``fork(..., rng="reseed")`` then ``child.rollout(policy=...)``: each child's copy of the one
    stochastic policy is reseeded from the child's seed, exactly as explore() reseeds its branches
    (the children drew the same numbers before); ``reseed_policy=False`` keeps the policy's own."""
    env = gym_fork.make("CartPole-v1", **_KINDS[kind])
    try:
        env.reset(seed=0)
        root = env.snapshot()
        seeds = [11, 12, 13]
        branches = gym_fork.explore(env, root, Noisy(7), n_branches=3, horizon=40, seeds=seeds,
                                    policy_in_worker=True, stop_at_done=False)
        kids = env.fork(root, 3, rng="reseed", seeds=seeds)
        try:
            outs = [k.rollout(policy=Noisy(7), steps=40, stop_at_done=False) for k in kids]
            assert [o["actions"] for o in outs] == [b.actions for b in branches.branches]
            assert len({tuple(o["actions"]) for o in outs}) == 3
            for k in kids:
                k.restore(root)
            kept = [k.rollout(policy=Noisy(7), steps=40, stop_at_done=False, reseed_policy=False) for k in kids]
            same = env.fork(root, 1)[0]
            try:
                ref = same.rollout(policy=Noisy(7), steps=40, stop_at_done=False)
                with pytest.raises(ValueError, match="rng='reseed'"):
                    same.rollout(policy=Noisy(7), steps=5, reseed_policy=True)
                with pytest.raises(TypeError, match="reseed_policy must be True, False or None"):
                    kids[0].rollout(policy=Noisy(7), steps=5, reseed_policy="yes")
            finally:
                same.close()
            # the policy's own draws in every child; only the envs' resets (reseeded) tell them apart
            first_episode = [o["actions"][:10] for o in kept]
            assert first_episode == [ref["actions"][:10]] * 3
        finally:
            for k in kids:
                k.close()
        with pytest.raises(ValueError, match="goes with a `policy`"):
            env.rollout([0, 1], reseed_policy=True)
    finally:
        env.close()

"""``gym_fork.check_env`` and ``gym-fork check``: Gymnasium's checker sees the env's own bugs (it
runs in the worker), and the exactness check catches an env that no snapshot copies exactly."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

import gym_fork
from gym_fork.check import FAIL, PASS, REFUSES, WARN

import random_envs

pytestmark = pytest.mark.criu

BROKEN_MODULE = textwrap.dedent('''
    import gymnasium as gym
    import numpy as np

    class NoSeed(gym.Env):
        """reset() takes no seed/options: Gymnasium's checker must fail it."""
        observation_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
        action_space = gym.spaces.Discrete(2)

        def reset(self):
            return np.zeros(2, np.float32), {}

        def step(self, action):
            return np.zeros(2, np.float32), 0.0, False, False, {}

    def make_broken():
        return NoSeed()

    class Walk(gym.Env):
        observation_space = gym.spaces.Box(-100.0, 100.0, (1,), np.float64)
        action_space = gym.spaces.Discrete(2)

        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            self.x = float(self.np_random.normal())
            return np.array([self.x]), {}

        def step(self, action):
            self.x += (2 * int(action) - 1) * 0.5 + float(self.np_random.normal()) * 0.1
            return np.array([self.x]), -abs(self.x), abs(self.x) > 20, False, {}

    def make_good():
        return gym.wrappers.TimeLimit(Walk(), 30)
''')


@pytest.fixture
def project(tmp_path):
    (tmp_path / "checkenvs.py").write_text(BROKEN_MODULE)
    return tmp_path


def cli(project, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gym_fork.cli", "check", *args], cwd=project,
                          capture_output=True, text=True, timeout=300)


def test_cli_fails_an_env_whose_reset_breaks_the_api(project):
    out = cli(project, "checkenvs:make_broken", "--backends", "pickle")
    assert out.returncode == 1, out.stdout + out.stderr
    line = [x for x in out.stdout.splitlines() if "gymnasium checker" in x][0]
    assert "FAIL" in line and "seed" in line
    assert "verdict: FAILED" in out.stdout


def test_cli_passes_a_good_env_on_every_backend(project):
    out = cli(project, "checkenvs:make_good", "--steps", "60")
    assert out.returncode == 0, out.stdout + out.stderr
    rows = {x.split("  ")[1].strip(): x for x in out.stdout.splitlines() if x.startswith("  exact:")}
    assert len(rows) == 3 and all(" PASS " in r for r in rows.values()), out.stdout
    assert "save/load" in rows["exact: fork tier (copy-on-write)"]
    assert "verdict: OK" in out.stdout


def test_cli_says_in_one_line_that_an_env_cannot_be_made(project):
    for target, said in (("NoSuchEnv-v0", "doesn't exist"), ("nosuchmodule:make", "No module named 'nosuchmodule'")):
        out = cli(project, target, "--backends", "pickle")
        assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
        assert f"gym-fork check: cannot make {target}:" in out.stderr and said in out.stderr


def test_cli_usage_errors(project):
    assert cli(project, "CartPole-v1", "--backends", "nope").returncode == 2


def outside_state_factory(path: str):
    """An env whose state lives in a file outside its process: no snapshot holds it."""

    def make():
        import gymnasium as gym

        class FileCounter(gym.Env):
            observation_space = gym.spaces.Box(0.0, 1e9, (1,), np.float64)
            action_space = gym.spaces.Discrete(2)

            def reset(self, *, seed=None, options=None):
                super().reset(seed=seed)
                with open(path, "w") as f:
                    f.write("0")
                return np.zeros(1), {}

            def step(self, action):
                with open(path) as f:
                    n = int(f.read()) + 1 + int(action)
                with open(path, "w") as f:
                    f.write(str(n))
                return np.array([float(n)]), 0.0, False, False, {}

        return FileCounter()

    return make


def test_exactness_check_catches_state_outside_the_process(tmp_path):
    report = gym_fork.check_env(outside_state_factory(str(tmp_path / "counter")), steps=10, verbose=False)
    rows = {r.check: r for r in report.rows}
    assert rows["gymnasium checker"].verdict == PASS
    for label in ("exact: fork tier (copy-on-write)", "exact: CRIU dumps"):
        # refused by path before anything diverged: the file it writes is in no snapshot
        assert rows[label].verdict == REFUSES and "counter" in rows[label].detail, rows[label]
    assert rows["exact: pickle"].verdict in (FAIL, REFUSES)
    assert not report.ok and "verdict: FAILED" in str(report)


def test_check_env_of_a_forkable_env_leaves_it_unchanged():
    env = gym_fork.make("CartPole-v1", backend="criu")
    try:
        env.reset(seed=0)
        for a in (0, 1, 0):
            env.step(a)
        state = np.array(env.unwrapped.state)
        report = gym_fork.check_env(env, backends=["fork", "pickle"], steps=10, verbose=False)
        assert report.ok and [r.verdict for r in report.rows[1:]] == [PASS, PASS, PASS]  # + rng='reseed'
        assert "_np_random" in report.rows[-1].detail
        assert env.steps == 3 and np.array_equal(env.unwrapped.state, state)
    finally:
        env.close()
    with pytest.raises(ValueError, match="unknown backend"):
        gym_fork.check_env("CartPole-v1", backends=["nope"])


def test_a_diverging_restore_is_explained_by_a_set_ordered_by_memory_addresses():
    """An env iterating a set of objects hashed by their address goes on in the order its objects
    lie in memory: no copy keeps that, so every tier diverges. The FAIL row says why and what to do
    instead of only where the runs parted."""
    import os

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: agent_envs
    import agent_envs

    report = gym_fork.check_env(agent_envs.entities, backends=["fork", "criu"], steps=12, verbose=False)
    rows = {r.check: r for r in report.rows}
    for label in ("exact: fork tier (copy-on-write)", "exact: CRIU dumps"):
        row = rows[label]
        if row.verdict == PASS:  # addresses happened to line up this run: nothing to explain
            continue
        assert row.verdict == FAIL and "diverges" in row.detail, row
        assert "env.ents (a set of Entity objects, hashed by their address" in row.detail, row
        assert "give the class a __hash__" in row.detail
    assert any(rows[label].verdict == FAIL for label in rows if label.startswith("exact:"))


@pytest.mark.parametrize("factory,verdict,says", [
    (random_envs.global_random, PASS, "random (the module's generator)"),
    (random_envs.own_generators, PASS, "env.noise, env.dice[0], env.legacy['rs']"),
    (random_envs.no_randomness, WARN, "went on identically"),
], ids=lambda x: getattr(x, "__name__", x))
def test_the_reseed_row_says_whether_branches_get_randomness_of_their_own(factory, verdict, says):
    report = gym_fork.check_env(factory, backends=["fork"], steps=10, verbose=False)
    row = report.rows[-1]
    assert row.check == "rng='reseed'" and row.verdict == verdict and says in row.detail, row
    assert report.ok


def test_an_env_the_pickle_backend_cannot_pickle_is_refused_there_not_failed():
    """An env holding a child process over pipes cannot be pickled at all: the pickle backend
    refuses it (UnpicklableEnvError, an UnsupportedEnvError and a SnapshotError), nothing is
    copied wrongly, and the verdict rests on the backends that capture it (CRIU: exact). It was
    a FAIL, so the verdict of every such agent env read FAILED."""
    import agent_envs

    from gym_fork.errors import SnapshotError, UnpicklableEnvError, UnsupportedEnvError

    report = gym_fork.check_env(agent_envs.pipe_child, backends=["criu", "pickle"], steps=6, verbose=False)
    rows = {r.check: r for r in report.rows}
    assert rows["exact: CRIU dumps"].verdict == PASS
    assert rows["exact: pickle"].verdict == REFUSES and "cannot capture" in rows["exact: pickle"].detail
    assert report.ok and "verdict: OK" in str(report)
    env = gym_fork.ForkableEnv(agent_envs.pipe_child, backend="pickle")
    try:
        env.reset(seed=0)
        with pytest.raises(UnpicklableEnvError, match="use backend='criu'") as e:
            env.snapshot()
        assert isinstance(e.value, UnsupportedEnvError) and isinstance(e.value, SnapshotError)
        env.step(1)  # runs on
    finally:
        env.close()

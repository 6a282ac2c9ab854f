"""Careless calls: a million copies, a count given as a string, a file given as a bundle.  Each is
refused before anything starts, with a typed error that says what was expected or what the
machine can hold (and how to override an estimate).  Real CRIU and pickle envs."""

from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import run_actions

import gym_fork
from gym_fork.errors import BundleError, CapacityError


def _children_of(pid: int) -> int:
    n = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        n += 1
            except (OSError, ValueError, IndexError):
                pass
    return n


@pytest.mark.criu
@pytest.mark.parametrize("kw", [{"fork_tier": True}, {"fork_tier": False}])
def test_a_million_copies_are_refused_with_numbers(kw):
    env = gym_fork.make("CartPole-v1", backend="criu", **kw)
    try:
        env.reset(seed=0)
        s = env.snapshot()
        before = _children_of(os.getpid())
        with pytest.raises(CapacityError, match=r"pid_max \d+") as e:
            env.fork(s, 10**6)
        assert e.value.requested == 10**6 and 0 < e.value.limit < 10**6
        with pytest.raises(CapacityError, match="1000000 copies"):
            gym_fork.explore(env, s, lambda o: 0, n_branches=10**6, horizon=5)
        with pytest.raises(CapacityError):
            gym_fork.explore(env, None, lambda o: 0, n_branches=10**6, horizon=5)
        assert _children_of(os.getpid()) == before  # nothing was started
        if not kw["fork_tier"]:  # CRIU restores hold every page privately: memory runs out first
            with pytest.raises(CapacityError, match=r"GiB.*max_copies=N") as e:
                env.fork(s, 5000)
            assert e.value.limit < 5000
        kids = env.fork(s, np.int64(2))  # NumPy integers are counts too
        assert len(kids) == 2
        for k in kids:
            k.close()
        env.step(0)
    finally:
        env.close()


@pytest.mark.criu
def test_copy_on_write_clones_are_estimated_from_the_frozen_process_anonymous_memory():
    from gym_fork.backends import capacity

    env = gym_fork.make("LunarLander-v3", backend="criu", fork_tier=True)
    try:
        env.reset(seed=0)
        run_actions(env, [0, 2] * 10)
        s = env.snapshot()
        with s._open_payload() as payload:
            cost = capacity.copy_cost(payload)
            with open(f"/proc/{payload.pid}/smaps_rollup") as f:  # the page-table walk it replaces
                anon = next(int(line.split()[1]) * 1024 for line in f if line.startswith("Anonymous:"))
        assert cost.how == "a copy-on-write clone" and (cost.processes, cost.threads) == (1, 1)
        assert anon > 8 << 20  # a LunarLander worker: tens of MB
        # a quarter of the frozen process's anonymous memory, plus a process's overhead
        assert abs(cost.memory - (anon // 4 + (1 << 20))) <= 64 << 10
        fit = int(capacity.limits()["memory"][0] * 0.9) // cost.memory
        with pytest.raises(CapacityError, match=r"copy-on-write clone\) is estimated to need .*MiB.*max_copies=N"):
            env.fork(s, 2 * fit + 10)
        env.step(0)
    finally:
        env.close()


def test_pickle_copies_are_bounded_by_memory(monkeypatch):
    env = gym_fork.make("CartPole-v1", backend="pickle")
    try:
        env.reset(seed=0)
        s = env.snapshot()
        with pytest.raises(CapacityError, match=r"memory.*MemAvailable.*max_copies=N") as e:
            env.fork(s, 10**7)
        assert e.value.limit < 10**7
        with pytest.raises(CapacityError, match="max_copies is 2"):
            env.fork(s, 3, max_copies=2)
        monkeypatch.setenv("GYM_FORK_MAX_COPIES", "2")
        with pytest.raises(CapacityError, match="max_copies is 2"):
            gym_fork.explore(env, s, lambda o: 0, n_branches=3, horizon=2)
        assert len(env.fork(s, 2)) == 2
        monkeypatch.setenv("GYM_FORK_MAX_COPIES", "lots")
        with pytest.raises(CapacityError, match="GYM_FORK_MAX_COPIES"):
            env.fork(s, 2)
    finally:
        env.close()


def test_wrong_argument_types_say_what_was_expected(tmp_path):
    env = gym_fork.make("CartPole-v1", backend="pickle")
    try:
        env.reset(seed=0)
        s = env.snapshot()
        for bad in ("3", 2.0, True, None, [2]):
            with pytest.raises(TypeError, match="n must be an int"):
                env.fork(s, bad)
        with pytest.raises(ValueError, match=">= 1"):
            env.fork(s, 0)
        with pytest.raises(TypeError, match="Snapshot"):
            env.fork("3f2a9c1e0b7d4e55", 2)
        with pytest.raises(TypeError, match="n_branches must be an int"):
            gym_fork.explore(env, s, lambda o: 0, n_branches="8")
        with pytest.raises(TypeError, match="horizon must be an int"):
            gym_fork.explore(env, s, lambda o: 0, n_branches=2, horizon=1.5)
    finally:
        env.close()
    f = tmp_path / "bundle.json"
    f.write_text("{}")
    with pytest.raises(BundleError, match="is a file, not a bundle directory"):
        gym_fork.load_snapshot(str(f))
    with pytest.raises(BundleError, match="no such bundle"):
        gym_fork.load_snapshot(str(tmp_path / "nothing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(BundleError, match="not a gym_fork bundle"):
        gym_fork.load_snapshot(str(tmp_path / "empty"))

"""``private_network=True`` beyond one process: an env whose state is in a Redis child it talks to
over TCP on 127.0.0.1, saved as a bundle and loaded (here and in another Python process), and
migrated to a local agent.  Each copy lives in a network namespace of its own, with its own Redis
at the same address, and continues bit-identically to the original stepped with the same actions;
nothing (processes, namespaces) is left behind.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from conftest import assert_same_traj
from test_agent_envs import _netns_fds, _tree, assert_gone, step

import agent_envs
import gym_fork

pytestmark = pytest.mark.criu

PREFIX = 5


def _netns(pid: int) -> int:
    return os.stat(f"/proc/{pid}/ns/net").st_ino


def _started(**opts):
    """The Redis-over-TCP env with a private network, ``PREFIX`` steps in; the actions to go on with."""
    env = gym_fork.ForkableEnv(agent_envs.redis_tcp, private_network=True, **opts)
    env.action_space.seed(7)
    env.reset(seed=3)
    for _ in range(PREFIX):
        env.step(env.action_space.sample())
    xs = [int(env.action_space.sample()) for _ in range(10)]
    return env, xs


def test_bundle_loaded_in_this_process_continues_exactly(tmp_path):
    ns_before = _netns_fds()
    env, xs = _started()
    pids: set[int] = set()
    try:
        snap = env.snapshot()
        snap.save(str(tmp_path / "b"))
        loaded = gym_fork.load_snapshot(str(tmp_path / "b"))
        copy = gym_fork.ForkableEnv.from_snapshot(loaded)
        try:
            assert copy.steps == PREFIX
            assert len({_netns(env.worker_pid), _netns(copy.worker_pid), _netns(os.getpid())}) == 3
            orig, mine = [], []
            for x in xs:  # interleaved: one Redis shared by both would show up as a divergence
                orig.append(step(env, x))
                mine.append(step(copy, x))
            assert_same_traj(orig, mine)
            pids |= _tree(env.worker_pid) | _tree(copy.worker_pid)
            # the loaded env snapshots, restores and forks like the original (its own network)
            s2 = copy.snapshot()
            more = [step(copy, x) for x in xs]
            kid = copy.fork(s2)[0]
            copy.restore(s2)
            assert_same_traj(more, [step(copy, x) for x in xs])
            assert_same_traj(more, [step(kid, x) for x in xs])
            assert _netns(kid.worker_pid) != _netns(copy.worker_pid)
            pids |= _tree(copy.worker_pid) | _tree(kid.worker_pid)
            kid.close()
        finally:
            copy.close()
    finally:
        env.close()
    assert_gone(pids)
    assert _netns_fds() == ns_before


_CHILD = textwrap.dedent("""
    import json, os, sys
    sys.path[:0] = [{tests!r}]
    import gym_fork
    from test_agent_envs import _tree
    snap = gym_fork.load_snapshot(sys.argv[1])
    env = gym_fork.ForkableEnv.from_snapshot(snap)
    pids = sorted(_tree(env.worker_pid))
    netns = os.stat(f"/proc/{{env.worker_pid}}/ns/net").st_ino
    out = []
    for a in json.loads(sys.argv[2]):
        obs, r, term, trunc, info = env.step(a)
        out.append([obs.tolist(), r, term, trunc, info])
    env.close()
    print(json.dumps({{"pids": pids, "netns": netns, "steps": out}}))
""")


def test_bundle_loaded_in_another_process_continues_exactly(tmp_path):
    env, xs = _started()
    try:
        snap = env.snapshot()
        path = snap.save(str(tmp_path / "b"))
        tests = os.path.dirname(os.path.abspath(__file__))
        res = subprocess.run([sys.executable, "-c", _CHILD.format(tests=tests), path, json.dumps(xs)],
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr[-3000:]
        got = json.loads(res.stdout.strip().splitlines()[-1])
        assert got["netns"] not in (_netns(env.worker_pid), _netns(os.getpid()))
        orig = [step(env, x) for x in xs]  # the original's Redis never saw the other process's steps
        for mine, (obs, r, term, trunc, info) in zip(got["steps"], orig):
            assert mine == [obs.tolist(), r, term, trunc, info]
        assert len(got["steps"]) == len(orig)
        assert len(got["pids"]) >= 2  # the worker and its redis-server ...
        assert_gone(set(got["pids"]))  # ... both ended with that process's env
    finally:
        env.close()


def test_migration_to_a_local_agent_continues_exactly(agent):
    env, xs = _started()
    ag = agent.agents["B"]
    try:
        snap = env.snapshot()
        ref = env.fork(snap)[0]  # stays here: what the env must do after the move
        pids = _tree(env.worker_pid)
        rep = env.migrate(agent.target["B"], token=agent.token)
        assert rep["node"] == "B" and env.steps == PREFIX
        moved = rep["pid"]
        # restored by the agent, in a network namespace of its own (not the agent's, not ours)
        assert moved in ag.children()
        assert _netns(moved) not in (_netns(ag.pid), _netns(os.getpid()), _netns(ref.worker_pid))
        moved_tree = _tree(moved)
        assert len(moved_tree) >= 2  # with its redis-server
        assert_gone(pids)  # the local worker and its Redis stopped after the move
        theirs, ours = [], []
        for x in xs:
            theirs.append(step(env, x))
            ours.append(step(ref, x))
        assert_same_traj(ours, theirs)
        ref.close()
    finally:
        env.close()
    assert_gone(moved_tree)
    assert ag.children() == []


def test_fork_tier_env_with_private_network_migrates_live_exactly(agent):
    """No child processes: copy-on-write snapshots, and the copy CRIU dumps for the move keeps the
    worker's own namespace; pre-copy (live=True) switches mid-stream and stays exact."""
    env = gym_fork.ForkableEnv("CartPole-v1", private_network=True)
    ag = agent.agents["B"]
    try:
        env.action_space.seed(1)
        env.reset(seed=2)
        for _ in range(4):
            env.step(env.action_space.sample())
        xs = [int(env.action_space.sample()) for _ in range(30)]
        ref = env.fork()[0]
        mig = env.migrate(agent.target["B"], token=agent.token, live=True)
        theirs = [step(env, x) for x in xs]  # the switch happens inside one of these steps
        rep = mig.result(timeout=60)
        assert rep["node"] == "B" and rep["pid"] in ag.children()
        assert _netns(rep["pid"]) not in (_netns(ag.pid), _netns(os.getpid()))
        assert_same_traj([step(ref, x) for x in xs], theirs)
        ref.close()
    finally:
        env.close()
    assert_gone({rep["pid"]})


def test_live_migration_of_a_process_tree_is_refused_with_the_reason(agent):
    """A tree (worker + Redis) has no copy-on-write snapshot to pre-copy: refused, typed, before
    anything moves; the env keeps running here, exactly."""
    env, xs = _started()
    try:
        ref = env.fork()[0]
        with pytest.raises(gym_fork.migration.MigrationError, match="live=True needs a copy-on-write"):
            env.migrate(agent.target["B"], token=agent.token, live=True)
        assert agent.agents["B"].children() == []
        assert_same_traj([step(ref, x) for x in xs], [step(env, x) for x in xs])
        ref.close()
    finally:
        env.close()

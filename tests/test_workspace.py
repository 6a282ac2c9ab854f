"""Workspace capture: each snapshot captures the env's directory (files + SQLite rows); restore
brings back exactly that content, and fork branches each get an isolated copy."""

from __future__ import annotations

import os
import sys

import pytest

import gym_fork

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
from agent_workspace import WebAppAgentEnv, snapshot_of_files  # noqa: E402

pytestmark = pytest.mark.criu


def test_restore_brings_back_files_and_rows(tmp_path):
    ws = str(tmp_path / "ws")
    env = gym_fork.ForkableEnv(WebAppAgentEnv, workspace=ws)
    env.reset(seed=0)
    for a in [0, 8, 1, 9]:
        env.step(a)
    snap = env.snapshot()
    want = snapshot_of_files(ws)
    # the live workspace changes: new files, in-place rewrites of captured files, more rows
    for a in [0, 2, 8, 8, 9]:
        env.step(a)
    with open(os.path.join(ws, "routes", "login.py"), "a") as f:
        f.write("# edited in place\n")
    open(os.path.join(ws, "stray.txt"), "w").close()
    assert snapshot_of_files(ws) != want
    obs, _ = env.restore(snap)
    assert snapshot_of_files(ws) == want
    assert not os.path.exists(os.path.join(ws, "stray.txt"))
    assert list(obs) == [2, 1, 3]  # the process state agrees with the files
    # and again: the capture itself was not altered by the restore or later writes
    env.step(8)
    env.restore(snap)
    assert snapshot_of_files(ws) == want
    env.close()


def test_fork_branches_are_isolated(tmp_path):
    ws = str(tmp_path / "ws")
    env = gym_fork.ForkableEnv(WebAppAgentEnv, workspace=ws)
    env.reset(seed=0)
    for a in [0, 8, 9]:
        env.step(a)
    snap = env.snapshot()
    base = snapshot_of_files(ws)
    kids = env.fork(snap, 2, rng="reseed", seeds=[1, 2])
    paths = [k.unwrapped.workspace for k in kids]
    assert len({ws, *paths}) == 3 and all(os.path.isdir(p) for p in paths)
    assert all(snapshot_of_files(p) == base for p in paths)
    for a in [3, 8, 9]:
        kids[0].step(a)
    for a in [5, 5, 9]:
        kids[1].step(a)
    s0, s1 = snapshot_of_files(paths[0]), snapshot_of_files(paths[1])
    assert "profile.py" in s0["files"] and "profile.py" not in s1["files"]
    assert "cart.py" in s1["files"] and "cart.py" not in s0["files"]
    assert len(s0["rows"]) == 2 and len(s1["rows"]) == 1
    assert snapshot_of_files(ws) == base  # the parent's workspace is untouched
    # a branch's own snapshot/restore works in its own directory
    ksnap = kids[0].snapshot()
    kids[0].step(8)
    kids[0].restore(ksnap)
    assert snapshot_of_files(paths[0]) == s0
    for k in kids:
        k.close()
    env.close()

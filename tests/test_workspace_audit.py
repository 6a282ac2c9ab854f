"""What a copy of a workspace directory cannot reproduce is refused by name, before any copy
diverges (found by an audit; each refusal below was silently accepted before):

* a symlink naming the workspace by its own path: every fork() branch and every workspace a
  bundle is loaded into followed it back and wrote into the original's file;
* a file hard-linked to a file outside the workspace: a restore separated the two names, and the
  outside file kept the later writes;
* a workspace file held open between steps, read-only too: a restored or forked copy read the
  original's (stale) inode, forks saw each other's rows, or the CRIU image could not be restored;
  and the refusal of one held open for writing tells to open it during a step, not to declare it
  private or untracked (it is in the workspace already).
"""

from __future__ import annotations

import functools
import os

import pytest

import gym_fork
import workspace_audit_envs as envs
from gym_fork.errors import UncapturableStateError

pytestmark = pytest.mark.criu

ACTS = (1, 2, 3, 0, 2)


@pytest.fixture(autouse=True)
def _private_key(tmp_path, monkeypatch):
    monkeypatch.setenv("GYM_FORK_KEY_FILE", str(tmp_path / "key"))
    monkeypatch.delenv("GYM_FORK_KEY", raising=False)


def _run(env, acts=ACTS) -> list:
    return [(list(o), i) for o, _r, _te, _tr, i in (env.step(a) for a in acts)]


def _restores_exactly(env) -> None:
    snap = env.snapshot()
    first = _run(env)
    for _ in range(2):
        env.restore(snap)
        assert _run(env) == first


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


# --- symlinks ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["absolute", "climbing"])
def test_a_symlink_naming_the_workspace_by_its_own_path_is_refused(tmp_path, how):
    ws = str(tmp_path / "ws")
    env = gym_fork.ForkableEnv(functools.partial(envs.linked_data, how), workspace=ws)
    try:
        env.reset(seed=0)
        for a in (0, 1, 2):
            env.step(a)
        with pytest.raises(UncapturableStateError, match=r"current -> .*data\.txt.*make such a link relative"):
            env.snapshot()
        with pytest.raises(UncapturableStateError, match="current -> "):
            env.fork(n=2)  # (takes a snapshot first)
        assert not [p for p in os.listdir(tmp_path) if ".branch-" in p]
        # the env runs on; once the link is relative, branches write their own files only
        assert env.step(3)[4]["d"] == "0123"
        env.call("relink", "relative")
        snap = env.snapshot()
        kids = env.fork(snap, 2)
        try:
            for k in kids:
                assert [k.step(a)[4]["d"] for a in (1, 2)] == ["01231", "012312"]
            assert _read(os.path.join(ws, "data.txt")) == "0123"
            assert env.step(0)[4]["d"] == "01230"
        finally:
            for k in kids:
                k.close()
    finally:
        env.close()


def test_a_relative_symlink_goes_to_each_copys_own_file(tmp_path):
    """The self-contained form is copied right: fork branches and a bundle loaded into another
    directory each write their own data.txt, never the original's."""
    ws = str(tmp_path / "ws")
    env = gym_fork.ForkableEnv(functools.partial(envs.linked_data, "relative"), workspace=ws, fork_tier=False)
    try:
        env.reset(seed=0)
        for a in (0, 1, 2):
            env.step(a)
        snap = env.snapshot()
        path = snap.save(str(tmp_path / "bundle"))
        want = [env.step(a)[4]["d"] for a in (3, 1)]
        env.restore(snap)
        loaded = gym_fork.ForkableEnv.from_snapshot(gym_fork.load_snapshot(path), workspace=str(tmp_path / "new"))
        try:
            assert os.readlink(str(tmp_path / "new" / "current")) == "data.txt"
            assert [loaded.step(a)[4]["d"] for a in (3, 1)] == want
            assert _read(os.path.join(ws, "data.txt")) == "012"
        finally:
            loaded.close()
    finally:
        env.close()


# --- hard links --------------------------------------------------------------------------------------

def test_a_file_hard_linked_outside_the_workspace_is_refused(tmp_path):
    ws, outside = str(tmp_path / "ws"), str(tmp_path / "outside.txt")
    open(outside, "w").close()
    env = gym_fork.ForkableEnv(functools.partial(envs.hard_linked, outside), workspace=ws)
    try:
        env.reset(seed=0)
        for a in (0, 1, 2):
            env.step(a)
        with pytest.raises(UncapturableStateError, match=r"hard-linked to a file outside the workspace \(a\.txt\)"):
            env.snapshot()
        assert env.step(3)[4]["d"] == "0123"
        assert os.stat(outside).st_nlink == 2  # nothing was separated
        env.call("unlink_outside")
        _restores_exactly(env)
        assert _read(outside) == "0123"
    finally:
        env.close()


def test_a_read_only_file_hard_linked_from_outside_is_kept(tmp_path):
    """A local `git clone` hard-links its read-only objects: neither name is ever written, so the
    capture's copy changes nothing, and the workspace is not refused for it."""
    ws, outside = str(tmp_path / "ws"), str(tmp_path / "object")
    with open(outside, "w") as f:
        f.write("blob")
    os.chmod(outside, 0o444)
    env = gym_fork.ForkableEnv(functools.partial(envs.read_only_linked, outside), workspace=ws)
    try:
        env.reset(seed=0)
        env.step(1)
        _restores_exactly(env)
    finally:
        env.close()


def test_hard_links_inside_the_workspace_are_kept(tmp_path):
    ws = str(tmp_path / "ws")
    env = gym_fork.ForkableEnv(envs.hard_linked, workspace=ws)
    try:
        env.reset(seed=0)
        for a in (0, 1, 2):
            env.step(a)
        _restores_exactly(env)
        snap = env.snapshot()
        kids = env.fork(snap, 2)
        try:
            for k in kids:
                assert [k.step(a)[4]["d"] for a in (1, 2)] == [_read(os.path.join(ws, "b.txt")) + "1",
                                                               _read(os.path.join(ws, "b.txt")) + "12"]
        finally:
            for k in kids:
                k.close()
    finally:
        env.close()


# --- workspace files held open between steps ---------------------------------------------------------

@pytest.mark.parametrize("how,fork_tier,shows", [
    ("read", "auto", r"state\.txt \(open for reading, in the env's workspace\)"),
    ("read", False, r"state\.txt \(open for reading, in the env's workspace\)"),
    ("sqlite-ro", "auto", r"app\.db \(SQLite database open for reading, in the env's workspace\).*connect per step"),
    ("sqlite-ro", False, r"app\.db \(SQLite database open for reading, in the env's workspace\)"),
    ("child", "auto", r"state\.txt \(open for reading, in the env's workspace\)"),
], ids=["read-fork-tier", "read-criu-dumps", "sqlite-ro-fork-tier", "sqlite-ro-criu-dumps", "child-stdin"])
def test_a_workspace_file_held_open_for_reading_is_refused(tmp_path, how, fork_tier, shows):
    ws = str(tmp_path / "ws")
    env = gym_fork.ForkableEnv(functools.partial(envs.held_open, how), workspace=ws, fork_tier=fork_tier)
    try:
        env.reset(seed=0)
        for a in (0, 1, 2):
            env.step(a)
        with pytest.raises(UncapturableStateError, match=shows) as ei:
            env.snapshot()
        assert "open it only during a step (with open(...) inside step())" in str(ei.value)
        assert any(r.fd is not None for r in ei.value.resources)
        env.step(3)  # the env runs on
        env.call("let_go")  # and once it holds nothing open, its snapshots restore exactly
        _restores_exactly(env)
    finally:
        env.close()


def test_a_workspace_file_held_open_for_writing_is_told_to_open_it_during_a_step(tmp_path):
    ws = str(tmp_path / "ws")
    env = gym_fork.ForkableEnv(functools.partial(envs.held_open, "write"), workspace=ws)
    try:
        env.reset(seed=0)
        env.step(1)
        shows = r"log\.txt \(open for writing, in the env's workspace\)"
        with pytest.raises(UncapturableStateError, match=shows) as ei:
            env.snapshot()
        msg = str(ei.value)
        assert "open it only during a step (with open(...) inside step())" in msg
        # it is in the workspace already: nothing about declaring it private, untracked or moving it there
        for wrong in ("private_dirs", "untracked_paths", "workspace=DIR", "put it in"):
            assert wrong not in msg, (wrong, msg)
        env.step(2)
    finally:
        env.close()

"""What a copy of a workspace directory cannot reproduce is refused by name, before any copy
diverges (found by an audit; each refusal below was silently accepted before):

* a symlink naming the workspace by its own path: every fork() branch and every workspace a
  bundle is loaded into followed it back and wrote into the original's file;
* a file hard-linked to a file outside the workspace: a restore separated the two names, and the
  outside file kept the later writes;
* a workspace file held open between steps, read-only too: a restored or forked copy read the
  original's (stale) inode, forks saw each other's rows, or the CRIU image could not be restored;
  and the refusal of one held open for writing tells to open it during a step, not to declare it
  private or untracked (it is in the workspace already);
* a copy's tool processes (a server started in the workspace or given its path, a tool run each
  step with a path the env derived once) wrote into the workspace of the env the snapshot was
  taken from: the original's files changed under it and the copy read the wrong ones.  As root,
  every copy now runs in a mount namespace that shows its own workspace at those paths.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import time

import pytest

import gym_fork
import workspace_audit_envs as envs
from gym_fork.errors import RestoreError, UncapturableStateError

from conftest import fd_links

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


# --- a copy's tools, which know the workspace by the path they were given -------------------------

TOOLS = ["server-cwd", "server-arg", "server-env", "tool-arg", "derived"]


def _notes(ws: str) -> str:
    return _read(os.path.join(ws, "notes.txt"))


@pytest.mark.skipif(os.geteuid() != 0, reason="mount namespaces need root (see tests/test_nonroot.py)")
@pytest.mark.parametrize("how", TOOLS)
def test_a_copys_tools_work_in_its_own_workspace_at_the_paths_they_were_given(tmp_path, how):
    """fork(): each child's tools write the child's own files, not the parent's (before: the
    parent's notes.txt got every child's lines, and each child read the parent's file); the same
    for a copy of a copy, and for a child's snapshot restored into the parent."""
    ws = str(tmp_path / "ws")
    env = gym_fork.ForkableEnv(functools.partial(envs.tool, how), workspace=ws)
    kids, grand = [], []
    try:
        env.reset(seed=0)
        _run(env, (1, 2))
        snap = env.snapshot()
        at_snap = _notes(ws)
        first = _run(env)
        after_first = _notes(ws)
        env.restore(snap)
        kids = env.fork(snap, 2)
        for k in kids:
            assert _run(k) == first
            assert _notes(k._workspace.path) == after_first
        assert _notes(ws) == at_snap  # the children wrote none of it
        assert _run(env) == first
        k0 = kids[0]
        ks = k0.snapshot()
        at_ks = _notes(k0._workspace.path)
        later = _run(k0, (3, 0, 3))
        k0_files = _notes(k0._workspace.path)
        env.restore(ks)  # a child's snapshot, in the parent's workspace
        assert _notes(ws) == at_ks
        assert _run(env, (3, 0, 3)) == later
        grand = k0.fork(ks, 1)  # a copy of a copy
        assert _run(grand[0], (3, 0, 3)) == later
        assert _notes(grand[0]._workspace.path) == k0_files
        assert _notes(k0._workspace.path) == k0_files  # neither touched the child's files
        assert _notes(kids[1]._workspace.path) == after_first
    finally:
        for k in [*grand, *kids]:
            k.close()
        env.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="mount namespaces need root (see tests/test_nonroot.py)")
def test_a_loaded_snapshots_server_works_in_the_new_workspace(tmp_path):
    """from_snapshot(load_snapshot(...), workspace=NEW) while the env it was saved from still runs:
    the restored server writes NEW, not the running env's directory."""
    ws, ws2 = str(tmp_path / "ws"), str(tmp_path / "other")
    env = gym_fork.ForkableEnv(functools.partial(envs.tool, "server-arg"), workspace=ws)
    try:
        env.reset(seed=0)
        _run(env, (1, 2))
        snap = env.snapshot()
        path = snap.save(str(tmp_path / "bundle"))
        at_snap = _notes(ws)
        first = _run(env)
        loaded = gym_fork.load_snapshot(path)
        other = gym_fork.ForkableEnv.from_snapshot(loaded, workspace=ws2)
        try:
            assert _run(other) == first
            assert _notes(ws2) == _notes(ws)
            _run(other, (0, 0))
            assert _notes(ws) == at_snap + "".join(f"{t}:{a}\n" for t, a in zip(range(3, 8), ACTS))
        finally:
            other.close()
    finally:
        env.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="mount namespaces need root (see tests/test_nonroot.py)")
@pytest.mark.parametrize("how", ["server-cwd", "derived"])
def test_a_copys_snapshot_can_be_saved_and_loaded_elsewhere(tmp_path, how):
    """A fork() child runs in a mount namespace of its own; its snapshots can still be saved
    (CRIU dumps them) and loaded into a third workspace, where its tools go on from there. Before,
    saving failed: the child had entered its namespace after it was forked, holding files on the
    parent's mounts, which CRIU cannot dump ("Can't lookup mount")."""
    ws, ws3 = str(tmp_path / "ws"), str(tmp_path / "third")
    env = gym_fork.ForkableEnv(functools.partial(envs.tool, how), workspace=ws)
    kids = []
    try:
        env.reset(seed=0)
        _run(env, (1, 2))
        snap = env.snapshot()
        kids = env.fork(snap, 1)
        # (the images the copy was restored from count: they were 0 bytes before, until release)
        assert snap.size_bytes > 1_000_000
        k = kids[0]
        _run(k, (3,))
        ks = k.snapshot()
        path = ks.save(str(tmp_path / "bundle"))
        at_ks = _notes(k._workspace.path)
        later = _run(k, (0, 3))
        k_files = _notes(k._workspace.path)
        parent_files = _notes(ws)
        other = gym_fork.ForkableEnv.from_snapshot(gym_fork.load_snapshot(path), workspace=ws3)
        try:
            assert _notes(ws3) == at_ks
            assert _run(other, (0, 3)) == later
            assert _notes(ws3) == k_files
            assert _notes(k._workspace.path) == k_files and _notes(ws) == parent_files
        finally:
            other.close()
    finally:
        for k in kids:
            k.close()
        env.close()


# --- tool processes that run on their own ------------------------------------------------------------
#
# restore() (and from_snapshot(), fork_into()) put the workspace's files back after the restored
# process tree was already running: a file watcher restored with it saw the files of the
# trajectory being left, logged a change the original never saw and counted on from there.  Now
# the tree's other processes are held stopped until their files are in place.

WATCH_ACTS = (3, 0, 2)


def _holder_pid(env: gym_fork.ForkableEnv) -> int:
    """Host pid of the HolderEnv's tool process."""
    from gym_fork.worker.resources import descendants_of

    for pid in descendants_of(env.worker_pid):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"SIGUSR1" in f.read():
                return pid
    raise AssertionError("no tool process")


def _holds_state_file(pid: int) -> bool:
    return any(link.endswith("/state.txt") for link in fd_links(pid))


def _tell(pid: int, sig: int, holding: bool) -> None:
    os.kill(pid, sig)
    deadline = time.monotonic() + 5
    while _holds_state_file(pid) != holding:
        assert time.monotonic() < deadline, "the tool did not do as told"
        time.sleep(0.001)


def test_a_workspace_file_a_tool_holds_open_at_the_dump_is_dumped_again_or_refused(tmp_path, monkeypatch):
    """A tool in the workspace that reads a file on its own schedule (a file watcher, every
    millisecond) can be caught by a CRIU dump with that file open, though the scan just before
    the dump found it closed. CRIU reopens such a file at restore by its path, before the
    snapshot's files are put back: the restored tool read the trajectory being left (CI caught a
    restored watcher logging a change the snapshot never saw; ~4 % of that env's dumps held its
    file), or the restore failed on the file's size. Such a dump is now taken again; a file held
    through every try is refused, naming it, and the env steps on."""
    from gym_fork.criu import client
    from gym_fork.errors import SnapshotError

    env = gym_fork.ForkableEnv(envs.holder, workspace=str(tmp_path / "ws"))
    try:
        env.reset(seed=0)
        env.step(1)
        tool = _holder_pid(env)
        real, tries, hold = client._dump_once, [], {"every": False}

        def caught(*args, **kwargs):  # the tool opens the file after the scan, before the freeze
            tries.append(1)
            if len(tries) == 1 or hold["every"]:
                _tell(tool, signal.SIGUSR1, True)
            try:
                return real(*args, **kwargs)
            finally:
                if not hold["every"] and _holds_state_file(tool):
                    _tell(tool, signal.SIGUSR2, False)

        monkeypatch.setattr(client, "_dump_once", caught)
        snap = env.snapshot()
        assert len(tries) == 2  # (the first try held it: dumped again)
        with snap._open_payload() as payload, open(os.path.join(payload.path, "files.img"), "rb") as f:
            assert b"state.txt" not in f.read()
        assert list(env.step(2)[0]) == [2.0, 2.0]
        env.restore(snap)
        assert list(env.step(3)[0]) == [2.0, 2.0]
        # held through every try: refused by name, and the env is where it was
        tool = _holder_pid(env)  # (the restored one)
        tries.clear()
        hold["every"] = True
        with pytest.raises(SnapshotError, match=r"holds \S*/state.txt open, a file of the env's workspace"):
            env.snapshot()
        assert len(tries) == client.PROC_FILE_TRIES
        _tell(tool, signal.SIGUSR2, False)
        assert list(env.step(1)[0]) == [3.0, 3.0]
        hold["every"] = False
        tries.clear()
        env.snapshot().release()
        assert len(tries) == 2
    finally:
        env.close()


def test_a_restored_file_watcher_sees_only_the_snapshots_files(tmp_path):
    ws = str(tmp_path / "ws")
    env = gym_fork.ForkableEnv(envs.watcher, workspace=ws)
    try:
        env.reset(seed=0)
        for a in (1, 2):
            env.step(a)
        snap = env.snapshot()
        first = _run(env, WATCH_ACTS)
        assert [o for o, _i in first] == [[3.0, 4.0], [4.0, 5.0], [5.0, 6.0]]  # one change seen per step (and reset's)
        for _ in range(3):
            env.restore(snap)
            assert _run(env, WATCH_ACTS) == first
        path = snap.save(str(tmp_path / "bundle"))
    finally:
        env.close()
    # a saved snapshot resumed in the same directory, which holds the files of the env's last step
    loaded = gym_fork.ForkableEnv.from_snapshot(gym_fork.load_snapshot(path), workspace=ws)
    try:
        assert _run(loaded, WATCH_ACTS) == first
    finally:
        loaded.close()


def test_a_watcher_started_after_the_snapshot_is_gone_before_the_files_go_back(tmp_path):
    """The snapshot holds the worker alone (fork tier); the watcher the env started after it must
    not see the restored files (it would log them into the restored workspace)."""
    ws = str(tmp_path / "ws")
    env = gym_fork.ForkableEnv(functools.partial(envs.watcher, "step"), workspace=ws)
    try:
        env.reset(seed=0)
        snap = env.snapshot()
        first = _run(env, WATCH_ACTS)
        for _ in range(3):
            env.restore(snap)
            assert not os.path.exists(os.path.join(ws, "changes.log"))
            assert _run(env, WATCH_ACTS) == first
    finally:
        env.close()


def test_fork_into_holds_each_slots_watcher_until_its_files_are_back(tmp_path):
    wss = [str(tmp_path / f"ws{i}") for i in range(3)]
    slots = [gym_fork.ForkableEnv(envs.watcher, workspace=w) for w in wss]
    for e in slots[1:]:
        e._share_lineage(slots[0])
    vec = gym_fork.ForkableVecEnv(slots)
    try:
        for e in slots:  # every slot's directory holds files of its own trajectory
            e.reset(seed=0)
        for a in (1, 2):
            slots[0].step(a)
        for e in slots[1:]:
            for a in (0, 3, 3, 1):
                e.step(a)
        snap = slots[0].snapshot()
        first = _run(slots[0], WATCH_ACTS)
        vec.fork_into(snap, [1, 2])
        for e in slots[1:]:
            assert _run(e, WATCH_ACTS) == first
    finally:
        vec.close()


def test_a_helper_stopped_at_the_snapshot_stays_stopped_after_a_restore(tmp_path):
    """Held stopped during the restore, the tree's processes go on after it -- except one that was
    stopped when the snapshot was taken (SIGSTOP, job control), which stays stopped."""
    env = gym_fork.ForkableEnv(envs.stopped_helper, workspace=str(tmp_path / "ws"))
    try:
        env.reset(seed=0)
        assert env.step(0)[4]["states"][0] == "T"
        snap = env.snapshot()
        env.step(1)
        for _ in range(2):
            env.restore(snap)
            states = env.step(1)[4]["states"]
            # the other runs: R, S, or D (a moment in uninterruptible sleep -- faulting in a page
            # just after the restore: CI once read it so), never T
            assert states[0] == "T" and states[1] in ("R", "S", "D"), states
    finally:
        env.close()


def test_a_tool_working_in_a_workspace_subdirectory_is_restored(tmp_path):
    """CRIU reopens a restored process's working directory by its path: with ``DIR/sub`` missing
    -- renamed by the trajectory being left, or not yet copied into the fresh directory of
    ``from_snapshot()`` -- the restore of a whole snapshot failed. The snapshot's directories are
    now made first (and removed again if the restore fails)."""
    ws = str(tmp_path / "ws")
    env = gym_fork.ForkableEnv(envs.subdir_server, workspace=ws)
    try:
        env.reset(seed=0)
        env.step(1)
        snap = env.snapshot()
        first = _run(env, (3, 0, 2))
        assert [i["dir"] for _o, i in first] == ["moved"] * 3
        for _ in range(2):
            env.restore(snap)
            assert _run(env, (3, 0, 2)) == first
        # a restore that fails leaves no directory it made behind
        env.restore(snap)
        env.step(3)
        real = env._backend.restore

        def failing(*args, **kwargs):
            assert os.path.isdir(os.path.join(ws, "sub"))  # made for criu
            raise RestoreError("injected")

        env._backend.restore = failing
        try:
            with pytest.raises(RestoreError, match="injected"):
                env.restore(snap)
        finally:
            env._backend.restore = real
        assert sorted(os.listdir(ws)) == ["moved"]
        assert env.step(0)[4]["dir"] == "moved"
        path = snap.save(str(tmp_path / "bundle"))
        env.restore(snap)
        want = _run(env, (0, 2))
    finally:
        env.close()
    loaded = gym_fork.ForkableEnv.from_snapshot(gym_fork.load_snapshot(path), workspace=str(tmp_path / "new"))
    try:
        assert _run(loaded, (0, 2)) == want
    finally:
        loaded.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="mount namespaces need root (see tests/test_nonroot.py)")
@pytest.mark.parametrize("how", ["server-cwd", "server-arg", "derived"])
def test_a_bundle_resumes_after_its_original_workspace_is_gone(tmp_path, how):
    """The bundle's processes know the workspace by its original path; once that directory (and
    its parent) was deleted -- or on another machine, where it never existed -- there was nothing
    to bind the new workspace on: the CRIU restore failed (a server's working directory), a
    server given the path died, an env's derived path was refused. The path is made to bind on."""
    ws = str(tmp_path / "gone" / "ws")
    env = gym_fork.ForkableEnv(functools.partial(envs.tool, how), workspace=ws)
    try:
        env.reset(seed=0)
        _run(env, (1, 2))
        path = env.snapshot().save(str(tmp_path / "bundle"))
        want = _run(env, (3, 0))
        want_files = _notes(ws)
    finally:
        env.close()
    shutil.rmtree(str(tmp_path / "gone"))
    new = str(tmp_path / "new")
    loaded = gym_fork.ForkableEnv.from_snapshot(gym_fork.load_snapshot(path), workspace=new)
    try:
        assert _run(loaded, (3, 0)) == want
        assert _notes(new) == want_files
        assert os.listdir(ws) == []  # (only a mount point: the copy's files are in its own directory)
    finally:
        loaded.close()

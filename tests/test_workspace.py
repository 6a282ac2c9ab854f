"""Workspace capture: each snapshot captures the env's directory (files + SQLite rows); restore
brings back exactly that content, and fork branches each get an isolated copy."""

from __future__ import annotations

import os
import shutil
import subprocess
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


# --- persistence: bundles and store entries carry the workspace --------------------------------------

@pytest.fixture(autouse=True)
def _private_key(tmp_path, monkeypatch):
    monkeypatch.setenv("GYM_FORK_KEY_FILE", str(tmp_path / "key"))
    monkeypatch.delenv("GYM_FORK_KEY", raising=False)


FRESH = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])
import gym_fork
from agent_workspace import snapshot_of_files
kind, src, ws = sys.argv[2], sys.argv[3], sys.argv[4]
snap = (gym_fork.load_snapshot(src) if kind == "bundle"
        else gym_fork.SnapshotStore(src).load(sys.argv[5]))
env = gym_fork.ForkableEnv.from_snapshot(snap, workspace=ws)
out = {"files": snapshot_of_files(ws), "attr": env.unwrapped.workspace, "steps": env.steps,
       "mode": oct(os.stat(os.path.join(ws, "run.sh")).st_mode & 0o777)}
obs, *_ = env.step(9)  # the restored process works in ws: its tests see the restored files/rows
out["obs"] = [float(x) for x in obs]
print(json.dumps(out))
env.close()
"""


def _fresh(*args: str) -> dict:
    import json
    import subprocess

    from gym_fork import keys

    ex = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
    out = subprocess.run([sys.executable, "-c", FRESH, ex, *args], capture_output=True, text=True, timeout=180,
                         env={**os.environ, "GYM_FORK_KEY_FILE": keys.key_file()})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _as_json(d: dict) -> dict:
    return {"files": d["files"], "rows": [list(r) for r in d["rows"]]}


@pytest.mark.parametrize("backend", ["criu", "pickle"])
def test_workspace_survives_the_process_in_bundles_and_stores(tmp_path, backend):
    import stat

    ws = str(tmp_path / "ws")
    st = gym_fork.SnapshotStore(str(tmp_path / "store")) if backend == "criu" else None
    env = gym_fork.ForkableEnv(WebAppAgentEnv, workspace=ws, store=st, backend=backend)
    env.reset(seed=0)
    for a in [0, 8, 1, 8, 9]:
        env.step(a)
    with open(os.path.join(ws, "run.sh"), "w") as f:
        f.write("#!/bin/sh\n")
    os.chmod(os.path.join(ws, "run.sh"), 0o750)
    snap = env.snapshot()
    want = snapshot_of_files(ws)
    bundle = snap.save(str(tmp_path / "bundle"))
    if st is not None:  # (stores hold CRIU snapshots only)
        st.put(snap)  # written into the store (its frozen process ends)
    # the live workspace moves on; the saved copies must not follow
    for a in [2, 3, 8, 9]:
        env.step(a)
    with open(os.path.join(ws, "routes", "home.py"), "a") as f:
        f.write("# edited in place\n")
    assert snapshot_of_files(ws) != want

    for path in (bundle, st._snap_dir(snap.id)) if st else (bundle,):
        wdir = os.path.join(path, "workspace")
        assert os.path.isfile(os.path.join(wdir, "app.db")) and os.path.isfile(os.path.join(wdir, "run.sh"))
        for r, ds, fs in os.walk(wdir):  # private inside the bundle/store
            assert all(stat.S_IMODE(os.stat(os.path.join(r, n)).st_mode) == 0o600 for n in fs)
            assert all(stat.S_IMODE(os.stat(os.path.join(r, n)).st_mode) == 0o700 for n in ds)

    # a fresh interpreter gets exactly the files and rows of the snapshot moment
    for kind, src, extra in (("bundle", bundle, []), ("store", st.path if st else "", [snap.id]))[:2 if st else 1]:
        new_ws = str(tmp_path / f"ws-{kind}")
        got = _fresh(kind, src, new_ws, *extra)
        assert got["files"] == _as_json(want), kind
        assert got["attr"] == new_ws and got["steps"] == 5 and got["mode"] == "0o750"
        assert got["obs"] == [2.0, 2.0, 3.0]  # 2 routes, 2 users; tests: 2 handlers + users
        assert snapshot_of_files(ws) != want  # the original workspace was not touched

    # and in this process, into the running env
    loaded = gym_fork.load_snapshot(bundle)
    env.restore(loaded)
    assert snapshot_of_files(ws) == want
    assert env.unwrapped.workspace == ws
    env.close()


def test_tampered_or_misused_workspace_is_refused(tmp_path):
    import json
    import shutil

    from gym_fork.errors import BundleError
    from gym_fork.errors import SnapshotCorruptedError

    ws = str(tmp_path / "ws")
    env = gym_fork.ForkableEnv(WebAppAgentEnv, workspace=ws)
    env.reset(seed=0)
    for a in [0, 8]:
        env.step(a)
    snap = env.snapshot()
    good = snap.save(str(tmp_path / "b"))

    def variant(name, change):
        p = str(tmp_path / name)
        shutil.copytree(good, p, symlinks=True)
        change(os.path.join(p, "workspace"), p)
        return p

    def flip(w, _p):
        f = os.path.join(w, "routes", "home.py")
        data = open(f).read()
        open(f, "w").write(data.replace("home", "evil"))

    def extra(w, _p):
        open(os.path.join(w, "routes", "backdoor.py"), "w").write("x = 1\n")

    def link(w, _p):
        os.symlink("/etc/passwd", os.path.join(w, "passwd"))

    def manifest(_w, p):
        meta = json.load(open(os.path.join(p, "bundle.json")))
        meta["workspace"]["files"].pop("routes/home.py")
        json.dump(meta, open(os.path.join(p, "bundle.json"), "w"))

    for name, change in (("flip", flip), ("extra", extra), ("link", link)):
        with pytest.raises(SnapshotCorruptedError, match="workspace"):
            gym_fork.load_snapshot(variant(name, change))
    with pytest.raises(BundleError, match="HMAC"):
        gym_fork.load_snapshot(variant("manifest", manifest))

    loaded = gym_fork.load_snapshot(good)
    with pytest.raises(ValueError, match="workspace=DIR"):
        gym_fork.ForkableEnv.from_snapshot(loaded)
    plain = gym_fork.ForkableEnv(WebAppAgentEnv)
    try:
        with pytest.raises(ValueError, match="captured a workspace"):
            plain.restore(loaded)  # the snapshot's worker would write into another env's directory
    finally:
        plain.close()
    env.close()


def test_branch_directories_are_deleted_on_close(tmp_path):
    import gc

    ws = str(tmp_path / "ws")
    env = gym_fork.ForkableEnv(WebAppAgentEnv, workspace=ws)
    env.reset(seed=0)
    for a in [0, 8]:
        env.step(a)
    snap = env.snapshot()
    base = snapshot_of_files(ws)
    kids = env.fork(snap, 3)
    paths = [k.unwrapped.workspace for k in kids]
    assert all(os.path.isdir(p) and ".branch-" in p for p in paths)
    kids[0].close()
    assert not os.path.exists(paths[0])
    kids[1].close(keep_workspace=True)
    assert os.path.isdir(paths[1]) and snapshot_of_files(paths[1]) == base
    k2 = kids.pop(2)
    del kids, k2  # never closed: the directory goes with the env
    gc.collect()
    assert not os.path.exists(paths[2])
    [kept] = env.fork(snap, 1, keep_workspace=True)
    kept_path = kept.unwrapped.workspace
    kept.step(3)
    kept.close()
    assert os.path.isdir(kept_path) and "profile.py" in snapshot_of_files(kept_path)["files"]

    # a branch restoring its parent's snapshot keeps working in its own directory
    [kid] = env.fork(snap, 1)
    kid_path = kid.unwrapped.workspace
    kid.step(4)
    kid.restore(snap)
    assert kid.unwrapped.workspace == kid_path and snapshot_of_files(kid_path) == base
    kid.step(5)
    assert "cart.py" in snapshot_of_files(kid_path)["files"]
    assert snapshot_of_files(ws) == base  # nothing leaked into the parent's directory
    kid.close()
    assert not os.path.exists(kid_path)
    env.close()
    assert os.path.isdir(ws)  # the user's own directory is never deleted


def test_make_passes_store_and_workspace(tmp_path):
    st = gym_fork.SnapshotStore(str(tmp_path / "store"))
    ws = str(tmp_path / "ws")
    env = gym_fork.make("CartPole-v1", backend="criu", store=st, workspace=ws)
    try:
        env.reset(seed=0)
        assert env.unwrapped.workspace == ws
        open(os.path.join(ws, "note.txt"), "w").write("at snapshot")
        snap = env.snapshot()
        assert snap._store is st and snap in st.in_memory()
        open(os.path.join(ws, "note.txt"), "w").write("later")
        env.restore(snap)
        assert open(os.path.join(ws, "note.txt")).read() == "at snapshot"
    finally:
        env.close()


# --- what a listing shows: the directory's own mode and time too --------------------------------------

@pytest.mark.parametrize("how", [{"fork_tier": True}, {"fork_tier": False}, {"backend": "pickle"}],
                         ids=["fork-tier", "criu-dumps", "pickle"])
def test_a_listing_of_the_workspace_continues_exactly(tmp_path, how):
    """An agent's ``ls -la`` shows ``.`` with its mode and mtime. A restore, a ``fork()`` child and a
    loaded bundle must show the workspace as it was at the snapshot: the directory's own time is that
    the env gave it before the snapshot, not the time its content was copied back."""
    import functools
    import time

    import agent_envs

    ws = str(tmp_path / "ws")
    os.makedirs(ws)
    os.chmod(ws, 0o751)
    env = gym_fork.ForkableEnv(functools.partial(agent_envs.listing_in, ws), workspace=ws, **how)
    env.reset(seed=0)
    env.step(1)
    env.step(1)
    snap = env.snapshot()
    want = [env.step(a)[4]["listing"] for a in (0, 1, 0)]
    assert want[0]["."] != want[2]["."]  # the note unpacked meanwhile moved the directory's time

    time.sleep(0.03)  # file times tick with the kernel's coarse clock (a few ms)
    env.restore(snap)
    assert [env.step(a)[4]["listing"] for a in (0, 1, 0)] == want
    [child] = env.fork(snap, 1)
    assert child.step(0)[4]["listing"] == want[0]  # its own directory, DIR.branch-<id>, as it was
    child.close()

    bundle = snap.save(str(tmp_path / "bundle"))
    time.sleep(0.03)
    env.restore(gym_fork.load_snapshot(bundle))
    assert env.step(0)[4]["listing"] == want[0]
    env.close()


def tmpfs_dir(tmp_path) -> str:
    """A new directory on a tmpfs (/dev/shm; /tmp on many distributions), removed afterwards by
    the caller; such a file system lists a directory's entries in the order they were made."""
    import tempfile

    with open("/proc/mounts") as f:
        assert any(line.split()[1:3] == ["/dev/shm", "tmpfs"] for line in f), "/dev/shm is not a tmpfs here"
    return tempfile.mkdtemp(dir="/dev/shm", prefix=f"gym_fork-test-{tmp_path.name}-")


WALK_ACTIONS = [0, 0, 3, 0, 2, 3, 0, 1, 2, 0, 3]


@pytest.mark.parametrize("how", [{"fork_tier": True}, {"fork_tier": False}, {"backend": "pickle"}],
                         ids=["fork-tier", "criu-dumps", "pickle"])
def test_an_unsorted_walk_of_a_workspace_on_tmpfs_continues_exactly(tmp_path, how):
    """``os.walk``, ``os.listdir`` and ``find`` list entries unsorted, in the order the file system
    keeps; tmpfs keeps the order they were made in, which copying the capture back did not
    reproduce: a restored workspace (and a fork child's, and a loaded bundle's) walked in another
    order than the original, on every backend."""
    import functools

    import agent_envs

    base = tmpfs_dir(tmp_path)
    try:
        ws = os.path.join(base, "ws")
        env = gym_fork.ForkableEnv(agent_envs.unsorted_listing, workspace=ws, **how)
        env.reset(seed=0)
        for a in WALK_ACTIONS:
            env.step(a)
        snap = env.snapshot()
        want = [env.step(a)[4]["walk"] for a in (0, 3, 2)]
        for a in (1, 1, 0, 2, 3, 1):  # change the live directory more before going back
            env.step(a)
        env.restore(snap)
        assert [env.step(a)[4]["walk"] for a in (0, 3, 2)] == want
        [child] = env.fork(snap, 1)
        assert [child.step(a)[4]["walk"] for a in (0, 3, 2)] == want
        child.close()
        bundle = snap.save(str(tmp_path / "bundle"))
        env.restore(gym_fork.load_snapshot(bundle))
        assert [env.step(a)[4]["walk"] for a in (0, 3, 2)] == want
        env.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_an_order_the_file_system_does_not_keep_is_said(tmp_path):
    """Where the file system orders entries by itself (ext4: by a hash of the name), a recorded
    order it does not list in cannot be made: a RuntimeWarning says so, naming the directory."""
    from gym_fork.snapshots import workspace as wsmod

    fs = subprocess.run(["stat", "-f", "-c", "%T", str(tmp_path)], capture_output=True, text=True).stdout.strip()
    src, dst = tmp_path / "src", tmp_path / "dst"
    for d in (src, dst):
        d.mkdir()
        for i in range(12):
            (d / f"e{i}").write_text("x")
    listed = os.listdir(dst)
    order = {"": listed[::-1]}  # an order this directory does not list in now
    if fs == "tmpfs":  # made in that order, it lists so
        wsmod.put_in_order(str(dst), str(src), order)
        assert os.listdir(dst) == listed[::-1]
    else:
        assert fs.startswith("ext"), f"this test knows tmpfs and ext4, not {fs}"
        with pytest.warns(RuntimeWarning, match=r"1 directory of .*\(\.\) list their entries in another order"):
            wsmod.put_in_order(str(dst), str(src), order)
        assert os.listdir(dst) == listed and sorted(os.listdir(dst)) == sorted(os.listdir(src))


def test_a_malformed_signed_listing_order_is_refused(tmp_path):
    """The listing order a bundle signs is checked like its file list: a malformed one (a name
    with a slash, a path out of the capture) refuses the load, and nothing is left behind."""
    from gym_fork.errors import SnapshotCorruptedError
    from gym_fork.snapshots import workspace as wsmod

    src = tmp_path / "packed"
    src.mkdir()
    (src / "a.txt").write_text("a")
    manifest = wsmod.pack(str(src), str(tmp_path / "bundle-ws"))
    assert manifest.get("order") is None  # (no capture beside it: nothing recorded)
    for bad in ({"": ["../a.txt"]}, {"../up": ["a.txt"]}, {"": "a.txt"}):
        dst = str(tmp_path / "loaded")
        with pytest.raises(SnapshotCorruptedError):
            wsmod.unpack(str(tmp_path / "bundle-ws"), {**manifest, "order": bad}, "test bundle", dst)
        assert not os.path.exists(dst) and not os.path.exists(dst + wsmod.ORDER)


def _digests(root: str) -> dict:
    import hashlib

    out = {}
    for top, _dirs, names in os.walk(root):
        for name in names:
            with open(os.path.join(top, name), "rb") as f:
                out[os.path.relpath(os.path.join(top, name), root)] = hashlib.sha256(f.read()).hexdigest()
    return out


def test_workspace_files_come_back_byte_for_byte(tmp_path):
    """``sha256sum app.db`` (or ``git status``) after a restore and in a fork child shows the bytes of
    the snapshot moment: a database is copied as it is, not rewritten by SQLite's backup API (the
    same rows, but another change counter in its header). Taking the snapshot changes nothing in
    the live directory (opening the database to back it up left ``-wal``/``-shm`` files there)."""
    ws = str(tmp_path / "ws")
    env = gym_fork.ForkableEnv(WebAppAgentEnv, workspace=ws)
    env.reset(seed=0)
    for a in [0, 8, 1, 9]:
        env.step(a)
    before = _digests(ws)
    assert "app.db" in before
    snap = env.snapshot()
    assert _digests(ws) == before
    for a in [0, 2, 8, 9]:
        env.step(a)
    assert _digests(ws) != before
    env.restore(snap)
    assert _digests(ws) == before
    [kid] = env.fork(snap, 1)
    assert _digests(kid.unwrapped.workspace) == before
    kid.close()
    env.restore(gym_fork.load_snapshot(snap.save(str(tmp_path / "bundle"))))
    assert _digests(ws) == before
    env.close()


# --- a fork child's workspace is its own ---------------------------------------------------------------

def _notes(path: str) -> list[str]:
    with open(os.path.join(path, "notes.txt")) as f:
        return f.read().split()


@pytest.mark.parametrize("how", [{"fork_tier": True}, {"fork_tier": False}, {"backend": "pickle"}],
                         ids=["fork-tier", "criu-dumps", "pickle"])
@pytest.mark.parametrize("find", ["attr", "cwd", "derived", "tool"])
def test_a_fork_child_works_in_its_own_workspace_or_says_why(tmp_path, how, find):
    """A fork() child works in ``DIR.branch-<id>``. An env that finds its files through
    ``self.workspace`` (the contract) or, in a worker, by relative paths after ``chdir``ing into its
    workspace (the child's working directory follows it) continues exactly, and the parent's
    files stay its own. One that uses a path derived before it was copied reached into the
    parent's directory: the children and the parent each read the others' notes, silently. As
    root, a CRIU-backed child's mount namespace now shows its own directory at that path too, so
    it continues exactly; elsewhere that access is refused in the child's step, naming the fix,
    and nothing of the parent's is touched; the pickle backend's first snapshot refuses such an
    env. (An in-process env's working directory is the learner's: it cannot follow, and is
    refused likewise.)"""
    import functools

    import agent_envs

    ws = str(tmp_path / "ws")
    os.makedirs(ws)
    env = gym_fork.ForkableEnv(functools.partial(agent_envs.notes_in, ws, find), workspace=ws, **how)
    cwd = os.getcwd()
    try:
        env.reset(seed=0)
        env.step(0)
        env.step(0)
        follows = find == "attr" or ("backend" not in how and (find == "cwd" or os.geteuid() == 0))
        if not follows and "backend" in how:  # the pickle backend's first-snapshot check finds it
            with pytest.raises(gym_fork.errors.UnsupportedEnvError, match=r"Derive paths from self\.workspace"):
                env.snapshot()
            assert env.step(1)[4]["notes"] == 3 and _notes(ws) == ["1:0", "2:0", "3:1"]
            return
        snap = env.snapshot()
        kids = env.fork(snap, 2)
        if follows:
            assert [k.step(1)[4]["notes"] for k in kids] == [3, 3]
            assert env.step(1)[4]["notes"] == 3
            for k in kids:
                assert _notes(k.unwrapped.workspace) == ["1:0", "2:0", "3:1"]
        else:
            for k in kids:
                with pytest.raises(Exception, match=r"Derive paths from self\.workspace") as ei:
                    k.step(1)
                assert isinstance(ei.value, (PermissionError, gym_fork.errors.WorkerError))
                assert _notes(k.unwrapped.workspace) == ["1:0", "2:0"]
            assert env.step(1)[4]["notes"] == 3
        assert _notes(ws) == ["1:0", "2:0", "3:1"]  # the parent's own notes only
        for k in kids:
            k.close()
    finally:
        env.close()
        os.chdir(cwd)  # (the in-process env chdir'ed the test's process)


@pytest.mark.parametrize("how", [{"fork_tier": True}, {"fork_tier": False}], ids=["fork-tier", "criu-dumps"])
def test_a_restored_env_working_in_a_subdirectory_of_its_workspace_goes_on(tmp_path, how):
    """The env ``chdir``s into ``proj/`` inside its workspace. A restore put the workspace back by
    clearing it and copying the capture in, so ``proj/`` became another directory and the restored
    process's working directory -- the original's (fork tier), or the one criu had just reopened
    by path -- was a deleted one: its next relative write failed. Directories the capture also
    has now stay the same directories."""
    import functools

    import agent_envs

    ws = str(tmp_path / "ws")
    os.makedirs(ws)
    cwd = os.getcwd()
    env = gym_fork.ForkableEnv(functools.partial(agent_envs.notes_in, ws, "cwd-sub"), workspace=ws, **how)
    try:
        env.reset(seed=0)
        env.step(0)
        snap = env.snapshot()
        want = [env.step(a)[4]["notes"] for a in (1, 2)]
        assert want == [2, 3]
        for _ in range(2):
            env.restore(snap)
            assert [env.step(a)[4]["notes"] for a in (1, 2)] == want
        with open(os.path.join(ws, "proj", "notes.txt")) as f:
            assert f.read().split() == ["1:0", "2:1", "3:2"]
    finally:
        env.close()
        os.chdir(cwd)


def test_an_env_that_chose_another_workspace_itself_is_no_copy(tmp_path):
    """The env made its own workspace in ``__init__`` (``self.workspace = own``) and the user
    declared another: the first worker is no copy, so nothing is refused in its step; what it
    writes in its own directory is outside the declared workspace and refuses the snapshot, as
    before, naming the file."""
    import functools

    import agent_envs
    from gym_fork.errors import UncapturedFilesError

    own, ws = str(tmp_path / "own"), str(tmp_path / "ws")
    os.makedirs(own)
    env = gym_fork.ForkableEnv(functools.partial(agent_envs.notes_in, own, "derived"), workspace=ws)
    try:
        env.reset(seed=0)
        assert env.step(0)[4]["notes"] == 1
        with pytest.raises(UncapturedFilesError, match="notes.txt"):
            env.snapshot()
    finally:
        env.close()

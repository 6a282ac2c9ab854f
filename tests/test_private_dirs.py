"""``private_dirs=``: an env working in directories of the machine (an app tree with files written
per step, a journal held open, a shell tool's log, a SQLite database) is captured with every
snapshot, and each worker (the first, every restore, every fork branch) sees its own copy at the
very same path, through a mount namespace of its own.  The real directory is never written.

Exactness is checked as in test_agent_envs.py: branches step interleaved with the original (shared
files would make them diverge), restores replay both action paths bit-identically.
"""

from __future__ import annotations

import functools
import os

import pytest
from conftest import assert_same_traj

import agent_envs
import gym_fork
from gym_fork.errors import BackendUnavailableError, UncapturableStateError, UncapturedFilesError, UnsupportedEnvError
from gym_fork.snapshots import sessiondir
from test_agent_envs import check_exact_and_isolated, step

pytestmark = pytest.mark.criu


def _copies() -> set[str]:
    return {n for n in os.listdir(sessiondir.session_dir()) if n.startswith(("pdl-", "pd-"))}


def _files(root: str) -> dict[str, bytes]:
    out = {}
    for name in sorted(os.listdir(root)):
        with open(os.path.join(root, name), "rb") as f:
            out[name] = f.read()
    return out


@pytest.mark.parametrize("hold, fork_tier, mechanism", [
    (False, "auto", "ForkPayload"),   # files opened per step, a shell child: fork tier + binds
    (True, "auto", "CriuPayload"),    # a journal held open: the scan picks CRIU dumps
    (False, False, "CriuPayload"),    # CRIU dumps throughout
], ids=["fork-tier", "held-file-criu", "criu-only"])
def test_files_in_private_dirs_are_exact_and_isolated(tmp_path, hold, fork_tier, mechanism):
    app = tmp_path / "app"
    app.mkdir()
    (app / "README").write_text("template\n")
    before = _files(str(app))
    existing = _copies()
    other: dict = {}

    def branches(env, kids) -> None:
        views = [env.private_dir_view(str(app))] + [k.private_dir_view(str(app)) for k in kids]
        assert len(set(views)) == 3 and str(app) not in views
        assert _files(views[0]) == _files(views[1])  # same actions, same files
        assert _files(views[0]) != _files(views[2])  # the other branch wrote its own
        other["files"] = _files(views[2])

    def restored(env) -> None:  # the second branch's actions replayed: its files, exactly
        assert _files(env.private_dir_view(str(app))) == other["files"]
        assert _files(str(app)) == before  # the real directory is the template, never written

    check_exact_and_isolated(functools.partial(agent_envs.app_dir, str(app), hold, True), 8, mechanism=mechanism,
                             on_branches=branches, on_restored=restored, private_dirs=[str(app)], fork_tier=fork_tier)
    assert _copies() <= existing, "private copies left behind"


@pytest.mark.parametrize("dir_fd", [False, True], ids=["cwd", "dir-fd"])
@pytest.mark.parametrize("fork_tier, mechanism", [("auto", "ForkPayload"), (False, "CriuPayload")],
                         ids=["fork-tier", "criu-only"])
def test_an_env_working_inside_its_private_dir_by_relative_paths(tmp_path, fork_tier, mechanism, dir_fd):
    """The env ``chdir``s into its private directory (or holds a descriptor of it). A fork-tier
    copy binds its own copy there, and its working directory and directory descriptors must
    follow: they pointed into the copy it inherited (the previous worker's, deleted once that one
    is replaced), so a restored copy's next write failed."""
    app = tmp_path / "app"
    app.mkdir()
    existing = _copies()

    def branches(env, kids) -> None:
        views = [env.private_dir_view(str(app))] + [k.private_dir_view(str(app)) for k in kids]
        assert sorted(os.listdir(views[0])) == sorted(os.listdir(views[1])) != sorted(os.listdir(views[2]))

    check_exact_and_isolated(functools.partial(agent_envs.project_cwd, str(app), dir_fd), 8, mechanism=mechanism,
                             on_branches=branches, private_dirs=[str(app)], fork_tier=fork_tier)
    assert os.listdir(app) == []  # the template was never written
    assert _copies() <= existing, "private copies left behind"


def test_without_private_dirs_the_same_env_is_refused(tmp_path):
    app = tmp_path / "app"
    app.mkdir()
    env = gym_fork.ForkableEnv(functools.partial(agent_envs.app_dir, str(app), False, True))
    try:
        env.reset(seed=0)
        env.step(1)
        with pytest.raises(UncapturedFilesError, match=str(app)):
            env.snapshot()
    finally:
        env.close()
    env = gym_fork.ForkableEnv(functools.partial(agent_envs.app_dir, str(app), True, False))
    try:
        env.reset(seed=0)
        env.step(1)
        with pytest.raises(UncapturableStateError, match=r"journal\.txt \(open for writing\).*private_dirs"):
            env.snapshot()
    finally:
        env.close()


def test_persisted_and_evicted_snapshot_restores_from_images(tmp_path):
    """A copy-on-write snapshot written as CRIU images (criu runs inside the worker's mount
    namespace) and restored from them, into a fresh copy of its files."""
    app = tmp_path / "app"
    app.mkdir()
    env = gym_fork.ForkableEnv(functools.partial(agent_envs.app_dir, str(app), False, True), private_dirs=[str(app)])
    try:
        env.reset(seed=1)
        for a in (1, 2, 3):
            env.step(a)
        snap = env.snapshot()
        ref = [step(env, a) for a in (0, 3, 1, 2)]
        snap.persist(keep_in_memory=False)
        env.restore(snap)
        assert_same_traj(ref, [step(env, a) for a in (0, 3, 1, 2)])
        # a restored copy (its files opened in its own namespace) takes CRIU dumps too
        snap2 = env.snapshot()
        snap2.persist(keep_in_memory=False)
        ref2 = [step(env, a) for a in (2, 2, 0)]
        env.restore(snap2)
        assert_same_traj(ref2, [step(env, a) for a in (2, 2, 0)])
    finally:
        env.close()


def test_vec_env_fork_into_gives_each_slot_its_own_copy(tmp_path):
    app = tmp_path / "app"
    app.mkdir()
    fac = functools.partial(agent_envs.app_dir, str(app), False, True)
    envs = [gym_fork.ForkableEnv(fac, private_dirs=[str(app)]) for _ in range(3)]
    for e in envs[1:]:
        e._share_lineage(envs[0])
    vec = gym_fork.ForkableVecEnv(envs)
    try:
        envs[0].reset(seed=2)
        envs[0].step(1)
        snap = envs[0].snapshot()
        ref = [step(envs[0], a) for a in (3, 0, 2)]
        vec.fork_into(snap, [1, 2])
        for e in envs[1:]:
            assert_same_traj(ref, [step(e, a) for a in (3, 0, 2)])
        views = {e.private_dir_view(str(app)) for e in envs}
        assert len(views) == 3
    finally:
        vec.close()


def test_bad_private_dirs_are_refused_before_anything_starts(tmp_path):
    fac = functools.partial(agent_envs.app_dir, str(tmp_path), False, False)
    with pytest.raises(ValueError, match="relative"):
        gym_fork.ForkableEnv(fac, private_dirs=["app"])
    with pytest.raises(ValueError, match="not an existing directory"):
        gym_fork.ForkableEnv(fac, private_dirs=[str(tmp_path / "missing")])
    (tmp_path / "a" / "b").mkdir(parents=True)
    with pytest.raises(ValueError, match="nested"):
        gym_fork.ForkableEnv(fac, private_dirs=[str(tmp_path / "a"), str(tmp_path / "a" / "b")])
    with pytest.raises(ValueError, match="'/'"):
        gym_fork.ForkableEnv(fac, private_dirs=["/"])
    with pytest.raises(TypeError, match="paths"):
        gym_fork.ForkableEnv(fac, private_dirs=[3])
    with pytest.raises(BackendUnavailableError, match="not pickle"):
        gym_fork.ForkableEnv(fac, private_dirs=[str(tmp_path)], backend="pickle")


ACTS = (0, 3, 1, 2)


def _tree_state(root: str) -> dict:
    """Every entry below ``root`` and ``root`` itself: type, mode, mtime, content (file bytes or
    link target) -- what a program that reads its directory could observe."""
    import stat

    def one(p: str) -> tuple:
        st = os.lstat(p)
        if stat.S_ISREG(st.st_mode):
            with open(p, "rb") as f:
                data = f.read().hex()
        else:
            data = os.readlink(p) if stat.S_ISLNK(st.st_mode) else None
        return stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), st.st_mtime_ns, data

    out = {".": one(root)}
    for d, dirs, names in os.walk(root):
        for n in dirs + names:
            out[os.path.relpath(os.path.join(d, n), root)] = one(os.path.join(d, n))
    return out


def _decorate(view: str) -> None:
    """What an agent leaves in its app tree besides plain files: a nested directory with its own
    mode and old times, a symlink, a FIFO, a unix socket node (not carried: servers bind again)."""
    import socket

    os.makedirs(os.path.join(view, "static", "css"))
    with open(os.path.join(view, "static", "css", "app.css"), "w") as f:
        f.write("body { margin: 0 }\n")
    os.utime(os.path.join(view, "static", "css", "app.css"), ns=(1_600_000_000_123_456_789,) * 2)
    os.chmod(os.path.join(view, "static"), 0o750)
    os.symlink("static/css/app.css", os.path.join(view, "style.css"))
    os.mkfifo(os.path.join(view, "control.fifo"), 0o620)
    s = socket.socket(socket.AF_UNIX)
    s.bind(os.path.join(view, "gone.sock"))
    s.close()
    os.chmod(view, 0o751)


def _started(app, **opts):
    env = gym_fork.ForkableEnv(functools.partial(agent_envs.app_dir, str(app), False, True),
                               private_dirs=[str(app)], **opts)
    env.reset(seed=3)
    _decorate(env.private_dir_view(str(app)))
    for a in (1, 2, 0):
        env.step(a)
    return env


@pytest.fixture
def app_env(tmp_path):
    """An app-directory env in ``tmp_path/app`` (private), decorated and a few steps in."""
    app = tmp_path / "app"
    app.mkdir()
    env = _started(app)
    yield app, env
    env.close()


CHILD = """
import json, sys
import gym_fork
snap = gym_fork.load_snapshot(sys.argv[1])
env = gym_fork.ForkableEnv.from_snapshot(snap, private_dirs=[sys.argv[2]])
traj = []
for a in json.loads(sys.argv[3]):
    obs, r, term, trunc, info = env.step(a)
    traj.append([obs.tolist(), r, term, trunc, info])
print(json.dumps({"pid": env.worker_pid, "traj": traj}))
env.close()
"""


def test_saved_snapshot_carries_its_private_dirs_to_a_fresh_interpreter(tmp_path):
    """Snapshot.save packs the captured directories into the bundle (signed); a fresh interpreter
    loads it and continues bit-identically, its worker seeing the files at the same path; the
    same bundle restores here too, with modes, times, links and FIFOs as they were."""
    import json
    import subprocess
    import sys

    from gym_fork import keys

    app = tmp_path / "app"
    app.mkdir()
    env = _started(app)
    try:
        snap = env.snapshot()
        at_snap = _tree_state(env.private_dir_view(str(app)))
        assert "gone.sock" in at_snap
        del at_snap["gone.sock"]
        path = snap.save(str(tmp_path / "bundle"))
        ref = [step(env, a) for a in ACTS]

        loaded = gym_fork.load_snapshot(path)
        assert loaded.private_dirs_paths == (str(app),)
        env.restore(loaded)  # a loaded snapshot restores into an env with the same private_dirs
        assert _tree_state(env.private_dir_view(str(app))) == at_snap
        assert_same_traj(ref, [step(env, a) for a in ACTS])
        fresh = gym_fork.ForkableEnv.from_snapshot(loaded, private_dirs=[str(app)])
        try:
            assert _tree_state(fresh.private_dir_view(str(app))) == at_snap
            assert_same_traj(ref, [step(fresh, a) for a in ACTS])
        finally:
            fresh.close()

        out = subprocess.run([sys.executable, "-c", CHILD, path, str(app), json.dumps(list(ACTS))],
                             capture_output=True, text=True, timeout=120,
                             env={**os.environ, "GYM_FORK_KEY_FILE": keys.key_file()})
        assert out.returncode == 0, out.stderr[-3000:]
        got = json.loads(out.stdout.strip().splitlines()[-1])["traj"]
        assert [[o.tolist(), r, t, u, i] for o, r, t, u, i in ref] == got
        assert sorted(os.listdir(app)) == []  # the real directory was never written
    finally:
        env.close()


ORDER_CHILD = r"""
import json, sys
import gym_fork
sys.path.insert(0, sys.argv[3])
import agent_envs

app, fork_tier = sys.argv[1], json.loads(sys.argv[2])
import functools
env = gym_fork.ForkableEnv(functools.partial(agent_envs.unsorted_listing, app), private_dirs=[app], fork_tier=fork_tier)
env.reset(seed=0)
for a in [0, 0, 3, 0, 2, 3, 0, 1, 2, 0, 3]:
    env.step(a)
snap = env.snapshot()
want = [env.step(a)[4]["walk"] for a in (0, 3, 2)]
for a in (1, 1, 0, 2, 3, 1):
    env.step(a)
env.restore(snap)
restored = [env.step(a)[4]["walk"] for a in (0, 3, 2)]
[kid] = env.fork(snap, 1)
forked = [kid.step(a)[4]["walk"] for a in (0, 3, 2)]
kid.close()
env.close()
print(json.dumps({"restored": restored == want, "forked": forked == want}))
"""


@pytest.mark.parametrize("fork_tier", ["auto", False], ids=["fork-tier", "criu-only"])
def test_private_copies_on_tmpfs_list_as_the_worker_did(tmp_path, fork_tier):
    """The copies a worker sees live in gym_fork's session directory; where that is a tmpfs
    (``$GYM_FORK_DIR``, or ``/tmp`` on many distributions), which lists entries in the order they
    were made, a restored or forked copy walked its private directory in another order than the
    worker did at the snapshot. (A fresh interpreter: the session directory is chosen once.)"""
    import json
    import shutil
    import subprocess
    import sys

    from test_workspace import tmpfs_dir

    session = tmpfs_dir(tmp_path)
    app = tmp_path / "app"
    app.mkdir()
    try:
        out = subprocess.run([sys.executable, "-c", ORDER_CHILD, str(app), json.dumps(fork_tier),
                              os.path.dirname(__file__)], capture_output=True, text=True, timeout=120,
                             env={**os.environ, "GYM_FORK_DIR": session})
        assert out.returncode == 0, out.stderr[-3000:]
        assert json.loads(out.stdout.strip().splitlines()[-1]) == {"restored": True, "forked": True}
    finally:
        shutil.rmtree(session, ignore_errors=True)


def test_damaged_private_files_in_a_bundle_are_refused(tmp_path, app_env):
    from gym_fork.errors import SnapshotCorruptedError

    _app, env = app_env
    path = env.snapshot().save(str(tmp_path / "bundle"))
    victim = os.path.join(path, "private_dirs", "0", "step-1.txt")
    os.chmod(victim, 0o600)
    with open(victim, "a") as f:
        f.write("x")
    with pytest.raises(SnapshotCorruptedError, match="sha256"):
        gym_fork.load_snapshot(path)
    os.truncate(victim, os.path.getsize(victim) - 1)
    gym_fork.load_snapshot(path).release()  # intact again
    with open(os.path.join(path, "private_dirs", "0", "extra.txt"), "w") as f:
        f.write("planted")
    with pytest.raises(SnapshotCorruptedError, match="differ from the signed list"):
        gym_fork.load_snapshot(path)
    env.step(1)  # untouched


def test_a_device_node_in_a_private_dir_is_not_saved(tmp_path, app_env):
    import stat

    app, env = app_env
    os.mknod(os.path.join(env.private_dir_view(str(app)), "null"), stat.S_IFCHR | 0o600, os.makedev(1, 3))
    snap = env.snapshot()
    with pytest.raises(UnsupportedEnvError, match=r"device nodes \(.*/app/null\)"):
        snap.save(str(tmp_path / "bundle"))
    assert not [n for n in os.listdir(tmp_path) if n.startswith("bundle")]  # no half-written bundle
    env.restore(snap)  # the snapshot itself is fine
    env.step(1)


def test_store_keeps_private_dirs_and_a_new_process_loads_them(tmp_path):
    app = tmp_path / "app"
    app.mkdir()
    store = gym_fork.SnapshotStore(str(tmp_path / "store"))
    env = _started(app, store=store)
    try:
        snap = env.snapshot()
        snap.pin()  # written into the store now
        ref = [step(env, a) for a in ACTS]
        again = gym_fork.SnapshotStore(str(tmp_path / "store")).load(snap.id)
        assert again.private_dirs_paths == (str(app),)
        fresh = gym_fork.ForkableEnv.from_snapshot(again, private_dirs=[str(app)])
        try:
            assert_same_traj(ref, [step(fresh, a) for a in ACTS])
        finally:
            fresh.close()
        with pytest.raises(ValueError, match="private_dirs"):
            gym_fork.ForkableEnv.from_snapshot(again)
    finally:
        env.close()


def test_what_cannot_carry_private_files_says_so(tmp_path):
    app = tmp_path / "app"
    app.mkdir()
    env = gym_fork.ForkableEnv(functools.partial(agent_envs.app_dir, str(app), False, False), private_dirs=[str(app)])
    try:
        env.reset(seed=0)
        env.step(1)
        snap = env.snapshot()
        with pytest.raises(UnsupportedEnvError, match="cannot migrate"):
            env.migrate("127.0.0.1:1", token="x" * 32)
        with pytest.raises(ValueError, match="private_dirs"):
            gym_fork.ForkableEnv.from_snapshot(snap)
        with pytest.raises(ValueError, match="private_dirs"):
            gym_fork.ForkableEnv.from_snapshot(snap, private_dirs=[str(tmp_path)])
        env.step(2)  # still running, unchanged
    finally:
        env.close()


def test_redis_listening_on_a_socket_path_in_a_private_dir(tmp_path):
    """Without private_dirs a bound socket path is refused (test_agent_envs); in a private directory
    every copy's redis-server binds its own copy of the path, so clients never cross."""

    run = tmp_path / "run"
    run.mkdir()
    existing = _copies()
    check_exact_and_isolated(functools.partial(agent_envs.redis_unix_in, str(run)), private_dirs=[str(run)])
    assert not os.listdir(run)  # the real directory never held the socket
    assert _copies() <= existing


def test_sqlite_held_open_in_a_private_dir_is_refused_with_the_fix(tmp_path):
    """A restored copy would find another inode at the path, and SQLite then refuses to write
    ("attempt to write a readonly database"): refused by name before that, with the fix."""
    app = tmp_path / "app"
    app.mkdir()
    env = gym_fork.ForkableEnv(functools.partial(agent_envs.SqliteEnv, str(app / "moves.db")), private_dirs=[str(app)])
    try:
        env.reset(seed=0)
        env.step(1)
        with pytest.raises(UncapturableStateError, match=r"moves\.db \(SQLite database held open.*during a step"):
            env.snapshot()
        env.step(2)
    finally:
        env.close()

"""Bad input and faults: typed errors with helpful messages, and the running env left intact."""

from __future__ import annotations

import copy
import gc
import importlib.util
import os
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import threading
import time

import gymnasium as gym
import numpy as np
import pytest
from conftest import campaign as load_campaign, eventually, process_alive, same, started_elsewhere

import gym_fork
from gym_fork import keys
from gym_fork.snapshots import sessiondir
from gym_fork.errors import (
    EnvClosedError,
    EnvNotShippableError,
    ForeignSnapshotError,
    RestoreError,
    GymForkError,
    SnapshotCorruptedError,
    SnapshotError,
    SnapshotReleasedError,
    UnsupportedEnvError,
    WorkerDiedError,
    WorkerError,
)

pytestmark = pytest.mark.criu


_alive = process_alive


@pytest.fixture
def env():
    # fork_tier=False: these tests look at CRIU image files (test_fork_tier.py covers the rest)
    e = gym_fork.make("CartPole-v1", backend="criu", fork_tier=False)
    e.reset(seed=0)
    yield e
    e.close()


def test_released_snapshot(env):
    snap = env.snapshot()
    path = snap.payload().path
    assert os.path.isdir(path)
    snap.release()
    assert snap.released and not os.path.exists(path)
    with pytest.raises(SnapshotReleasedError, match="released"):
        env.restore(snap)
    env.step(0)  # still usable


def test_snapshot_freed_when_unreferenced(env):
    snap = env.snapshot()
    path = snap.payload().path
    del snap
    gc.collect()
    assert not os.path.exists(path)


def test_foreign_snapshot():
    a = gym_fork.make("CartPole-v1", backend="criu")
    b = gym_fork.make("CartPole-v1", backend="criu")
    p = gym_fork.make("CartPole-v1", backend="pickle")
    try:
        for e in (a, b, p):
            e.reset(seed=0)
        snap = a.snapshot()
        with pytest.raises(ForeignSnapshotError, match="another env"):
            b.restore(snap)
        with pytest.raises(TypeError, match="Snapshot"):
            b.restore("not a snapshot")
        b.step(1)
    finally:
        for e in (a, b, p):
            e.close()


def test_released_fork_snapshot_frees_its_process():
    e = gym_fork.make("CartPole-v1", backend="criu", fork_tier=True)
    try:
        e.reset(seed=0)
        snap = e.snapshot()
        pid = snap.payload().pid
        assert _alive(pid)
        snap.release()
        for _ in range(100):
            if not _alive(pid):
                break
            time.sleep(0.02)
        assert not _alive(pid)
        with pytest.raises(SnapshotReleasedError):
            e.restore(snap)
        e.step(0)
    finally:
        e.close()


def test_closed_env_and_its_snapshots():
    e = gym_fork.make("CartPole-v1", backend="criu", fork_tier=False)
    e.reset(seed=0)
    snap = e.snapshot()
    pid = e.worker_pid
    path = snap.payload().path
    e.close()
    assert not _alive(pid), "close() must stop the worker"
    assert not os.path.exists(path), "close() must release the env's snapshots"
    with pytest.raises(EnvClosedError):
        e.step(0)
    with pytest.raises(EnvClosedError):
        e.restore(snap)
    with pytest.raises(EnvClosedError):
        e.snapshot()
    e.close()  # idempotent


@pytest.mark.parametrize("damage", ["corrupt", "truncate", "delete-file", "delete-dir"])
def test_damaged_images_refused_env_intact(env, damage):
    for _ in range(5):
        env.step(0)
    snap = env.snapshot()
    path = snap.payload().path
    pages = max((f for f in os.listdir(path) if f.startswith("pages-")),
                key=lambda f: os.path.getsize(os.path.join(path, f)))
    target = os.path.join(path, pages)
    if damage == "corrupt":
        with open(target, "r+b") as f:
            f.seek(os.path.getsize(target) // 2)
            f.write(b"\xde\xad\xbe\xef")
    elif damage == "truncate":
        os.truncate(target, 100)
    elif damage == "delete-file":
        os.unlink(target)
    else:
        import shutil

        shutil.rmtree(path)
    pid = env.worker_pid
    obs_before = env.unwrapped.state
    with pytest.raises(SnapshotCorruptedError):
        env.restore(snap)
    assert env.worker_pid == pid and np.array_equal(env.unwrapped.state, obs_before)
    env.step(0)


@pytest.mark.parametrize("verify", ["full", "sha256"])
def test_image_changed_in_place_is_refused(verify):
    """A restore never reads an image that changed after the dump: "full" (the default) tells by
    the identity recorded at the dump (a write moves the mtime), "sha256" by the bytes, also when
    the mtime was put back afterwards."""
    env = gym_fork.make("CartPole-v1", backend="criu", fork_tier=False, verify=verify)
    try:
        env.reset(seed=0)
        snap = env.snapshot()
        path = snap.payload().path
        pages = max((f for f in os.listdir(path) if f.startswith("pages-")),
                    key=lambda f: os.path.getsize(os.path.join(path, f)))
        target = os.path.join(path, pages)
        st = os.stat(target)
        with open(target, "r+b") as f:
            f.seek(st.st_size // 2)
            byte = f.read(1)
            f.seek(st.st_size // 2)
            f.write(bytes([byte[0] ^ 0xFF]))
        if verify == "sha256":
            os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))  # the change hides from identity
        with pytest.raises(SnapshotCorruptedError, match="changed after it was dumped" if verify == "full" else "sha256"):
            env.restore(snap)
        env.step(0)  # untouched
    finally:
        env.close()


def test_own_images_get_their_sha256_when_they_leave(env, tmp_path):
    """Images dumped into the session directory carry no sha256 until something signs them (a
    bundle here); the digest then computed is the bytes' own, and kept for next time."""
    import hashlib

    from gym_fork.snapshots import sessiondir

    snap = env.snapshot()
    path = snap.payload().path
    assert all("sha256" not in f for f in sessiondir.read_manifest(path)["files"].values())
    snap.save(str(tmp_path / "b"))
    files = sessiondir.read_manifest(path)["files"]
    for name, f in files.items():
        with open(os.path.join(path, name), "rb") as fh:
            assert f["sha256"] == hashlib.sha256(fh.read()).hexdigest()
    env.restore(snap)  # still the same images
    env.step(0)


def test_worker_killed_says_how(env):
    os.kill(env.worker_pid, signal.SIGKILL)
    with pytest.raises(WorkerDiedError, match="SIGKILL|signal 9|137"):
        env.step(0)


def test_worker_restored_then_killed(env):
    snap = env.snapshot()
    env.restore(snap)
    os.kill(env.worker_pid, signal.SIGKILL)
    with pytest.raises(WorkerDiedError, match="SIGKILL"):
        env.step(0)


class _ExitsOnOne(gym.Env):
    """Steps as usual, except action 1, on which the process exits with code 3 (a native
    library's ``exit(3)`` on an error it cannot recover from), and action 2: exit code 0."""

    observation_space = gym.spaces.Box(-1, 1, (1,), np.float32)
    action_space = gym.spaces.Discrete(3)

    def reset(self, *, seed=None, options=None):
        return np.zeros(1, np.float32), {}

    def step(self, action):
        if action:
            os._exit(3 if action == 1 else 0)
        return np.zeros(1, np.float32), 0.0, False, False, {}


def _copy_whose_parent_is(parent: str, env: gym_fork.ForkableEnv) -> gym_fork.Snapshot:
    """Make ``env`` run on a fork-tier copy (not this process's child) whose parent is
    ``parent``; returns a snapshot to go on from."""
    env.reset(seed=0)
    snap = env.snapshot()
    if parent == "its frozen snapshot":
        env.restore(snap)
    elif parent == "the namespace's reaper":  # its snapshot released: the copy was handed over
        env.restore(snap)
        env.step(0)
        back = env.snapshot()
        env.restore(back)
        back.release()  # (the copy restored from `back` goes to the namespace's reaper)
    else:  # "moved off the namespace's init" by a fork of its snapshot (test_a_crash_of_an_env_spares_its_forks)
        for child in env.fork(snap, 1):
            child.close()
    return snap


@pytest.mark.parametrize("parent", ["its frozen snapshot", "the namespace's reaper", "moved off the namespace's init"])
@pytest.mark.parametrize("ending, said", [
    pytest.param(signal.SIGSEGV, "killed by SIGSEGV", id="segfault"),
    pytest.param(signal.SIGKILL, "killed by SIGKILL", id="sigkill"),
    pytest.param(1, "exited with code 3", id="exit-3")])
def test_a_copy_on_write_copy_that_died_says_how(parent, ending, said):
    """A restored or forked fork-tier copy is its frozen snapshot's child (or, once that is
    released, its namespace's reaper's), not this process's, and only a parent learns how its
    child ended: the frozen snapshots ignored SIGCHLD, and a copy's death (a segfault in a
    native env, the OOM killer's SIGKILL, an exit(3)) was reported as "it has exited (... how
    is not known here)" -- most of an env's workers after its first restore or fork are such
    copies. Now its parent writes down how (gym_fork.worker.exits), and the error says it."""
    env = gym_fork.ForkableEnv(_ExitsOnOne, fork_tier=True)
    try:
        snap = _copy_whose_parent_is(parent, env)
        assert not env._handle._child and env._handle._popen is None  # (not ours to wait for)
        pid = env.worker_pid
        if isinstance(ending, signal.Signals):
            os.kill(pid, ending)
            assert eventually(lambda: not os.path.exists(f"/proc/{pid}"))  # collected: no zombie to read it from
            action = 0
        else:
            action = ending
        with pytest.raises(WorkerDiedError) as info:
            env.step(action)
        assert said in str(info.value)
        assert "not known" not in str(info.value) and "still running" not in str(info.value)
        env.restore(snap)  # the env goes on from its snapshot
        env.step(0)
    finally:
        env.close()


def test_a_copy_on_write_copy_that_exited_with_0_is_not_said_to_be_running():
    """A copy that exits with status 0 is not written down (one retires at every restore): it
    is said to have exited (with code 0, where the parent had not collected it yet), never to be
    "still running but closed its channel"."""
    env = gym_fork.ForkableEnv(_ExitsOnOne, fork_tier=True)
    try:
        snap = _copy_whose_parent_is("its frozen snapshot", env)
        with pytest.raises(WorkerDiedError, match="has exited|exited with code 0") as info:
            env.step(2)
        assert "still running" not in str(info.value)
        env.restore(snap)
        env.step(0)
    finally:
        env.close()


_KILL_A_COPY_OF_A_LOADED_SNAPSHOT = textwrap.dedent(
    """
    import os, signal, sys, time
    import gym_fork
    from gym_fork.errors import WorkerDiedError
    env = gym_fork.ForkableEnv.from_snapshot(gym_fork.load_snapshot(sys.argv[1]))  # CRIU-restored
    snap = env.snapshot()  # a frozen process forked from that worker
    env.restore(snap)      # a copy of it, its child
    pid = env.worker_pid
    os.kill(pid, signal.SIGSEGV)
    while os.path.exists(f"/proc/{pid}"):  # collected by its parent: no zombie to read the status from
        time.sleep(0.01)
    try:
        env.step(0)
    except WorkerDiedError as e:
        print(e)
    env.close()
    """
)


def test_a_copy_in_a_process_that_loaded_the_snapshot_says_how_it_ended(tmp_path):
    """A CRIU-restored worker's environment names the record of how copies ended of the process
    that started it (here: this one, still running), so its copies' parents wrote there, and the
    process that loaded the snapshot said only that its copy "has exited". A restore now tells
    the worker its own controller's record."""
    env = gym_fork.ForkableEnv("CartPole-v1", fork_tier=True)
    try:
        env.reset(seed=0)
        env.step(0)
        path = env.snapshot().save(str(tmp_path / "bundle"))
    finally:
        env.close()
    out = subprocess.run([sys.executable, "-c", _KILL_A_COPY_OF_A_LOADED_SNAPSHOT, path], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "GYM_FORK_KEY_FILE": keys.key_file()})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "killed by SIGSEGV" in out.stdout, out.stdout


class _SlowOnOne(gym.Env):
    """Steps in microseconds, except action 1, which takes 0.5 s."""

    observation_space = gym.spaces.Box(-1, 1, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        return np.zeros(1, np.float32), {}

    def step(self, action):
        if action == 1:
            time.sleep(0.5)
        return np.zeros(1, np.float32), 0.0, False, False, {}


@pytest.mark.parametrize("path", ["socket", "ring"])
def test_worker_killed_while_the_controller_polls_for_its_reply_says_how(path, monkeypatch, tmp_path):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU: nothing polls (gym_fork.worker.channel.spin_cap)")
    monkeypatch.setenv("GYM_FORK_RING", "1" if path == "ring" else "0")
    monkeypatch.setenv("GYM_FORK_RING_SLOTS_DIR", str(tmp_path / "ring-slots"))  # none held elsewhere
    e = gym_fork.ForkableEnv(_SlowOnOne)
    try:
        e.reset(seed=0)
        for _ in range(200):  # fast steps: the controller polls (spins on the ring) before it sleeps
            e.step(0)
        assert e.step_path == path
        h = e._handle
        pace = h.ring.pace if path == "ring" else h._spin
        if pace.budget <= 0:  # (a loaded machine's steps came back slowly: poll for this one anyway)
            from gym_fork.worker.channel import SpinWait

            pace = SpinWait(pace.cap, pace.cap / 4)
            if path == "ring":
                h.ring.pace = pace
            else:
                h._spin = pace
        assert pace.budget > 0
        killer = threading.Timer(0.05, os.kill, (e.worker_pid, signal.SIGKILL))
        killer.start()
        with pytest.raises(WorkerDiedError, match="SIGKILL"):
            e.step(1)
        killer.join()
    finally:
        e.close()


class _HoldsForeignSocket(gym.Env):
    """Keeps a connection to a process outside the worker: CRIU cannot dump that."""

    observation_space = gym.spaces.Box(-1, 1, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, path):
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.connect(path)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(1, np.float32), {}

    def step(self, action):
        self.t += 1
        return np.full(1, self.t / 100, np.float32), 1.0, False, False, {}


@pytest.mark.parametrize("fork_tier", [False, True])
def test_failed_dump_leaves_env_running_and_no_snapshot(tmp_path, fork_tier):
    path = str(tmp_path / "srv.sock")
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen(1)
    conns = []
    threading.Thread(target=lambda: conns.append(srv.accept()), daemon=True).start()
    e = gym_fork.ForkableEnv(lambda: _HoldsForeignSocket(path), backend="criu", fork_tier=fork_tier)
    try:
        e.reset(seed=0)
        e.step(0)
        before = set(os.listdir(sessiondir.session_dir()))
        # Neither tier can copy a connection to a process outside the env: a fork() copy would
        # share it with the original, a CRIU dump cannot hold its other end. Refused up front.
        with pytest.raises(SnapshotError, match="keeps running"):
            e.snapshot()
        assert set(os.listdir(sessiondir.session_dir())) == before, "no half-written snapshot may stay"
        obs, *_ = e.step(0)
        assert obs[0] == pytest.approx(0.02)
    finally:
        e.close()
        srv.close()


def test_unshippable_instance():
    class Local(gym.Env):
        observation_space = gym.spaces.Discrete(2)
        action_space = gym.spaces.Discrete(2)

        def __init__(self):
            self.lock = threading.Lock()  # cannot be pickled

    with pytest.raises(EnvNotShippableError, match="env id.*factory"):
        gym_fork.ForkableEnv(Local(), backend="criu")


def _env_with_a_space_class_defined_in_a_function():
    class LocalSpace(gym.spaces.Discrete):
        pass

    class Local(gym.Env):
        observation_space = gym.spaces.Discrete(2)
        action_space = LocalSpace(2)

    return Local()


def test_a_space_class_defined_in_a_function_is_named_as_the_cause():
    """The worker builds the env, but its answer (the spaces) holds a class defined inside a
    function, which pickle cannot send back: EnvNotShippableError with the fix, on every Python
    (pickle says "Can't pickle local object" up to 3.12, "Can't get local object" from 3.13;
    it was a bare WorkerError[AttributeError])."""
    with pytest.raises(EnvNotShippableError, match="defined inside a function.*module level"):
        gym_fork.ForkableEnv(_env_with_a_space_class_defined_in_a_function, backend="criu")


def test_env_errors_keep_their_type(env):
    with pytest.raises(AssertionError) as ei:
        env.step(7)  # CartPole: invalid action
    assert isinstance(ei.value, WorkerError) and "invalid" in str(ei.value)
    env.step(0)  # the worker survived
    with pytest.raises(gym.error.Error):
        gym_fork.make("NoSuchEnv-v0", backend="criu")


def test_bad_arguments(env):
    with pytest.raises(ValueError, match="unknown backend"):
        gym_fork.make("CartPole-v1", backend="magic")
    with pytest.raises(ValueError, match="n must be"):
        env.fork(n=0)
    with pytest.raises(TypeError, match="env id"):
        gym_fork.ForkableEnv(42)
    with pytest.raises(ValueError, match="invalid snapshot id"):
        sessiondir.check_id("../../etc")


def test_images_are_private(env):
    snap = env.snapshot()
    for p in (sessiondir.session_dir(), snap.payload().path):
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o700


class _LosesStateOnPickle(gym.Env):
    """Looks picklable but drops its position: the pickle backend must notice."""

    observation_space = gym.spaces.Box(-1e9, 1e9, (1,), np.float64)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.pos = 0.0
        return np.array([self.pos]), {}

    def step(self, action):
        self.pos += 1.0
        return np.array([self.pos]), 0.0, False, False, {}

    def __getstate__(self):
        d = dict(self.__dict__)
        d["pos"] = 0.0
        return d


def test_pickle_backend_refuses_lossy_env():
    e = gym_fork.ForkableEnv(_LosesStateOnPickle, backend="pickle")
    e.reset(seed=0)
    e.step(0)
    with pytest.raises(UnsupportedEnvError, match="differs from the original"):
        e.snapshot()
    e.step(0)
    e.close()


def test_all_errors_share_a_base():
    for cls in (EnvClosedError, SnapshotCorruptedError, WorkerDiedError, UnsupportedEnvError):
        assert issubclass(cls, GymForkError)


def _criu_processes() -> set[int]:
    out = set()
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/comm") as f:
                    if f.read().strip() == "criu" and not started_elsewhere(int(p)):
                        out.add(int(p))
            except OSError:
                pass
    return out


@pytest.mark.alone  # keeps every CPU busy: the other test process would crawl meanwhile
@pytest.mark.criu
def test_criu_restores_killed_at_their_timeout_leave_no_process_behind(monkeypatch):
    """A CRIU restore past $GYM_FORK_CRIU_TIMEOUT is killed at whatever point it reached (timeouts
    from 1 to 20 ms land in criu's start-up, its kernel probes and the restore itself): a typed
    error each time, the env intact, and no criu, criu helper or half-restored task left, running
    or as a zombie (killed criu helpers lived on orphaned; killed half-restored tasks stayed
    zombies of the learner)."""
    from gym_fork.errors import RestoreError

    import subprocess
    import sys

    env = gym_fork.ForkableEnv("CartPole-v1", backend="criu", fork_tier=False)
    # Both CPUs kept busy meanwhile: a slow criu is cut short at later stages too, past the one
    # where the restored root task takes a process group of its own (killpg of criu's group then
    # misses it: it waited on criu's futex for ever -- seen only on a loaded machine before)
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    try:
        env.reset(seed=0)
        snap = env.snapshot()
        before = _criu_processes()
        failed = 0
        for i in range(20):
            monkeypatch.setenv("GYM_FORK_CRIU_TIMEOUT", str((0.001, 0.003, 0.01, 0.02)[i % 4]))
            try:
                env.restore(snap)
            except RestoreError as e:
                assert "did not finish within" in str(e)
                failed += 1
        monkeypatch.delenv("GYM_FORK_CRIU_TIMEOUT")
        for b in burners:
            b.kill()
            b.wait()
        assert failed >= 10
        # (criu's killed helpers are orphaned to init, which collects them in its own time)
        assert eventually(lambda: _criu_processes() - before == set(), timeout=10), _criu_processes() - before
        env.step(0)  # the env still works, and a restore in time too
        env.restore(snap)
        env.step(0)
    finally:
        for b in burners:
            b.kill()
        env.close()


def test_a_worker_that_cannot_import_its_loop_says_why(tmp_path, monkeypatch):
    # The worker's stderr is /dev/null (no worker_log): before, the learner only read "exited with
    # code 1". A broken NumPy earlier on the worker's path makes its import fail.
    broken = tmp_path / "numpy"
    broken.mkdir()
    (broken / "__init__.py").write_text("raise ImportError('this numpy is broken on purpose')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(_gym_fork_workers())
    with pytest.raises(WorkerError) as info:
        gym_fork.ForkableEnv("CartPole-v1")
    assert isinstance(info.value, ImportError)
    message = str(info.value)
    assert "could not start" in message and "this numpy is broken on purpose" in message
    assert "imports gym_fork and its dependencies" in message
    assert "ImportError: this numpy is broken on purpose" in info.value.remote_traceback
    assert eventually(lambda: set(_gym_fork_workers()) <= before), "the worker that failed is still running"


def test_the_worker_launcher_answers_init_with_what_failed():
    # A step of the launcher that fails (here: joining a network namespace through a descriptor
    # that is not open) ends it before any worker runs; its reason must reach the controller.
    from gym_fork.backends.criu import _PIDNS_LAUNCHER, _worker_environ
    from gym_fork.worker.channel import Channel

    ours, theirs = socket.socketpair()
    proc = subprocess.Popen(
        [sys.executable, "-S", "-c", _PIDNS_LAUNCHER, str(theirs.fileno()), "root", "", "",
         sessiondir.session_dir(), "987"], pass_fds=[theirs.fileno()], env=_worker_environ(),
        stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
    theirs.close()
    chan = Channel(ours)
    chan.send(("init", None))
    reply = chan.recv()
    assert reply[0] == 1 and reply[1] == "OSError"  # channel.ERR
    assert "setns(network namespace) failed: Bad file descriptor" in reply[2]
    assert proc.wait(timeout=30) == 125
    assert b"setns(network namespace) failed" in proc.stderr.read()  # and still in its log
    ours.close()


def _gym_fork_workers() -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    if b"gym_fork.worker" in f.read() and not started_elsewhere(int(name)):
                        out.append(int(name))
            except OSError:
                continue
    return out


@pytest.mark.parametrize("backend", ["criu", "pickle"])
def test_a_second_thread_calling_an_env_in_use_gets_a_clear_error(backend):
    """Two threads calling one env swapped its replies (a reset's answer returned by a step:
    "not enough values to unpack") and then hung. A call while another thread's is in flight
    is now refused, nothing sent, and the first call and the env go on exactly."""
    from gym_fork.errors import ConcurrentUseError

    ref = gym.make("CartPole-v1")
    ref.reset(seed=3)
    env = gym_fork.ForkableEnv("CartPole-v1", backend=backend)
    try:
        env.reset(seed=3)
        env.step_send(0)  # this thread's request is in flight until step_receive()
        refused: list = []

        def other() -> None:
            for call in (lambda: env.step(1), lambda: env.reset(), lambda: env.snapshot(),
                         lambda: env.unwrapped.gravity, lambda: env.step_send(1)):
                try:
                    call()
                except ConcurrentUseError as e:
                    refused.append(str(e))

        t = threading.Thread(target=other)
        t.start()
        t.join(30)
        assert not t.is_alive() and len(refused) == 5, refused
        assert "one call at a time" in refused[0] and "Nothing was sent" in refused[0]
        assert np.array_equal(env.step_receive()[0], ref.step(0)[0])  # its own reply
        out: list = []
        t = threading.Thread(target=lambda: out.append(env.step(1)))  # free again: any thread may call
        t.start()
        t.join(30)
        assert np.array_equal(out[0][0], ref.step(1)[0]) and env.steps == 2
    finally:
        env.close()


def test_threads_racing_on_one_env_never_swap_replies_or_hang():
    from gym_fork.errors import ConcurrentUseError

    env = gym_fork.ForkableEnv("CartPole-v1")
    env.reset(seed=0)
    done = {"steps": 0, "refused": 0}
    other_errors: list = []
    count = threading.Lock()

    def work(action: int) -> None:
        for _ in range(300):
            try:
                out = env.step(action)
                assert len(out) == 5
                with count:
                    done["steps"] += 1
            except ConcurrentUseError:
                with count:
                    done["refused"] += 1
            except Exception as e:  # noqa: BLE001
                other_errors.append(repr(e))

    try:
        threads = [threading.Thread(target=work, args=(a,)) for a in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "hung"
        assert not other_errors, other_errors[:3]
        assert done["steps"] + done["refused"] == 600 and env.steps == done["steps"]
        assert env.step(0)[0].shape == (4,)
    finally:
        env.close()


def test_a_call_between_step_send_and_step_receive_is_refused_and_the_reply_kept():
    """A snapshot (or any call) between step_send() and step_receive() read and dropped the
    step's reply, and step_receive() then waited forever. It is refused now; the reply stays."""
    from gym_fork.errors import ConcurrentUseError

    ref = gym.make("CartPole-v1")
    ref.reset(seed=0)
    env = gym_fork.ForkableEnv("CartPole-v1")
    try:
        env.reset(seed=0)
        env.step_send(1)
        for call in (env.snapshot, env.reset, lambda: env.step(0), lambda: env.unwrapped.gravity):
            with pytest.raises(ConcurrentUseError, match="step_receive"):
                call()
        assert np.array_equal(env.step_receive()[0], ref.step(1)[0])
        env.rollout_send([0, 1])
        with pytest.raises(ConcurrentUseError, match="rollout_receive"):
            env.snapshot()
        out = env.rollout_receive()
        ref.step(0)
        assert np.array_equal(out["final_obs"], ref.step(1)[0]) and env.steps == 3
        snap = env.snapshot()  # free again
        assert snap.steps == 3
    finally:
        env.close()


@pytest.mark.criu
def test_a_crashed_worker_takes_its_copy_on_write_snapshots_and_persisted_ones_restore_from_disk():
    """A fork-tier snapshot is a frozen process in its worker's PID namespace, which ends with
    the env's first worker: a crash of the env (here: SIGKILL) takes it. A snapshot persisted
    before the crash has CRIU images on disk, but its restore still asked the dead frozen process
    and failed (RestoreError), leaving nothing to recover from. Now it restores from its images,
    exactly, and again after; one never persisted says why it is gone and how to keep one."""
    env = gym_fork.ForkableEnv("CartPole-v1")
    ref = gym.make("CartPole-v1")
    try:
        for e in (env, ref):
            e.reset(seed=3)
            e.step(1)
        kept = env.snapshot()
        kept.persist()
        env.step(0)
        lost = env.snapshot()
        too_late = env.snapshot()
        os.kill(env.worker_pid, signal.SIGKILL)
        with pytest.raises(WorkerDiedError):
            env.step(1)
        with pytest.raises(RestoreError, match="never persisted.*snap.persist"):
            env.restore(lost)
        # persist() after the crash: it said WorkerDiedError "the snapshot's frozen process died
        # during 'ping'", as if the env's worker had died in that call, and nothing of what to do
        with pytest.raises(SnapshotCorruptedError, match="frozen process.*never persisted.*snap.persist"):
            too_late.persist()
        for _ in range(2):  # (the second from the images straight away)
            obs, _ = env.restore(kept)
            assert env.steps == 1
            ref_copy = copy.deepcopy(ref)
            for a in (0, 1, 1, 0):
                assert same(env.step(a)[0], ref_copy.step(a)[0])
        [child] = env.fork(kept, 1)
        assert same(child.step(1)[0], copy.deepcopy(ref).step(1)[0])
        child.close()
    finally:
        env.close()
        ref.close()


def test_a_worker_killed_during_its_dump_is_said_to_have_died(monkeypatch):
    """A worker killed while CRIU dumps it (its snapshot is a CRIU dump): the SnapshotError said
    "the env keeps running", which was false. It now says the process died during the dump, and
    the env's next call says the worker is gone."""
    from gym_fork.criu import client

    env = gym_fork.ForkableEnv("CartPole-v1", fork_tier=False)
    real = client.dump

    def killed_first(pid, *args, **kwargs):
        os.kill(pid, signal.SIGKILL)
        return real(pid, *args, **kwargs)

    try:
        env.reset(seed=0)
        monkeypatch.setattr(client, "dump", killed_first)
        with pytest.raises(SnapshotError, match="died during the dump") as info:
            env.snapshot()
        assert "keeps running" not in str(info.value)
        monkeypatch.undo()
        with pytest.raises(WorkerDiedError, match="SIGKILL"):
            env.step(0)
    finally:
        env.close()


def test_the_crash_campaign_finds_nothing_on_a_seed():
    """``scripts/crash_campaign.py`` on one seed: workers and frozen snapshots killed at random
    moments; every answer matches the env's history, persisted snapshots bring the env back after
    each crash, an unpersisted one lost with its worker says so, and no worker is left."""
    bad, crashes = load_campaign("crash_campaign").run(5, 120, True)
    assert bad == 0
    assert crashes > 0


@pytest.mark.parametrize("which", ["given", "current"], ids=["fork-of-a-snapshot", "fork-of-the-current-state"])
def test_a_crash_of_an_env_spares_its_forks(which):
    """A copy-on-write snapshot is a frozen process in its worker's PID namespace, and so is every
    copy of it: ``fork()``'s children were processes in the parent env's first worker's
    namespace, which ends with that worker. A crash of the parent (a segfault, the OOM killer;
    here SIGKILL) killed its "independent" forks too. Now the parent moves to a copy of its
    current state before its first fork (its first worker a reaper); its timeline is unchanged,
    and its forks outlive its crash, exactly."""
    env = gym_fork.ForkableEnv("CartPole-v1", fork_tier=True)
    ref = gym.make("CartPole-v1")
    try:
        for e in (env, ref):
            e.reset(seed=5)
            e.step(1)
        first = env.worker_pid
        snap = env.snapshot() if which == "given" else None
        kids = env.fork(snap, 2)
        assert env.worker_pid != first and process_alive(first)  # on a copy; the first worker a reaper
        since = [] if snap else [1]  # (the actions since the last snapshot, or since the reset)
        assert env.steps == 1 and env._parent_id == (snap.id if snap else None) and env._actions == since
        env.step(0)
        later = env.snapshot()
        assert later.parent_id == (snap.id if snap else None) and later.actions == since + [0]
        os.kill(env.worker_pid, signal.SIGKILL)
        with pytest.raises(WorkerDiedError):
            env.step(1)
        for kid in kids:
            ref_copy = copy.deepcopy(ref)
            for a in (1, 0, 0):
                assert same(kid.step(a)[0], ref_copy.step(a)[0])
            kid.close()
        if snap is not None:  # (the env's own snapshots taken before the move live in the reaper's namespace)
            env.restore(snap)
            assert same(env.step(0)[0], copy.deepcopy(ref).step(0)[0])
    finally:
        env.close()
        ref.close()


def test_an_env_that_only_restores_its_own_snapshots_stays_on_its_first_worker_until_then():
    """Only a copy for *another* env moves an env off its first worker: snapshots alone leave it
    there (its later child processes can still be dumped with it, see test_agent_envs)."""
    env = gym_fork.ForkableEnv("CartPole-v1", fork_tier=True)
    try:
        env.reset(seed=0)
        first = env.worker_pid
        snap = env.snapshot()
        env.step(0)
        env.snapshot()
        assert env.worker_pid == first
        env.restore(snap)
        assert env.worker_pid != first and process_alive(first)
    finally:
        env.close()


@pytest.mark.parametrize("api", ["gymnasium", "sb3"])
def test_a_crash_of_a_vector_slot_spares_the_slots_restored_from_its_snapshots(api):
    """In a vector env, a slot restored (or ``fork_into``'d) from another slot's snapshot ran in
    that slot's first worker's namespace: a crash of that slot killed it too. Now it outlives it."""
    make = lambda: gym.make("CartPole-v1")  # noqa: E731
    if api == "sb3":
        pytest.importorskip("stable_baselines3")
        from gym_fork.vec_env import ForkableVecEnv

        envs = ForkableVecEnv([make] * 3)
        envs.seed(0)
        envs.reset()
        step = lambda a: envs.step(np.array(a))[0]  # noqa: E731
    else:
        from gym_fork.vector import ForkableVectorEnv

        envs = ForkableVectorEnv([make] * 3)
        envs.reset(seed=0)
        step = lambda a: envs.step(np.array(a))[0]  # noqa: E731
    try:
        step([1, 1, 1])
        snap = envs.snapshot(0)
        envs.restore(1, snap)
        envs.fork_into(snap, [2])
        out = step([0, 0, 0])
        assert same(out[1], out[0]) and same(out[2], out[0])
        pid = envs.envs[0].worker_pid
        os.kill(pid, signal.SIGKILL)
        assert eventually(lambda: not process_alive(pid))  # (what ends with it has ended by then)
        with pytest.raises(WorkerDiedError) as info:
            step([1, 1, 1])
        assert info.value.partial_step[-1] == [0]  # only the crashed slot failed
        rows = info.value.partial_step[0]
        assert same(rows[1], rows[2])
    finally:
        envs.close()


def test_the_vector_crash_campaign_finds_nothing_on_a_seed():
    """``scripts/crash_vector_campaign.py`` on one seed, both vector APIs: slot workers killed in
    steps; the other slots' rows of each failed step match the model, the dead slot restores from
    a persisted snapshot, and no worker is left."""
    from gymnasium.vector import AutoresetMode

    campaign = load_campaign("crash_vector_campaign")
    runs = [(campaign.Gymnasium, AutoresetMode.NEXT_STEP)]
    if importlib.util.find_spec("stable_baselines3") is not None:  # (not in the Python tier without SB3)
        runs.append((campaign.SB3, None))
    for api, mode in runs:
        bad, crashes = campaign.run(api, 4, 80, mode)
        assert bad == 0
        assert crashes > 0


def test_a_vector_step_whose_worker_died_keeps_the_other_slots_record_and_results():
    """A Gymnasium vector step in which one slot's worker died: the other slots stepped, but their
    record (observation, whether the episode ended) stayed as before, and their results were
    dropped. A learner that restored the dead slot and stepped on stepped a slot past its
    episode's end (no autoreset) from an observation it never had. Now their record follows
    their workers, the error carries the step's results (``partial_step``), and after the dead
    slot's restore the next step resets the ended episode, as a Gymnasium vector env does."""
    from gymnasium.vector import AutoresetMode

    from gym_fork.vector import ForkableVectorEnv

    make = lambda: gym.make("CartPole-v1", max_episode_steps=2)  # noqa: E731
    envs = ForkableVectorEnv([make] * 2, autoreset_mode=AutoresetMode.NEXT_STEP)
    ref = make()
    try:
        envs.reset(seed=0)
        ref.reset(seed=1)  # (slot 1's seed)
        envs.step(np.array([1, 1]))
        ref.step(1)
        snap = envs.snapshot(0).persist()  # (a copy-on-write snapshot would die with the worker)
        os.kill(envs.envs[0].worker_pid, signal.SIGKILL)
        with pytest.raises(WorkerDiedError) as info:
            envs.step(np.array([0, 0]))
        obs, rewards, terminations, truncations, _infos, failed = info.value.partial_step
        want = ref.step(0)
        assert failed == [0] and same(obs[1], want[0]) and rewards[1] == want[1] and truncations[1]
        assert envs.pending_reset[1], "slot 1's episode ended in that step: its next step must reset it"
        envs.restore(0, snap)
        obs = envs.step(np.array([1, 1]))[0]
        assert same(obs[1], ref.reset()[0]), "slot 1 was stepped past its episode's end"
    finally:
        envs.close()
        ref.close()


@pytest.mark.parametrize("max_steps", [2, 50], ids=["episode-ends", "mid-episode"])
def test_an_sb3_vector_step_whose_worker_died_keeps_the_other_slots_results(max_steps):
    """SB3's ``ForkableVecEnv``: a step in which one slot's worker died raised with the other
    slots' rewards, episode ends and infos dropped (a learner lost a real transition of each).
    Now the error's ``partial_step`` holds them, as ``step_wait`` returns them (the reset's
    observation and ``terminal_observation`` where an episode ended), with an empty row for the
    failed slot; ``current_obs`` follows the workers and the dead slot's restore goes on exactly."""
    pytest.importorskip("stable_baselines3")
    from gym_fork.vec_env import ForkableVecEnv

    make = lambda: gym.make("CartPole-v1", max_episode_steps=max_steps)  # noqa: E731
    venv = ForkableVecEnv([make] * 2)
    ref = make()
    try:
        venv.seed(0)
        before = venv.reset()
        ref.reset(seed=1)  # (slot 1's seed)
        venv.step(np.array([1, 1]))
        ref.step(1)
        snap = venv.snapshot(0).persist()  # (a copy-on-write snapshot would die with the worker)
        os.kill(venv.worker_pids[0], signal.SIGKILL)
        with pytest.raises(WorkerDiedError) as info:
            venv.step(np.array([0, 0]))
        obs, rewards, dones, infos, failed = info.value.partial_step
        want = ref.step(0)
        assert failed == [0] and rewards[0] == 0 and not dones[0] and infos[0] == {}
        assert obs.shape == before.shape and rewards[1] == want[1] and dones[1] == (want[2] or want[3])
        if dones[1]:
            assert same(infos[1]["terminal_observation"], want[0]) and infos[1]["TimeLimit.truncated"]
            assert not same(obs[1], want[0])  # the reset's observation
        else:
            assert same(obs[1], want[0])
        assert same(venv.current_obs[1], obs[1])
        venv.restore(0, snap)
        assert venv.envs[0].steps == 1
    finally:
        venv.close()
        ref.close()

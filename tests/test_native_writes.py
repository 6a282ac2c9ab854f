"""Files changed below Python: by the env's child processes (a shell, a server) and by native code
in the worker (libc's ``fopen``).  Python's audit hook sees none of them; the worker's fanotify
group does (:mod:`gym_fork.worker.fswatch`), so gym_fork refuses by path instead of restoring
silently wrong.  Real worker processes, real ``sh`` children, real files; root (CI) only.

Each env reads its file back every step (obs = the file's line count), so a restore that left
the file as it is would show in the trajectory if it were allowed.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import time

import gymnasium as gym
import numpy as np
import pytest

import gym_fork
from gym_fork.errors import UncapturedFilesError

from conftest import fd_links

pytestmark = [pytest.mark.criu,
              pytest.mark.skipif(os.geteuid() != 0, reason="fanotify filesystem marks need root")]


class WriterEnv(gym.Env):
    """On every step from ``start_at`` on, appends a line to ``path`` (or to ``log.txt`` in its
    workspace) in the way ``how`` says:

    * ``"shell"``: ``sh -c 'echo ... >> PATH'``, waited for (a child process, gone by the reply);
    * ``"native"``: libc ``fopen``/``fputs``/``fclose`` through ctypes (no Python audit event);
    * ``"background"``: ``sh -c 'sleep 0.2; echo ... >> PATH' &`` (a child that writes after
      the step returned);
    * ``"scratch"``: a shell that creates a file next to ``path`` and removes it again (no trace).
    """

    observation_space = gym.spaces.Box(0, 1e9, (1,), np.float64)
    action_space = gym.spaces.Discrete(3)

    def __init__(self, path: str | None = None, how: str = "shell", start_at: int = 1, read_back: bool = True):
        self.path, self.how, self.start_at, self.read_back = path, how, start_at, read_back
        self.n = 0
        self._bg: list[subprocess.Popen] = []

    def _file(self) -> str:
        ws = getattr(self, "workspace", None)
        return os.path.join(ws, "log.txt") if ws else self.path

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.n = 0
        return self._obs(), {}

    def step(self, action):
        self.n += 1
        if self.n >= self.start_at:
            line = f"{self.n} {int(action)}"
            path = self._file()
            if self.how == "shell":
                subprocess.run(["sh", "-c", f"echo '{line}' >> '{path}'"], check=True)
            elif self.how == "native":
                libc = ctypes.CDLL(None)
                libc.fopen.restype = ctypes.c_void_p
                libc.fputs.argtypes = [ctypes.c_char_p, ctypes.c_void_p]
                libc.fclose.argtypes = [ctypes.c_void_p]
                fp = libc.fopen(path.encode(), b"a")
                libc.fputs((line + "\n").encode(), fp)
                libc.fclose(fp)
            elif self.how == "background":
                self._bg.append(subprocess.Popen(["sh", "-c", f"sleep 0.2; echo '{line}' >> '{path}'"]))
            elif self.how == "scratch":
                tmp = path + f".{self.n}.tmp"
                subprocess.run(["sh", "-c", f"echo x > '{tmp}'; rm '{tmp}'"], check=True)
        for p in list(self._bg):
            if p.poll() is not None:
                self._bg.remove(p)
        return self._obs(), float(action), False, False, {}

    def _obs(self):
        path = self._file()
        lines = 0
        if self.read_back and path and os.path.exists(path):
            with open(path) as f:
                lines = sum(1 for _ in f)
        return np.array([lines], dtype=np.float64)


@pytest.fixture
def tmp(tmp_path):
    return str(tmp_path)


@pytest.mark.parametrize("how", ["shell", "native"])
def test_a_write_below_python_refuses_snapshot_restore_and_fork_by_path(tmp, how):
    path = os.path.join(tmp, "out.log")
    env = gym_fork.ForkableEnv(lambda: WriterEnv(path=path, how=how, start_at=3))
    try:
        env.reset(seed=0)
        env.step(0)
        snap = env.snapshot()  # before any write: fine
        for _ in range(3):
            obs, *_ = env.step(1)
        assert obs[0] == 2  # the file was really written (steps 3 and 4)
        with pytest.raises(UncapturedFilesError) as err:
            env.restore(snap)
        assert err.value.paths == [path] and path in str(err.value)
        with pytest.raises(UncapturedFilesError):
            env.fork(snap)
        with pytest.raises(UncapturedFilesError) as err:
            env.snapshot()
        assert err.value.paths == [path]
        obs, *_ = env.step(2)  # refused, nothing lost: the env runs on
        assert obs[0] == 3
    finally:
        env.close()


def test_a_criu_restored_worker_watches_too(tmp):
    """CRIU brings a worker's fanotify group back without its marks: the restored copy opens
    a new one (its ``hello``), so its children's writes are seen as well."""
    path = os.path.join(tmp, "restored.log")
    env = gym_fork.ForkableEnv(lambda: WriterEnv(path=path, how="shell", start_at=3), fork_tier=False)
    try:
        env.reset(seed=0)
        env.step(0)
        snap = env.snapshot()
        assert snap.backend == "criu"
        env.restore(snap)  # the worker is now a CRIU-restored process
        env.step(0)
        snap2 = env.snapshot()
        env.step(0)  # n == 3: the shell writes
        with pytest.raises(UncapturedFilesError) as err:
            env.restore(snap2)
        assert err.value.paths == [path]
    finally:
        env.close()


def test_a_child_writing_after_the_step_returned_is_seen_before_a_restore(tmp):
    """The env's processes write at any time: the controller asks the worker once more."""
    path = os.path.join(tmp, "late.log")
    env = gym_fork.ForkableEnv(lambda: WriterEnv(path=path, how="background", start_at=1))
    try:
        env.reset(seed=0)
        snap = env.snapshot()
        env.step(0)  # starts `sleep 0.2; echo >> path` and returns at once
        deadline = time.monotonic() + 10
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert os.path.exists(path)
        with pytest.raises(UncapturedFilesError) as err:
            env.restore(snap)  # no step since the write: only the extra look sees it
        assert err.value.paths == [path]
    finally:
        env.close()


def test_children_writing_in_the_workspace_are_captured_exactly(tmp):
    """The declared workspace is captured with each snapshot: a shell writing there is fine."""
    ws = os.path.join(tmp, "ws")
    os.mkdir(ws)
    env = gym_fork.ForkableEnv(lambda: WriterEnv(how="shell"), workspace=ws)
    try:
        env.reset(seed=0)
        env.step(0)
        snap = env.snapshot()
        first = [env.step(a)[0][0] for a in (1, 2, 0)]
        env.restore(snap)
        again = [env.step(a)[0][0] for a in (1, 2, 0)]
        assert first == again == [2.0, 3.0, 4.0]
    finally:
        env.close()


def test_branches_whose_shells_write_their_own_workspaces_do_not_refuse_each_other(tmp):
    """Fork-tier copies share a PID namespace, and an exited shell's pid tells no owner: a change
    in a branch's own workspace is that branch's (the agent pattern: a tool run per step)."""
    ws = os.path.join(tmp, "ws")
    os.mkdir(ws)
    env = gym_fork.ForkableEnv(lambda: WriterEnv(how="shell"), workspace=ws)
    kids = []
    try:
        env.reset(seed=0)
        env.step(0)
        snap = env.snapshot()
        kids = env.fork(snap, 3)
        for _ in range(3):
            for e in (env, *kids):
                e.step(1)
        assert all(k.step(0)[0][0] == 5.0 for k in kids)
        for e in (env, *kids):
            s = e.snapshot()  # no refusal: each shell wrote its own branch's workspace
            e.step(2)
            e.restore(s)
            assert e.step(2)[0][0] == 6.0 if e is not env else True
    finally:
        for k in kids:
            k.close()
        env.close()


def test_untracked_paths_and_traceless_scratch_files_are_not_refused(tmp):
    path = os.path.join(tmp, "cache", "out.log")
    os.mkdir(os.path.dirname(path))
    env = gym_fork.ForkableEnv(lambda: WriterEnv(path=path, how="shell"),
                               untracked_paths=[os.path.dirname(path)])
    scratch = gym_fork.ForkableEnv(lambda: WriterEnv(path=os.path.join(tmp, "s"), how="scratch"))
    try:
        for e in (env, scratch):
            e.reset(seed=0)
            snap = e.snapshot()
            e.step(0)
            e.step(1)
            e.restore(snap)  # a declared cache; a file created and removed again: no refusal
            e.snapshot()
    finally:
        env.close()
        scratch.close()


def test_a_sibling_copys_native_writes_are_not_this_copys(tmp):
    """Fork-tier copies share one PID namespace; the kernel's pid tells whose write it was."""
    path = os.path.join(tmp, "native.log")
    env = gym_fork.ForkableEnv(lambda: WriterEnv(path=path, how="native", start_at=10**9))
    kids = []
    try:
        env.reset(seed=0)
        snap = env.snapshot()
        kids = env.fork(snap, 2)
        kids[0].unwrapped.start_at = 1  # set in that copy's worker
        kids[0].step(0)  # writes natively
        kids[1].step(0)
        env.step(0)
        assert os.path.exists(path)
        with pytest.raises(UncapturedFilesError):
            kids[0].snapshot()
        kids[1].snapshot()  # its own process wrote nothing: not refused
        env.restore(snap)
    finally:
        for k in kids:
            k.close()
        env.close()


def test_what_a_sibling_writes_while_a_ready_copy_waits_is_not_that_copys(tmp):
    """A ready copy opens its group before it is used, while other copies of the env run. One of
    them writes natively meanwhile; the ready copy, taken by a branch, reads that change from its
    queue and must know it for a sibling's (its own process wrote nothing)."""
    path = os.path.join(tmp, "native.log")
    env = gym_fork.ForkableEnv(lambda: WriterEnv(path=path, how="native", start_at=10**9))
    kids = []
    try:
        env.reset(seed=0)
        kids += env.fork(env.snapshot(), 1)  # the sibling that will write
        env.step(0)
        snap = env.snapshot()
        payload = snap.payload()
        deadline = time.monotonic() + 5
        while not payload.ready_pids and time.monotonic() < deadline:
            time.sleep(0.02)
            payload.collect()
        ready = payload.ready_pids[-1]
        time.sleep(0.05)  # it has answered hello and opened its group
        assert "anon_inode:[fanotify]" in fd_links(ready)
        kids[0].unwrapped.start_at = 1  # in the sibling's worker only
        kids[0].step(0)  # writes natively, while the ready copy's group is open
        assert os.path.exists(path)
        kids += env.fork(snap, 1)  # takes the ready copy
        assert kids[1].worker_pid == ready
        kids[1].step(0)
        kids[1].snapshot()  # not refused: the write was its sibling's
        with pytest.raises(UncapturedFilesError):
            kids[0].snapshot()  # the sibling's own
    finally:
        for k in kids:
            k.close()
        env.close()


def test_pickle_backend_env_that_starts_processes_is_refused_naming_the_program(tmp):
    """In the learner's process gym_fork cannot see what the env's processes write: refused."""
    path = os.path.join(tmp, "p.log")
    # obs does not read the file back: two copies stepped alike agree, the pickle check passes
    env = gym_fork.ForkableEnv(lambda: WriterEnv(path=path, how="shell", start_at=3, read_back=False),
                               backend="pickle")
    try:
        env.reset(seed=0)
        env.step(0)
        snap = env.snapshot()  # no process started yet
        env.step(0)
        env.step(0)  # runs sh
        with pytest.raises(UncapturedFilesError, match=r"backend='pickle'.*started processes \(sh\)"):
            env.snapshot()
        with pytest.raises(UncapturedFilesError, match="default backend"):
            env.restore(snap)
        env.step(1)  # the env runs on
    finally:
        env.close()


def test_a_filesystem_the_watch_cannot_see_is_named_in_a_warning(tmp):
    """ramfs reports no directory handles: the worker says so (once) instead of staying blind."""
    mnt = os.path.join(tmp, "ramfs")
    os.mkdir(mnt)
    subprocess.run(["mount", "-t", "ramfs", "ramfs", mnt], check=True)
    try:
        with pytest.warns(RuntimeWarning, match=r"ramfs.*not seen"):
            env = gym_fork.ForkableEnv("CartPole-v1")
            env.reset(seed=0)
        env.close()
    finally:
        subprocess.run(["umount", "-l", mnt], check=True)  # lazily: a worker may still be exiting


class ProbeAtInitEnv(WriterEnv):
    """Runs a short probe while it is built (as glfw does when MuJoCo envs import it)."""

    def __init__(self, spawn_in_reset: bool = False):
        super().__init__(path=None, how="none")
        subprocess.run(["true"], check=True)
        self.spawn_in_reset = spawn_in_reset

    def reset(self, *, seed=None, options=None):
        if self.spawn_in_reset:
            subprocess.run(["true"], check=True)
        return super().reset(seed=seed, options=options)


@pytest.mark.parametrize("in_reset", [False, True])
def test_only_processes_started_after_building_make_copies_namespace_inits(in_reset):
    env = gym_fork.ForkableEnv(lambda: ProbeAtInitEnv(spawn_in_reset=in_reset))
    try:
        env.reset(seed=0)
        snap = env.snapshot()
        env.restore(snap)  # a fork-tier copy
        assert env._handle.ns_root is in_reset  # PID 1 of its own namespace only if the env spawned later
        env.step(0)
    finally:
        env.close()


@pytest.mark.parametrize("wait", [0.1, 1.5])
def test_a_ready_copy_watches_from_its_first_request(tmp, wait):
    """A restore takes the copy forked ahead of time; that copy opened its group ahead (taken
    after 0.1 s) or closed it again while it waited (1.5 s) and opens one with its first request:
    its writes below Python are seen all the same."""
    path = os.path.join(tmp, "ready.log")
    env = gym_fork.ForkableEnv(lambda: WriterEnv(path=path, how="native", start_at=3))
    try:
        env.reset(seed=0)
        snap = env.snapshot()
        time.sleep(wait)  # the frozen snapshot forks its ready copy once things are quiet
        env.restore(snap)  # takes it
        for _ in range(3):
            env.step(1)  # the third writes natively
        with pytest.raises(UncapturedFilesError) as err:
            env.snapshot()
        assert err.value.paths == [path]
    finally:
        env.close()


@pytest.mark.parametrize("op", ["rm -f '{p}'", "mv '{p}' '{p}.moved'", "chmod 600 '{p}'", "touch '{p}'",
                                "mkdir -p '{d}/made/deeper' && echo x > '{d}/made/deeper/f'"])
def test_a_shell_child_removing_renaming_or_chmodding_is_refused(tmp, op):
    """Not only writes: removals, renames, attribute changes and new trees by a child count."""
    existing = os.path.join(tmp, "existing.txt")
    with open(existing, "w") as f:
        f.write("before\n")
    cmd = op.format(p=existing, d=tmp)

    class OpEnv(WriterEnv):
        def step(self, action):
            self.n += 1
            if self.n == 2:
                subprocess.run(["sh", "-c", cmd], check=True)
            return self._obs(), 0.0, False, False, {}

    env = gym_fork.ForkableEnv(lambda: OpEnv(path=existing, how="none", read_back=False))
    try:
        env.reset(seed=0)
        snap = env.snapshot()
        env.step(0)
        env.step(0)  # the child changes the tree outside any workspace
        with pytest.raises(UncapturedFilesError) as err:
            env.restore(snap)
        assert err.value.paths, err.value
        assert all(p.startswith(tmp) for p in err.value.paths), err.value.paths
    finally:
        env.close()

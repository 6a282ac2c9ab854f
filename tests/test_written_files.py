"""Files an env writes outside its workspace and closes between steps: no snapshot holds them, so
gym_fork refuses (by path, before anything diverged) instead of restoring silently wrong.

The envs read their file back every step (the observation is its line count), so a restore that
left the file as it was would show in the trajectory.  Real worker processes, real files.
"""

from __future__ import annotations

import os
import sqlite3
import sys
import tempfile

import gymnasium as gym
import numpy as np
import pytest

import gym_fork
from gym_fork.errors import RestoreError, UncapturableStateError, UncapturedFilesError

pytestmark = pytest.mark.criu


class LogEnv(gym.Env):
    """Appends one line per step to ``path`` (or to ``log.txt`` in its workspace, when it has one),
    with ``with open(..., "a")``: nothing stays open between steps.  obs = lines in the file."""

    observation_space = gym.spaces.Box(0, 1e9, (2,), np.float64)
    action_space = gym.spaces.Discrete(3)

    def __init__(self, path: str | None = None, cache_path: bool = False, read_back: bool = True):
        self.path = path
        self.cache_path = cache_path
        self.read_back = read_back
        self.n = 0

    def _file(self) -> str:
        ws = getattr(self, "workspace", None)
        return os.path.join(ws, "log.txt") if ws else self.path

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.n = 0
        if self.cache_path:  # the file's path is decided once (a branch keeps its parent's)
            self.path = self._file()
        return self._obs(), {}

    def step(self, action):
        self.n += 1
        path = self.path if self.cache_path else self._file()
        with open(path, "a") as f:
            f.write(f"{self.n} {int(action)} {self.np_random.integers(1000)}\n")
        return self._obs(), float(action), False, False, {}

    def _obs(self):
        path = self.path if self.cache_path else self._file()
        lines = 0
        if self.read_back and path and os.path.exists(path):
            with open(path) as f:
                lines = len(f.readlines())
        return np.array([float(self.n), float(lines)])


class SqliteEnv(LogEnv):
    """A row per step in an SQLite database, connected and closed within the step."""

    def step(self, action):
        self.n += 1
        con = sqlite3.connect(self.path)
        try:
            con.execute("CREATE TABLE IF NOT EXISTS t (n INTEGER, a INTEGER)")
            con.execute("INSERT INTO t VALUES (?, ?)", (self.n, int(action)))
            con.commit()
        finally:
            con.close()
        return np.array([float(self.n), 0.0]), 0.0, False, False, {}

    def _obs(self):
        return np.array([float(self.n), 0.0])


class ScratchEnv(LogEnv):
    """Leaves no trace outside the workspace: a temp file written and deleted in each step, a
    directory made with ``exist_ok`` that exists already, and a module imported (its bytecode
    written to ``__pycache__``)."""

    def __init__(self, scratch: str, modules: str):
        super().__init__(None)
        self.scratch = scratch
        self.modules = modules

    def step(self, action):
        self.n += 1
        os.makedirs(self.scratch, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.scratch)
        with os.fdopen(fd, "w") as f:
            f.write("x" * 100)
        os.replace(tmp, tmp + ".done")
        os.remove(tmp + ".done")
        with tempfile.NamedTemporaryFile(dir=self.scratch) as f:
            f.write(b"y")
        with tempfile.TemporaryFile() as f:
            f.write(b"z")
        if self.modules not in sys.path:
            sys.path.insert(0, self.modules)
        sys.dont_write_bytecode = False  # (PYTHONDONTWRITEBYTECODE may be set): the import writes it
        mod = __import__(f"wf_mod_{self.n}")
        return np.array([float(self.n), float(mod.VALUE)]), 0.0, False, False, {}


def _traj(env, actions):
    return [env.step(a)[0].tolist() for a in actions]


def _lines(path):
    with open(path) as f:
        return f.read().splitlines()


def test_snapshot_after_a_write_is_refused_by_path(tmp_path):
    log = str(tmp_path / "out" / "log.txt")
    os.makedirs(os.path.dirname(log))
    env = gym_fork.ForkableEnv(lambda: LogEnv(log))
    ref = gym_fork.ForkableEnv(lambda: LogEnv(str(tmp_path / "ref.txt")), backend="pickle")
    try:
        env.reset(seed=1)
        ref.reset(seed=1)
        assert _traj(env, [1]) == _traj(ref, [1])
        with pytest.raises(UncapturedFilesError) as err:
            env.snapshot()
        assert err.value.paths == [log]
        assert isinstance(err.value, UncapturableStateError)
        msg = str(err.value)
        assert log in msg and "workspace=DIR" in msg and "untracked_paths" in msg
        with pytest.raises(UncapturedFilesError):  # fork() takes a snapshot first
            env.fork()
        # the env keeps running, exactly as one that was never snapshotted
        assert _traj(env, [2, 0, 1]) == _traj(ref, [2, 0, 1])
        assert len(_lines(log)) == 4
    finally:
        env.close()
        ref.close()


@pytest.mark.parametrize("fork_tier", ["auto", False])
def test_restore_and_fork_after_a_write_are_refused(tmp_path, fork_tier):
    log = str(tmp_path / "log.txt")
    env = gym_fork.ForkableEnv(lambda: LogEnv(log), fork_tier=fork_tier)
    ref = gym_fork.ForkableEnv(lambda: LogEnv(str(tmp_path / "ref.txt")), backend="pickle")
    try:
        env.reset(seed=3)
        ref.reset(seed=3)
        snap = env.snapshot()  # nothing written yet: allowed
        assert _traj(env, [1, 2, 0]) == _traj(ref, [1, 2, 0])
        with pytest.raises(UncapturedFilesError) as err:
            env.restore(snap)
        assert err.value.paths == [log] and isinstance(err.value, RestoreError)
        assert snap.id in str(err.value) and log in str(err.value)
        with pytest.raises(UncapturedFilesError):
            env.fork(snap, 2)
        assert env.steps == 3
        assert _traj(env, [1, 1]) == _traj(ref, [1, 1])  # untouched: same worker, same file
        assert len(_lines(log)) == 5
    finally:
        env.close()
        ref.close()


def test_workspace_file_is_captured_and_restored_exactly(tmp_path):
    ws = str(tmp_path / "ws")
    env = gym_fork.ForkableEnv(LogEnv, workspace=ws)
    try:
        env.reset(seed=5)
        _traj(env, [1, 2])
        snap = env.snapshot()
        want = _lines(os.path.join(ws, "log.txt"))
        after = _traj(env, [0, 1, 2])
        env.restore(snap)
        assert _lines(os.path.join(ws, "log.txt")) == want
        assert _traj(env, [0, 1, 2]) == after
        kids = env.fork(snap, 2)
        try:
            for k in kids:  # each branch writes its own copy: snapshots of it are fine
                assert _traj(k, [0, 1, 2]) == after
                k.snapshot()
            assert _lines(os.path.join(ws, "log.txt")) == want + _lines(os.path.join(ws, "log.txt"))[2:]
        finally:
            for k in kids:
                k.close()
    finally:
        env.close()


def test_branch_using_its_parents_workspace_path_never_writes_the_parents_files(tmp_path):
    """A branch works in its own copy of the workspace; an env that kept the parent's path would
    write into the parent's directory (it was only found at the branch's next snapshot, after the
    parent's file had changed -- and an explore() branch, never snapshotted, went unnoticed).  As
    root the branch's mount namespace shows its own copy at that path, so the write lands there
    (as it would in the parent); without root the write is refused in the branch's step, naming
    the fix (also checked as a plain user, tests/test_nonroot.py).  Either way the parent's file
    is untouched."""
    from gym_fork.errors import WorkerError

    ws = str(tmp_path / "ws")
    env = gym_fork.ForkableEnv(lambda: LogEnv(cache_path=True), workspace=ws)
    try:
        env.reset(seed=0)
        _traj(env, [1])
        env.snapshot()  # the parent's own workspace: fine
        kid = env.fork()[0]
        try:
            if os.geteuid() == 0:
                assert _traj(kid, [2])[0][1] == 2.0  # its own file: the parent's line and its own
                assert len(_lines(os.path.join(kid._workspace.path, "log.txt"))) == 2
            else:
                with pytest.raises(WorkerError, match=r"ForeignWorkspaceError.*log\.txt refused.*Derive paths"):
                    _traj(kid, [2])
            assert len(_lines(os.path.join(ws, "log.txt"))) == 1  # the parent's one line only
            kid.snapshot()  # nothing was written outside its own workspace
        finally:
            kid.close()
        assert _traj(env, [0])[0][1] == 2.0  # the parent goes on with its own file
    finally:
        env.close()


def test_untracked_paths_are_allowed_and_not_restored(tmp_path):
    logdir = tmp_path / "logs"
    logdir.mkdir()
    log = str(logdir / "log.txt")
    env = gym_fork.ForkableEnv(lambda: LogEnv(log), untracked_paths=[str(logdir / "*.txt")])
    try:
        env.reset(seed=0)
        _traj(env, [1, 2])
        snap = env.snapshot()
        _traj(env, [0, 0])
        obs, _ = env.restore(snap)
        assert obs.tolist() == [2.0, 2.0]  # the env's memory of that moment
        assert len(_lines(log)) == 4  # documented: an untracked file is not put back
        assert env.step(1)[0].tolist() == [3.0, 5.0]
        kid = env.fork(snap)[0]  # forks too (they share the file)
        kid.close()
    finally:
        env.close()
    # a directory covers what is inside it; a pattern for other files does not
    env = gym_fork.ForkableEnv(lambda: LogEnv(log), untracked_paths=[str(tmp_path)])
    try:
        env.reset(seed=0)
        env.step(0)
        env.snapshot()
    finally:
        env.close()
    env = gym_fork.ForkableEnv(lambda: LogEnv(log), untracked_paths=[str(logdir / "*.log")])
    try:
        env.reset(seed=0)
        env.step(0)
        with pytest.raises(UncapturedFilesError):
            env.snapshot()
    finally:
        env.close()


def test_sqlite_database_outside_the_workspace_is_refused(tmp_path):
    db = str(tmp_path / "data.db")
    env = gym_fork.ForkableEnv(lambda: SqliteEnv(db))
    try:
        env.reset(seed=0)
        snap = env.snapshot()
        env.step(1)
        with pytest.raises(UncapturedFilesError) as err:
            env.snapshot()
        assert err.value.paths == [db]
        with pytest.raises(UncapturedFilesError):
            env.restore(snap)
        env.step(2)
        con = sqlite3.connect(db)
        assert con.execute("SELECT n, a FROM t").fetchall() == [(1, 1), (2, 2)]
        con.close()
    finally:
        env.close()


def test_no_trace_left_is_not_refused(tmp_path):
    scratch = str(tmp_path / "scratch")
    os.makedirs(scratch)
    modules = str(tmp_path / "mods")
    os.makedirs(modules)
    for i in range(1, 7):
        with open(os.path.join(modules, f"wf_mod_{i}.py"), "w") as f:
            f.write(f"VALUE = {i * 10}\n")
    env = gym_fork.ForkableEnv(lambda: ScratchEnv(scratch, modules))
    try:
        env.reset(seed=0)
        env.step(0)
        snap = env.snapshot()
        after = _traj(env, [0, 0])
        env.restore(snap)
        assert _traj(env, [0, 0]) == after
        assert os.listdir(scratch) == []
        assert os.listdir(os.path.join(modules, "__pycache__"))  # bytecode was written, and ignored
    finally:
        env.close()


def test_pickle_backend_records_the_envs_writes_only(tmp_path):
    """In-process: only what the env does inside its calls counts.  (Its obs does not read the file
    back: the pickle backend's own check steps two copies, which both append to it.)"""
    log = str(tmp_path / "log.txt")
    env = gym_fork.ForkableEnv(lambda: LogEnv(log, read_back=False), backend="pickle")
    try:
        env.reset(seed=0)
        snap = env.snapshot()
        with open(tmp_path / "learner.txt", "w") as f:  # the learner's own write is not the env's
            f.write("mine")
        env.snapshot().release()
        env.step(1)
        with pytest.raises(UncapturedFilesError) as err:
            env.snapshot()
        assert err.value.paths == [log]
        with pytest.raises(UncapturedFilesError):
            env.restore(snap)
        assert env.step(1)[0].tolist() == [2.0, 0.0]
    finally:
        env.close()


def test_migration_of_an_env_that_wrote_outside_is_refused(tmp_path, agent):
    log = str(tmp_path / "log.txt")
    env = gym_fork.ForkableEnv(lambda: LogEnv(log))
    try:
        env.reset(seed=0)
        env.step(1)
        with pytest.raises(UncapturedFilesError):
            env.migrate(agent.target["B"], token=agent.token)
        assert env.step(2)[0].tolist() == [2.0, 2.0]  # still here, unchanged
    finally:
        env.close()


def test_live_migration_is_cancelled_when_the_env_writes_outside_meanwhile(tmp_path, agent):
    """The target replays what the source did while the snapshot travelled: an outside write
    would happen twice (here: the same file, one machine).  The migration is cancelled first."""
    from gym_fork.migration import MigrationError

    log = str(tmp_path / "log.txt")
    env = gym_fork.ForkableEnv(lambda: LogEnv(log))
    try:
        env.reset(seed=0)
        mig = env.migrate(agent.target["B"], token=agent.token, live=True)
        env.step(1)  # the first outside write: the migration is cancelled, the step answered here
        with pytest.raises(MigrationError, match="outside its workspace"):
            mig.result(timeout=60)
        assert mig.state == "cancelled" and env._live is None
        for n in range(2, 5):
            assert env.step(0)[0].tolist() == [float(n), float(n)]  # written once per step
        assert len(_lines(log)) == 4
    finally:
        env.close()

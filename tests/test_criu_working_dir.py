"""CRIU dumps and the dumped process's working directory.

CRIU's parasite makes a directory ``proc.crtools`` in the working directory of every process it
dumps whose ``/proc`` is not its own PID namespace's -- every gym_fork worker (PID 1 of a
namespace of its own) -- mounts a proc there for a moment and removes it. Two dumps at once of
workers started in one directory (two learners in one project directory, a live migration's dump
beside a snapshot's) collided on it, and one failed at random (3 of 120 dumps of two learners).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

import gym_fork
from gym_fork.criu import client
from gym_fork.errors import SnapshotError

from conftest import same

pytestmark = pytest.mark.criu


@pytest.fixture
def dumped_env(tmp_path, monkeypatch):
    """A CartPole whose snapshots are CRIU dumps, its worker started in ``tmp_path/cwd``."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    env = gym_fork.make("CartPole-v1", fork_tier=False)
    env.reset(seed=4)
    env.step(0)
    yield env, cwd
    env.close()


def _check_untouched(env) -> None:
    """The env goes on from where it was: a snapshot's restore repeats its next step exactly."""
    snap = env.snapshot()
    a = env.step(1)
    env.restore(snap)
    assert same(env.step(1)[0], a[0])


def test_a_dump_waits_for_another_dumps_directory_in_the_same_working_directory(dumped_env):
    env, cwd = dumped_env
    held = cwd / client.PARASITE_PROC_DIR
    held.mkdir()  # as a dump of another worker started here holds it
    threading.Timer(0.5, held.rmdir).start()  # ... and removes it when done
    snap = env.snapshot()  # before: SnapshotError "Can't create a directory (-17)"
    assert not held.exists()
    want = env.step(0)
    env.restore(snap)
    assert same(env.step(0)[0], want[0])


def test_a_streamed_dump_waits_for_another_processs_dump_in_the_same_working_directory(dumped_env, tmp_path):
    """A dump whose images are read as they are written (a migration's) cannot be tried again, so
    it must not meet another dump's directory at all: every gym_fork process takes a lock per
    working directory around its dumps (``_cwd_locks``), and this one waits while another process
    holds it. Before, it failed at once with "Can't create a directory (-17)" (seen in CI: two test
    processes, one project directory, a migration beside a snapshot)."""
    env, cwd = dumped_env
    other = subprocess.Popen(  # another process, dumping a tree of its own in the same directory
        [sys.executable, "-c",
         "import os, sys, time\n"
         "from gym_fork.criu import client\n"
         "with client._cwd_locks(os.getpid(), 30):\n"
         "    os.mkdir(client.PARASITE_PROC_DIR)  # (its parasite's, while it dumps)\n"
         "    print('dumping', flush=True)\n"
         "    time.sleep(0.5)\n"
         "    os.rmdir(client.PARASITE_PROC_DIR)\n"],
        cwd=cwd, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))})
    try:
        assert other.stdout.readline().strip() == "dumping"
        into = tmp_path / "streamed"
        payload, _size = env._backend._dump(env._handle, "streamed", leave_running=True, into=str(into))
        assert (into / "inventory.img").exists() and not (cwd / client.PARASITE_PROC_DIR).exists()
    finally:
        other.wait(timeout=30)
    assert other.returncode == 0
    _check_untouched(env)


def test_two_learners_in_one_directory_dump_side_by_side(tmp_path):
    """The collision itself: two processes, each dumping its own worker in a loop, in one cwd."""
    script = (
        "import gym_fork\n"
        "env = gym_fork.make('CartPole-v1', fork_tier=False); env.reset(seed=0)\n"
        "for _ in range(40):\n"
        "    env.snapshot().release()\n"
        "env.close()\n"
        "print('all dumped')\n")
    procs = [subprocess.Popen([sys.executable, "-c", script], cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0 and "all dumped" in out, err[-2000:]
    assert not (tmp_path / client.PARASITE_PROC_DIR).exists()


def test_a_leftover_of_a_killed_dump_is_removed(dumped_env):
    env, cwd = dumped_env
    left = cwd / client.PARASITE_PROC_DIR
    left.mkdir(mode=0o700)
    old = time.time() - 2 * client.PARASITE_DIR_WAIT_S
    os.utime(left, (old, old))
    env.snapshot()
    assert not left.exists()


def test_a_directory_of_that_name_with_files_is_not_removed_and_named(dumped_env, monkeypatch):
    env, cwd = dumped_env
    monkeypatch.setattr(client, "PARASITE_DIR_WAIT_S", 0.5)  # (how long a dump waits for it to go)
    mine = cwd / client.PARASITE_PROC_DIR
    mine.mkdir()
    (mine / "data").write_text("the user's")
    old = time.time() - 2 * client.PARASITE_DIR_WAIT_S
    os.utime(mine, (old, old))
    with pytest.raises(SnapshotError, match=r"proc\.crtools.*stays in the working directory.*remove it"):
        env.snapshot()
    assert (mine / "data").read_text() == "the user's"
    (mine / "data").unlink()
    mine.rmdir()
    _check_untouched(env)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a read-only tmpfs (root); CI runs as root")
def test_a_read_only_working_directory_is_named(tmp_path, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "gym_fork-test-ro", str(ro)], check=True)
    try:
        monkeypatch.chdir(ro)
        env = gym_fork.make("CartPole-v1", fork_tier=False)
        monkeypatch.chdir(tmp_path)
        try:
            env.reset(seed=0)
            with pytest.raises(SnapshotError, match=f"{ro}.*Read-only file system.*may write to"):
                env.snapshot()
            env.step(0)  # the env goes on
        finally:
            env.close()
    finally:
        subprocess.run(["umount", "-l", str(ro)], check=False)

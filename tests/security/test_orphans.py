"""A controller killed with SIGKILL: its workers and frozen snapshots die with it, and its
session directory (CRIU images: the whole process memory) is removed by the next gym_fork
process and by `gym-fork snapshots gc` -- also when a child it forked without exec lives on --
while the directory of a live process is never touched.  Real processes, real CRIU."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import eventually

from gym_fork.snapshots import reclaim

pytestmark = pytest.mark.criu

CONTROLLER = textwrap.dedent(
    """
    import os, sys, time
    import gym_fork
    from gym_fork.snapshots import sessiondir
    sessiondir.session_dir()  # the owner lock is held from here on
    kid = os.fork()           # user code forking without exec (e.g. a data loader), lock held
    if kid == 0:
        time.sleep(600)
        os._exit(0)
    env = gym_fork.ForkableEnv("CartPole-v1", backend="criu", fork_tier=True)
    env.reset(seed=0)
    kept = [env.snapshot() for _ in range(2)]   # frozen processes in the worker's tree
    kept.append(env.snapshot().persist())       # and CRIU images in the session directory
    print(sessiondir.session_dir(), env.worker_pid, kid, kept[0].payload().pid, flush=True)
    time.sleep(600)
    """
)

TOUCH = "from gym_fork.snapshots import sessiondir; print(sessiondir.session_dir())"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _wait(cond, timeout: float = 60.0) -> bool:
    return eventually(cond, timeout, every=0.1)


def _run(args: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120, env=env)


def test_a_killed_controllers_session_is_reclaimed(tmp_path):
    base = str(tmp_path / "base")
    env = dict(os.environ, GYM_FORK_DIR=base)
    ctl = subprocess.Popen([sys.executable, "-c", CONTROLLER], stdout=subprocess.PIPE, text=True, env=env)
    kid = None
    try:
        line = ctl.stdout.readline().split()
        assert line, "the controller did not start"
        sess, worker, kid, frozen = line[0], int(line[1]), int(line[2]), int(line[3])
        assert any(n.startswith("snap-") for n in os.listdir(sess))
        # while it lives, neither a new process nor gc touches its directory
        assert _run(["-c", TOUCH], env).returncode == 0
        gc = _run(["-m", "gym_fork.cli", "snapshots", "gc"], env)
        assert gc.returncode == 0 and "removed 0 session directories" in gc.stdout, gc.stdout + gc.stderr
        assert os.path.isdir(sess)

        ctl.send_signal(signal.SIGKILL)
        ctl.wait()
        assert _wait(lambda: not _alive(worker) and not _alive(frozen)), "the worker outlived its controller"
        assert _alive(kid)  # the forked child lives on, and must not keep the lock held
        assert os.path.isdir(sess)
        size = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(sess) for f in fs)
        assert size > 1 << 20  # CRIU images: what used to stay behind forever

        out = _run(["-c", TOUCH], env)  # the next gym_fork process
        assert out.returncode == 0, out.stderr
        assert _wait(lambda: not os.path.exists(sess)), os.listdir(base)
        assert not any(n.startswith(".reclaim-") for n in os.listdir(base))
        new = out.stdout.strip()
        assert not os.path.exists(new)  # and that process removed its own at exit
    finally:
        if ctl.poll() is None:
            ctl.kill()
            ctl.wait()
        if kid is not None and _alive(kid):
            os.kill(kid, signal.SIGKILL)


def test_gc_reclaims_and_leaves_other_directories_alone(tmp_path):
    base = str(tmp_path / "base")
    env = dict(os.environ, GYM_FORK_DIR=base)
    # two killed owners, a live one, a legacy directory without a lock, and a non-session dir
    sleeper = ("from gym_fork.snapshots import sessiondir; import time; "
               "print(sessiondir.session_dir(), flush=True); time.sleep(600)")
    procs = [subprocess.Popen([sys.executable, "-c", sleeper], stdout=subprocess.PIPE, text=True, env=env)
             for _ in range(3)]
    try:
        dirs = [p.stdout.readline().strip() for p in procs]
        for d in dirs:
            with open(os.path.join(d, "pages-1.img"), "wb") as f:
                f.write(os.urandom(1 << 20))
        for p in procs[:2]:
            p.kill()
            p.wait()
        os.makedirs(os.path.join(base, "s1-legacyxx"))
        os.makedirs(os.path.join(base, "ray-hosts"))
        gc = _run(["-m", "gym_fork.cli", "snapshots", "gc"], env)
        assert gc.returncode == 0, gc.stderr
        assert "removed 2 session directories" in gc.stdout and "s1-legacyxx" in gc.stdout, gc.stdout
        assert not os.path.exists(dirs[0]) and not os.path.exists(dirs[1])
        assert os.path.isdir(dirs[2]) and os.path.isdir(os.path.join(base, "s1-legacyxx"))
        assert os.path.isdir(os.path.join(base, "ray-hosts"))
        assert reclaim.reclaim_orphans(base)["reclaimed"] == []
    finally:
        for p in procs:
            p.kill()
            p.wait()

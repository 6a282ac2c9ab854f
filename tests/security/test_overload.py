"""Crash under load: an agent that runs out of file descriptors (RLIMIT_NOFILE 128, 200
connections) or of threads (a pids cgroup) sheds the new connections, logs it and keeps serving;
an env migrated to it before keeps stepping through it, bit-identical to a local reference."""

from __future__ import annotations

import os
import socket

import pytest

import gym_fork
from gym_fork.migration.wire.connect import connect
from gym_fork.migration.wire.messages import recv_msg, send_msg
from tests.conftest import assert_same_traj, run_actions
from tests.security.rig import AgentProc, wait_for

pytestmark = pytest.mark.criu
ENV = "CartPole-v1"


def _actions(n: int, k: int) -> list[int]:
    return [(i * 7 + k) % 2 for i in range(n)]


def _migrated(agent: AgentProc):
    env, ref = gym_fork.make(ENV), gym_fork.make(ENV)
    for e in (env, ref):
        e.reset(seed=11)
    env.migrate(agent.target, token=agent.token)
    acts = _actions(10, 0)
    assert_same_traj(run_actions(env, acts)[0], run_actions(ref, acts)[0])
    return env, ref


def _hammer(target: str, n: int) -> list[socket.socket]:
    """``n`` connections opened at once (non-blocking connects) and held open, silent."""
    host, port = target.rsplit(":", 1)
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex((host, int(port)))
        socks.append(s)
    return socks


def _ping(agent: AgentProc) -> bool:
    try:
        sock, _hello = connect(agent.target, agent.token.encode(), timeout=5)
    except Exception:  # noqa: BLE001 - shed or busy: try again
        return False
    with sock:
        send_msg(sock, {"op": "ping"})
        return bool(recv_msg(sock).get("ok"))


@pytest.mark.parametrize("caps", [(), ("--max-connections", "1000", "--max-unauthenticated", "1000")],
                         ids=["default-caps", "caps-above-the-fd-limit"])
def test_out_of_fds_sheds_load_and_the_migrated_env_keeps_working(caps):
    """With the default caps the agent stays under its fd limit; with caps set above it,
    ``accept`` fails with EMFILE: either way the agent lives and the env steps on."""
    agent = AgentProc(*caps, nofile=128)
    env = ref = None
    try:
        env, ref = _migrated(agent)
        socks = _hammer(agent.target, 200)
        try:
            wait_for(lambda: "shedding load" in agent.log(), 10)
            acts = _actions(40, 1)
            assert_same_traj(run_actions(env, acts)[0], run_actions(ref, acts)[0])
            assert agent.alive()
        finally:
            for s in socks:
                s.close()
        assert wait_for(lambda: _ping(agent), 30), agent.log()[-3000:]
        acts = _actions(20, 2)
        assert_same_traj(run_actions(env, acts)[0], run_actions(ref, acts)[0])
        log = agent.log()
        assert "shedding load" in log
        if caps:
            assert "cannot accept a connection" in log and "Too many open files" in log
        assert "Traceback" not in log
    finally:
        for e in (env, ref):
            if e is not None:
                e.close()
        agent.stop()


class _PidsCgroup:
    """A pids cgroup (v1 or v2) holding one process; ``limit(n)`` caps its tasks."""

    def __init__(self, pid: int):
        root = "/sys/fs/cgroup/pids" if os.path.isdir("/sys/fs/cgroup/pids") else "/sys/fs/cgroup"
        if not os.path.exists(os.path.join(root, "cgroup.procs")):
            pytest.fail("no pids cgroup hierarchy to cap the agent's threads with")
        self.root, self.pid = root, pid
        self.path = os.path.join(root, f"gfsec-{os.getpid()}-{os.urandom(3).hex()}")
        os.mkdir(self.path)
        self._write("cgroup.procs", str(pid))

    def _write(self, name: str, value: str) -> None:
        with open(os.path.join(self.path, name), "w") as f:
            f.write(value)

    def limit(self, n: int | str) -> None:
        self._write("pids.max", str(n))

    def close(self) -> None:
        self.limit("max")
        try:
            with open(os.path.join(self.root, "cgroup.procs"), "w") as f:
                f.write(str(self.pid))
        except OSError:
            pass  # it exited
        os.rmdir(self.path)


def test_out_of_threads_sheds_load_and_the_migrated_env_keeps_working():
    agent = AgentProc()
    env = ref = None
    cg = None
    try:
        env, ref = _migrated(agent)
        cg = _PidsCgroup(agent.pid)
        cg.limit(agent.status()["Threads"] + 2)  # two connection threads more, then none
        socks = _hammer(agent.target, 50)
        try:
            assert wait_for(lambda: "cannot start a thread" in agent.log(), 15), agent.log()[-3000:]
            acts = _actions(40, 1)
            assert_same_traj(run_actions(env, acts)[0], run_actions(ref, acts)[0])
            assert agent.alive()
        finally:
            for s in socks:
                s.close()
            cg.close()
            cg = None
        assert wait_for(lambda: _ping(agent), 30), agent.log()[-3000:]
        acts = _actions(20, 2)
        assert_same_traj(run_actions(env, acts)[0], run_actions(ref, acts)[0])
        assert "Traceback" not in agent.log()
    finally:
        if cg is not None:
            cg.close()
        for e in (env, ref):
            if e is not None:
                e.close()
        agent.stop()

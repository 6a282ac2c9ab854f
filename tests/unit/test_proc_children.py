"""Child-process scans find a process's children whichever of its threads made them, also while
threads end (CI flakes: the agent's connection thread ended while a test looked for the worker it
had just stopped, so the worker went unseen, then seen). They read each process's parent in
/proc/*/stat (``gym_fork.criu.status.children_by_parent``), not the per-thread children files: a
child moves to another thread when the one that made it ends, and a scan of those files across
the move could miss it; a listing of threads led by one already gone is harmless too."""

from __future__ import annotations

import os
import subprocess
import types

import pytest

from gym_fork.criu import client as criu_client
from gym_fork.criu.status import dump_size_bound
from gym_fork.testing.nodes import AgentProcess


@pytest.fixture
def child(monkeypatch):
    """A child of this process, and every task listing led by a thread that is already gone."""
    proc = subprocess.Popen(["sleep", "60"])
    real = os.listdir

    def listdir(path="."):
        names = real(path)
        if str(path).endswith("/task"):
            return ["0", *names]  # tid 0 never exists: like a thread that ended just now
        return names

    monkeypatch.setattr(os, "listdir", listdir)
    yield proc
    proc.kill()
    proc.wait()


def test_criu_client_sees_children_past_an_ended_thread(child):
    assert child.pid in criu_client._proc_children(os.getpid())


def test_the_test_agent_sees_children_past_an_ended_thread(child):
    agent = AgentProcess.__new__(AgentProcess)  # only its pid is read
    agent.proc = types.SimpleNamespace(pid=os.getpid())
    assert child.pid in agent.children()


def test_dump_size_bound_counts_children_past_an_ended_thread(child):
    with open(f"/proc/{child.pid}/status") as f:
        rss = next(int(x.split()[1]) * 1024 for x in f if x.startswith("VmRSS:"))
    alone = dump_size_bound(os.getpid())
    assert dump_size_bound(os.getpid(), tree=True) >= alone + rss


def test_a_child_made_by_a_thread_that_ended_is_still_found():
    import threading

    from conftest import process_states

    made = []
    t = threading.Thread(target=lambda: made.append(subprocess.Popen(["sleep", "60"])))
    t.start()
    t.join()  # the thread that made it is gone: the child now hangs under another thread
    try:
        kid = made[0].pid
        assert kid in criu_client._proc_children(os.getpid())
        assert kid in process_states(os.getpid())
        agent = AgentProcess.__new__(AgentProcess)
        agent.proc = types.SimpleNamespace(pid=os.getpid())
        assert kid in agent.children()
    finally:
        made[0].kill()
        made[0].wait()

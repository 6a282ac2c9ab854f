"""Child-process scans over /proc/PID/task/*/children skip a thread that ended since the listing
instead of giving up on the threads after it (a CI flake: the agent's connection thread ended
while a test looked for the worker it had just stopped, so the worker went unseen, then seen)."""

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
    assert str(child.pid) in criu_client._proc_children(os.getpid())


def test_the_test_agent_sees_children_past_an_ended_thread(child):
    agent = AgentProcess.__new__(AgentProcess)  # only its pid is read
    agent.proc = types.SimpleNamespace(pid=os.getpid())
    assert child.pid in agent.children()


def test_dump_size_bound_counts_children_past_an_ended_thread(child):
    with open(f"/proc/{child.pid}/status") as f:
        rss = next(int(x.split()[1]) * 1024 for x in f if x.startswith("VmRSS:"))
    alone = dump_size_bound(os.getpid())
    assert dump_size_bound(os.getpid(), tree=True) >= alone + rss

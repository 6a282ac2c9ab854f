"""Shared fixtures. CRIU tests never skip silently: without a usable CRIU they *fail*, unless
GYM_FORK_ALLOW_NO_CRIU=1 is set (for developer machines without root; never set in CI).

This is the suite's only conftest.py: env workers built from test factories import helpers from
the module named ``conftest``, so a second one (e.g. in tests/unit/) would shadow this one there."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time

import gymnasium as gym
import numpy as np
import pytest

from gym_fork.criu.status import criu_status

# The suite runs in two test processes at once (pytest-xdist, scripts/test.sh), each test file in
# one of them, the tests marked ``alone`` afterwards by themselves.  Each process counts its own
# step-ring slots (one per machine on 2 CPUs: a test that expects a ring must not find the other
# process's env holding it), and a test that looks at every process on the machine skips those
# the other test process started (``started_elsewhere``).
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if XDIST_WORKER and "GYM_FORK_RING_SLOTS_DIR" not in os.environ:
    _slots = f"/tmp/gym_fork-test-{os.getuid()}/ring-slots-{XDIST_WORKER}"
    os.makedirs(os.path.dirname(_slots), mode=0o700, exist_ok=True)
    os.environ["GYM_FORK_RING_SLOTS_DIR"] = _slots

_SB3_LOGDIR: list[str] = []


def pytest_configure(config):
    # SB3 makes a log directory /tmp/SB3-<time> in every learn() without a logger of its own
    # (dozens per run, never removed): here they all go to one, removed when the session ends.
    # (In pytest only: processes that import this module for its helpers make none.)
    if "SB3_LOGDIR" not in os.environ:
        _SB3_LOGDIR.append(tempfile.mkdtemp(prefix="gym_fork-tests-sb3-"))
        os.environ["SB3_LOGDIR"] = _SB3_LOGDIR[0]


def pytest_unconfigure(config):
    for d in _SB3_LOGDIR:
        shutil.rmtree(d, ignore_errors=True)


def started_elsewhere(pid: int) -> bool:
    """Whether ``pid`` belongs to another test process of this run (its environment, inherited by
    everything a test starts -- workers, criu, servers, CRIU-restored copies -- names another
    pytest-xdist worker). A zombie has no environment left: it is judged by its parent (a criu
    the other test process has not reaped yet). False outside pytest-xdist, and where nothing
    can be read (gone, another user's): a process of this test is never overlooked."""
    if not XDIST_WORKER:
        return False
    for _ in range(8):  # (a zombie's parent, a zombie's parent's parent, ...)
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                entries = f.read().split(b"\0")
        except ProcessLookupError:  # a zombie's (ESRCH)
            entries = [b""]
        except OSError:
            return False
        named = [e for e in entries if e.startswith(b"PYTEST_XDIST_WORKER=")]
        if named:
            return named[0] != b"PYTEST_XDIST_WORKER=" + XDIST_WORKER.encode()
        if entries != [b""] or ppid <= 1:  # an environment without the name: started apart from us
            return False
        pid = ppid
    return False


@pytest.fixture(scope="session")
def criu_ok() -> None:
    st = criu_status()
    if st.usable:
        return
    msg = "CRIU is not usable: " + "; ".join(st.reasons) + ". Fix: " + "; ".join(st.advice)
    if os.environ.get("GYM_FORK_ALLOW_NO_CRIU") == "1" and not os.environ.get("CI"):
        pytest.skip(msg)
    pytest.fail(msg + " (CRIU tests must run; set GYM_FORK_ALLOW_NO_CRIU=1 only off CI)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "criu" in item.keywords:
            item.fixturenames.append("criu_ok")
    # scripts/run_pytest.sh runs the suite in two parts: GYM_FORK_TEST_PART=shared (the tests that
    # may share the machine with another test process) and =alone (those marked ``alone``).
    part = os.environ.get("GYM_FORK_TEST_PART")
    if part in ("shared", "alone"):
        keep, dropped = [], []
        for item in items:
            (keep if ("alone" in item.keywords) == (part == "alone") else dropped).append(item)
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = keep


def same(a, b) -> bool:
    """Bit-exact equality of nested obs/info structures (arrays compare dtype, shape, bytes)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float):
        return np.float64(a).tobytes() == np.float64(b).tobytes()
    return type(a) is type(b) and a == b


def run_in_child(fn) -> bytes:
    """Run ``fn()`` in a forked child; returns what it returned (bytes), through a pipe. Every
    process that returns from ``fn`` in that child writes what it returned (a child of the child
    that returns too -- PID 1 of a namespace ``fn`` made -- adds its bytes)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            os.write(w, fn())
        finally:
            os._exit(0)
    os.close(w)
    out = b""
    while chunk := os.read(r, 65536):
        out += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return out


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs (not gone, not a zombie). Reading the ``stat`` of a process that exits
    meanwhile fails (ESRCH, or ENOENT): that is "gone", never an error of the test."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in "ZX"
    except (FileNotFoundError, ProcessLookupError):
        return False


def fd_links(pid: int) -> set[str]:
    """What the open descriptors of ``pid`` name (``readlink`` of each ``/proc/PID/fd/N``). A
    descriptor closed between the listing and its ``readlink`` (a tool letting go of a file, a
    ready copy's passing ``/proc`` read) is left out, never an error of the test; a process gone
    has none."""
    fd_dir = f"/proc/{pid}/fd"
    try:
        names = os.listdir(fd_dir)
    except (FileNotFoundError, ProcessLookupError):
        return set()
    out = set()
    for name in names:
        try:
            out.add(os.readlink(os.path.join(fd_dir, name)))
        except (FileNotFoundError, ProcessLookupError):
            continue
    return out


def process_states(pid: int, *, tree: bool = False) -> dict[int, str]:
    """``{pid: state letter}`` of ``pid``'s children (``tree``: of all its descendants), host
    pids as /proc names them. A child reaped while this reads is skipped."""
    from gym_fork.criu.status import children_by_parent  # (not the per-thread children files: see there)

    out: dict[int, str] = {}
    parents = children_by_parent()
    todo = [pid]
    while todo:
        for kid in parents.get(todo.pop(), ()):
            try:
                with open(f"/proc/{kid}/stat") as s:
                    out[kid] = s.read().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if tree:
                todo.append(kid)
    return out


def eventually(cond, timeout: float = 5.0, every: float = 0.01) -> bool:
    """Whether ``cond()`` becomes true within ``timeout`` seconds (asked every ``every``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(every)
    return bool(cond())


def campaign(name: str):
    """The module of ``scripts/<name>.py`` (a campaign), loaded with ``scripts/`` on the path
    while it loads: campaigns import their envs from one another."""
    import importlib.util
    import sys

    here = os.path.join(os.path.dirname(__file__), "..", "scripts")
    sys.path.insert(0, here)
    try:
        spec = importlib.util.spec_from_file_location(name, os.path.join(here, f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(here)
    return module


def run_actions(env: gym.Env, actions: list) -> tuple[list, int]:
    """Step through ``actions``, resetting (unseeded: the env's own RNG) at episode ends.

    Returns the trajectory and how many episode ends it crossed."""
    traj, ends = [], 0
    for a in actions:
        obs, r, term, trunc, info = env.step(a)
        traj.append((obs, r, term, trunc, info))
        if term or trunc:
            ends += 1
            traj.append(("reset",) + tuple(env.reset()))
    return traj, ends


def assert_same_traj(t1: list, t2: list) -> None:
    assert len(t1) == len(t2)
    for i, (x, y) in enumerate(zip(t1, t2)):
        assert same(x, y), f"trajectories differ at item {i}:\n{x}\n{y}"


@pytest.fixture(scope="module")
def agent():
    """A local ``gym-fork agent`` (node ``B``) for migration tests of one module."""
    from gym_fork.testing.nodes import Nodes

    with Nodes(["B"], use_netns=False) as n:
        yield n


@pytest.fixture
def pair():
    """Two connected unix stream sockets; a module may override it (e.g. with channels)."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.settimeout(20)  # a frame the receiver waits for forever fails the test instead of hanging it
    b.settimeout(20)
    yield a, b
    a.close()
    b.close()

"""``_fork_exact``: a fork-tier copy draws what its parent would have drawn next, where CPython
makes every forked child draw afresh (the global ``random`` state, ``tempfile`` names,
``multiprocessing`` lock names)."""

from __future__ import annotations

import multiprocessing.synchronize
import os
import pickle
import random
import subprocess
import sys
import tempfile

from gym_fork import atfork
from gym_fork.worker.loop import _fork_exact


def _draws() -> tuple:
    return (random.random(), next(tempfile._get_candidate_names()),
            next(multiprocessing.synchronize.SemLock._rand))


def _in_child(fork, report) -> object:
    """What ``report()`` returns in a child made by ``fork()`` (sent back through a pipe; the child
    then exits)."""
    r, w = os.pipe()
    pid = fork()
    if pid == 0:
        try:
            os.write(w, pickle.dumps(report()))
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        got = pickle.loads(f.read())
    os.waitpid(pid, 0)
    return got


def _next_draws_in(fork) -> tuple:
    """What a child made by ``fork()`` draws next."""
    return _in_child(fork, _draws)


def test_a_forked_copy_draws_what_its_parent_draws_next():
    _draws()  # every generator has drawn in this process: keyed to its pid
    copy = _next_draws_in(_fork_exact)
    assert copy == _draws()


def test_a_process_the_env_forks_itself_still_draws_afresh():
    """Only gym_fork's own copies are re-keyed: a child the env starts with ``os.fork()`` gets
    the fresh names CPython gives it (it must not collide with its parent's files)."""
    _draws()
    child = _next_draws_in(os.fork)[1:]
    mine = _draws()[1:]
    assert child[0] != mine[0] and child[1] != mine[1]


# Run in a fresh interpreter: one thread, as a worker between requests and a frozen snapshot
# have. (A pytest-xdist test process has execnet's threads: its quiet forks fall back.)
_QUIET_FORKS = r"""
import os, sys
sys.path.insert(0, {tests!r})
import test_fork_exact as t
from gym_fork.worker.loop import _fork_exact

t._draws()
same = t._next_draws_in(lambda: _fork_exact(quiet=True)) == t._draws()
# a quiet fork whose child forks quietly again: a frozen snapshot forking its copy
again = t._in_child(lambda: _fork_exact(quiet=True), lambda: t._next_draws_in(lambda: _fork_exact(quiet=True)) == t._draws())
print(same, again, *t._in_child(_fork_exact, t._hooks_run), *t._in_child(lambda: _fork_exact(quiet=True), t._hooks_run))
"""


def _quiet_forks() -> list[str]:
    """In a fresh process: whether a quiet fork's child draws what its parent draws next, whether
    the child of a quiet fork's child does too, which hooks (Python's, gym_fork's) ``os.fork()``
    ran in its child, and which the quiet fork ran."""
    here = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run([sys.executable, "-c", _QUIET_FORKS.format(tests=here)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_a_quiet_fork_draws_what_its_parent_draws_next():
    """``quiet=True`` (every fork of the fork tier: libc's fork, no CPython after-fork work)
    keeps the same promise: the copy goes on drawing as its parent would, and so does a copy of
    that copy (a frozen snapshot's)."""
    assert _quiet_forks()[:2] == ["True", "True"]


_python_hook_runs: list[int] = []
_own_hook_runs: list[int] = []
os.register_at_fork(after_in_child=lambda: _python_hook_runs.append(1))  # (only ever notes a child's run)
atfork.in_child(lambda: _own_hook_runs.append(1))


def _hooks_run() -> tuple[bool, bool]:
    """In a child: whether an ``os.register_at_fork`` hook ran, and whether a gym_fork one did."""
    return bool(_python_hook_runs), bool(_own_hook_runs)


def test_a_quiet_fork_runs_gym_forks_own_hooks_and_no_other():
    """A fork-tier copy is the same computation going on: Python's after-fork hooks (a library's
    cache cleared, a generator reseeded) would make it differ from the original, which never runs
    them; the hooks for gym_fork's own per-process state (:mod:`gym_fork.atfork`) run in every
    child all the same. ``os.fork()`` runs both."""
    *_, os_python, os_own, quiet_python, quiet_own = _quiet_forks()
    assert (os_python, os_own) == ("True", "True")
    assert (quiet_python, quiet_own) == ("False", "True")


def test_a_quiet_fork_with_another_thread_is_os_fork():
    """Where another thread runs (waiting for the GIL, a copy without it would wait forever), a
    quiet fork falls back to ``os.fork()``: the hooks run, and the copy lives."""
    import threading

    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    try:
        assert _in_child(lambda: _fork_exact(quiet=True), _hooks_run) == (True, True)
    finally:
        stop.set()
        t.join()

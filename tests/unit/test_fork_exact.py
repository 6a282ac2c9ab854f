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

from gym_fork.worker.loop import _fork_exact


def _draws() -> tuple:
    return (random.random(), next(tempfile._get_candidate_names()),
            next(multiprocessing.synchronize.SemLock._rand))


def _next_draws_in(fork) -> tuple:
    """What a child made by ``fork()`` draws next (it reports them through a pipe and exits)."""
    r, w = os.pipe()
    pid = fork()
    if pid == 0:
        try:
            os.write(w, pickle.dumps(_draws()))
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        drawn = pickle.loads(f.read())
    os.waitpid(pid, 0)
    return drawn


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




# Run in a fresh interpreter (one thread): there it forks with ``os.fork()`` as a worker forks a
# frozen snapshot, and the frozen child then forks its copies. (A pytest-xdist test process has
# execnet's threads, and a child forked from it still counts them: its quiet forks fall back.)
_FROZEN_AND_ITS_COPY = r"""
import os, sys
sys.path.insert(0, {tests!r})
import test_fork_exact as t
from gym_fork.worker.loop import _fork_exact


def in_frozen():
    t._draws()
    same = t._next_draws_in(lambda: _fork_exact(quiet=True)) == t._draws()
    t._hook_runs.clear()  # (this child ran it, as a frozen snapshot did)
    hooks = (t._hook_ran_in(_fork_exact), t._hook_ran_in(lambda: _fork_exact(quiet=True)))
    return "%s %s %s" % (same, *hooks)


r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.write(w, in_frozen().encode())
    os._exit(0)
os.close(w)
print(os.read(r, 100).decode())
os.waitpid(pid, 0)
"""


def _frozen_and_its_copy() -> list[str]:
    """In a fresh process's ``os.fork()`` child: whether a quiet fork's copy drew what its parent
    draws next, whether ``os.fork()`` ran the after-fork hook, whether the quiet fork did."""
    here = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run([sys.executable, "-c", _FROZEN_AND_ITS_COPY.format(tests=here)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_a_frozen_snapshots_copy_draws_what_its_parent_draws_next():
    """``quiet=True`` (a frozen snapshot forking a copy: libc's fork, no CPython after-fork work)
    keeps the same promise: the copy goes on drawing as its parent would."""
    assert _frozen_and_its_copy()[0] == "True"


_hook_runs: list[int] = []
os.register_at_fork(after_in_child=lambda: _hook_runs.append(1))  # (only ever notes a child's run)


def _hook_ran_in(fork) -> bool:
    r, w = os.pipe()
    pid = fork()
    if pid == 0:
        try:
            os.write(w, b"1" if _hook_runs else b"0")
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        ran = f.read() == b"1"
    os.waitpid(pid, 0)
    return ran


def test_a_frozen_snapshots_copy_runs_no_after_fork_hook_again():
    """A frozen snapshot ran every ``after_in_child`` hook when it was forked from the worker and
    runs no env code after that: its copies skip them (a LunarLander copy's ~110 copy-on-write
    faults of CPython's threading and logging resets), while the worker's own fork runs them."""
    _same, worker_fork_ran_it, copy_ran_it = _frozen_and_its_copy()
    assert worker_fork_ran_it == "True" and copy_ran_it == "False"


def test_a_quiet_fork_with_another_thread_is_os_fork():
    """Where another thread runs (waiting for the GIL, a copy without it would wait forever), a
    quiet fork falls back to ``os.fork()``: the hooks run, and the copy lives."""
    import threading

    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    try:
        assert _hook_ran_in(lambda: _fork_exact(quiet=True))
    finally:
        stop.set()
        t.join()

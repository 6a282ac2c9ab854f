"""``_fork_exact``: a fork-tier copy draws what its parent would have drawn next, where CPython
makes every forked child draw afresh (the global ``random`` state, ``tempfile`` names,
``multiprocessing`` lock names)."""

from __future__ import annotations

import multiprocessing.synchronize
import os
import pickle
import random
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



def _in_a_forked_child(check) -> bool:
    """``check()``'s truth, run in a child forked from this process with ``os.fork()``, as a
    frozen snapshot is forked from its worker: one thread, the after-fork hooks run (a test
    process under pytest-xdist has more threads, and there a quiet fork falls back to ``os.fork()``)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            os.write(w, b"1" if check() else b"0")
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        ok = f.read() == b"1"
    os.waitpid(pid, 0)
    return ok


def test_a_frozen_snapshots_copy_draws_what_its_parent_draws_next():
    """``quiet=True`` (a frozen snapshot forking a copy: libc's fork, no CPython after-fork work)
    keeps the same promise: the copy goes on drawing as its parent would."""
    def check():
        _draws()
        copy = _next_draws_in(lambda: _fork_exact(quiet=True))
        return copy == _draws()

    assert _in_a_forked_child(check)


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
    def check():
        _hook_runs.clear()  # (this child ran it: as a frozen snapshot did)
        return _hook_ran_in(_fork_exact) and not _hook_ran_in(lambda: _fork_exact(quiet=True))

    assert not _hook_runs
    assert _in_a_forked_child(check)


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

"""A forked child of the worker never returns into the frames it inherited (worker.loop._child_life)."""

from __future__ import annotations

import os

from gym_fork.worker import loop


def _fork_and_wait(run) -> int:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # (the child: whatever happens, it must end inside _child_life)
        os.close(r)
        try:
            loop._child_life(run)
        finally:
            os.write(w, b"returned into its parent's frames")
            os._exit(99)
    os.close(w)
    _, status = os.waitpid(pid, 0)
    leaked = os.read(r, 100)
    os.close(r)
    assert leaked == b"", leaked
    return os.waitstatus_to_exitcode(status)


def test_a_child_that_raises_exits_with_1_and_never_returns():
    """Before: an exception in a ready copy went on in the frozen loop that forked it (a second
    frozen process on the snapshot's channel: the snapshot was lost), one in a frozen process in
    the worker's loop (answering on the worker's channel)."""
    def fails():
        raise OSError(9, "Bad file descriptor")

    assert _fork_and_wait(fails) == 1


def test_a_child_that_ends_exits_with_0_and_sys_exit_keeps_its_code():
    assert _fork_and_wait(lambda: None) == 0

    def exits():
        raise SystemExit(3)

    assert _fork_and_wait(exits) == 3

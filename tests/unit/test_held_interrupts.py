"""gym_fork.interrupts.held: Ctrl-C (SIGINT) waits until a step that must not be cut is whole."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from gym_fork import interrupts
from gym_fork.interrupts import held


def ctrl_c() -> None:
    os.kill(os.getpid(), signal.SIGINT)


def test_ctrl_c_inside_the_block_is_raised_when_it_ends():
    done = []
    with pytest.raises(KeyboardInterrupt):
        with held():
            ctrl_c()
            for _ in range(1000):  # (many chances for the interpreter to run the handler)
                done.append(1)
    assert len(done) == 1000
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_second_ctrl_c_goes_through_at_once():
    after = []
    with pytest.raises(KeyboardInterrupt):
        with held():
            ctrl_c()
            sum(range(100))
            ctrl_c()  # pressed again: the way out of a block that hangs
            sum(range(100))
            after.append(1)
    assert after == []
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_block_without_ctrl_c_raises_nothing_and_its_errors_pass():
    with held():
        pass
    with pytest.raises(ValueError):
        with held():
            raise ValueError("x")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_nested_blocks_and_other_threads_hold_through_the_outer_one():
    seen = []
    with pytest.raises(KeyboardInterrupt):
        with held():
            with held():
                ctrl_c()
                sum(range(100))
            seen.append("inner ended")
            t = threading.Thread(target=lambda: seen.append(held().__enter__ is not None))
            t.start()
            t.join()
            seen.append("outer body done")
    assert seen == ["inner ended", True, "outer body done"]


def test_a_handler_of_the_users_own_runs_after_the_block():
    calls = []
    old = signal.signal(signal.SIGINT, lambda *a: calls.append("user"))
    try:
        with held():
            ctrl_c()
            sum(range(100))
            assert calls == []
        assert calls == ["user"]
    finally:
        signal.signal(signal.SIGINT, old)


def test_an_interrupt_inside_enter_leaves_ctrl_c_working():
    """Another signal's handler that raises may cut ``__enter__`` after the swap: the handler it
    leaves in place forwards Ctrl-C at once, and the next block puts the real one back."""
    block = held()
    original_signal = interrupts._set_handler

    def signal_then_raise(sig, h):
        original_signal(sig, h)
        raise KeyboardInterrupt  # (as a SIGALRM handler that raises, right after the swap)

    interrupts._set_handler = signal_then_raise
    try:
        with pytest.raises(KeyboardInterrupt):
            block.__enter__()
    finally:
        interrupts._set_handler = original_signal
    assert signal.getsignal(signal.SIGINT) == block._hold
    with pytest.raises(KeyboardInterrupt):
        ctrl_c()
        sum(range(100))
    with held():
        pass
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_block_whose_exit_was_cut_holds_nothing_back():
    """``__exit__`` cut on entry (another signal's handler raising there): the block never ended,
    and the function that opened it was left by that exception. Ctrl-C still raises at once, and
    the next block holds again."""
    def opens_a_block_and_is_cut():
        held().__enter__()  # (as if its __exit__ had been cut: the exception leaves this function)

    opens_a_block_and_is_cut()
    with pytest.raises(KeyboardInterrupt):
        ctrl_c()
        sum(range(100))
    with pytest.raises(KeyboardInterrupt):
        with held():
            ctrl_c()
            sum(range(100))
            raised_inside = False
    assert raised_inside is False
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

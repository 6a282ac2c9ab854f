"""Ctrl-C held back through the few steps that must not be cut in two.

Ctrl-C raises ``KeyboardInterrupt`` between any two calls of the Python code that runs when it
comes. Most of gym_fork's calls settle afterwards what an interrupt cut short: the worker runs
the interrupted request all the same, and the next request asks it what it did
(``ForkableEnv._after_interrupt``). A few steps cannot be settled afterwards, because the
interrupt leaves nothing to ask:

- an exchange with a frozen snapshot (a ``clone`` request and the descriptor sent after it; a
  ready copy's offer and its descriptor): cut between the two, the frozen process waits for a
  descriptor that never comes, or the next read starts inside a message -- the snapshot is lost,
  or the next restore hangs;
- the switch of an env to a restored worker (the handle, the step count, the action log, the
  workspace's files): cut in the middle, the env runs one worker and counts another's steps.

:func:`held` holds SIGINT back through such a step: a Ctrl-C that comes meanwhile raises
``KeyboardInterrupt`` when the step is whole, and a second one goes through at once (a way out
of a step that hangs). Only SIGINT: a handler of another signal that raises is left alone
(``pytest-timeout``'s must still fire).

Example:
    >>> from gym_fork.interrupts import held
    >>> with held():
    ...     pass  # Ctrl-C here raises KeyboardInterrupt after the block, not inside it
"""

from __future__ import annotations

import _signal
import signal
import sys
import threading
from typing import Any

# signal's C functions: signal.signal/getsignal wrap each in enum conversions that cost more than
# the system call (a block took ~14 µs instead of ~2, and a restore opens 7)
_set_handler = _signal.signal
_get_handler = _signal.getsignal

_MAIN = threading.main_thread().ident  # (signal handlers run in the main thread only)
_owner: "held | None" = None  # the held() block running (only ever set in the main thread)


class held:
    """Hold Ctrl-C (SIGINT) back until the ``with`` block ends; see the module's docstring.

    A no-op outside the main thread (Python runs signal handlers only there, so nothing
    interrupts another thread), inside another ``held()`` block, and where SIGINT's handler is
    not a Python one (set from C, or ignored).

    Python code can be cut on entry to any function, ``__exit__`` too (a handler of another
    signal that raises): then a block never ends. So whether a block still runs is not a flag
    but a fact, looked up when it matters (a Ctrl-C, a nested block): the frame that opened it
    is still on the stack. A block cut that way holds nothing back; its handler, left in place,
    forwards, and the next block puts the one behind it back.
    """

    __slots__ = ("_handler", "_caught", "_active", "_frame")

    def __init__(self) -> None:
        self._active = False

    def __enter__(self) -> "held":
        global _owner
        if threading.get_ident() != _MAIN:
            return self
        if _owner is not None and _owner._running(sys._getframe(1)):
            return self  # within a running block: that one holds
        handler = _get_handler(signal.SIGINT)
        while isinstance(getattr(handler, "__self__", None), held):  # one left by a block cut
            handler = handler.__self__._handler  # short (it forwards): the handler behind it
        if not callable(handler):
            return self
        self._handler, self._caught, self._frame = handler, [], sys._getframe(1)
        _set_handler(signal.SIGINT, self._hold)
        # (two stores, no call between them or after them: nothing interrupts in between)
        self._active = True
        _owner = self
        return self

    def _running(self, frame: Any) -> bool:
        """Whether this block still runs: its frame is ``frame`` or one of its callers."""
        if self._active:
            while frame is not None:
                if frame is self._frame:
                    return True
                frame = frame.f_back
            self._active = False  # cut: its __exit__ never ran
        return False

    def _hold(self, signum: int, frame: Any) -> None:
        if self._caught or not self._running(frame):  # pressed twice, or outside its block: now
            self._handler(signum, frame)
            return
        self._caught.append((signum, frame))

    def __exit__(self, *exc: object) -> None:
        global _owner
        if not self._active:
            return
        self._active = False  # (first: from here on _hold() is the old handler, whatever comes)
        _owner = None
        self._frame = None
        _set_handler(signal.SIGINT, self._handler)  # (gym_fork's blocks set no handler of their own)
        if self._caught:
            self._handler(*self._caught[0])  # KeyboardInterrupt, now that the step is whole

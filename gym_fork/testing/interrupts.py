"""Interrupts at chosen moments, for tests and campaigns (``scripts/ctrl_c_campaign.py``).

Example:
    >>> import time
    >>> from gym_fork.testing.interrupts import interrupt_after
    >>> try:
    ...     with interrupt_after(0.01):
    ...         time.sleep(1)
    ... except KeyboardInterrupt:
    ...     print("interrupted")
    interrupted
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator


@contextlib.contextmanager
def interrupt_after(seconds: float, *, sigint: bool = False) -> Iterator[None]:
    """``KeyboardInterrupt`` in the main thread after ``seconds``, unless the block ends first
    (``seconds`` <= 0: none).

    Args:
        seconds: when, from now.
        sigint: False: raised by a SIGALRM handler, as any signal handler that raises can (it
            lands between any two calls). True: SIGINT sent to this process, as a terminal's
            Ctrl-C (which gym_fork holds back through the steps that must stay whole:
            :mod:`gym_fork.interrupts`).
    """
    def fire(*_: object) -> None:
        if sigint:
            os.kill(os.getpid(), signal.SIGINT)
        else:
            raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, fire)
    if seconds > 0:
        signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        try:
            signal.setitimer(signal.ITIMER_REAL, 0)
        finally:
            signal.signal(signal.SIGALRM, old)

"""gym_fork's own after-fork hooks: one list of what a forked child must drop.

Some of gym_fork's per-process state belongs to the process that made it and must not be taken
over by a ``fork()`` child: output not yet sent on the worker's channel, the file-change group,
step rings mapped with the controller, a session directory's lock. Each module that keeps such
state registers its hook here, once, with :func:`in_child`; the hook then runs in every child
forked with ``os.fork()`` (``os.register_at_fork``) -- and the fork tier, which forks its copies
without Python's after-fork work (``gym_fork.worker.loop._fork_exact``), runs them all with
:func:`run_in_child`. A hook added later is thus never forgotten by one of the two.

    >>> import os
    >>> from gym_fork import atfork
    >>> dropped = []
    >>> _ = atfork.in_child(lambda: dropped.append(os.getpid()))
    >>> atfork.run_in_child()  # what a quiet fork's child does first
    >>> dropped == [os.getpid()]
    True
"""

from __future__ import annotations

import os
from typing import Callable

_hooks: list[Callable[[], None]] = []


def in_child(hook: Callable[[], None]) -> Callable[[], None]:
    """Run ``hook`` in every child forked from now on (no argument, nothing returned; it must not
    raise). Returns ``hook``, so that it can decorate a function."""
    if not callable(hook):
        raise TypeError(f"an after-fork hook must be callable, not {type(hook).__name__}")
    _hooks.append(hook)
    os.register_at_fork(after_in_child=hook)
    return hook


def run_in_child() -> None:
    """In a child forked without Python's after-fork work (libc's ``fork()``): run every hook
    :func:`in_child` registered, in the order they were registered."""
    for hook in _hooks:
        hook()

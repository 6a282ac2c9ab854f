"""Python's buffers over the env's log files, emptied before a copy of the worker is made.

A log the env keeps open (``untracked_paths``, SB3's ``*.monitor.csv``) is appended to by every
copy.  What the env wrote through a buffered Python file (``open(path, "a")`` and ``print(...,
file=f)`` without a flush) is still in the process's memory when a fork-tier snapshot or a CRIU
dump copies that memory: the original and each restored copy then flush the same lines, and the
log holds every line written before the snapshot once per copy (measured: three times after a
fork of two copies, on both backends).  The worker's scan (:func:`gym_fork.worker.resources.
fork_blockers`) notes which of its descriptors are such logs; :func:`flush` writes their Python
buffers out right before the copy, so each line reaches the file once, in the order written.

It also runs ahead of every reply (:func:`gym_fork.worker.output.flush`): a restore stops the
worker it replaces without a word (CRIU's are killed), and the lines the abandoned branch had
written were lost with its memory, where an env dropped in the learner's process flushes them
when it is collected.  Between the env's calls a noted log holds nothing unwritten (~1 µs a
reply, only for an env with such logs).  The records a ``logging`` ``MemoryHandler`` buffers for
such a log are written out the same way.
"""

from __future__ import annotations

import gc
import io
import sys
import weakref

_BUFFERED = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom)

_fds: frozenset[int] = frozenset()  # the worker's descriptors open on logs (the last full scan's)
_files: list[weakref.ref] = []  # the Python file objects over them, found once per change
_found_for: frozenset[int] | None = None


def note(fds: set[int] | frozenset[int]) -> None:
    """The worker's descriptors that are logs, as the latest full scan found them."""
    global _fds
    _fds = frozenset(fds)


def flush() -> None:
    """Write out the Python buffers of every file object over a noted log descriptor, after the
    records ``logging`` buffering handlers (``MemoryHandler``) hold for such a log."""
    if not _fds:
        return
    if "logging.handlers" in sys.modules:
        _flush_logging_buffers()
    for f in _objects():
        try:
            f.flush()
        except (OSError, ValueError):  # closed meanwhile, or the disk is full: nothing to do here
            pass


def _flush_logging_buffers() -> None:
    """A ``MemoryHandler`` keeps records until it fills or sees an error, then hands them to its
    target: over a noted log, those records are lines not yet written, like a file's buffer."""
    import logging
    from logging.handlers import BufferingHandler

    for ref in list(logging._handlerList):  # type: ignore[attr-defined]  # (every live handler, weakly)
        h = ref()
        if not isinstance(h, BufferingHandler) or not getattr(h, "buffer", None):
            continue
        target = h
        for _ in range(4):  # a chain of buffering handlers ends at the one that writes
            target = getattr(target, "target", None)
            if not isinstance(target, BufferingHandler):
                break
        if _fileno(getattr(target, "stream", None)) in _fds:
            try:
                h.flush()
            except Exception:  # noqa: BLE001 - a handler that fails here fails when it flushes anyway
                pass


def _objects() -> list:
    global _files, _found_for
    live = [f for f in (r() for r in _files) if f is not None and not f.closed]
    if _found_for != _fds or len(live) != len(_files):
        # gc.get_objects() costs milliseconds on a large heap: only when the logs changed
        # (type(), not isinstance(): that may ask an object's own __class__, which can raise)
        live = [o for o in gc.get_objects() if issubclass(type(o), _BUFFERED) and _fileno(o) in _fds]
        _files, _found_for = [weakref.ref(o) for o in live], _fds
    return live


def _fileno(f) -> int | None:
    try:
        return f.fileno()
    except (OSError, ValueError):
        return None

"""What the env prints, warns and logs in its worker reaches the user, saying which worker.

Worker side (:func:`install`, :func:`identify`, :func:`flush`): warnings the worker would show
(after the worker's own warning filters, so each one once per place, as in any process),
``logging`` records that reach the worker's root logger (WARNING and up, or whatever the env's
loggers let through), and Python-level writes to ``sys.stdout``/``sys.stderr`` (whole lines)
are collected as *events*.  Right before each reply the worker sends them in one
``(OUTPUT, pid, label, events)`` frame on its channel, so they arrive in order, ahead of the
reply they belong to, and nothing is left queued between requests (a snapshot never holds
output that its copies would repeat).  A forked copy drops events its parent will send.

Learner side (:func:`emit`, called by :meth:`Channel.recv <gym_fork.worker.channel.Channel.recv>`):
warnings are re-issued with ``warnings.warn_explicit`` (the env's category, file and line, the
message prefixed with ``(worker LABEL, pid PID)``) under the learner's filters; log records go
to the logger ``gym_fork.worker.LABEL`` (``record.process`` is the worker's pid,
``record.worker_logger`` the logger name in the worker); printed lines go to the learner's
stdout/stderr, prefixed the same way.  LABEL is the env id (or the env's class name).

Not forwarded: output written below Python (C libraries writing to file descriptors 1 and 2),
which goes to ``worker_log`` when one is set, as everything printed does too.
"""

from __future__ import annotations

import io
import logging
import os
import signal
import sys
import threading
import traceback
import warnings
from typing import Any

from gym_fork import atfork
from gym_fork.worker import files, fswatch, log_buffers

OUTPUT = 2  # frame tag, next to channel.OK (0) and channel.ERR (1)
_events: list[tuple] = []
_label = "env"
_installed = False


# --- worker side ----------------------------------------------------------------------------------
def install(source: Any = None) -> None:
    """Collect this process's warnings, log records and printed lines (the worker, at start-up).

    Args:
        source: the env source being built (its env id, if any, names the worker until
            :func:`identify`).
    """
    global _installed
    if _installed:
        return
    _installed = True
    _label_from_source(source)
    warnings.showwarning = _showwarning
    logging.getLogger().addHandler(_Forward())
    sys.stdout = _Lines("stdout", sys.stdout)
    sys.stderr = _Lines("stderr", sys.stderr)
    atfork.in_child(_events.clear)  # the parent sends what was pending


def identify(env: Any) -> None:
    """Name this worker after its built env: the env id, else the base env's class name."""
    global _label
    spec = getattr(env, "spec", None)
    _label = getattr(spec, "id", None) or type(getattr(env, "unwrapped", env)).__name__


def flush(chan: Any) -> None:
    """Send the pending events on ``chan`` (right before a reply); a no-op when there are none.
    A changed record of files written outside the workspace rides along as a ``("files",
    record)`` event (:mod:`gym_fork.worker.files`). Python's buffers over the env's logs are
    written out too (:mod:`gym_fork.worker.log_buffers`)."""
    log_buffers.flush()  # (a copy killed by a restore leaves no lines behind in its memory)
    fswatch.drain()  # what the env's children and native code changed (one read() when nothing)
    written = files.pending()
    # Not only the env's processes write files between replies: its threads do, and a signal
    # handler on a timer it armed. Then, too, the controller asks again before it goes back.
    spawned = not fswatch.spawn_told and (fswatch.spawned or threading.active_count() > 1
                                          or signal.getitimer(signal.ITIMER_REAL)[0] > 0)
    if not _events and written is None and not spawned:
        return
    events = _events[:]
    del _events[:len(events)]
    if written is not None:
        events.append(("files", written))
    if spawned:  # the env's processes write at any time: the controller asks again before going back
        events.append(("spawned", True))
        fswatch.spawn_told = True
    try:
        chan.send((OUTPUT, _pid(), _label, events))
    except Exception:  # noqa: BLE001 - output must never break the reply that follows
        pass


def _label_from_source(source: Any) -> None:
    global _label
    while isinstance(source, tuple) and source:
        if source[0] == "id" and len(source) > 1 and isinstance(source[1], str):
            _label = source[1]
            return
        source = source[-1]  # a source wrapping another (registrations, wrappers): the inner one


def _pid() -> int:
    try:
        return int(os.readlink("/proc/self"))  # the host's pid, also inside a PID namespace
    except (OSError, ValueError):
        return os.getpid()


def _showwarning(message: Any, category: type, filename: str, lineno: int, file: Any = None,
                 line: Any = None) -> None:
    _events.append(("warning", str(message), category.__module__, category.__qualname__, filename, lineno))


class _Forward(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        try:
            exc = logging.Formatter().formatException(record.exc_info) if record.exc_info else record.exc_text
            _events.append(("log", record.name, record.levelno, record.getMessage(), record.pathname,
                            record.lineno, record.funcName, record.created, exc, record.stack_info))
        except Exception:  # noqa: BLE001 - a record that cannot be formatted is dropped, as logging would
            pass


class _Lines(io.TextIOBase):
    """``sys.stdout``/``sys.stderr`` of the worker: whole lines become events; everything also
    goes to the original stream (``worker_log``, or nowhere)."""

    def __init__(self, name: str, original: Any):
        self._name = name
        self._orig = original
        self._partial = ""

    def write(self, s: str) -> int:
        try:
            self._orig.write(s)
        except Exception:  # noqa: BLE001
            pass
        text = self._partial + s
        cut = text.rfind("\n") + 1
        if cut:
            _events.append((self._name, text[:cut]))
        self._partial = text[cut:]
        return len(s)

    def flush(self) -> None:
        try:
            self._orig.flush()
        except Exception:  # noqa: BLE001
            pass

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self._orig.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._orig, "encoding", "utf-8")

    @property
    def buffer(self) -> Any:
        return self._orig.buffer


# --- learner side ---------------------------------------------------------------------------------
_registry: dict = {}  # warn_explicit's once-per-place memory for forwarded warnings


def emit(frame: tuple, chan: Any = None) -> None:
    """Re-issue a worker's events here (module docstring); a ``files`` event is kept as
    ``chan.files`` (the worker's latest record of files it wrote, for the controller's checks)."""
    _, pid, label, events = frame
    prefix = f"(worker {label}, pid {pid}) "
    for event in events:
        if event[0] == "files":
            if chan is not None:
                chan.files = event[1]
            continue
        if event[0] == "spawned":
            if chan is not None:
                chan.spawned = True
            continue
        try:
            _emit_one(prefix, label, pid, event)
        except Exception:  # noqa: BLE001 - e.g. a warnings filter set to "error": say it, go on
            try:
                sys.stderr.write(f"gym_fork: output of env worker {label} (pid {pid}) could not be shown here: "
                                 f"{traceback.format_exc(limit=1).strip()}\n")
            except Exception:  # noqa: BLE001
                pass


def _emit_one(prefix: str, label: str, pid: int, event: tuple) -> None:
    kind = event[0]
    if kind == "warning":
        _, message, module, qualname, filename, lineno = event
        warnings.warn_explicit(prefix + message, _category(module, qualname), filename, lineno,
                               registry=_registry)
    elif kind == "log":
        _, name, levelno, message, pathname, lineno, func, created, exc_text, stack = event
        logger = logging.getLogger(f"gym_fork.worker.{label}")
        if logger.isEnabledFor(levelno):
            record = logging.makeLogRecord({
                "name": logger.name, "levelno": levelno, "levelname": logging.getLevelName(levelno),
                "msg": message, "args": None, "pathname": pathname, "filename": os.path.basename(pathname),
                "module": os.path.splitext(os.path.basename(pathname))[0], "lineno": lineno, "funcName": func,
                "created": created, "exc_text": exc_text, "stack_info": stack, "process": pid,
                "processName": f"gym_fork worker ({label})", "worker_logger": name})
            logger.handle(record)
    elif kind in ("stdout", "stderr"):
        stream = sys.stdout if kind == "stdout" else sys.stderr
        text = event[1]
        stream.write("".join(prefix + line for line in text.splitlines(keepends=True)))
        stream.flush()


def _category(module: str, qualname: str) -> type:
    """The warning's own category when this process already has it (never imported for this),
    else UserWarning."""
    obj: Any = sys.modules.get(module)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, type) and issubclass(obj, Warning) else UserWarning

"""How copy-on-write copies ended, for a learner that cannot wait for them itself.

A fork-tier copy is the child of the frozen snapshot it was forked from, not of the learner, and
once that snapshot is released, of the nearest subreaper above it (another frozen snapshot, or
its PID namespace's init: the env's first worker, or the reaper that worker retired into). Only
a parent can collect a child's exit status, and until this module the parents threw it away
(frozen snapshots ignored ``SIGCHLD``): a learner whose copy died of a segfault, the OOM killer
or ``os._exit(3)`` could say only that it "has exited".

So the parents write it down. The learner names a file in its private session directory
(``$GYM_FORK_EXIT_LOG``, set for every worker it spawns; copies and reapers inherit it) and
every gym_fork process that collects a child appends one line per child that did not end with
status 0 (a retired copy exits 0, and there is one per restore: those are not worth a line):

``D <ino> <status>``
    a frozen snapshot collected its copy whose channel's worker end is socket ``<ino>`` (the
    learner's handle knows that inode: ``RemoteHandle.ino``);
``A <pidns> <pid> <ino>``
    a frozen snapshot exits while its copy ``<pid>`` (in PID namespace ``<pidns>``) still runs:
    whoever collects that pid next collects this copy;
``R <pidns> <pid> <status>``
    a process collected ``<pid>``, a child it did not fork (an orphan it adopted).

``<status>`` is the raw wait status. Lines are appended with ``O_APPEND`` (no interleaving) and
written only when a child ends, never on the step or restore path. Where the file cannot be
written, nothing is recorded and the learner says it does not know how the copy ended, as before.
"""

from __future__ import annotations

import os
import signal

#: the variable naming the file, set by the learner for the workers it spawns
PATH_ENV = "GYM_FORK_EXIT_LOG"

_copies: dict[int, int] = {}  # this frozen process's copies: pid -> inode of their channel's worker end
_collector = 0  # the pid of the process that collects into _copies (a copy inherits the dict, not the role)
_check_signals = None  # CPython's PyErr_CheckSignals, looked up in the collector (not in every copy)


def _path() -> str | None:
    return os.environ.get(PATH_ENV) or None


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _append(lines: list[str]) -> None:
    path = _path()
    if not lines or path is None:
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError:
        return  # (the learner's session ended, or this worker was restored elsewhere)
    try:
        os.write(fd, "".join(line + "\n" for line in lines).encode())
    except OSError:
        pass
    finally:
        os.close(fd)


def collect_in_this_process() -> bool:
    """In a frozen snapshot: collect its children from now on (:func:`collect`, as the
    ``SIGCHLD`` handler) instead of letting the kernel discard their statuses. False where no
    file is named: the caller ignores ``SIGCHLD`` as before."""
    global _collector, _check_signals
    if _path() is None:
        return False
    try:
        import ctypes

        _check_signals = ctypes.pythonapi.PyErr_CheckSignals
    except (AttributeError, OSError):
        _check_signals = None
    _collector = os.getpid()
    signal.signal(signal.SIGCHLD, collect)
    return True


def collecting() -> bool:
    """Whether this process writes down how its children end (a frozen snapshot, with a file)."""
    return _collector == os.getpid()


def track(pid: int, fd: int) -> None:
    """In a frozen snapshot, after forking copy ``pid`` that serves on socket ``fd``."""
    if _collector:
        try:
            _copies[pid] = os.fstat(fd).st_ino
        except OSError:
            pass


def in_copy() -> None:
    """In a copy just forked from a frozen snapshot, before it puts the env's ``SIGCHLD``
    handling back: a ``SIGCHLD`` its parent had not handled yet when it forked is handled now,
    by :func:`collect` (a no-op here), not by the env's handler (a call the original never
    had); and the parent's list of copies is not this process's."""
    global _collector
    if _collector and _check_signals is not None:
        _check_signals()  # (runs a handler still pending from the parent; collect() returns at once)
    _collector = 0
    _copies.clear()


def collect(signum: int | None = None, frame: object = None) -> None:
    """Collect every child that has ended, writing down those whose status was not 0."""
    if os.getpid() != _collector:
        return  # (a copy that inherited a pending signal: see in_copy)
    lines = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        except InterruptedError:
            continue
        if pid == 0:
            break
        ino = _copies.pop(pid, None)
        if status:
            lines.append(f"D {ino} {status}" if ino is not None else f"R {_pid_namespace()} {pid} {status}")
    _append(lines)


def hand_over() -> None:
    """A frozen snapshot about to exit: its copies still running go to another process, which
    knows nothing of them -- write down which they are (``A`` lines)."""
    if os.getpid() != _collector:
        return
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # (so that no handler runs from here on)
    collect()
    if _copies:
        ns = _pid_namespace()
        _append([f"A {ns} {pid} {ino}" for pid, ino in _copies.items()])


def reaped(pid: int, status: int) -> None:
    """A process collected ``pid``, a child it did not fork itself (a reaper, a namespace init)."""
    if status:
        _append([f"R {_pid_namespace()} {pid} {status}"])


def ended(path: str, ino: int) -> int | None:
    """The wait status recorded in ``path`` for the copy whose channel's worker end is socket
    ``ino``; None where none is recorded (it is still running, ended with status 0, or its
    parent could not write)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    found: int | None = None
    adopted: tuple[bytes, bytes] | None = None
    for line in data.splitlines():
        fields = line.split()
        try:
            if fields[0] == b"D" and int(fields[1]) == ino:
                found, adopted = int(fields[2]), None
            elif fields[0] == b"A" and int(fields[3]) == ino:
                found, adopted = None, (fields[1], fields[2])
            elif fields[0] == b"R" and adopted == (fields[1], fields[2]):
                found, adopted = int(fields[3]), None
        except (IndexError, ValueError):
            continue  # (a line cut short: the disk filled up)
    return found

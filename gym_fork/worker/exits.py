"""How copy-on-write copies ended, for a learner that cannot wait for them itself.

A fork-tier copy is the child of the frozen snapshot it was forked from, not of the learner, and
once that snapshot is gone (released, or killed), of the nearest subreaper above it: another
frozen snapshot, or its PID namespace's init (the env's first worker, or the reaper that worker
retired into). Only a parent can collect a child's exit status, and until this module the
parents threw it away (frozen snapshots ignored ``SIGCHLD``): a learner whose copy died of a
segfault, the OOM killer or ``os._exit(3)`` could say only that it "has exited".

So the parents write it down. The learner names a file in its private session directory
(``$GYM_FORK_EXIT_LOG``, set for every worker it spawns and told to every worker CRIU restores;
copies and reapers inherit it), and every gym_fork process that collects a child -- the frozen
snapshots (:func:`collect_in_this_process`), a namespace init while it is a worker
(``resources.reap_fork_zombies``), the reaper (:func:`reap_until_none_left`) -- appends one line
per child that did not end with 0 (a retired copy exits with 0, one per restore: not worth a
line)::

    <host pid> <returncode> <CLOCK_REALTIME ns when it was collected>

The host pid is read from a pidfd of the zombie *before* it is reaped (``/proc`` names a process
by its host pid, ``waitid`` by its pid in the collector's namespace), so the line is on disk
while that pid still belongs to the copy; the learner takes the first line for its worker's pid
written after it started talking to that worker (:func:`ended`), so a line of an earlier
process that had the same pid is never taken for it. (The real-time clock: a CRIU-restored
process runs in a time namespace whose monotonic clock goes on from its dump's, behind the
learner's; a real-time clock set back between the two would only lose the line.) Returncodes as
``subprocess`` gives them: the exit code, or minus the signal. Lines are appended with
``O_APPEND`` and written only when a child ends, never on the step or restore path. Where the
file cannot be written (the session ended; a ``/proc`` that is not the learner's), nothing is
recorded, and the learner says that no signal or exit code was recorded.
"""

from __future__ import annotations

import os
import signal
import time

#: the variable naming the file, set by the learner for the workers it spawns
PATH_ENV = "GYM_FORK_EXIT_LOG"

_collector = 0  # the pid of the frozen snapshot collecting in its SIGCHLD handler (copies inherit the value)
_check_signals = None  # CPython's PyErr_CheckSignals, looked up in the collector (not in every copy)


def _path() -> str | None:
    return os.environ.get(PATH_ENV) or None


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


def in_copy() -> None:
    """In a copy just forked from a frozen snapshot, before it puts the env's ``SIGCHLD``
    handling back: a ``SIGCHLD`` its parent had not handled yet when it forked (the fork tier's
    fork skips Python's after-fork work, which would clear it) is handled now, by
    :func:`collect`, a no-op here -- not later by the env's handler, a call the original never
    had."""
    global _collector
    if _collector and _check_signals is not None:
        _check_signals()
    _collector = 0


def collect(signum: int | None = None, frame: object = None) -> None:
    """A frozen snapshot's ``SIGCHLD`` handler: collect every child that has ended."""
    if os.getpid() != _collector:
        return  # (a copy that inherited a pending signal: see in_copy)
    try:
        _collect_all(os.WNOHANG)
    except Exception:  # noqa: BLE001 - raised in a handler, it would end the frozen snapshot
        pass


def reap_until_none_left() -> None:
    """A retired namespace init's life: collect children, writing down how they ended, until
    none is left (the namespace then ends)."""
    _collect_all(0)


def _collect_all(nohang: int) -> None:
    """Collect ended children until none is left (``nohang`` ``os.WNOHANG``: until none has
    ended yet), each written down by :func:`_settle`."""
    while True:
        try:
            ended = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT | nohang)
        except ChildProcessError:
            return
        except InterruptedError:
            continue
        if ended is None:  # (WNOHANG: none has ended yet)
            return
        _settle(ended)


def _settle(ended: os.waitid_result) -> None:
    """Write down how the zombie ``ended`` names ended (it still holds its pid), then reap it."""
    rc = ended.si_status if ended.si_code == os.CLD_EXITED else -ended.si_status
    if rc:
        host = _host_pid(ended.si_pid)
        if host is not None:
            record(host, rc)
    try:
        os.waitpid(ended.si_pid, 0)  # (a zombie: at once)
    except ChildProcessError:
        pass


def _host_pid(local: int) -> int | None:
    return pid_via_pidfd(local, nested_only=False)


def pid_via_pidfd(local: int, nested_only: bool = True) -> int | None:
    """``local``'s pid as ``/proc`` names it, from a pidfd's ``fdinfo``: its ``NSpid`` line lists
    the pid in the namespace of the ``/proc`` mounted, then in each namespace below, down to the
    process's own. A few system calls, also for a zombie not yet collected; reading every child's
    ``status`` instead cost a frozen snapshot ~0.9 ms a copy with 16 copies about (LunarLander:
    40 % of a clone). None where pidfds or their ``NSpid`` are missing (Linux < 5.3); with
    ``nested_only``, also unless the line goes down more than one namespace and ends in ``local``
    (no namespaces, or ``/proc`` is this namespace's own): then the caller scans."""
    try:
        fd = os.pidfd_open(local)
    except (AttributeError, OSError):
        return None
    try:
        with open(f"/proc/self/fdinfo/{fd}", "rb") as f:
            for line in f:
                if line.startswith(b"NSpid:"):
                    ids = line.split()[1:]
                    if (not nested_only or (len(ids) >= 2 and int(ids[-1]) == local)) and int(ids[0]) > 0:
                        return int(ids[0])
                    return None
    except (OSError, ValueError, IndexError):
        return None
    finally:
        os.close(fd)
    return None


def record(host_pid: int, rc: int) -> None:
    """Write down that process ``host_pid`` ended with returncode ``rc`` (nothing for 0)."""
    path = _path()
    if not rc or path is None:
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError:
        return  # (the learner's session ended)
    try:
        os.write(fd, b"%d %d %d\n" % (host_pid, rc, time.time_ns()))
    except OSError:
        pass
    finally:
        os.close(fd)


def ended(path: str, pid: int, since_ns: int) -> int | None:
    """The returncode written down in ``path`` for process ``pid`` (a host pid) collected at or
    after ``since_ns`` (``time.time_ns()``); None where there is none (it runs, ended
    with 0, or its parent could not write)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    for line in data.splitlines():
        try:
            host, rc, when = (int(x) for x in line.split())
        except ValueError:
            continue  # (a line cut short: the disk filled up)
        if host == pid and when >= since_ns:
            return rc
    return None

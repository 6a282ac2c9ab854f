"""What a worker holds that ``fork()`` cannot copy: a cheap scan of ``/proc``.

A copy-on-write snapshot is a ``fork()`` of the worker.  ``fork()`` copies the calling thread's
memory and nothing else: other threads are gone in the copy, child processes stay the original's,
and every file descriptor is *shared* (one file offset, one pipe, one socket peer, one eventfd
counter for both).  Any of those makes a forked copy silently wrong.  Before each fork snapshot
the worker therefore looks at itself (:func:`fork_blockers`, a few hundred microseconds on the
common path, where nothing is found); when something is there, the snapshot is taken as a CRIU
dump of the whole process tree instead, or refused when nothing can capture it exactly.

Each finding is a :class:`Resource`: what it is, who holds it (host pid, fd), the path or peer,
and how it can be captured:

``"criu"``
    a CRIU dump of the worker's whole tree restores it exactly (threads, child processes, pipes
    and unix sockets between the tree's processes, unlinked files up to :data:`GHOST_LIMIT`,
    anonymous shared memory, eventfd/timerfd/inotify/epoll, read-only files outside the env's
    workspace with their offset, ptys the env opened itself (both ends in the tree: an
    interactive shell, as pexpect runs one),
    interval timers (``signal.alarm``/``setitimer``) and POSIX timers, which a forked child does not
    have, and the env's own ``os.register_at_fork(after_in_child=...)`` hooks, which the fork
    tier's copies skip and the env may rely on);
``"criu+netns"``
    the same, but only when the worker has a network namespace of its own (TCP/UDP sockets and
    abstract unix sockets: a restored copy would otherwise collide with the original's address);
``"none"``
    nothing captures it: a socket or pipe to a process outside the tree or to another machine, a
    file open for writing (its content is not in any image), a file of the env's ``workspace=``
    held open for reading or writing (the workspace is captured as files: a restore or fork puts
    back other inodes than the one the descriptor names), shared memory or a shared file
    mapping other processes can write, a terminal or a GPU device.  ``fix`` says what to do.

The scan also reports the tree's shape (:class:`Scan`): whether the worker is the init of its PID
namespace (only such a process can be dumped with its children) and which of its children are
gym_fork's own fork-tier processes (frozen snapshots, clones), which a whole-tree dump must not
include.

Example:
    >>> import os
    >>> scan = fork_blockers(own_fds={0, 1, 2})
    >>> isinstance(scan.resources, list) and scan.pid > 0
    True
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import time
import signal
import socket
import stat
import struct
import sys
from dataclasses import asdict, dataclass, field

from gym_fork.worker import exits, files, log_buffers, mounts

#: unlinked files up to this size are copied into CRIU images (``--ghost-limit``); larger ones are refused
GHOST_LIMIT = 64 << 20
#: what gym_fork's fork-tier processes call themselves (``/proc/PID/comm``), so a scan can tell
#: them from the env's own child processes
FORK_COMM = b"gym_fork-fork"
REAPER_MARK = b"gym_fork reaper"  # in the command line of a retired namespace init (gym_fork.worker.loop)

_HARMLESS_DEVICES = frozenset({"/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom"})
_CRIU_ANON = {
    "[eventfd]": "an eventfd",
    "[timerfd]": "a timerfd",
    "inotify": "an inotify instance",
    "[signalfd]": "a signalfd",
    "[eventpoll]": "an epoll instance",
    "[pidfd]": "a pidfd",
}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR


@dataclass
class Resource:
    """One thing in the worker's process tree that ``fork()`` does not copy."""

    kind: str  # thread, child, pipe, socket, listener, file, unlinked-file, shared-memory, device, ...
    pid: int  # host pid of the process that holds it
    what: str  # path, socket address, peer or thread name, as words
    capture: str  # "criu", "criu+netns" or "none"
    fd: int | None = None
    fix: str = ""  # for capture == "none" (and "criu+netns"): what to do instead
    detail: dict = field(default_factory=dict)

    def describe(self) -> str:
        where = f"pid {self.pid}" + (f" fd {self.fd}" if self.fd is not None else "")
        words = self.kind.replace("-", " ")  # ("shared memory /dev/shm/x", not "shared-memory shared memory ...")
        return f"{self.what} ({where})" if words in self.what else f"{self.kind} {self.what} ({where})"


@dataclass
class Scan:
    """The outcome of one scan of a worker's process tree."""

    pid: int  # the worker's host pid
    ns_init: bool  # PID 1 of its own PID namespace (a whole-tree CRIU dump is possible)
    resources: list[Resource]
    fork_processes: list[int]  # gym_fork fork-tier processes among the worker's descendants
    tree: list[int]  # host pids of the env's own processes (worker first, then its descendants)
    # the env's workspace as the tree's processes name it (and its real path): a CRIU dump that
    # caught one of them with a file there open is taken again (criu.client.dump's held_paths)
    workspace: list[str] = field(default_factory=list)

    def to_wire(self) -> dict:
        d = asdict(self)
        return d

    @classmethod
    def from_wire(cls, d: dict) -> "Scan":
        return cls(pid=d["pid"], ns_init=d["ns_init"], resources=[Resource(**r) for r in d["resources"]],
                   fork_processes=list(d["fork_processes"]), tree=list(d["tree"]),
                   workspace=list(d.get("workspace", ())))  # (an older gym_fork's worker: none)


_WORKER_COMM = b""  # the worker's own name, set below (forked copies inherit the value)


def host_pid() -> int:
    try:
        return int(os.readlink("/proc/self"))
    except (OSError, ValueError):
        return os.getpid()


try:
    # looked up once: in a freshly forked copy, dlopen() and a new function object cost ~0.4 ms
    # of copy-on-write faults
    prctl = ctypes.CDLL(None).prctl
except (OSError, AttributeError):
    prctl = None


def _set_comm(name: bytes) -> None:
    if prctl is not None:
        prctl(15, ctypes.c_char_p(name), 0, 0, 0)  # PR_SET_NAME


def mark_fork_process() -> None:
    """Name this process :data:`FORK_COMM` (a fork-tier process, not one of the env's)."""
    _set_comm(FORK_COMM)


def unmark_fork_process() -> None:
    """Take the worker's own name back: for a copy that will be dumped by CRIU and run the env
    again as a namespace init (its env's forked children must not look like gym_fork's)."""
    _set_comm(_WORKER_COMM)


def _children(proc: str, tids: list[str] | None = None) -> list[int]:
    """Children of every thread of the process ``proc`` ("self" or a pid)."""
    out: list[int] = []
    if tids is None:
        try:
            tids = os.listdir(f"/proc/{proc}/task")
        except OSError:
            return out
    for tid in tids:
        try:
            with open(f"/proc/{proc}/task/{tid}/children", "rb") as f:
                out.extend(int(p) for p in f.read().split())
        except OSError:
            continue
    return out


def _comm(pid: int | str) -> bytes:
    try:
        with open(f"/proc/{pid}/comm", "rb") as f:
            return f.read().strip()
    except OSError:
        return b""


def _status(pid: int, level: int = -1) -> tuple[bytes, bytes, int] | None:
    """(name, state letter, pid in the PID namespace at depth ``level``) of a host pid (/proc
    shows host pids, while ``os.fork()`` inside a worker's namespace returns that namespace's);
    None when the process is gone."""
    name, state, local = b"", b"", pid
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Name:"):
                    name = line[5:].strip()
                elif line.startswith(b"State:"):
                    state = line[6:].strip()[:1]
                elif line.startswith(b"NSpid:"):
                    ids = line.split()[1:]
                    local = int(ids[level] if -len(ids) <= level < len(ids) else ids[-1])
                    break
    except OSError:
        return None
    except (ValueError, IndexError):
        pass
    return name, state, local


def _is_reaper(pid: int) -> bool:
    """Whether ``pid`` is a retired namespace init of gym_fork's (its command line says so)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return REAPER_MARK in f.read(4096)
    except OSError:
        return False


def _ns_depth(pid: int) -> int:
    """How many PID namespaces ``pid`` (a host pid) is in (1: the host's only)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"NSpid:"):
                    return len(line.split()) - 1
    except OSError:
        pass
    return 1


def _own_level() -> int:
    """Depth of this process's PID namespace (0: the host's), the index into a child's NSpid.
    (Not cached: a CRIU restore may put the same process, same pid, at another depth.)"""
    with open("/proc/self/status", "rb") as f:
        for line in f:
            if line.startswith(b"NSpid:"):
                return len(line.split()) - 2
    return 0


def _all_alive_children(pids: set[int]) -> bool:
    """Whether every pid is still a live child of this process (``waitpid`` with WNOHANG: about a
    microsecond each).  A zombie among them is reaped and dropped from ``pids``; one that is not
    our child any more (reaped by the env, e.g. with SIGCHLD ignored) is dropped too."""
    ok = True
    for pid in list(pids):
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == 0:
                continue
        except ChildProcessError:
            pass
        if isinstance(pids, set):
            pids.discard(pid)
        ok = False
    return ok


def classify_children(kids: list[int], forked: set[int] | frozenset[int]) -> tuple[list[int], list[tuple[int, int, bool]]]:
    """Split this process's children (host pids) into the env's own and gym_fork's fork-tier
    processes ``(host pid, local pid, is a zombie)``.  ``forked``: namespace-local pids of the
    frozen snapshots this process forked and has not reaped (pruned in place).  When the counts
    match and every one of those is still a live child, every child is one of them (no /proc
    reads); else each child's status is read."""
    if len(kids) == len(forked) and _all_alive_children(forked):  # type: ignore[arg-type]
        return [], [(p, -1, False) for p in kids]
    env, fork = [], []
    level = _own_level()
    # A marked child that is not one of our frozen snapshots is gym_fork's (a clone or spare
    # orphaned to this namespace init) only when we are not marked ourselves: a clone is, and its
    # env's fork()ed children inherit the name.
    orphans_ours = _comm("self") != FORK_COMM
    for pid in kids:
        st = _status(pid, level)
        if st is None:  # gone (e.g. a zombie reaped just now)
            continue
        name, state, local = st
        if local in forked or (name == FORK_COMM and (orphans_ours or _ns_depth(pid) > level + 1)) \
                or (orphans_ours and _is_reaper(pid) and _ns_depth(pid) > level + 1):
            # (a copy that is PID 1 of a namespace of its own, orphaned to us, lives one namespace
            # deeper: the env's own forked children share ours, even when they inherit our name)
            fork.append((pid, local, state == b"Z"))
        else:
            env.append(pid)
    return env, fork


def reap_fork_zombies(forked: set[int]) -> None:
    """Collect exited fork-tier children without blocking: frozen snapshots that were released
    (``forked``, namespace-local pids, updated in place) and clones orphaned to this namespace
    init.  The env's own children are left to the env to wait for."""
    reap_forked(forked)
    kids = _children("self")
    if len(kids) != len(forked):
        _reap_zombies_among(classify_children(kids, forked)[1], forked)


def reap_forked(forked: set[int]) -> None:
    """Collect the exited ones among this process's frozen snapshots (``forked``, pruned in
    place): one ``waitpid(WNOHANG)`` each and no ``/proc`` read, so cheap enough right after a
    fork, while the learner waits for the next step.  Orphans (clones of a released snapshot,
    adopted by this namespace init) are left to the next scan (:func:`fork_blockers`) or
    :func:`reap_fork_zombies`: finding them takes a ``/proc`` read per child."""
    for pid in list(forked):
        try:
            if os.waitpid(pid, os.WNOHANG)[0]:
                forked.discard(pid)
        except ChildProcessError:
            forked.discard(pid)


def _reap_zombies_among(fork_kids: list[tuple[int, int, bool]], forked: set[int] | frozenset[int]
                        ) -> list[tuple[int, int, bool]]:
    """Reap the zombies among fork-tier children found by :func:`classify_children`; returns
    the others."""
    alive = []
    for kid in fork_kids:
        host, local, zombie = kid
        if not zombie or local <= 0:  # (never waitpid(-1) or (0): the env's children are the env's)
            alive.append(kid)
            continue
        try:
            pid, status = os.waitpid(local, os.WNOHANG)
            if pid and local not in forked:  # an orphan copy adopted by this namespace init
                exits.record(host, os.waitstatus_to_exitcode(status))
        except ChildProcessError:
            pass
        if isinstance(forked, set):
            forked.discard(local)
    return alive


def _fd_flags(proc: str, fd: str) -> int:
    try:
        with open(f"/proc/{proc}/fdinfo/{fd}", "rb") as f:
            for line in f:
                if line.startswith(b"flags:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _fd_lock(proc: str, fd: str) -> str | None:
    """The kind of lock held through ``fd`` (its fdinfo's ``lock:`` lines: ``FLOCK``, ``POSIX``
    or ``OFDLCK``, with the access), or None."""
    try:
        with open(f"/proc/{proc}/fdinfo/{fd}", "rb") as f:
            for line in f:
                if line.startswith(b"lock:"):
                    words = line.split()
                    # "lock:\t1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF"
                    return f"{words[2].decode()} {words[4].decode()}" if len(words) > 4 else "a lock"
    except OSError:
        pass
    return None


def _pty_index(proc: str, fd: str) -> int | None:
    """The number of the pty whose master ``fd`` is (``tty-index`` in its fdinfo)."""
    try:
        with open(f"/proc/{proc}/fdinfo/{fd}", "rb") as f:
            for line in f:
                if line.startswith(b"tty-index:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def _pts_number(target: str) -> int | None:
    tail = target[len("/dev/pts/"):]
    return int(tail) if tail.isdigit() else None


def _link(proc: str, fd: str) -> str | None:
    try:
        return os.readlink(f"/proc/{proc}/fd/{fd}")
    except OSError:
        return None


def fork_blockers(own_fds: set[int] | frozenset[int] = frozenset(), own_children: set[int] | frozenset[int] = frozenset(),
                  log_files: tuple[tuple[int, int], ...] | None = None) -> Scan:
    """Scan this process (the worker) and its descendants for what ``fork()`` cannot copy.

    Args:
        own_fds: this process's own gym_fork descriptors (its channel, an fd that came with the
            request): never reported.
        own_children: namespace-local pids of this process's own fork-tier children (frozen
            snapshots it forked and has not reaped).
        log_files: ``(st_dev, st_ino)`` of files that count as the worker's log (opened
            ``O_APPEND`` by gym_fork); default: whatever fds 1 and 2 are.

    Exited fork-tier children it comes across (released frozen snapshots, copies orphaned to a
    namespace init) are collected on the way (``waitpid``), so nothing else needs to look for them.

    Returns:
        A :class:`Scan`; ``scan.resources`` is empty when a ``fork()`` copy is exact.
    """
    global _last_clean
    if isinstance(own_children, set):
        # released snapshots first: one of them exited (a zombie) would send classify_children down
        # its slow path, a /proc read per child, for a process that is gone by then
        reap_forked(own_children)
    me = host_pid()
    tids = os.listdir("/proc/self/task")
    timers = _armed_timers(me) + _child_hooks(me)
    env_kids, fork_kids = classify_children(_children("self", tids), own_children)
    # the exited ones are read anyway: collect them here, so that nothing needs to look for them
    # after the fork (see reap_forked), while the learner waits
    fork_kids = _reap_zombies_among(fork_kids, own_children)
    fork_procs = [p for p, _local, _z in fork_kids]
    quick = None
    if len(tids) == 1 and not env_kids and log_files is None and not timers:
        # What the rest of the scan reads has not changed since a scan that found nothing: then
        # it would find nothing again (every descriptor it would report shows in the fingerprint).
        quick = _quick_state(own_fds)
        if quick is not None and quick == _last_clean:
            log_buffers.flush()  # (the logs the last scan noted are those open now)
            # (no workspace paths: the worker alone, one thread, holds nothing open at a dump that
            # it did not hold at this scan, which would have found it)
            return Scan(pid=me, ns_init=os.getpid() == 1, resources=[], fork_processes=fork_procs, tree=[me])
    _seen_logs.clear()
    logs = set(log_files) if log_files is not None else _stdio_files()
    found: list[Resource] = list(timers)
    if len(tids) > 1:
        names = _thread_names("self")
        found.append(Resource("thread", me, f"{len(tids) - 1} other thread(s) ({', '.join(names)})", "criu"))
    own_links = {_link("self", str(fd)) for fd in own_fds}
    fds = _scan_fds("self", me, set(own_fds), logs, own_links)
    shared = _scan_maps("self", me)
    tree = [me]
    if env_kids or fds or shared:
        found.extend(fds)
        found.extend(shared)
        if env_kids:
            tree.extend(_descendants(env_kids))
            for pid in tree[1:]:
                comm = _comm(pid)
                name = "a fork() of the worker" if comm == FORK_COMM else comm.decode(errors="replace")
                found.append(Resource("child", pid, f"process {pid} ({name})", "criu"))
                # a child that inherited the worker's channel: CRIU handles it like the worker's
                found.extend(_scan_fds(str(pid), pid, set(), logs, own_links))
                found.extend(_scan_maps(str(pid), pid))
        _resolve_peers(found, tree)
    _last_clean = quick if not found else None
    log_buffers.note(_seen_logs)
    log_buffers.flush()  # the copy about to be made must not hold lines the original will write
    return Scan(pid=me, ns_init=os.getpid() == 1, resources=found, fork_processes=fork_procs, tree=tree,
                workspace=_workspace_paths())


#: the fingerprint (:func:`_quick_state`) taken by the last scan of this process that found nothing
_last_clean: tuple | None = None
#: the worker's own descriptors the running scan found to be logs every copy appends to
_seen_logs: set[int] = set()


# --- os.register_at_fork(after_in_child=...) -----------------------------------------------------------
#: modules whose after-fork hooks only reset what a process must not share (locks, caches, event
#: loops, thread pools) or what gym_fork carries on itself (``random``): a copy that runs them
#: still goes on like the original
HARMLESS_HOOK_MODULES = ("gym_fork", "logging", "concurrent.futures", "threading", "random", "multiprocessing",
                         "asyncio", "importlib", "matplotlib", "fsspec", "filelock", "torch", "platformdirs")
_hooks: list = []  # (after_in_child callable, the module that registered it) since watch_at_fork_hooks()


def watch_at_fork_hooks() -> None:
    """Note every ``after_in_child`` hook registered from now on (the worker calls it before it
    builds the env). The fork tier forks without running them (``loop._fork_exact``), as the
    original never runs them either; but a hook the env's own code registered may be one it
    relies on in a process of its own, which nothing here can tell, so the scan reports the hooks
    it does not know (:func:`_child_hooks`) and their envs get CRIU dumps, where no fork happens."""
    register = os.register_at_fork
    if getattr(register, "gym_fork_watch", False):
        return

    def watched(**kwargs):
        child = kwargs.get("after_in_child")
        register(**kwargs)  # (raises for what it refuses, before anything is noted)
        if child is not None:
            caller = sys._getframe(1).f_globals.get("__name__", "?")  # who registers, not what: a
            _hooks.append((child, caller))  # bound builtin (a list's clear) names no module

    watched.gym_fork_watch = True  # type: ignore[attr-defined]
    watched.__doc__ = register.__doc__
    os.register_at_fork = watched  # type: ignore[assignment]


def _hook_name(f, caller: str) -> str:
    name = getattr(f, "__qualname__", None) or type(f).__qualname__
    mod = getattr(f, "__module__", None)
    return f"{mod}.{name}" if mod else f"{name}, registered by {caller}"


def _clears_a_cache(f) -> bool:
    """An ``lru_cache``'s ``cache_clear`` (matplotlib's fonts, importlib_metadata's zip paths)."""
    return getattr(f, "__name__", "") == "cache_clear" and type(getattr(f, "__self__", None)).__name__ == \
        "_lru_cache_wrapper"


_unknown: list = []  # the hooks of _hooks[:_looked_at] that are not known to be harmless
_looked_at = 0


def _child_hooks(me: int) -> list[Resource]:
    global _looked_at
    for f, caller in _hooks[_looked_at:]:  # (hooks are only ever added: each is looked at once)
        if not (any(caller == m or caller.startswith(m + ".") for m in HARMLESS_HOOK_MODULES) or _clears_a_cache(f)):
            _unknown.append((f, caller))
    _looked_at = len(_hooks)
    out = []
    for f, caller in _unknown:
        name = _hook_name(f, caller)
        out.append(Resource("at-fork hook", me, f"{name} (os.register_at_fork(after_in_child=...): a fork-tier copy "
                                                "skips it, and nothing tells whether the env relies on it)", "criu",
                            fix="a CRIU dump runs no hook: keep fork_tier='auto' (or False), which takes them; "
                                "hooks of known libraries (locks, caches: functools.lru_cache's cache_clear) are "
                                "not counted"))
    return out


_ITIMERS = ("ITIMER_REAL", "ITIMER_VIRTUAL", "ITIMER_PROF")


def _armed_timers(me: int) -> list[Resource]:
    """This process's armed interval timers (``signal.alarm``, ``signal.setitimer``): a ``fork()``
    child starts with none, so a copy would never get the signal the original gets; a CRIU dump
    restores them with the time they had left. (Three ``getitimer`` calls, ~1 µs.) Also POSIX
    timers (``timer_create``)."""
    out = []
    for name in _ITIMERS:
        left, every = signal.getitimer(getattr(signal, name))
        if left or every:
            period = f", then every {every:.3f} s" if every else ""
            out.append(Resource("timer", me, f"{name} armed by signal.alarm/setitimer ({left:.3f} s left{period})",
                                "criu"))
    # POSIX timers (timer_create, from native code): not inherited by a fork() child either, armed
    # or not (its timer ids would name nothing); CRIU dumps them. One read, ~5 µs.
    try:
        with open("/proc/self/timers", "rb") as f:
            n = f.read().count(b"ID:")
    except OSError:  # a kernel without CONFIG_CHECKPOINT_RESTORE: CRIU would not run either
        n = 0
    if n:
        out.append(Resource("timer", me, f"{n} POSIX timer(s) made by timer_create", "criu"))
    return out


def _quick_state(own_fds: set[int] | frozenset[int]) -> tuple | None:
    """A cheap fingerprint of what :func:`fork_blockers` reads beyond threads and children: each
    descriptor's number, file identity, type, link count (an unlink) and open flags, by
    ``fstat``/``fcntl`` (no ``/proc`` link or fdinfo reads), and the shared mappings.  None where
    the mappings cannot be listed quickly (no ``PROCMAP_QUERY``)."""
    maps = _shared_maps_fast()
    if maps is None:
        return None
    fds = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd in own_fds:
            continue
        try:
            st = os.fstat(fd)
            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        except OSError:
            continue  # the listing's own descriptor, closed by now
        fds.append((fd, st.st_dev, st.st_ino, st.st_mode, st.st_nlink, flags))
    return tuple(fds), tuple(maps)


def _stdio_files() -> set[tuple[int, int]]:
    out = set()
    for fd in (1, 2):
        try:
            st = os.fstat(fd)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            flags = _fd_flags("self", str(fd))
            if flags & os.O_APPEND:
                out.add((st.st_dev, st.st_ino))
    return out


def _thread_names(proc: str) -> list[str]:
    names = []
    try:
        tids = sorted(os.listdir(f"/proc/{proc}/task"), key=int)[1:]
    except OSError:
        return names
    for tid in tids[:8]:
        try:
            with open(f"/proc/{proc}/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            continue
    return names


def descendants_of(pid: int) -> list[int]:
    """Host pids of every descendant of host pid ``pid`` (not ``pid`` itself), parents first."""
    return _descendants(_children(str(pid)))


def innermost_pid(pid: int) -> int | None:
    """Host pid ``pid``'s number in its own (innermost) PID namespace; None when it is gone."""
    st = _status(pid)
    return st[2] if st is not None else None


def _descendants(roots: list[int]) -> list[int]:
    out, todo = [], list(roots)
    while todo:
        pid = todo.pop(0)
        if pid in out:
            continue
        out.append(pid)
        todo.extend(_children(str(pid)))
    return out


def _scan_fds(proc: str, pid: int, own: set[int], logs: set[tuple[int, int]],
              own_links: set[str | None] | None = None) -> list[Resource]:
    out: list[Resource] = []
    try:
        fds = os.listdir(f"/proc/{proc}/fd")
    except OSError:
        return out
    if own_links is None:
        own_links = {_link(proc, str(fd)) for fd in own}
    for name in fds:
        fd = int(name)
        if fd in own:
            continue
        target = _link(proc, name)
        if target is None or target in own_links:  # e.g. a dup of the channel
            continue
        if target.startswith("socket:["):
            out.append(Resource("socket", pid, target, "?", fd, detail={"ino": int(target[8:-1])}))
        elif target.startswith("pipe:["):
            flags = _fd_flags(proc, name)
            end = "write" if flags & os.O_WRONLY else "read"
            out.append(Resource("pipe", pid, f"{target} ({end} end)", "?", fd,
                                detail={"ino": int(target[6:-1]), "end": end}))
        elif target.startswith("anon_inode:"):
            kind = target[len("anon_inode:"):]
            if kind in _CRIU_ANON:
                out.append(Resource(kind.strip("[]"), pid, _CRIU_ANON[kind], "criu", fd))
            else:
                out.append(Resource("anon-inode", pid, target, "none", fd,
                                    fix="nothing captures this kind of descriptor; create it during a step "
                                        "and close it before the step returns"))
        elif target.startswith("/"):
            r = _file_resource(proc, name, pid, fd, target, logs)
            if r is not None:
                out.append(r)
        else:  # net:[...], mnt:[...] namespace fds, [fanotify] ...
            out.append(Resource("descriptor", pid, target, "none", fd,
                                fix="nothing captures this kind of descriptor; close it between steps"))
    return out


def _file_resource(proc: str, name: str, pid: int, fd: int, target: str,
                   logs: set[tuple[int, int]]) -> Resource | None:
    if target in _HARMLESS_DEVICES:
        return None
    try:
        st = os.stat(f"/proc/{proc}/fd/{name}")
    except OSError:
        return None
    if stat.S_ISDIR(st.st_mode):
        return None
    flags = _fd_flags(proc, name)
    writing = bool(flags & _WRITE_FLAGS)
    if stat.S_ISCHR(st.st_mode) and (target == "/dev/ptmx" or target.startswith("/dev/pts/")):
        # a pseudo-terminal: one the env opened itself (an interactive shell on a pty, as pexpect
        # and agents' terminal tools run one) is the env's, when both ends are in its tree
        # (_resolve_peers); a terminal the worker was started on is not
        # A pty is a number in one devpts instance (each restored tree has its own, where the
        # numbers start again): (instance, number) names it. A master opened through /dev/ptmx
        # belongs to the instance at /dev/pts where it was opened.
        if target == "/dev/ptmx":
            index, end = _pty_index(proc, name), "master"
            try:
                dev = os.stat(f"/proc/{proc}/root/dev/pts").st_dev
            except OSError:
                dev = None
        else:
            index, end, dev = _pts_number(target), "slave", st.st_dev
        return Resource("pty", pid, f"{target} ({end} end of pty {index})", "?", fd,
                        detail={"index": index, "end": end, "dev": dev})
    if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
        gpu = target.startswith(("/dev/nvidia", "/dev/dri", "/dev/kfd", "/dev/accel"))
        tty = target.startswith(("/dev/pts", "/dev/tty", "/dev/console", "/dev/ptmx"))
        what = "a GPU" if gpu else "a terminal" if tty else "a device"
        fix = ("GPU memory and device state are not captured by any snapshot: keep the GPU in the learner, "
               "not in the env" if gpu else
               "start the env with stdin/stdout/stderr not on a terminal" if tty else
               "device state is not captured; open the device only during a step")
        return Resource("device", pid, f"{target} ({what})", "none", fd, fix=fix)
    if not stat.S_ISREG(st.st_mode):  # FIFOs by path, sockets by path (rare): treat as foreign
        return Resource("file", pid, target, "none", fd,
                        fix="a named pipe or socket file is shared with whoever else opens it; open it only "
                            "during a step")
    deleted = target.endswith(" (deleted)")
    path = target[: -len(" (deleted)")] if deleted else target
    lock = _fd_lock(proc, name)
    if lock is not None:
        return Resource("file-lock", pid, f"{path} (locked: {lock})", "none", fd, detail={"path": path},
                        fix="a lock the env holds between steps would be held by every copy at once (a "
                            "fork-tier copy shares it, a restored copy would have to take it again while the "
                            "original holds it), and CRIU refuses to dump it: take the lock inside a step and "
                            "release it before the step returns")
    if deleted or path.startswith("/memfd:"):
        if st.st_size > GHOST_LIMIT:
            return Resource("unlinked-file", pid, f"{path} ({st.st_size} bytes)", "none", fd,
                            fix=f"unlinked files larger than {GHOST_LIMIT >> 20} MiB are not copied into "
                                "snapshots; keep it smaller, or keep it in workspace=DIR under a name")
        return Resource("unlinked-file", pid, f"{path} ({st.st_size} bytes)", "criu", fd,
                        detail={"size": st.st_size})
    if writing and flags & os.O_APPEND and (st.st_dev, st.st_ino) in logs:
        return None  # the worker's own log (worker_log=): appended to by every copy
    if _in_workspace(path):
        # The workspace is captured as files: a restore swaps the directory's content (new
        # inodes) and a fork() child works in a copy of its own, while a descriptor held open
        # across steps still names the original's file -- a reader reads stale or another copy's
        # content (and a CRIU image of it fails on the file's new size), a writer writes there.
        how = "open for writing" if writing else "open for reading"
        sqlite = _is_sqlite(proc, name)
        return Resource("file", pid, f"{path} ({'SQLite database ' if sqlite else ''}{how}, in the env's workspace)",
                        "none", fd, detail={"path": path},
                        fix="a workspace file is captured by its content, and a descriptor held open between steps "
                            "would still name the original's file after a restore or in a fork() child, not the "
                            "copy put back: open it only during a step (with open(...) inside step()) and close it "
                            "before the step returns" + ("; for SQLite: connect per step (also for reading) and "
                                                          "close the connection before the step returns"
                                                          if sqlite else ""))
    if writing:
        if mounts.under_private(path):  # each restored copy gets its own copy of the file
            if _is_sqlite(proc, name):
                return Resource("file", pid, f"{path} (SQLite database held open, in a private directory)", "none",
                                fd, detail={"path": path},
                                fix="SQLite remembers the inode number of the database it opened and refuses to "
                                    "write once another file (a restored copy's) is at that path; connect to it "
                                    "during a step and close it before the step returns: the file is then "
                                    "captured like any other")
            return Resource("file", pid, f"{path} (open for writing, in a private directory)", "criu", fd,
                            detail={"path": path})
        if files.is_log(path):
            found = _log_resource(proc, pid, fd, path, flags, st)
            if found is None and proc == "self":
                _seen_logs.add(fd)  # its Python buffer is flushed before each copy (log_buffers)
            return found
        return Resource("file", pid, f"{path} (open for writing)", "none", fd, detail={"path": path},
                        fix=f"its content is not part of a process snapshot, so copies would share one "
                            f"{os.path.basename(path)}: declare its directory private (ForkableEnv(..., private_dirs=["
                            f"{os.path.dirname(path)!r}]), root), or put it in the env's workspace (workspace=DIR) "
                            "and open it only during a step (for SQLite: connect per step); if it is a log the "
                            f"env only appends to, say so: ForkableEnv(..., untracked_paths=[{path!r}])")
    return Resource("file", pid, f"{path} (open for reading)", "criu", fd, detail={"path": path})


def _workspace_paths() -> list[str]:
    """The env's declared workspace (:func:`gym_fork.worker.files.set_workspace`) and its real
    path, as this process names them; none without one."""
    rec = files._active or files._worker
    ws = getattr(rec, "workspace", None)
    return list(dict.fromkeys((ws, os.path.realpath(ws)))) if ws else []


def _in_workspace(path: str) -> bool:
    """Whether ``path`` (as ``/proc`` names an open file: symlinks resolved) lies in the env's
    declared workspace (:func:`gym_fork.worker.files.set_workspace`)."""
    rec = files._active or files._worker
    ws = getattr(rec, "workspace", None)
    if not ws:
        return False
    for d in {ws, os.path.realpath(ws)}:
        if path == d or path.startswith(d.rstrip("/") + "/"):
            return True
    return False


def _log_resource(proc: str, pid: int, fd: int, path: str, flags: int, st: os.stat_result) -> Resource | None:
    """A file open for writing whose content no snapshot restores (``untracked_paths``, SB3's
    ``*.monitor.csv``): a log.  Every copy goes on appending to it -- a fork-tier copy through the
    file description it shares, a CRIU-restored one by reopening the path -- which is right only
    when it is opened write-only and in append mode: a CRIU restore would otherwise write at the
    offset of the dump, over what was written since (and criu refuses a file whose size changed).
    A log opened without ``O_APPEND`` and written only at its end (SB3's Monitor opens with
    ``"w"``; so does a server started with ``stdout=open(log, "w")``) is switched to append mode
    here -- the worker's own descriptor, or a child's through a copy of it (``pidfd_getfd``), whose
    file description the child shares; nothing it writes changes place."""
    access = flags & os.O_ACCMODE
    if access == os.O_WRONLY and not flags & os.O_APPEND:
        if proc == "self":
            if _append_at_end(fd):
                flags |= os.O_APPEND
        else:  # a child's (a server started with its output in a log the env did not keep open)
            dup = _dup_from_child(proc, fd)
            if dup is not None:
                try:  # the copy shares the child's file description, and so its flags
                    same = os.fstat(dup)
                    if (same.st_dev, same.st_ino) == (st.st_dev, st.st_ino) and _append_at_end(dup):
                        flags |= os.O_APPEND
                finally:
                    os.close(dup)
    if access == os.O_WRONLY and flags & os.O_APPEND:
        return None
    how = ("open for reading too: the env may read back what it wrote" if access == os.O_RDWR else
           "open for writing, not at its end: copies would write over each other" if proc == "self" else
           "open for writing without O_APPEND by one of the env's processes: a restored copy would write "
           "over what was written after the snapshot")
    return Resource("file", pid, f"{path} (a log {how})", "none", fd, detail={"path": path},
                    fix="a log that every copy appends to must be opened write-only in append mode "
                        "(open(path, 'a')); a file the env reads back is state: keep it in the env's "
                        "workspace (workspace=DIR) or a private directory (private_dirs=[DIR])")


def _append_at_end(fd: int) -> bool:
    """Switch ``fd``'s file description to ``O_APPEND`` when it was written only at its end (its
    offset is the file's size): nothing written through it changes place."""
    try:
        if os.lseek(fd, 0, os.SEEK_CUR) == os.fstat(fd).st_size:
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_APPEND)
            return True
    except OSError:
        pass
    return False


_SYS_PIDFD_GETFD = 438  # the same number on every architecture (Linux >= 5.6)


def _dup_from_child(proc: str, fd: int) -> int | None:
    """A descriptor here for the child ``proc``'s ``fd`` (``pidfd_getfd``: the same open file
    description), or None (gone, not ours to take, or a kernel without it)."""
    try:
        with open(f"/proc/{proc}/status", "rb") as f:
            local = next(int(line.split()[-1]) for line in f if line.startswith(b"NSpid:"))
        pidfd = os.pidfd_open(local)  # (its pid in our namespace: the last NSpid entry)
    except (OSError, StopIteration, ValueError, AttributeError):
        return None
    try:
        syscall = _c_library().syscall
        syscall.restype = ctypes.c_long
        dup = syscall(_SYS_PIDFD_GETFD, pidfd, fd, 0)
        return dup if dup >= 0 else None
    except (OSError, AttributeError):
        return None
    finally:
        os.close(pidfd)


def _is_sqlite(proc: str, fd: str) -> bool:
    """Whether the file open as ``fd`` is a SQLite database (its 16-byte header)."""
    try:
        with open(f"/proc/{proc}/fd/{fd}", "rb") as f:
            return f.read(16) == b"SQLite format 3\0"
    except OSError:
        return False


class _ProcmapQuery(ctypes.Structure):
    """``struct procmap_query`` (linux/fs.h, Linux >= 6.11): one VMA per ioctl, filtered in the kernel."""

    _fields_ = [("size", ctypes.c_uint64), ("query_flags", ctypes.c_uint64), ("query_addr", ctypes.c_uint64),
                ("vma_start", ctypes.c_uint64), ("vma_end", ctypes.c_uint64), ("vma_flags", ctypes.c_uint64),
                ("vma_page_size", ctypes.c_uint64), ("vma_offset", ctypes.c_uint64), ("inode", ctypes.c_uint64),
                ("dev_major", ctypes.c_uint32), ("dev_minor", ctypes.c_uint32), ("vma_name_size", ctypes.c_uint32),
                ("build_id_size", ctypes.c_uint32), ("vma_name_addr", ctypes.c_uint64),
                ("build_id_addr", ctypes.c_uint64)]


_PROCMAP_QUERY = 0xC0000000 | (ctypes.sizeof(_ProcmapQuery) << 16) | (ord("f") << 8) | 17
_VMA_WRITABLE, _VMA_SHARED, _COVERING_OR_NEXT = 0x02, 0x08, 0x10
_procmap_ok = True
_libc: ctypes.CDLL | None = None
_name_buf = _query = None


def _c_library() -> ctypes.CDLL:
    """This process's C library, loaded once (``PROCMAP_QUERY``'s ioctl, ``pidfd_getfd``)."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


def _shared_maps_fast() -> list[tuple[bytes, bool]] | None:
    """(name, writable) of this process's shared mappings through PROCMAP_QUERY: tens of
    microseconds where reading ``/proc/self/maps`` (hundreds of VMAs: pygame, Box2D) takes a
    millisecond or more.  None where the kernel lacks the ioctl."""
    global _procmap_ok
    global _name_buf, _query
    if not _procmap_ok:
        return None
    if _name_buf is None:
        _name_buf, _query = ctypes.create_string_buffer(4096), _ProcmapQuery()
    libc, name, q = _c_library(), _name_buf, _query
    out: list[tuple[bytes, bool]] = []
    fd = os.open("/proc/self/maps", os.O_RDONLY | os.O_CLOEXEC)
    try:
        addr = 0
        while True:
            q.size, q.query_flags, q.query_addr = ctypes.sizeof(q), _VMA_SHARED | _VMA_WRITABLE | _COVERING_OR_NEXT, addr
            q.vma_name_size, q.vma_name_addr, q.build_id_size = len(name), ctypes.addressof(name), 0
            if libc.ioctl(fd, _PROCMAP_QUERY, ctypes.byref(q)) != 0:
                err = ctypes.get_errno()
                if err == 2:  # ENOENT: no more shared VMAs
                    return out
                _procmap_ok = False
                return None
            out.append((name.value[: max(q.vma_name_size - 1, 0)] or b"[anonymous shared]",
                        bool(q.vma_flags & _VMA_WRITABLE)))
            addr = q.vma_end
    finally:
        os.close(fd)


def _shared_maps_text(proc: str) -> list[tuple[bytes, bool]]:
    try:
        with open(f"/proc/{proc}/maps", "rb") as f:
            data = f.read()
    except OSError:
        return []
    out = []
    for line in data.splitlines():
        parts = line.split(None, 5)
        if len(parts) >= 2 and parts[1][3:4] == b"s":
            out.append((parts[5].strip() if len(parts) > 5 else b"[anonymous shared]", parts[1][1:2] == b"w"))
    return out


#: gym_fork's own shared mappings in this process, by name (the step ring, whose memfd name
#: is random): like the channel, never the env's state, and dropped before any fork or dump
OWN_MAPPINGS: set[bytes] = set()


def _scan_maps(proc: str, pid: int) -> list[Resource]:
    """Shared memory mappings: ``fork()`` shares them between the copies."""
    out: list[Resource] = []
    maps = _shared_maps_fast() if proc == "self" else None
    if maps is None:
        maps = _shared_maps_text(proc)
    seen: set[bytes] = set(OWN_MAPPINGS) if proc == "self" else set()
    for path, writable in maps:
        if path in seen:
            continue
        seen.add(path)
        text = path.decode(errors="replace")
        anon = (text.startswith("/dev/zero") or text.startswith("/memfd:") or text.startswith("[anon_shmem")
                or text == "[anonymous shared]" or (text.endswith(" (deleted)") and not text.startswith("/SYSV")))
        if text.startswith("/SYSV"):
            out.append(Resource("shared-memory", pid, f"System V shared memory {text}", "none",
                                fix="System V shared memory is shared with other processes and not captured; "
                                    "keep the env's state in its own memory"))
        elif anon:
            out.append(Resource("shared-memory", pid, f"anonymous shared memory {text}", "criu"))
        elif not writable:
            continue  # read-only mapping of a file (e.g. a locale cache): the same in every copy
        elif text.startswith("/dev/shm/sem.mp-"):
            out.append(Resource("shared-memory", pid, f"shared memory {text} (a multiprocessing semaphore)", "none",
                                fix="multiprocessing's 'spawn' and 'forkserver' start methods (forkserver is "
                                    "Python 3.14's default) keep their locks and queues' semaphores in /dev/shm, "
                                    "shared with any process that opens them; give the env's pool or queue the "
                                    "'fork' context (multiprocessing.get_context('fork'), or mp_context= for a "
                                    "ProcessPoolExecutor), whose semaphores a CRIU dump of the tree captures"))
        elif text.startswith("/dev/shm/"):
            out.append(Resource("shared-memory", pid, f"shared memory {text}", "none",
                                fix="POSIX shared memory is shared with any process that opens it and not "
                                    "captured; keep the env's state in its own memory"))
        elif mounts.under_private(text):
            out.append(Resource("shared-mapping", pid, f"{text} (mapped shared, in a private directory)", "criu"))
        else:
            out.append(Resource("shared-mapping", pid, f"{text} (mapped shared, writable)", "none",
                                fix="writes to a shared file mapping go to the file, which is not captured; "
                                    "map it privately, or keep the file in workspace=DIR and map it during a step"))
    return out


# --- sockets and pipes: who is at the other end? ------------------------------------------------

def _resolve_peers(found: list[Resource], tree: list[int]) -> None:
    """Fill in ``capture`` for sockets and pipes: inside the tree (CRIU restores both ends) or not."""
    socks = [r for r in found if r.kind == "socket"]
    pipes = [r for r in found if r.kind == "pipe"]
    if pipes:
        ends: dict[int, set[str]] = {}
        for r in pipes:
            ends.setdefault(r.detail["ino"], set()).add(r.detail["end"])
        outside = None
        for r in pipes:
            ino = r.detail["ino"]
            if ends[ino] == {"read", "write"}:
                r.capture = "criu"
                r.what = f"pipe:[{ino}] between processes of the env"
                continue
            if outside is None:
                outside = _holders_outside({r.detail["ino"] for r in pipes}, "pipe", tree)
            holders = outside.get(ino, [])
            if holders:
                r.capture = "none"
                r.what = f"pipe:[{ino}] to process(es) {holders} outside the env"
                r.detail["peer"] = holders
                r.fix = ("a process outside the env's process tree holds the other end, and it is not "
                         "snapshotted: start that process from the env (its child), or talk to it only "
                         "during a step")
            else:
                r.capture = "criu"
                r.what = f"pipe:[{ino}] ({r.detail['end']} end; the other end is closed)"
    if socks:
        _resolve_sockets(socks, tree)
    ptys = [r for r in found if r.kind == "pty"]
    if ptys:
        _resolve_ptys(ptys, tree)


def _resolve_ptys(ptys: list[Resource], tree: list[int]) -> None:
    """A pty the env opened (its master in the tree) and whose terminal end only the tree holds
    is captured by a CRIU dump (a restore gets a devpts of its own, where the pty keeps its
    number: see ``CriuBackend``); any other terminal is not the env's."""
    masters = {(r.detail["dev"], r.detail["index"]) for r in ptys
               if r.detail["end"] == "master" and None not in (r.detail["dev"], r.detail["index"])}
    outside = _pts_holders_outside(masters, tree) if masters else {}
    for r in ptys:
        key, index = (r.detail["dev"], r.detail["index"]), r.detail["index"]
        if key in masters and not outside.get(key):
            r.capture = "criu"
            r.what = f"{index} ({r.detail['end']} end) between processes of the env"  # ("pty 0 (master end) ...")
        elif key in masters:
            r.capture = "none"
            r.what = f"{index}, also open in process(es) {outside[key]} outside the env"
            r.fix = ("a process outside the env's process tree holds this terminal, and it is not snapshotted: "
                     "open the terminal only in the env's own processes")
        else:
            r.kind = "device"
            r.capture = "none"
            r.what = f"{'/dev/ptmx' if r.detail['end'] == 'master' else f'/dev/pts/{index}'} (a terminal)"
            r.fix = ("a terminal the env did not open (the worker's or a child's stdio on the terminal you run "
                     "from) is not captured: start the env with stdin/stdout/stderr not on a terminal; a pty "
                     "the env opens itself (pty.openpty(), pexpect) is captured")


def _pts_holders_outside(ptys: set[tuple[int, int]], tree: list[int]) -> dict[tuple[int, int], list[int]]:
    """Pids outside ``tree`` holding the terminal end of one of ``ptys`` ((devpts instance,
    number) pairs), each pid once."""
    out: dict[tuple[int, int], list[int]] = {}
    for pid, fd, link in _held_outside({f"/dev/pts/{i}" for _dev, i in ptys}, tree):
        try:  # the same number in another devpts instance is another terminal
            key = (os.stat(f"/proc/{pid}/fd/{fd}").st_dev, int(link[len("/dev/pts/"):]))
        except OSError:
            continue
        if key in ptys and pid not in out.setdefault(key, []):
            out[key].append(pid)
    return out


def _holders_outside(inos: set[int], kind: str, tree: list[int]) -> dict[int, list[int]]:
    """Pids outside ``tree`` holding ``kind:[ino]``."""
    want = {f"{kind}:[{i}]": i for i in inos}
    out: dict[int, list[int]] = {}
    for pid, _fd, link in _held_outside(set(want), tree):
        out.setdefault(want[link], []).append(pid)
    return out


def _held_outside(links: set[str], tree: list[int]):
    """``(pid, fd, link)`` of every descriptor outside ``tree`` whose link is one of ``links`` (a
    walk over /proc: only on the slow path)."""
    skip = set(tree)
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in skip:
            continue
        try:
            fds = os.listdir(f"/proc/{name}/fd")
        except OSError:
            continue
        for fd in fds:
            link = _link(name, fd)
            if link in links:
                yield int(name), fd, link


_TCP_STATES = {1: "ESTABLISHED", 2: "SYN_SENT", 3: "SYN_RECV", 4: "FIN_WAIT1", 5: "FIN_WAIT2", 6: "TIME_WAIT",
               7: "CLOSE", 8: "CLOSE_WAIT", 9: "LAST_ACK", 10: "LISTEN", 11: "CLOSING"}


def _inet_table() -> dict[int, dict]:
    """inode -> {proto, local, remote, state} from /proc/self/net/{tcp,tcp6,udp,udp6}."""
    out: dict[int, dict] = {}
    for proto in ("tcp", "tcp6", "udp", "udp6"):
        try:
            with open(f"/proc/self/net/{proto}") as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            p = line.split()
            if len(p) < 10:
                continue
            out[int(p[9])] = {"proto": proto.rstrip("6"), "local": _addr(p[1]), "remote": _addr(p[2]),
                              "state": _TCP_STATES.get(int(p[3], 16), p[3]) if proto.startswith("tcp") else "UDP"}
    return out


def _addr(hexaddr: str) -> tuple[str, int]:
    ip, port = hexaddr.split(":")
    raw = bytes.fromhex(ip)
    if len(raw) == 4:
        host = socket.inet_ntop(socket.AF_INET, raw[::-1])
    else:
        words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
        host = socket.inet_ntop(socket.AF_INET6, words)
        if host.startswith("::ffff:"):
            host = host[7:]
    return host, int(port, 16)


def _is_loopback(host: str) -> bool:
    return host.startswith("127.") or host in ("::1", "0.0.0.0", "::")


_NETNS_FIX = ("a restored copy needs the same addresses and connections while the original holds them: give "
              "the env's worker a network namespace of its own, ForkableEnv(..., private_network=True)")


def _resolve_sockets(socks: list[Resource], tree: list[int]) -> None:
    inos = {r.detail["ino"] for r in socks}
    inet = _inet_table()
    unix = _unix_diag()
    tree_inos = inos
    by_local = {(v["proto"], v["local"]): k for k, v in inet.items() if k in tree_inos}
    for r in socks:
        ino = r.detail["ino"]
        if ino in inet:
            v = inet[ino]
            lhost, lport = v["local"]
            r.detail.update(proto=v["proto"], local=f"{lhost}:{lport}", state=v["state"])
            if v["state"] == "LISTEN" or v["proto"] == "udp":
                r.kind = "listener" if v["state"] == "LISTEN" else "udp-socket"
                r.what = f"{v['proto'].upper()} {lhost}:{lport}" + (" (listening)" if v["state"] == "LISTEN" else "")
                r.capture = "criu+netns"
                r.fix = _NETNS_FIX
                continue
            rhost, rport = v["remote"]
            peer_in_tree = by_local.get((v["proto"], (rhost, rport))) is not None
            r.what = f"{v['proto'].upper()} {lhost}:{lport} -> {rhost}:{rport} ({v['state']})"
            r.detail["peer"] = f"{rhost}:{rport}"
            if peer_in_tree:
                r.capture = "criu+netns"
                r.fix = _NETNS_FIX
            elif _is_loopback(rhost):
                r.capture = "none"
                r.fix = ("the peer is a process outside the env's process tree, which is not snapshotted: start "
                         "the server from the env (as its child), or connect only during a step")
            else:
                r.capture = "none"
                r.fix = ("a connection to another machine cannot be copied (the other side is not snapshotted): "
                         "connect during a step and close before it returns, or keep the remote service out of "
                         "the env's state")
            continue
        if ino in unix:
            u = unix[ino]
            name, peer, state = u.get("name"), u.get("peer"), u.get("state")
            r.detail.update(family="unix", name=name, peer=peer)
            if state == 10:  # TCP_LISTEN: a listening unix socket
                r.kind = "listener"
                if name and name.startswith("@"):
                    r.what = f"unix socket {name} (abstract, listening)"
                    r.capture = "criu+netns"
                    r.fix = ("abstract unix socket names are per network namespace: ForkableEnv(..., "
                             "private_network=True) gives every copy its own")
                elif name and os.path.exists(name) and mounts.under_private(name):
                    r.what = f"unix socket {name} (listening, in a private directory)"
                    r.capture = "criu"  # each restored copy binds it again in its own copy of the directory
                elif name and os.path.exists(name):
                    r.what = f"unix socket {name} (listening)"
                    r.capture = "none"
                    r.fix = ("a socket path is one name in the shared file system: every restored copy would bind "
                             "it again and take it from the original and its siblings. Connect the env's client, "
                             "then unlink the path (established connections stay private to each copy), declare its "
                             f"directory private (ForkableEnv(..., private_dirs=[{os.path.dirname(name)!r}]), root), "
                             "or use TCP on 127.0.0.1 with ForkableEnv(..., private_network=True)")
                else:
                    r.what = f"unix socket {name or '(unnamed)'} (listening, path unlinked)"
                    r.capture = "criu"
                continue
            if peer and peer in tree_inos:
                r.what = f"unix socket {ino} <-> {peer} (between processes of the env)"
                r.capture = "criu"
            elif peer:
                holders = _holders_outside({peer}, "socket", tree).get(peer, [])
                r.what = f"unix socket {name or ino} connected to process(es) {holders or '?'} outside the env"
                r.detail["peer"] = holders
                r.capture = "none"
                r.fix = ("the process at the other end is not part of the env's process tree, so it is not "
                         "snapshotted: start it from the env (as its child), or connect only during a step")
            else:
                r.what = f"unix socket {name or ino} (not connected)"
                r.capture = "criu"
            continue
        r.what = f"socket {ino} (not TCP, UDP or unix)"
        r.capture = "none"
        r.fix = "only TCP, UDP and unix sockets are captured; open other sockets only during a step"


# sock_diag for unix sockets: the peer inode (not in /proc/net/unix) and the bound name.
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST, _NLM_F_DUMP = 0x1, 0x300
_UDIAG_SHOW_NAME, _UDIAG_SHOW_PEER = 0x1, 0x4


def _unix_diag() -> dict[int, dict]:
    """inode -> {state, name, peer} of every unix socket in this network namespace."""
    out: dict[int, dict] = {}
    try:
        s = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, 4)  # NETLINK_SOCK_DIAG
    except OSError:
        return out
    try:
        req = struct.pack("=BBHIIIII", socket.AF_UNIX, 0, 0, 0xFFFFFFFF, 0,
                          _UDIAG_SHOW_NAME | _UDIAG_SHOW_PEER, 0xFFFFFFFF, 0xFFFFFFFF)
        hdr = struct.pack("=IHHII", 16 + len(req), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST | _NLM_F_DUMP, 1, 0)
        s.send(hdr + req)
        done = False
        while not done:
            data = s.recv(1 << 16)
            pos = 0
            while pos + 16 <= len(data):
                length, mtype, _flags, _seq, _pid = struct.unpack_from("=IHHII", data, pos)
                if length < 16:
                    done = True
                    break
                if mtype in (2, 3):  # NLMSG_ERROR, NLMSG_DONE
                    done = True
                    break
                body = data[pos + 16: pos + length]
                _fam, _typ, state, _pad, ino = struct.unpack_from("=BBBBI", body, 0)
                entry: dict = {"state": state}
                apos = 16
                while apos + 4 <= len(body):
                    alen, atype = struct.unpack_from("=HH", body, apos)
                    if alen < 4:
                        break
                    val = body[apos + 4: apos + alen]
                    if atype == 0:  # UNIX_DIAG_NAME
                        entry["name"] = ("@" + val[1:].decode(errors="replace")) if val[:1] == b"\0" \
                            else val.rstrip(b"\0").decode(errors="replace")
                    elif atype == 2:  # UNIX_DIAG_PEER
                        entry["peer"] = struct.unpack_from("=I", val)[0]
                    apos += (alen + 3) & ~3
                out[ino] = entry
                pos += (length + 3) & ~3
    except OSError:
        pass
    finally:
        s.close()
    return out


def host_pid_of_child(local: int) -> int | None:
    """The host pid (as ``/proc`` names it) of this process's child ``local`` (as ``os.fork()``
    returned it, in this PID namespace); None when it is not found."""
    level = _own_level()
    if level == 0:
        return local
    found = exits.pid_via_pidfd(local)
    if found is not None:
        return found
    for pid in _children("self"):
        st = _status(pid, level)
        if st is not None and st[2] == local:
            return pid
    return None


def kill_env_processes(forked: set[int] | frozenset[int] = frozenset()) -> list[int]:
    """SIGKILL this worker's env's descendants (not gym_fork's fork-tier processes -- ``forked``,
    its frozen snapshots, and clones orphaned to it -- nor what they started): what a worker that
    stops, or retires into a reaper, must not leave behind."""
    start = classify_children(_children("self"), set(forked))[0]
    victims = _descendants(start) if start else []
    level = _own_level() if victims else 0
    for pid in reversed(victims):
        # /proc names them by host pid; kill() takes this PID namespace's numbers
        st = _status(pid, level) if level else None
        try:
            os.kill(st[2] if st is not None else pid, 9)
        except OSError:
            pass
    return victims


def await_dead(pids: list[int], timeout: float = 2.0) -> None:
    """Wait until every process of ``pids`` (host pids, SIGKILLed) has stopped running: gone or
    a zombie, so none writes another byte (a killed process may still finish the system call
    it is in); at most ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                with open(f"/proc/{pid}/stat", "rb") as f:
                    state = f.read().rsplit(b")", 1)[1].split()[0]
            except (OSError, IndexError):
                break
            if state in (b"Z", b"X"):
                break
            time.sleep(0.0002)


def env_descendants_local(forked: set[int] | frozenset[int] = frozenset()) -> list[int]:
    """This worker's env's living descendants, as this PID namespace numbers them (what
    ``fanotify`` reports): gym_fork's fork-tier processes (``forked``, and clones orphaned to
    it) and what they started are left out."""
    start = classify_children(_children("self"), set(forked))[0]
    if not start:
        return []
    level = _own_level()
    out = []
    for pid in _descendants(start):
        st = _status(pid, level) if level else None
        out.append(st[2] if st is not None else pid)
    return out


def kill_env_descendants(pid: int) -> list[int]:
    """Controller side: SIGKILL the descendants of worker ``pid`` that are the env's (all but
    gym_fork's fork-tier processes, its frozen snapshots, which outlive it).  For a worker that
    is not its namespace's init, whose env children would otherwise live on without it."""
    start = [p for p in _children(str(pid)) if _comm(p) != FORK_COMM]
    victims = _descendants(start) if start else []
    for victim in reversed(victims):
        try:
            os.kill(victim, 9)
        except OSError:
            pass
    return victims


_WORKER_COMM = _comm("self")

"""Dumping and restoring process trees through CRIU's RPC (pycriu), every call under a timeout.

The one place that drives ``criu swrk``: env snapshots (:mod:`gym_fork.backends.criu`) and whole
jobs (:mod:`gym_fork.migration.job`) both dump and restore through :func:`dump` and
:func:`restore`.  A call that outlives ``$GYM_FORK_CRIU_TIMEOUT`` seconds has its criu process
SIGKILLed (and, for a restore, the half-restored processes holding its fresh channel socket),
then raises :class:`TimeoutError`, so a wedged CRIU never hangs the caller.

``mode`` says how criu runs: ``"root"`` (the host namespaces) or ``"userns"`` (inside this
session's unprivileged user + mount namespace, ``--unprivileged``; see :mod:`gym_fork.criu.userns`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import random
import re
import shutil
import signal
import socket
import stat
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from gym_fork.criu.status import (children_by_parent, criu_status, criu_timeout, kill_socket_holders, new_client,
                                  reap as _reap)
from gym_fork.snapshots import sessiondir


#: CRIU's parasite, inside every process it dumps whose ``/proc`` is not its own PID namespace's
#: (a worker is PID 1 of a namespace of its own), makes a directory of this name in that process's
#: working directory, mounts a proc there for a moment and removes it.  Two dumps at once of
#: processes with one working directory (two learners started in one project directory, a live
#: migration's dump beside a snapshot's) collide on it: one fails with "Can't create a directory
#: (-17)" -- 3 in 120 dumps of two learners here.  :func:`dump` takes a lock per working directory
#: that every gym_fork process of this user takes (``_cwd_locks``), and tries again where another
#: process's dump took none (an older gym_fork, or any other CRIU user).
PARASITE_PROC_DIR = "proc.crtools"
#: how long :func:`dump` tries again while another dump holds :data:`PARASITE_PROC_DIR` (it holds it
#: for milliseconds); still there after that, and empty, it is a leftover of a dump that was killed
PARASITE_DIR_WAIT_S = 5.0
_PARASITE_MKDIR = "Can't create a directory ("  # parasite.c, followed by -errno
# one dump at a time in this process: two of its threads (a live migration's dump beside a
# snapshot's) never collide on that directory, and a dump whose images are read as they are
# written (streamed: not tried again, see dump's ``retry``) meets another process's only
_DUMP_LOCK = threading.Lock()


def dump(pid: int, images_dir: str, *, leave_running: bool, external: Sequence[str] = (),
         mode: str = "root", binary: str | None = None, log_file: str = "dump.log",
         timeout: float | None = None, options: Mapping[str, Any] | None = None, retry: bool = True,
         held_paths: Sequence[str] = ()) -> None:
    """Dump the process tree rooted at ``pid`` into the existing directory ``images_dir``.

    Args:
        pid: root of the tree (a PID-namespace init dumps its whole namespace).
        images_dir: where the image files (and ``log_file``) are written.
        leave_running: keep the tree running after the dump (else CRIU kills it).
        external: resources the tree shares with us, e.g. ``["unix[INO]"]`` for the channel socket
            whose peer stays here (restored later with ``inherit_fd``).
        mode: ``"root"`` or ``"userns"`` (see the module docstring).
        binary: the criu executable (default: the one :func:`~gym_fork.criu.status.criu_status` found).
        log_file: CRIU's log, inside ``images_dir`` (read it with :func:`~gym_fork.criu.status.log_tail`).
        timeout: seconds before criu is killed (default ``$GYM_FORK_CRIU_TIMEOUT``, 60).
        options: further pycriu ``opts`` fields, e.g. ``{"tcp_established": True, "ghost_limit": N}``.
        held_paths: directories (the env's workspace, as the tree names it) whose regular files
            no process may hold open in the images: a restore reopens a file by its path before
            the caller puts the directory's content back, so it would read the trajectory being
            left (see :func:`files_held`).

    A dump that meets another one's :data:`PARASITE_PROC_DIR` in a working directory is tried
    again (the failed try left the tree running); an empty one older than
    :data:`PARASITE_DIR_WAIT_S` is a leftover and removed. Not with ``retry=False``: images
    that someone reads while CRIU writes them (a migration streams them) must come from one try.
    This process's dumps run one at a time.

    A dump that caught a process with a file of ``/proc/PID/`` or of ``held_paths`` open (a tool
    that reads one for a moment, on its own schedule) is taken again, up to :data:`PROC_FILE_TRIES`
    times in all (once with ``retry=False``).

    Raises:
        TimeoutError: the dump took longer than ``timeout``; criu was killed.
        OSError: ``EBUSY``: such a file was open in every try (the message names it). Or CRIU could not make its temporary directory in the working directory of a
            process of the tree (read-only, or a :data:`PARASITE_PROC_DIR` that stays); the
            message names it.
        Exception: pycriu's own errors for a failed dump (see the log).
    """
    with _DUMP_LOCK, _cwd_locks(pid, timeout if timeout is not None else criu_timeout()):
        _dump_retrying(pid, images_dir, leave_running, external, mode, binary, log_file, timeout, options, retry,
                       held_paths)


@contextlib.contextmanager
def _cwd_locks(pid: int, wait: float) -> Iterator[None]:
    """Hold, for each working directory of the tree at ``pid``, a lock that every gym_fork process
    of this user takes around its dumps (``flock`` on a file named by the directory's device and
    inode, in :func:`~gym_fork.snapshots.sessiondir.base_dir`): dumps of trees that share a working
    directory then run one at a time across processes, and their parasites no longer collide on
    :data:`PARASITE_PROC_DIR` -- which a dump that is streamed as it is written (a migration's,
    ``retry=False``) could not survive (seen in CI: two test processes, one project directory).
    A lock not had within ``wait`` seconds (a dump that hangs elsewhere) is gone without; the
    retry is there for that, and for processes that take no lock. None inside a ``gym-fork run``
    job, which CRIU may checkpoint whole at any moment: a held lock would have to travel with it."""
    if os.environ.get(sessiondir.JOB_ENV):
        yield
        return
    keys = set()
    for p in _tree(pid):
        try:
            st = os.stat(f"/proc/{p}/cwd")  # (the directory itself, in whatever mount namespace)
        except OSError:
            continue
        keys.add((st.st_dev, st.st_ino))
    fds: list[int] = []
    try:
        base = sessiondir.private_mkdir(sessiondir.base_dir())
        deadline = time.monotonic() + wait
        for dev, ino in sorted(keys):  # (one order for all: no two processes wait on each other)
            fd = os.open(os.path.join(base, f"dump-cwd-{dev:x}-{ino:x}.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                         0o600)
            fds.append(fd)
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.002)
        yield
    finally:
        for fd in fds:
            os.close(fd)  # (lets the lock go)


def _dump_retrying(pid: int, images_dir: str, leave_running: bool, external: Sequence[str], mode: str,
                   binary: str | None, log_file: str, timeout: float | None, options: Mapping[str, Any] | None,
                   retry: bool, held_paths: Sequence[str] = ()) -> None:
    before = set(os.listdir(images_dir))
    # (a directory made just before the first try is a leftover once PARASITE_DIR_WAIT_S old)
    deadline = time.monotonic() + 2 * PARASITE_DIR_WAIT_S
    proc_tries = PROC_FILE_TRIES
    while True:
        try:
            _dump_once(pid, images_dir, leave_running, external, mode, binary, log_file, timeout, options)
            proc, own = files_held(images_dir, held_paths) if leave_running else ([], [])
            if not proc and not own:
                return
            proc_tries -= 1
            if not retry or proc_tries <= 0:
                tries = f"tried {PROC_FILE_TRIES} times" if retry else "a streamed dump is not tried again"
                if proc:
                    raise OSError(errno.EBUSY, f"a process of the dumped tree (root {pid}) holds {proc[0]} open, a "
                                               "file of /proc named by a pid that a restore cannot give back (a "
                                               "restored tree has its own PID namespace): no restore could reopen "
                                               f"it ({tries}). Close it between steps; the env keeps running")
                raise OSError(errno.EBUSY, f"a process of the dumped tree (root {pid}) holds {own[0]} open, a file "
                                           "of the env's workspace: a restore would reopen it by its path before "
                                           "the snapshot's files are put back, and read the trajectory being left "
                                           f"({tries}). Open workspace files only for a moment (a tool that watches "
                                           "the workspace: read and close), or only during a step; the env keeps "
                                           "running")
            # caught mid-read (redis-server reads its /proc/PID/stat every 100 ms, a file watcher
            # its workspace every millisecond): dump again, it is closed by now
            _remove_new(images_dir, before)
            time.sleep(random.uniform(0.001, 0.005))
            continue
        except TimeoutError:
            raise
        except Exception as e:  # noqa: BLE001 - pycriu's errors: read the log for the parasite's
            err = _parasite_mkdir_errno(os.path.join(images_dir, log_file))
            if err is None or (err == errno.EEXIST and not retry):
                raise
            if err != errno.EEXIST:
                raise OSError(err, f"CRIU's parasite could not make its temporary directory "
                                   f"{PARASITE_PROC_DIR!r} in the working directory of a process it dumps "
                                   f"({_cwds(pid)}): {os.strerror(err)}. Start the env in a directory it "
                                   f"may write to") from e
            if not _remove_leftover_proc_dirs(pid) and time.monotonic() > deadline:
                raise OSError(err, f"CRIU's temporary directory {PARASITE_PROC_DIR!r} stays in the working "
                                   f"directory of a process it dumps ({_cwds(pid)}) and is not an empty "
                                   f"leftover of an earlier dump; remove it") from e
            _remove_new(images_dir, before)  # the failed attempt's images and log
            time.sleep(random.uniform(0.002, 0.02))  # apart from the other dump's next try


#: dumps that find a file held open that no restore may reopen (files_held) before one is said to fail
PROC_FILE_TRIES = 4
_PROC_PID_FILE = re.compile(rb"/proc/[0-9]+/")


def files_held(images_dir: str, held_paths: Sequence[str] = ()) -> tuple[list[str], list[str]]:
    """The files that the dumped processes held open (``files.img``) and that a restore must not
    reopen by their path: those under ``/proc/PID/`` -- the restored tree's pids belong to a PID
    namespace of its own, so the restore fails ("Can't open file proc/PID/stat on restore") --
    and the regular files under ``held_paths`` (their directories, a working directory there,
    are kept in place by the restore and are fine). A raw search first (a few µs); the image is
    parsed only where it finds one."""
    path = os.path.join(images_dir, "files.img")
    prefixes = [p.rstrip("/").encode() + b"/" for p in held_paths if p]
    try:
        with open(path, "rb") as f:
            raw = f.read()
        if not _PROC_PID_FILE.search(raw) and not any(p in raw for p in prefixes):
            return [], []
        import pycriu

        with open(path, "rb") as f:
            entries = pycriu.images.load(f)["entries"]
    except Exception:  # noqa: BLE001 - an unreadable image is caught by the checksums
        return [], []
    proc: list[str] = []
    own: list[str] = []
    for e in entries:
        if e.get("type") != "REG":
            continue
        reg = e.get("reg") or {}
        name = reg.get("name", "")
        if _PROC_PID_FILE.match(name.encode()):
            proc.append(name)
        elif any(name.encode().startswith(p) for p in prefixes) and stat.S_ISREG(reg.get("mode", stat.S_IFREG)):
            own.append(name)
    return proc, own


def _remove_new(images_dir: str, before: set[str]) -> None:
    """Remove what appeared in ``images_dir`` since ``before`` (a failed or refused try's images)."""
    for name in set(os.listdir(images_dir)) - before:
        path = os.path.join(images_dir, name)
        shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.unlink(path)


def _dump_once(pid: int, images_dir: str, leave_running: bool, external: Sequence[str], mode: str,
               binary: str | None, log_file: str, timeout: float | None, options: Mapping[str, Any] | None) -> None:
    dfd = os.open(images_dir, os.O_DIRECTORY)
    try:
        c = _client(mode, binary, dfd, None)
        c.opts.log_file = log_file
        c.opts.log_level = 2
        c.opts.pid = pid
        c.opts.leave_running = leave_running
        c.opts.external.extend(external)
        for key, value in (options or {}).items():
            setattr(c.opts, key, value)
        _call(c, "dump", f"CRIU dump of process {pid}", timeout)
    finally:
        os.close(dfd)


def _parasite_mkdir_errno(log: str) -> int | None:
    """The errno of the parasite's failed ``mkdir(PARASITE_PROC_DIR)`` in a dump's log, if that failed it."""
    try:
        with open(log, errors="replace") as f:
            for line in f:
                at = line.find(_PARASITE_MKDIR)
                if at >= 0 and "parasite" in line:
                    try:
                        return -int(line[at + len(_PARASITE_MKDIR):].split(")", 1)[0])
                    except ValueError:
                        return None
    except OSError:
        pass
    return None


def _tree_by_scan(pid: int) -> list[int]:
    """:func:`_tree` from a scan of all of ``/proc`` (a kernel without children files)."""
    kids = children_by_parent()
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += kids.get(p, [])
    return out


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants, through each thread's ``/proc/PID/task/TID/children``: tens of
    µs for a worker, where a scan of all of ``/proc`` takes ~1 ms per hundred processes (this runs
    before every dump: :func:`_cwd_locks`)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue  # (gone meanwhile)
        for tid in tids:
            try:
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    todo += [int(c) for c in f.read().split()]
            except FileNotFoundError:
                if os.path.isdir(f"/proc/{p}/task/{tid}"):  # the thread is there, its file is not:
                    return _tree_by_scan(pid)  # this kernel has none (else: a thread that ended meanwhile)
            except OSError:
                continue
    return out


def _cwds(pid: int) -> str:
    """The working directories of the tree at ``pid`` (as their processes see them)."""
    seen: list[str] = []
    for p in _tree(pid):
        try:
            cwd = os.readlink(f"/proc/{p}/cwd")
        except OSError:
            continue
        if cwd not in seen:
            seen.append(cwd)
    return ", ".join(seen) or "unknown"


def _remove_leftover_proc_dirs(pid: int) -> bool:
    """Remove each empty :data:`PARASITE_PROC_DIR` older than :data:`PARASITE_DIR_WAIT_S` in a
    working directory of the tree at ``pid`` (reached through ``/proc/PID/cwd``: the process's own
    mount namespace), the leftover of a dump killed between its mkdir and rmdir. Not a mount point
    (a dump using it right now). Returns whether one was removed."""
    removed = False
    for p in _tree(pid):
        path = f"/proc/{p}/cwd/{PARASITE_PROC_DIR}"
        try:
            st, parent = os.lstat(path), os.stat(f"/proc/{p}/cwd")
            if (stat.S_ISDIR(st.st_mode) and st.st_dev == parent.st_dev
                    and time.time() - st.st_mtime > PARASITE_DIR_WAIT_S):
                os.rmdir(path)  # (only an empty one)
                removed = True
        except OSError:
            continue
    return removed


def restore(images_dir: str, *, inherit_fd: Mapping[str, int] | None = None, rst_sibling: bool = True,
            work_dir: str | None = None, mode: str = "root", binary: str | None = None,
            log_file: str = "restore.log", timeout: float | None = None, kill_ino: int | None = None,
            options: Mapping[str, Any] | None = None) -> int:
    """Restore the process tree dumped in ``images_dir``; returns the pid of its root.

    Args:
        images_dir: the images (read only).
        inherit_fd: external resources to plug in, e.g. ``{"socket:[OLD_INO]": fd}``: the restored
            tree gets ``fd`` (inherited by criu, so it must be inheritable) where it had that socket.
        rst_sibling: the restored root becomes our child (``waitpid`` works), not criu's.
        work_dir: where criu writes its log and stats (default: ``images_dir``); concurrent
            restores of one image need one each.
        mode, binary, timeout: as for :func:`dump`.
        log_file: CRIU's log, inside ``work_dir``.
        kill_ino: on a timeout, also SIGKILL our processes holding ``socket:[kill_ino]`` (the
            half-restored tree, found by the fresh socket handed in through ``inherit_fd``).
        options: further pycriu ``opts`` fields, as for :func:`dump`.

    Raises:
        TimeoutError: the restore took longer than ``timeout``; criu (and the half-restored
            processes) were killed.
        Exception: pycriu's own errors for a failed restore (see the log).
    """
    dfd = os.open(images_dir, os.O_DIRECTORY)
    c = None
    try:
        c = _client(mode, binary, dfd, work_dir)
        c.opts.log_file = log_file
        c.opts.log_level = 2
        c.opts.rst_sibling = rst_sibling
        for key, fd in (inherit_fd or {}).items():
            x = c.opts.inherit_fd.add()
            x.key = key
            x.fd = fd
        for key, value in (options or {}).items():
            setattr(c.opts, key, value)
        return _call(c, "restore", f"CRIU restore from {images_dir}", timeout, kill_ino=kill_ino).pid
    finally:
        os.close(dfd)
        if c is not None and c.opts.HasField("work_dir_fd"):
            os.close(c.opts.work_dir_fd)


def _client(mode: str, binary: str | None, dfd: int, work_dir: str | None) -> Any:
    """A pycriu client for one call, its images directory given as the open fd ``dfd``."""
    binary = binary or criu_status().binary
    if mode != "userns":
        c = new_client(binary)
        c.opts.images_dir_fd = dfd
        if work_dir is not None:
            c.opts.work_dir_fd = os.open(work_dir, os.O_DIRECTORY)
        return c
    from gym_fork.criu.userns import get_holder

    c = new_client(get_holder().criu_wrapper(binary))
    c.opts.unprivileged = True
    # criu, inside the holder's user namespace, may not open /proc/<us>/fd/N (ptrace access into
    # the parent namespace): hand it the fd itself and name it /proc/self/fd/N.
    os.set_inheritable(dfd, True)
    c.opts.images_dir_fd = -1
    c.opts.images_dir = f"/proc/self/fd/{dfd}"
    if work_dir is not None:
        cfg = os.path.join(work_dir, "criu.conf")
        with open(cfg, "w") as f:
            f.write(f"work-dir {work_dir}\n")
        c.opts.config_file = cfg
    return c


def _call(c: Any, method: str, what: str, timeout: float | None, kill_ino: int | None = None) -> Any:
    """``c.<method>()`` under a timeout: past it, criu is SIGKILLed (and the processes holding
    ``socket:[kill_ino]``), and TimeoutError is raised."""
    timeout = criu_timeout() if timeout is None else timeout
    done = threading.Event()
    fired: list[int | None] = []

    def watchdog() -> None:
        if done.wait(timeout):
            return
        comm = c._comm
        deadline = time.monotonic() + 5
        while getattr(comm, "swrk", None) is None and not done.is_set() and time.monotonic() < deadline:
            time.sleep(0.01)
        if done.is_set():
            return
        pid = getattr(comm, "swrk", None)
        fired.append(pid)
        if pid:
            fired.append(_start_time(pid))
            _kill_criu(pid)
        sk = getattr(comm, "sk", None)
        if sk is not None:
            try:
                sk.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    threading.Thread(target=watchdog, daemon=True, name="gym_fork-criu-timeout").start()
    try:
        return getattr(c, method)()
    except Exception as e:
        if not fired:
            raise
        pid = fired[0]
        if pid:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
        killed = kill_socket_holders(kill_ino) if kill_ino is not None else []
        if kill_ino is not None and pid:
            killed += _kill_stranded_tasks(pid, fired[1])
        raise TimeoutError(
            f"{what} did not finish within {timeout:g} s ($GYM_FORK_CRIU_TIMEOUT): criu (pid {pid}) was "
            f"killed" + (f", and the half-restored process(es) {killed}" if killed else "")) from e
    finally:
        done.set()


def _kill_criu(pid: int) -> None:
    """SIGKILL criu, its helper children and the tasks it was restoring. criu forks helpers of
    its own (e.g. a child it ptrace-attaches to probe the kernel, which sleeps in a loop until
    criu kills it): killed alone, criu leaves them running, orphaned, for good. The tasks of a
    restore are clones of criu made our children (``rst_sibling``) that wait on a futex for
    criu's next stage: cut short, they wait forever. criu runs as the leader of a process group
    of its own (``criu.status``, ``process_group=0``), which its helpers and those tasks share
    until a task restores its own: one ``killpg`` reaches them all, and the tasks among them,
    our children, are waited for. Stopped first, criu forks none meanwhile."""
    try:
        os.kill(pid, signal.SIGSTOP)
        leader = os.getpgid(pid) == pid
    except ProcessLookupError:
        return
    group = _group_members(pid) if leader else []
    helpers = [int(p) for p in _proc_children(pid) if _comm(p) == "criu"]
    try:
        os.killpg(pid, signal.SIGKILL) if group else os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for p in helpers:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _reap([p for p in group if p != pid])  # (criu itself is waited for by the caller)


def _stat(pid: int | str) -> list[bytes] | None:
    """The fields of ``/proc/PID/stat`` after the command name (state first), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None


def _start_time(pid: int) -> int:
    """When ``pid`` started, in clock ticks since boot (0 when it is gone)."""
    st = _stat(pid)
    return int(st[19]) if st else 0


def _kill_stranded_tasks(criu_pid: int, since: int) -> list[int]:
    """SIGKILL the root tasks a restore cut short left behind, and wait for them. Made our
    children (``rst_sibling``), each PID 1 of the namespace criu made for it, they wait on a
    futex for criu's next stage -- for ever once criu is gone -- and once a task has restored its
    own process group, the ``killpg`` of criu's misses it. Ours: children of this process still
    named criu, started after criu (``since``), PID 1 of a namespace below ours, and not in the
    group of another criu that is still running (a concurrent restore's)."""
    out = []
    for kid in _proc_children(os.getpid()):
        st = _stat(kid)
        if st is None or _comm(kid) != "criu" or int(st[19]) < since:
            continue
        pgid = int(st[2])
        if pgid not in (int(kid), criu_pid) and _comm(pgid) == "criu":
            continue  # in another criu's group: that restore's
        try:
            with open(f"/proc/{kid}/status", "rb") as f:
                nspid = next((line.split()[1:] for line in f if line.startswith(b"NSpid:")), [])
        except OSError:
            continue
        if len(nspid) >= 2 and nspid[-1] == b"1":
            try:
                os.kill(int(kid), signal.SIGKILL)  # the namespace's init: all of it goes
                out.append(int(kid))
            except ProcessLookupError:
                pass
    _reap(out)
    return out


def _group_members(pgid: int) -> list[int]:
    """The processes of process group ``pgid`` (from ``/proc``)."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(name)
            if st is not None and int(st[2]) == pgid:
                out.append(int(name))
    return out


def _proc_children(pid: int) -> list[int]:
    """The child processes of ``pid`` (see :func:`children_by_parent`: whichever thread made them)."""
    return children_by_parent().get(pid, [])


def _comm(pid: int | str) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""

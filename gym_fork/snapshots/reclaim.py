"""Session directories outlive a process killed with SIGKILL; the next gym_fork process removes them.

Every session directory holds a lock file (``owner.lock``) that its process keeps ``flock``-ed
for its whole lifetime.  The kernel drops a ``flock`` when the last descriptor of its open file goes
away, however the process ends, so "the lock is free" means "the owner is gone" -- with no pid
check (pids are reused, and differ between PID namespaces).  The descriptor is close-on-exec
(workers and CRIU are started with ``exec``), and a process forked without ``exec`` closes its
copy at once (:func:`os.register_at_fork`), so a forked child never keeps a dead owner's
lock held.

:func:`reclaim_orphans` (run once when a process creates its session directory, and by
``gym-fork snapshots gc``) takes each free lock without waiting, renames that directory out of
the way (``.reclaim-*``: nobody else can then pick it) and deletes it.  Directories of gym_fork
versions without a lock file are left alone and reported, never guessed about.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import shutil
import threading
import time

OWNER = "owner.lock"
#: session directories: s<pid>-<random> (named by their creator; the pid is informative only)
SESSION_RE = re.compile(r"s\d+-[A-Za-z0-9_]+")
_STALE_NEW_S = 3600.0  # a ".new-*" directory this old was left by a creator that died half-way
log = logging.getLogger("gym_fork")


def hold(path: str) -> int:
    """Create and ``flock`` the owner lock of the session directory ``path``; returns the
    descriptor, which the caller keeps open for its lifetime (close-on-exec)."""
    fd = os.open(os.path.join(path, OWNER), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def _take(path: str) -> int | None:
    """The owner lock of ``path`` if it is free (its owner is gone), else None (held, or no lock
    file: not a directory this scheme manages)."""
    try:
        fd = os.open(os.path.join(path, OWNER), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _size(path: str) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for n in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, n)).st_blocks * 512
    return total


def reclaim_orphans(base: str, *, keep: str | None = None, background: bool = False) -> dict:
    """Remove the session directories under ``base`` whose owner is gone.

    Args:
        base: the directory holding session directories (:func:`gym_fork.snapshots.sessiondir.base_dir`).
        keep: a directory never to touch (the caller's own).
        background: delete in a thread (the scan and the renames happen now either way).

    Returns:
        ``{"reclaimed": [names], "bytes": freed (0 with background), "legacy": [names of
        session directories without a lock file, left alone]}``.
    """
    out: dict = {"reclaimed": [], "bytes": 0, "legacy": []}
    try:
        names = os.listdir(base)
    except OSError:
        return out
    uid = os.geteuid()
    doomed = []
    for name in names:
        path = os.path.join(base, name)
        if path == keep or not (SESSION_RE.fullmatch(name) or name.startswith((".reclaim-", ".new-"))):
            continue
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not os.path.isdir(path) or os.path.islink(path) or st.st_uid != uid:
            continue
        if name.startswith(".new-") and time.time() - st.st_mtime < _STALE_NEW_S:
            continue  # being created right now
        fd = _take(path)
        if fd is None:
            if not os.path.lexists(os.path.join(path, OWNER)):
                if SESSION_RE.fullmatch(name):
                    out["legacy"].append(name)
                elif name.startswith(".new-"):  # its creator died before taking the lock: empty
                    shutil.rmtree(path, ignore_errors=True)
            continue
        try:
            trash = path if name.startswith(".reclaim-") else os.path.join(base, f".reclaim-{name}")
            if trash != path:
                os.rename(path, trash)
        except OSError:
            os.close(fd)
            continue
        out["reclaimed"].append(name)
        doomed.append((trash, fd))

    def remove() -> None:
        for trash, fd in doomed:
            try:
                if not background:
                    out["bytes"] += _size(trash)
                shutil.rmtree(trash, ignore_errors=True)
            finally:
                os.close(fd)

    if doomed:
        log.info("gym_fork: removing %d session directories of processes that are gone: %s", len(doomed),
                 ", ".join(out["reclaimed"][:5]))
        if background:  # not a daemon: an exiting interpreter finishes the deletion first
            threading.Thread(target=remove, name="gym_fork-reclaim").start()
        else:
            remove()
    return out

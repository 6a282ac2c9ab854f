"""Durable file writes shared by bundles and the snapshot store.

A bundle or a store entry becomes visible by one ``rename`` after everything in it reached the
disk; these helpers do the flushing (per file, per directory, or the whole file system at once),
the atomic rewrite of small JSON files, and the cheap copies (hard links) of immutable images.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
from typing import Any


def fsync_dir(path: str) -> None:
    """Flush a directory's entries (a rename inside it, a new file)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str) -> None:
    """Flush every file and directory under ``path`` (symlinks are not followed)."""
    for root, _dirs, files in os.walk(path):
        for name in files:
            if os.path.islink(os.path.join(root, name)):  # a workspace symlink: not ours to open
                continue
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(root)


def syncfs(path: str) -> None:
    """Flush the whole file system holding ``path`` (one call instead of an fsync per file)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.syncfs(fd) != 0:
            os.sync()
    except (AttributeError, OSError):
        os.sync()
    finally:
        os.close(fd)


def atomic_write_json(path: str, obj: Any) -> None:
    """Replace ``path`` with ``obj`` as JSON (0600): written aside, flushed, renamed into place."""
    tmp = f"{path}.tmp-{os.getpid()}-{os.urandom(3).hex()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=0, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(os.path.dirname(path))


def link_tree(src: str, dst: str) -> None:
    """Put the regular files directly in ``src`` into the new private directory ``dst``: hard
    links on the same file system (images are never modified in place), else copies."""
    os.makedirs(dst, mode=0o700)
    for name in os.listdir(src):
        s, d = os.path.join(src, name), os.path.join(dst, name)
        if not os.path.isfile(s):
            continue
        try:
            os.link(s, d)
        except OSError:
            shutil.copy2(s, d)


def allocated_bytes(path: str) -> int:
    """Bytes a file really occupies on disk (allocated blocks; 0 when it is gone)."""
    try:
        return os.lstat(path).st_blocks * 512  # never follow a workspace symlink
    except OSError:
        return 0

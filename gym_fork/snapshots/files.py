"""File access shared by bundles and the snapshot store: durable writes, and careful reads.

A bundle or a store entry becomes visible by one ``rename`` after everything in it reached the
disk; these helpers do the flushing (per file, per directory, or the whole file system at once),
the atomic rewrite of small JSON files, and the cheap copies (hard links) of immutable images.

Bundles and store entries may sit in directories that someone else can write to, so reading them
never follows a symlink, never opens a FIFO or a device (which could block or never end), and
never reads past a size known in advance: :func:`open_regular`, :func:`read_bounded`.  A full
disk becomes :class:`~gym_fork.errors.NoSpaceError` with the numbers (:func:`no_space`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import shutil
import stat
from typing import Any, Iterable

from gym_fork.errors import NoSpaceError, SnapshotCorruptedError

# O_PATH opens nothing: no device driver runs, no FIFO blocks; the final component is not followed
_PATH_FLAGS = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "symbolic link"), (stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
                       (stat.S_ISSOCK, "socket")):
        if test(mode):
            return name
    return "special file"


def open_regular(name: str, *, dir_fd: int | None = None, what: str = "") -> tuple[int, os.stat_result]:
    """Open the regular file ``name`` (relative to ``dir_fd`` if given) for reading, safely.

    The file is first opened with ``O_PATH | O_NOFOLLOW`` (which opens nothing: no device driver,
    no blocking FIFO, a symlink stays a symlink), checked with ``fstat``, and only a regular file
    is then reopened for reading through ``/proc/self/fd`` (the same inode, whatever happens to
    the name meanwhile).

    Returns:
        ``(fd, stat)``: the caller closes ``fd``.

    Raises:
        SnapshotCorruptedError: missing, or not a regular file (``what`` starts the message).
    """
    prefix = f"{what}: " if what else ""
    try:
        pfd = os.open(name, _PATH_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        raise SnapshotCorruptedError(f"{prefix}{name} is missing") from None
    except OSError as e:
        raise SnapshotCorruptedError(f"{prefix}{name} cannot be opened ({e.strerror})") from None
    try:
        st = os.fstat(pfd)
        if not stat.S_ISREG(st.st_mode):
            raise SnapshotCorruptedError(f"{prefix}{name} is a {_kind(st.st_mode)}, not a regular file; "
                                         "nothing was read from it")
        fd = os.open(f"/proc/self/fd/{pfd}", os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    finally:
        os.close(pfd)
    return fd, st


def read_bounded(path: str, limit: int, what: str = "") -> bytes:
    """The content of the regular file ``path`` (see :func:`open_regular`), at most ``limit``
    bytes.  Raises SnapshotCorruptedError when it is missing, not a regular file, or larger."""
    fd, st = open_regular(path, what=what)
    try:
        if st.st_size > limit:
            raise SnapshotCorruptedError(f"{what + ': ' if what else ''}{path} is larger than {limit} bytes")
        chunks, left = [], limit + 1
        while left > 0:
            b = os.read(fd, min(left, 1 << 20))
            if not b:
                break
            chunks.append(b)
            left -= len(b)
        data = b"".join(chunks)
        if len(data) > limit:
            raise SnapshotCorruptedError(f"{what + ': ' if what else ''}{path} is larger than {limit} bytes")
        return data
    finally:
        os.close(fd)


def free_bytes(path: str) -> int | None:
    """Bytes an unprivileged writer may still use on the file system holding ``path``."""
    try:
        v = os.statvfs(path)
    except OSError:
        return None
    return v.f_bavail * v.f_frsize


def no_space(e: OSError, path: str, what: str, needed: int | None = None) -> NoSpaceError:
    """The NoSpaceError for ``e`` (an ENOSPC or EDQUOT while writing ``what`` under ``path``),
    with the free space and, if known, what was needed; the caller raises it ``from e``."""
    free = free_bytes(path)
    size = f"; the file system has {free} bytes free" if free is not None else ""
    need = f", about {needed} bytes were needed" if needed is not None else ""
    err = NoSpaceError(f"no space left on the device holding {path} while writing {what}{need}{size}. "
                        "Nothing was kept of the failed write; free disk space (e.g. `gym-fork snapshots gc "
                        "DIR --max-bytes ...`, or remove old bundles) or point the store/bundle elsewhere")
    err.path, err.free_bytes, err.needed_bytes = path, free, needed
    return err


def is_no_space(e: BaseException) -> bool:
    """Whether ``e`` says a disk or quota is full (an OSError, or a failed ``cp``'s message)."""
    if isinstance(e, NoSpaceError):
        return True
    if isinstance(e, OSError):
        return e.errno in (errno.ENOSPC, errno.EDQUOT)
    out = getattr(e, "stderr", None)  # subprocess.CalledProcessError of cp
    if isinstance(out, bytes):
        out = out.decode(errors="replace")
    return isinstance(out, str) and ("No space left" in out or "Disk quota exceeded" in out)


def as_no_space(e: BaseException, path: str, what: str, needed: int | None = None) -> NoSpaceError | None:
    """``e`` as a NoSpaceError (itself if it is one) when it says the disk is full, else None."""
    if isinstance(e, NoSpaceError):
        return e
    if not is_no_space(e):
        return None
    return no_space(e if isinstance(e, OSError) else OSError(errno.ENOSPC, str(e)), path, what, needed)


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


def link_tree(src: str, dst: str, names: Iterable[str] | None = None) -> None:
    """Put the regular files directly in ``src`` (only those in ``names``, when given) into the
    new private directory ``dst``: hard links on the same file system (images are never modified
    in place), else copies."""
    os.makedirs(dst, mode=0o700)
    for name in os.listdir(src) if names is None else names:
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

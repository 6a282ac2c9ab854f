"""Private directories: each copy of an env sees its own files at the same paths.

``ForkableEnv(..., private_dirs=["/srv/app", "/var/lib/app"])`` (root, criu backend) declares
directories the env works in anywhere on the machine, without being told where (unlike
``workspace=``, whose branches live at ``DIR.branch-<id>``).  Every worker -- the first, and each
one a ``restore()`` or ``fork()`` starts -- gets a mount namespace of its own in which each
declared directory is a bind mount of a private copy (of the real directory, or of the
snapshot's files; made by the controller in its session directory, see
:mod:`gym_fork.snapshots.private_dirs`), so files it writes or keeps open, unix sockets bound
there and the env's child processes all see that copy at the original path while its siblings
see theirs.  (A SQLite database held open across steps is the exception: SQLite notices the new
inode; the resources scan refuses it by name.)

This module is the worker's half: it remembers which directories are private (the resources scan
then counts files open there as captured by a CRIU dump, :func:`under_private`) and enters a
fresh mount namespace with the binds (:func:`enter`).  CRIU restores get the same namespace from
the wrapper that starts criu (:mod:`gym_fork.backends.criu`).

Why a bind of a full copy and not an overlay: an overlay upper directory cannot live inside its
lower one (``/``) and would need a tmpfs per worker that CRIU then has to dump; a copy in the
session directory keeps every capture a plain directory (``cp --reflink=auto``).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterable, Sequence

from gym_fork.worker.files import is_under

CLONE_NEWNS = 0x00020000
MS_BIND, MS_REC, MS_PRIVATE = 0x1000, 0x4000, 0x40000
MNT_DETACH = 2

#: the env's private directories (absolute, normalised); empty when it declared none
PRIVATE: tuple[str, ...] = ()


def set_private(dirs: Iterable[str]) -> None:
    """Remember the env's private directories (files open there are captured by CRIU dumps)."""
    global PRIVATE
    PRIVATE = tuple(os.path.normpath(d) for d in dirs)


def under_private(path: str) -> bool:
    """Whether ``path`` lies in one of the env's private directories."""
    return any(path == d or path.startswith(d + "/") for d in PRIVATE)


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]
    return libc


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def enter(binds: Sequence[tuple[str, str]]) -> None:
    """Move this process into a new mount namespace where each ``(source, target)`` directory
    pair is bound: ``target`` shows ``source``'s files.  Mounts do not propagate back to the
    namespace we came from (``/`` is made private first).  Needs ``CAP_SYS_ADMIN``; the process
    must be single-threaded (a fork-tier copy is)."""
    libc = _libc()
    cwd = _path_of("/proc/self/cwd")  # by path: the env may work inside a private directory
    _check(libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    _check(libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "making / private")
    for source, _target in binds:
        # A source may be covered in the namespace this copy inherited (a copy of a copy: its
        # parent showed another directory at the path that is now this copy's own workspace)
        for _ in range(16):
            if libc.umount2(os.fsencode(source), MNT_DETACH) != 0:
                break  # EINVAL: not a mount point (the usual case)
    for source, target in binds:
        # Take off the copy this process inherited (its parent's), so the new one sits on the
        # real directory: a bind stacked on the old copy would vanish when the controller deletes
        # that copy (the kernel detaches mounts whose mount point is removed, in every namespace).
        for _ in range(16):
            if libc.umount2(os.fsencode(target), MNT_DETACH) != 0:
                break  # EINVAL: no longer a mount point
        _check(libc.mount(os.fsencode(source), os.fsencode(target), None, MS_BIND | MS_REC, None),
               f"binding {source} on {target}")
    if cwd is not None and (under_private(cwd) or any(is_under(cwd, t) for _s, t in binds)):
        # The working directory, like a descriptor, still points into the copy this process
        # inherited (the previous worker's, deleted once that one was replaced): an env that
        # chdir'ed into its private directory must go on in its own copy, at the same path.
        try:
            os.chdir(cwd)
        except OSError:
            pass
    reopen_files()


def _path_of(link: str) -> str | None:
    """The path a ``/proc`` link names, also once the directory was removed (``" (deleted)"``:
    a private copy deleted after its worker was replaced, seen from a frozen snapshot's copy)."""
    try:
        path = os.readlink(link)
    except OSError:
        return None
    return path[: -len(" (deleted)")] if path.endswith(" (deleted)") else path


def reopen_files() -> None:
    """Open this process's files again by path, inside its new mount namespace.

    A descriptor opened before ``unshare(CLONE_NEWNS)`` still points into the old namespace's
    mounts, which CRIU (dumping from inside the new one) cannot find ("Can't lookup mount"), and a
    file in a private directory would still be the previous copy's.  Each regular file or device
    is reopened with its flags and offset, and so is a directory in a private directory (also
    one whose previous copy is gone: it is this copy's that the env must work in); unlinked
    files, pipes, sockets and anonymous inodes (which belong to no mount) are left alone."""
    import fcntl
    import stat

    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
            st = os.fstat(fd)
        except OSError:
            continue  # the listing's own descriptor
        if not target.startswith("/"):
            continue
        private_dir = stat.S_ISDIR(st.st_mode) and under_private(_path_of(f"/proc/self/fd/{fd}") or "")
        if private_dir:  # as the working directory (enter()): this copy's own, also once the old one is gone
            target = _path_of(f"/proc/self/fd/{fd}") or target
        elif target.endswith(" (deleted)") or not (stat.S_ISREG(st.st_mode) or stat.S_ISCHR(st.st_mode)):
            continue  # unlinked files, other directories (our listing's own), FIFOs and sockets stay
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        keep = flags & (os.O_ACCMODE | os.O_APPEND | os.O_NONBLOCK | getattr(os, "O_DIRECT", 0) | os.O_SYNC
                        | getattr(os, "O_PATH", 0) | os.O_DIRECTORY)
        try:
            new = os.open(target, keep | os.O_NOCTTY)
        except OSError:
            continue  # gone or not reopenable: CRIU says so by name if it is ever dumped
        try:
            if stat.S_ISREG(st.st_mode):
                os.lseek(new, os.lseek(fd, 0, os.SEEK_CUR), os.SEEK_SET)
            inheritable = os.get_inheritable(fd)
            cloexec = fcntl.fcntl(fd, fcntl.F_GETFD)
            os.dup2(new, fd, inheritable=inheritable)
            fcntl.fcntl(fd, fcntl.F_SETFD, cloexec)
        finally:
            os.close(new)

"""Private directories, the controller's half: capture at each snapshot, a copy per new worker.

``ForkableEnv(..., private_dirs=[DIR, ...])`` (root, criu backend; see
:mod:`gym_fork.worker.mounts` for the worker's half) captures every declared directory with each
snapshot and gives every worker a ``restore()`` or ``fork()`` starts its own copy of the captured
files, bound at the same paths in a mount namespace of the worker's own:

* **capture**: while the worker is blocked between requests, each directory is copied *as the
  worker sees it* (``/proc/<pid>/root/DIR``: a restored worker's view, not the host's) into
  ``<session>/pd-<snapshot id>/<i>`` with ``cp -a --reflink=auto``: byte for byte, SQLite files
  and their ``-wal``/``-shm`` included (a process restored with the database open must find the
  very file it had open, not a re-written backup of it).
* **every worker** -- the first (a copy of the real directories, made before the env is built),
  each ``restore()``, each ``fork()`` branch -- gets ``<session>/pdl-<random>/<i>``, a copy of
  the capture, and sees it at ``DIR``: the first worker's launcher and CRIU restores (criu runs
  in a new namespace with the binds, so the restored tree opens its files there) bind it before
  anything runs; a fork-tier copy enters a new mount namespace and binds it before its first
  request.  The copy is deleted when that worker is replaced or closed.  The real directories
  are the template every env starts from and are never written; read an env's files at
  :meth:`PrivateDirs.view` (``ForkableEnv.private_dir_view``).

Costs: a full copy per snapshot and per new worker (reflinks where the file system has them),
so keep private directories small (an app tree, a database), not a dataset.

Persisted (``Snapshot.save``, a ``SnapshotStore``): the capture goes into ``private_dirs/<i>/`` of
the bundle, listed in the HMAC-covered ``bundle.json`` -- every file's size, sha256, mode and
mtime, directories, symlinks, FIFOs, each directory's own mode and mtime (:func:`pack`); a
loaded snapshot gets a verified private capture (:func:`adopt`) and restores, like one taken
here, into an env made with the same ``private_dirs`` (``env.restore``, ``env.fork``,
``ForkableEnv.from_snapshot(snap, private_dirs=...)``).  Not carried: unix socket *nodes* (a
restored server binds its path again), owners (files come back owned by the loading user),
devices (refused by path).  Migration of such envs is refused by name
(:class:`~gym_fork.errors.UnsupportedEnvError`).

What a copy cannot be: the *same inode* as its origin.  Programs that remember the inode of a file
they keep open notice (SQLite refuses to write: "attempt to write a readonly database"), so a
SQLite database held open across steps is refused by name (connect per step instead).  Files the
env's processes change *between* requests (a server flushing on a timer) are copied as they are
at that moment; capture is exact for envs whose files change only while they serve a request.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import weakref
from collections.abc import Iterable, Sequence

from gym_fork.snapshots import sessiondir, workspace


def normalise(dirs: str | Iterable[str] | None) -> tuple[str, ...]:
    """Validate ``private_dirs=``: existing absolute directories, none inside another.

    Raises:
        TypeError: not a path or a list of paths.
        ValueError: a path that is relative, missing, not a directory, ``/``, or nested.
    """
    if dirs is None:
        return ()
    if isinstance(dirs, (str, os.PathLike)):
        dirs = [dirs]
    if not isinstance(dirs, Iterable):
        raise TypeError(f"private_dirs must be a directory or a list of directories, not {type(dirs).__name__}")
    out: list[str] = []
    for d in dirs:
        if not isinstance(d, (str, os.PathLike)):
            raise TypeError(f"private_dirs entries must be paths (str), not {type(d).__name__}: {d!r}")
        p = os.fspath(d)
        if not os.path.isabs(p):
            raise ValueError(f"private_dirs entry {p!r} is relative: pass an absolute path (a restored worker "
                             "may run in another working directory)")
        p = os.path.realpath(p)
        if p == "/":
            raise ValueError("private_dirs cannot hold '/': name the directories the env writes in")
        if not os.path.isdir(p):
            raise ValueError(f"private_dirs entry {p} is not an existing directory: create it first")
        if p in out:
            continue
        for q in out:
            if p.startswith(q + "/") or q.startswith(p + "/"):
                raise ValueError(f"private_dirs entries {q} and {p} are nested: keep only the outer one")
        out.append(p)
    root = os.path.realpath(sessiondir.session_dir())
    for p in out:
        if root == p or root.startswith(p + "/"):
            raise ValueError(f"private_dirs entry {p} holds gym_fork's session directory {root}: pick a "
                             "directory below it, or set $GYM_FORK_DIR elsewhere")
    return tuple(out)


def _copy(src: str, dst: str) -> None:
    """``dst`` (new) becomes a byte-exact copy of the directory ``src``: modes, owners, times,
    links; reflinks where the file system has them."""
    os.makedirs(os.path.dirname(dst), mode=0o700, exist_ok=True)
    r = subprocess.run(["cp", "-a", "--reflink=auto", "-T", "--", src, dst], capture_output=True, text=True)
    if r.returncode != 0:
        raise OSError(f"copying {src} to {dst} failed: {r.stderr.strip()}")


class PrivateDirs:
    """One env's private directories and where its current worker sees them on the host.

    Users write ``ForkableEnv(make_env, private_dirs=[d])`` (as root); what the env does with it:

    Example:
        >>> import os, tempfile
        >>> d = tempfile.mkdtemp()
        >>> pd = PrivateDirs(normalise([d]))
        >>> root, binds = pd.new_copy(None)     # a copy of the real directory, for one new worker
        >>> binds == [(os.path.join(root, "0"), os.path.realpath(d))]   # (host copy, path it is seen at)
        True
        >>> pd.switch(root)                     # that worker runs now: the env's files are there
        >>> pd.view(d) == binds[0][0]
        True
        >>> pd.discard()                        # the worker is gone: so is its copy
        >>> os.path.exists(root)
        False
        >>> os.rmdir(d)
    """

    def __init__(self, dirs: Sequence[str]):
        self.dirs = tuple(dirs)
        self.copy_root: str | None = None  # <session>/pdl-*: the current worker's copies (None: the real dirs)

    def capture(self, pid: int, snap_id: str) -> str:
        """Copy every directory as worker ``pid`` sees it; returns the capture's directory."""
        dst = os.path.join(sessiondir.session_dir(), f"pd-{sessiondir.check_id(snap_id)}")
        tmp = dst + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            sessiondir.private_mkdir(tmp)
            for i, d in enumerate(self.dirs):
                _copy(f"/proc/{pid}/root{d}", os.path.join(tmp, str(i)))
                workspace.record_order(f"/proc/{pid}/root{d}", os.path.join(tmp, str(i)))
            os.rename(tmp, dst)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return dst

    def new_copy(self, captured: str | None) -> tuple[str, list[tuple[str, str]]]:
        """A fresh copy of ``captured`` (None: of the real directories) for one new worker:
        ``(its root, [(copy, DIR), ...])``."""
        root = os.path.join(sessiondir.session_dir(), f"pdl-{os.urandom(6).hex()}")
        try:
            sessiondir.private_mkdir(root)
            binds = []
            for i, d in enumerate(self.dirs):
                _copy(d if captured is None else os.path.join(captured, str(i)), os.path.join(root, str(i)))
                if captured is not None:  # listed as the worker's copy listed at the capture
                    workspace.put_in_order(os.path.join(root, str(i)), os.path.join(captured, str(i)))
                binds.append((os.path.join(root, str(i)), d))
        except BaseException:
            shutil.rmtree(root, ignore_errors=True)
            raise
        return root, binds

    def switch(self, root: str | None) -> None:
        """The env's worker now sees ``root``'s copies (None: the real directories); the previous
        worker's copies are deleted (that worker is gone)."""
        old, self.copy_root = self.copy_root, root
        if old is not None and old != root:
            shutil.rmtree(old, ignore_errors=True)

    def view(self, d: str) -> str:
        """Where the current worker's ``d`` is on the host (``d`` itself for the first worker)."""
        d = os.path.realpath(d)
        if d not in self.dirs:
            raise KeyError(f"{d} is not one of this env's private_dirs {list(self.dirs)}")
        return d if self.copy_root is None else os.path.join(self.copy_root, str(self.dirs.index(d)))

    def discard(self) -> None:
        self.switch(None)


def attach(snap, pd: PrivateDirs, pid: int) -> None:
    """Capture ``pd`` for ``snap`` (worker ``pid``); the capture goes when the snapshot does."""
    snap.private_dirs = pd.capture(pid, snap.id)
    snap.private_dirs_paths = pd.dirs
    snap._file_finalizers = (*snap._file_finalizers, weakref.finalize(snap, shutil.rmtree, snap.private_dirs, True))


def pack(snap, dest: str) -> list[dict]:
    """Write ``snap``'s captured private directories into the new directory ``dest`` (a bundle's
    or store entry's ``private_dirs/``); returns their signed list, one entry per directory:
    ``{"path", "mode", "mtime_ns", "fifos", "files": <workspace manifest with times>}``.

    Raises:
        UnsupportedEnvError: a device node in a private directory (its state is the device's).
    """
    import stat

    from gym_fork.errors import UnsupportedEnvError
    from gym_fork.snapshots import workspace

    out = []
    sessiondir.private_mkdir(dest)
    for i, d in enumerate(snap.private_dirs_paths):
        src = os.path.join(snap.private_dirs, str(i))
        fifos, devices = {}, []
        for top, dirs, names in os.walk(src):  # what is neither file, directory nor link
            for name in dirs + names:
                st = os.lstat(os.path.join(top, name))
                rel = os.path.relpath(os.path.join(top, name), src)
                if stat.S_ISFIFO(st.st_mode):
                    fifos[rel] = {"mode": stat.S_IMODE(st.st_mode), "mtime_ns": st.st_mtime_ns}
                elif stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
                    devices.append(os.path.join(d, rel))
                # a socket node is left behind: its server binds the path again
        if devices:
            raise UnsupportedEnvError(f"snapshot {snap.id} cannot be saved: its private directory {d} holds "
                                      f"device nodes ({', '.join(devices[:3])}), whose state is the device's")
        root = os.lstat(src)
        files = workspace.pack(src, os.path.join(dest, str(i)), times=True)
        out.append({"path": d, "mode": stat.S_IMODE(root.st_mode), "mtime_ns": root.st_mtime_ns,
                    "fifos": fifos, "files": files})
    return out


def check_signed(entries, what: str) -> list[dict]:
    """``entries`` (the signed ``private_dirs`` of a bundle) unchanged if well-formed, else
    SnapshotCorruptedError: absolute, distinct directories, integer modes and times."""
    from gym_fork.errors import SnapshotCorruptedError

    ok = isinstance(entries, list) and entries
    paths = []
    for e in entries if ok else ():
        ok = (isinstance(e, dict) and isinstance(e.get("path"), str) and os.path.isabs(e["path"])
              and os.path.normpath(e["path"]) == e["path"] and e["path"] != "/"
              and type(e.get("mode")) is int and type(e.get("mtime_ns")) is int
              and isinstance(e.get("fifos"), dict)
              and all(isinstance(f, dict) and type(f.get("mode")) is int and type(f.get("mtime_ns")) is int
                      for f in e["fifos"].values())
              and isinstance(e.get("files"), dict))
        if not ok:
            break
        paths.append(e["path"])
    if not ok or len(set(paths)) != len(paths):
        raise SnapshotCorruptedError(f"{what}: its signed private_dirs list is malformed; nothing was loaded")
    return entries


def adopt(snap, src: str, entries: list[dict] | None, what: str) -> None:
    """Give a loaded ``snap`` the private directories packed at ``src`` (a bundle's
    ``private_dirs/``), verified into a new capture of its own (removed with the snapshot)."""
    if not entries:
        return
    from gym_fork.snapshots import workspace

    check_signed(entries, what)
    root = os.path.join(sessiondir.session_dir(), f"pd-load-{os.urandom(6).hex()}")
    try:
        sessiondir.private_mkdir(root)
        for i, e in enumerate(entries):
            dst = os.path.join(root, str(i))
            workspace.unpack(os.path.join(src, str(i)), e["files"], f"{what}, private directory {e['path']}", dst)
            for rel, f in e["fifos"].items():
                fifo = os.path.join(dst, workspace.check_rel(rel))
                os.mkfifo(fifo)
                os.chmod(fifo, f["mode"] & 0o7777)  # not the umask's
                os.utime(fifo, ns=(f["mtime_ns"], f["mtime_ns"]))
            for rel in e["fifos"]:  # the FIFOs changed their directories' times: put them back
                parent = os.path.dirname(rel)
                t = e["files"].get("times", {}).get(parent) if parent else None
                if t is not None:
                    os.utime(os.path.join(dst, parent), ns=(t, t))
            os.chmod(dst, e["mode"] & 0o7777)
            os.utime(dst, ns=(e["mtime_ns"], e["mtime_ns"]))
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    snap.private_dirs = root
    snap.private_dirs_paths = tuple(e["path"] for e in entries)
    snap._file_finalizers = (*getattr(snap, "_file_finalizers", ()), weakref.finalize(snap, shutil.rmtree, root, True))


def remove(roots: Iterable[str]) -> None:
    """Delete copies made for workers that never started (a failed restore or fork)."""
    for r in roots:
        shutil.rmtree(r, ignore_errors=True)

"""Workspace capture: the files an env works in, snapshotted together with its process.

CRIU captures process memory, not file contents.  ``ForkableEnv(..., workspace=DIR)`` makes every
snapshot also capture ``DIR``; ``restore()`` puts that content back, and every ``fork()`` child
gets its own copy of it in a new directory.

The contract with the env (the simplest one that works with CRIU restores, where the paths of
open files are fixed):

* the env opens workspace files only *during* a step (``with open(...)``, a SQLite connection
  per step) and holds no workspace file open between steps;
* it finds its workspace through an attribute ``workspace`` (an absolute path) on its
  ``unwrapped`` env.  ``restore()`` keeps the same path and swaps the directory's *content*;
  a ``fork()`` child gets a new directory ``DIR.branch-<id>`` and gym_fork sets the child's
  ``env.unwrapped.workspace`` to it (``setattr`` command) before returning the child.

Capture happens while the worker is blocked between requests, so the files are quiescent.
Copies use ``cp -a --reflink=auto`` (copy-on-write clones where the file system supports them,
otherwise real copies: later in-place writes in the live directory can never alter a capture, as
they could with hard links).  SQLite databases (``*.db``, ``*.sqlite``, ``*.sqlite3``) are
captured with SQLite's online backup API, which yields a consistent, self-contained database
(committed data only, WAL folded in) even if the env left a connection or transaction open;
their ``-wal``/``-shm``/``-journal`` files are not copied.  Captures live in the private session
directory and are deleted when their snapshot is released.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess

from gym_fork import store

SQLITE_SUFFIXES = (".db", ".sqlite", ".sqlite3")
SQLITE_SIDE = ("-wal", "-shm", "-journal")


def _is_sqlite_side(name: str) -> bool:
    return any(name.endswith(s + side) for s in SQLITE_SUFFIXES for side in SQLITE_SIDE)


def copy_tree(src: str, dst: str) -> None:
    """Copy ``src``'s content into the (new or empty) directory ``dst``; SQLite via backup."""
    os.makedirs(dst, mode=0o700, exist_ok=True)
    names = [n for n in os.listdir(src) if not _is_sqlite_side(n)]
    if names:
        subprocess.run(["cp", "-a", "--reflink=auto", "--", *[os.path.join(src, n) for n in names], dst],
                       check=True, capture_output=True)
    for root, _dirs, files in os.walk(src):
        for name in files:
            rel = os.path.relpath(os.path.join(root, name), src)
            if _is_sqlite_side(name):
                side = os.path.join(dst, rel)
                if os.path.exists(side):
                    os.unlink(side)
            elif name.endswith(SQLITE_SUFFIXES):
                backup_sqlite(os.path.join(root, name), os.path.join(dst, rel))


def backup_sqlite(src: str, dst: str) -> None:
    if os.path.exists(dst):
        os.unlink(dst)
    s = sqlite3.connect(f"file:{src}?mode=ro", uri=True)
    try:
        d = sqlite3.connect(dst)
        try:
            s.backup(d)
        finally:
            d.close()
    except sqlite3.DatabaseError:  # not really a database: the plain copy stays
        shutil.copy2(src, dst)
    finally:
        s.close()


def clear_dir(path: str) -> None:
    for name in os.listdir(path):
        p = os.path.join(path, name)
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p)
        else:
            os.unlink(p)


class Workspace:
    """The live directory of one env (see the module docstring for the contract)."""

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        os.makedirs(self.path, exist_ok=True)

    def capture(self, snap_id: str) -> str:
        dst = os.path.join(store.session_dir(), f"ws-{store.check_id(snap_id)}")
        tmp = dst + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        copy_tree(self.path, tmp)
        os.rename(tmp, dst)
        return dst

    def restore_from(self, captured: str) -> None:
        """Make the live directory's content exactly ``captured`` (same path)."""
        clear_dir(self.path)
        copy_tree(captured, self.path)

    def branch(self, captured: str, tag: str) -> "Workspace":
        """A new directory next to this one, holding a copy of ``captured``."""
        path = f"{self.path}.branch-{tag}"
        shutil.rmtree(path, ignore_errors=True)
        copy_tree(captured, path)
        return Workspace(path)


def attach(snap, ws: Workspace) -> None:
    """Capture ``ws`` for ``snap``; the capture is deleted when the snapshot goes away."""
    import weakref

    snap.workspace = ws.capture(snap.id)
    weakref.finalize(snap, shutil.rmtree, snap.workspace, True)

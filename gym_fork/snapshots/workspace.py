"""Workspace capture: the files an env works in, snapshotted together with its process.

CRIU captures process memory, not file contents.  ``ForkableEnv(..., workspace=DIR)`` makes every
snapshot also capture ``DIR``; ``restore()`` puts that content back, and every ``fork()`` child
gets its own copy of it in a new directory.

The contract with the env (the simplest one that works with CRIU restores, where the paths of
open files are fixed):

* the env opens workspace files only *during* a step (``with open(...)``, a SQLite connection
  per step) and holds no workspace file open between steps, for writing or for reading (the
  worker's scan refuses a snapshot while it does: a descriptor names the original's file, not the
  copy a restore or fork puts back);
* the workspace is self-contained: a symlink in it that names a workspace file does so by a
  relative path inside it (``ln -s data.txt current``; one by the workspace's absolute path
  would lead every branch back into the original), and no file in it is hard-linked to a file
  outside it (a copy separates the two names).  A capture refuses either by name
  (:func:`check_capturable`); a symlink to a path outside the workspace is copied as it is
  (writes through it are files outside the workspace, refused as such);
* it finds its workspace through an attribute ``workspace`` (an absolute path) on its
  ``unwrapped`` env.  ``restore()`` keeps the same path and swaps the directory's *content*
  (the processes the env started, restored with it, run again only once it is back: a tool
  that works on its own, a file watcher, never sees the files of the trajectory being left);
  a ``fork()`` child gets a new directory ``DIR.branch-<id>`` and gym_fork sets the child's
  ``env.unwrapped.workspace`` to it (``setattr`` command) before returning the child.  A child's
  working directory inside ``DIR`` follows it there (an env that ``chdir``ed into its workspace
  works by relative paths).  As root (the criu backend), every copy also runs in a mount
  namespace of its own where ``DIR`` -- and every other path the snapshot's processes knew the
  workspace by -- shows the copy's own directory (:func:`binds_for`): a path the env derived
  once, a tool server started in the workspace or given its path (restored with the process
  tree) all work in the copy's files.  Without root a path the env derived from ``DIR`` before
  it was copied is refused when it is used (``ForeignWorkspaceError`` from the audit hook,
  :mod:`gym_fork.worker.files`), and a copy whose tree holds a process started there or given
  that path is refused when it is made (``UnsupportedEnvError``), so no copy ever reads or
  writes another env's directory.

Capture happens while the worker is blocked between requests, so the files are quiescent: the
env holds none of them open for writing (a worker's scan refuses a snapshot of one that does; the
pickle backend cannot pickle an open connection), and no process of its tree writes.  Copies use
``cp -a --reflink=auto`` (copy-on-write clones where the file system supports them, otherwise
real copies: later in-place writes in the live directory can never alter a capture, as they could
with hard links): byte for byte, SQLite databases with their ``-wal``/``-shm``/``-journal`` files
as they are, so a restored env finds the very bytes it left (a database rewritten by SQLite's
backup API holds the same rows but other bytes: a new change counter in its header, its WAL folded
in).  Captures live in the private session directory and are deleted when their snapshot is
released.

Branch directories: a ``fork()`` child's ``DIR.branch-<id>`` is deleted when that child is closed
(or garbage-collected without ``close()``), unless ``fork(..., keep_workspace=True)`` or
``child.close(keep_workspace=True)``.  The directory passed as ``workspace=`` is never deleted.

Captures, restores and branches keep every entry's mode and times, the workspace directory's own
included (an env that lists its workspace, ``.`` and all, sees what it saw at the snapshot), and
the order in which each directory lists its entries: ``os.listdir``, ``os.walk``, ``glob`` and
``find`` list them unsorted, in an order the file system keeps -- on tmpfs (``/tmp`` on many
distributions) the order they were created in, which a copy does not reproduce (measured: a
restored workspace on tmpfs listed 6 files in another order, on every backend).  A capture
records each directory's order beside it (``<capture>.order.json``); a restore or branch whose
copy lists differently moves the entries of that directory out and back in the order that lists
like the capture (the entries themselves, their inodes and times stay; the directory's times are
put back).  Where the file system orders entries by itself (ext4 by a hash of the name, seeded
per file system: another machine) that cannot be done, and a ``RuntimeWarning`` says so.

Persistence: ``Snapshot.save`` and a ``SnapshotStore`` entry hold the capture in ``workspace/``,
listed (size, sha256, mode of every file; directories; symlink targets; every entry's mtime and
the directory's own mode and mtime) in the HMAC-covered ``bundle.json``; a loaded snapshot gets a verified private copy, which ``env.restore(snap)`` or
``ForkableEnv.from_snapshot(snap, workspace=DIR)`` puts into the env's workspace (a restored
process whose workspace was elsewhere is pointed at the env's directory).  Inside a bundle the
files are 0600 and directories 0700; the original modes are put back when loading.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import warnings

from gym_fork.snapshots import sessiondir
from gym_fork.errors import SnapshotCorruptedError

#: beside a capture ``C``: ``C + ORDER``, every directory's entries in the order it lists them
ORDER = ".order.json"


def listing_order(root: str) -> dict[str, list[str]]:
    """Every directory under ``root`` (``""``: root itself; links not followed) -> its entries
    in the order the file system lists them."""
    out: dict[str, list[str]] = {}
    todo = [""]
    while todo:
        rel = todo.pop()
        d = os.path.join(root, rel) if rel else root
        try:
            with os.scandir(d) as it:  # (readdir order, as listdir; the entry types without a stat each)
                entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
        except OSError:
            continue
        out[rel] = [n for n, _ in entries]
        todo += [os.path.join(rel, n) if rel else n for n, is_dir in entries if is_dir]
    return out


def record_order(live: str, captured: str) -> None:
    """Note beside ``captured`` how the directories of ``live`` (what it is a copy of) list."""
    with open(os.open(captured + ORDER, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600), "w") as f:
        json.dump(listing_order(live), f)


def read_order(captured: str) -> dict[str, list[str]] | None:
    try:
        with open(captured + ORDER) as f:
            order = json.load(f)
    except (OSError, ValueError):
        return None
    return order if _order_ok(order) else None


def _order_ok(order: object) -> bool:
    return isinstance(order, dict) and all(
        isinstance(rel, str) and isinstance(names, list) and all(isinstance(n, str) and n and "/" not in n
                                                                 and n not in (".", "..") for n in names)
        for rel, names in order.items())


def drop_capture(captured: str) -> None:
    shutil.rmtree(captured, ignore_errors=True)
    try:
        os.unlink(captured + ORDER)
    except OSError:
        pass


def put_in_order(root: str, captured: str, order: dict[str, list[str]] | None = None) -> None:
    """Make every directory of ``root`` (a copy of ``captured``) list its entries as the
    capture's original did (``order``: as given instead); a RuntimeWarning names those the file
    system would not reorder."""
    if order is None:
        order = read_order(captured)
    if not order:
        return
    stuck = []
    for rel in sorted(order, key=lambda r: r.count(os.sep), reverse=True):  # (deepest first: times below settle)
        want = order[rel]
        d = os.path.join(root, check_rel(rel)) if rel else root
        try:
            have = os.listdir(d)
        except OSError:
            continue
        if have == want or sorted(have) != sorted(want):
            continue
        if not _reorder(d, want):
            stuck.append(rel or ".")
        shutil.copystat(os.path.join(captured, rel) if rel else captured, d)  # (the moves changed its times)
    if stuck:
        warnings.warn(
            f"{len(stuck)} director{'ies' if len(stuck) > 1 else 'y'} of {root} ({', '.join(stuck[:3])}) list their "
            "entries in another order than at the snapshot: this file system orders entries by itself (by a hash "
            "of the name, seeded per file system: the snapshot was taken on another one). An env that lists them "
            "unsorted (os.listdir, os.walk, find) sees another order than the original did.", RuntimeWarning,
            stacklevel=3)


def _reorder(d: str, want: list[str]) -> bool:
    """Move ``d``'s entries out and back in, in the order that makes it list as ``want``: the
    reverse of it (tmpfs lists the newest first) or, failing that, ``want`` itself."""
    aside = os.path.join(d, f".gym_fork-order-{os.urandom(4).hex()}")
    os.mkdir(aside, 0o700)
    try:
        for n in want:
            os.rename(os.path.join(d, n), os.path.join(aside, n))
        for attempt in (want[::-1], want):
            for n in attempt:
                os.rename(os.path.join(aside, n), os.path.join(d, n))
            if [n for n in os.listdir(d) if n != os.path.basename(aside)] == want:
                return True
            if attempt is not want:
                for n in want:
                    os.rename(os.path.join(d, n), os.path.join(aside, n))
        return False
    finally:  # whatever happened, every entry ends up back in d (only their order may differ)
        for n in os.listdir(aside):
            os.rename(os.path.join(aside, n), os.path.join(d, n))
        os.rmdir(aside)

def copy_tree(src: str, dst: str) -> None:
    """Copy ``src``'s content into the (new or empty) directory ``dst``, byte for byte.

    ``dst`` ends with ``src``'s own mode and times, and every entry in it with its source's, so
    an env that lists its workspace (``ls -la``: ``.`` included) or hashes a file in it
    (``sha256sum app.db``, ``git status``) sees what it saw at the snapshot."""
    os.makedirs(dst, mode=0o700, exist_ok=True)
    names = os.listdir(src)
    if names:
        subprocess.run(["cp", "-a", "--reflink=auto", "--", *[os.path.join(src, n) for n in names], dst],
                       check=True, capture_output=True)
    shutil.copystat(src, dst)  # cp copied what is in src, not src itself


def _under(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def _leaves_and_comes_back(rel: str, target: str) -> bool:
    """Whether the relative link target ``target`` of the entry ``rel`` (relative to the
    workspace root) climbs out of the workspace on its way (``../ws/data.txt``), read lexically."""
    depth = len([c for c in os.path.dirname(rel).split("/") if c])
    for c in target.split("/"):
        if c in ("", "."):
            continue
        if c == "..":
            depth -= 1
            if depth < 0:
                return True
        else:
            depth += 1
    return False


def check_capturable(root: str) -> None:
    """Refuse a workspace that a copy cannot reproduce as an independent directory.

    * A symlink whose target names the workspace by its own path (``ln -s $PWD/data.txt
      current``: an absolute path into it, or a relative one that climbs out of it and back in)
      is copied as it is: in every ``fork()`` branch (``DIR.branch-<id>``) and in a workspace a
      bundle is loaded into it still names the *original's* file, and each copy would write
      there.  A relative link inside the workspace (``ln -s data.txt current``) is copied right.
    * A writable regular file with more links (``st_nlink``) than it has names in the workspace is
      hard-linked to a file outside it: the capture copies its content, after which the two names
      are separate files, and what the env writes through one no longer shows through the other.
      (A read-only one, such as the git objects a local ``git clone`` links, is not written
      through either name: it is kept.)

    Raises:
        UncapturableStateError: naming each such entry and what to do instead.
    """
    import stat

    from gym_fork.errors import UncapturableStateError

    root = os.path.normpath(os.path.abspath(root))
    real = os.path.realpath(root)
    homes = (root,) if real == root else (root, real)
    links: list[str] = []
    inodes: dict[tuple[int, int], list] = {}  # (dev, ino) -> [st_nlink, names in the workspace]
    todo = [""]
    while todo:
        rel = todo.pop()
        d = os.path.join(root, rel) if rel else root
        try:
            it = os.scandir(d)
        except OSError:
            continue
        with it:
            for e in it:
                name = os.path.join(rel, e.name) if rel else e.name
                try:
                    if e.is_symlink():
                        target = os.readlink(e.path)
                        if os.path.isabs(target):
                            if any(_under(os.path.normpath(target), h) for h in homes):
                                links.append(f"{name} -> {target}")
                        elif _leaves_and_comes_back(name, target) and _under(
                                os.path.normpath(os.path.join(root, os.path.dirname(name), target)), root):
                            links.append(f"{name} -> {target}")
                    elif e.is_dir(follow_symlinks=False):
                        todo.append(name)
                    elif e.is_file(follow_symlinks=False):
                        st = e.stat(follow_symlinks=False)
                        # (read-only files are left out: a git object that `git clone` linked from a
                        # local repository is never written, so separating its names changes nothing)
                        if st.st_nlink > 1 and stat.S_ISREG(st.st_mode) and st.st_mode & 0o222:
                            inodes.setdefault((st.st_dev, st.st_ino), [st.st_nlink, []])[1].append(name)
                except OSError:
                    continue  # gone meanwhile: not in the capture either
    hard = [names for nlink, names in inodes.values() if nlink > len(names)]
    problems, fixes = [], []
    if links:
        problems.append(f"{len(links)} symlink{'s' if len(links) > 1 else ''} naming the workspace by its own "
                        f"path ({', '.join(sorted(links)[:5])}{', ...' if len(links) > 5 else ''}), which every "
                        "fork() branch and every workspace a saved snapshot is loaded into would follow back into "
                        f"{root}")
        fixes.append("make such a link relative and inside the workspace (os.symlink('data.txt', "
                     "os.path.join(self.workspace, 'current')), ln -s data.txt current), so each copy's link "
                     "names that copy's file")
    if hard:
        shown = sorted(", ".join(sorted(names)) for names in hard)
        problems.append(f"{len(hard)} file{'s' if len(hard) > 1 else ''} hard-linked to a file outside the "
                        f"workspace ({'; '.join(shown[:5])}{'; ...' if len(shown) > 5 else ''}), whose other "
                        "name a restore or fork would separate from the copy it puts back")
        fixes.append("copy the file into the workspace instead of linking it (shutil.copy2), or keep every "
                     "name of it inside the workspace (tools that hard-link by themselves: git clone of a local "
                     "repository, use --no-hardlinks; uv, set UV_LINK_MODE=copy)")
    if problems:
        raise UncapturableStateError(
            f"gym_fork cannot snapshot this env exactly: its workspace {root} holds " + "; and ".join(problems)
            + ". To fix: " + " | ".join(fixes) + ". No snapshot was kept; the env keeps running.")


def _prune(src: str, dst: str) -> None:
    """Remove from ``dst`` everything but the directories that ``src`` has as directories too
    (recursively), so that copying ``src`` into it then leaves exactly ``src``'s content."""
    for name in os.listdir(dst):
        d, s_ = os.path.join(dst, name), os.path.join(src, name)
        if os.path.isdir(d) and not os.path.islink(d):
            if os.path.isdir(s_) and not os.path.islink(s_):
                _prune(s_, d)
            else:
                shutil.rmtree(d)
        else:
            os.unlink(d)


class Workspace:
    """The live directory of one env (see the module docstring for the contract).

    ``owned``: gym_fork made this directory (a fork branch) and deletes it when the env that
    works in it is closed, unless ``keep`` is set."""

    def __init__(self, path: str, *, owned: bool = False, keep: bool = False):
        self.path = os.path.abspath(path)
        self.owned = owned
        self.keep = keep
        os.makedirs(self.path, exist_ok=True)

    def discard(self, *, force: bool = False) -> None:
        """Delete the directory if gym_fork made it (a branch) and nobody asked to keep it
        (``force``: kept or not -- a branch whose env was never made)."""
        if self.owned and (force or not self.keep):
            shutil.rmtree(self.path, ignore_errors=True)

    def capture(self, snap_id: str) -> str:
        """Copy the live directory into a new capture for snapshot ``snap_id``; returns its path.

        Raises:
            UncapturableStateError: the directory holds what no copy of it reproduces (see
                :func:`check_capturable`); nothing was copied."""
        check_capturable(self.path)
        dst = os.path.join(sessiondir.session_dir(), f"ws-{sessiondir.check_id(snap_id)}")
        tmp = dst + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        copy_tree(self.path, tmp)
        record_order(self.path, dst)
        os.rename(tmp, dst)
        return dst

    def restore_from(self, captured: str) -> None:
        """Make the live directory's content exactly ``captured`` (same path). A directory in
        both stays the same directory (its content replaced): the restored process's working
        directory or directory descriptor there -- a fork-tier copy's is the original's, a CRIU
        restore reopened it by path just before -- keeps naming it."""
        _prune(captured, self.path)
        copy_tree(captured, self.path)
        put_in_order(self.path, captured)

    def make_missing_dirs(self, captured: str) -> list[str]:
        """Create (empty) each directory of ``captured`` that the live directory lacks, before a
        restore that reopens paths (CRIU): a restored process whose working directory, or a
        directory it holds open, was ``DIR/sub`` is reopened at that path -- missing (the
        trajectory being left renamed or deleted it; a fresh directory for ``from_snapshot()``)
        the restore failed, though the snapshot was whole.  :meth:`restore_from` then fills them
        in, modes and times included.  Returns the created ones, outermost first, for
        :func:`remove_dirs` should the restore fail."""
        made: list[str] = []
        for d, dirs, _files in os.walk(captured):
            rel = os.path.relpath(d, captured)
            for name in dirs:
                target = os.path.normpath(os.path.join(self.path, rel, name))
                if not os.path.lexists(target):
                    st = os.lstat(os.path.join(d, name))
                    try:
                        os.mkdir(target, 0o700)
                    except OSError:
                        continue  # (under a path that is not a directory here: criu says which)
                    made.append(target)
                    # criu checks a reopened directory's mode (and the owner is part of what it was)
                    os.chmod(target, st.st_mode & 0o7777)
                    if os.geteuid() == 0:
                        os.chown(target, st.st_uid, st.st_gid)
        return made

    def branch(self, captured: str, tag: str, *, keep: bool = False) -> "Workspace":
        """A new directory next to this one, holding a copy of ``captured`` (deleted when the
        branch env is closed unless ``keep``)."""
        path = f"{self.path}.branch-{tag}"
        shutil.rmtree(path, ignore_errors=True)
        copy_tree(captured, path)
        put_in_order(path, captured)
        return Workspace(path, owned=True, keep=keep)


def remove_dirs(made: list[str]) -> None:
    """Undo :meth:`Workspace.make_missing_dirs` (innermost first; a directory something was put
    into meanwhile is left)."""
    for d in reversed(made):
        try:
            os.rmdir(d)
        except OSError:
            pass


def attach(snap, ws: Workspace, aliases: tuple[str, ...] = ()) -> None:
    """Capture ``ws`` for ``snap``; the capture is deleted when the snapshot goes away.  Where
    the workspace cannot be captured (:func:`check_capturable`) the snapshot is released and
    the error raised: no snapshot exists whose files would come back wrong.  ``aliases``: the
    other paths the worker shows its workspace at (:func:`binds_for`)."""
    import weakref

    try:
        snap.workspace = ws.capture(snap.id)
    except BaseException:
        snap.release()
        raise
    snap.workspace_path = ws.path
    snap.workspace_aliases = tuple(a for a in aliases if a != ws.path)
    weakref.finalize(snap, drop_capture, snap.workspace)


# --- where a copy's processes look for their workspace ------------------------------------------
#
# A copy's worker is told its new directory (``setattr workspace``), but the processes the env
# started know the workspace by the path they were given: a tool server started with
# ``cwd=workspace``, a path in its arguments or environment, a path the env derived once.  Restored
# by CRIU (or cloned), they would go on working in the directory the snapshot was captured from --
# another env's, silently.  So as root every copy runs in a mount namespace of its own in which
# each such path shows the copy's own directory (``gym_fork.worker.mounts.enter``; a CRIU restore
# is born in it).  A snapshot remembers those paths (``workspace_aliases``) so that a copy of a
# copy binds them all.


def aliases_of(snap) -> tuple[str, ...]:
    """Every path the processes of ``snap`` may know its workspace by: the directory it was
    captured from and the paths its worker was shown that directory at."""
    origin = getattr(snap, "workspace_path", None)
    out = [origin] if origin else []
    out += [a for a in getattr(snap, "workspace_aliases", None) or () if a not in out]
    return tuple(out)


def binds_for(snap, own: str) -> list[tuple[str, str]]:
    """``(own, alias)`` for each path the processes of ``snap`` may know its workspace by that is
    not ``own``: a worker restored from ``snap`` into the workspace ``own`` sees ``own`` there.
    One inside ``own`` or around it is left out, as is one where something other than a
    directory now is.  A path that no longer exists -- the original workspace deleted, or a
    bundle loaded on another machine -- is made (an empty directory, 0700, with any missing
    parents) to bind on: without it the copy's tools found no directory there (a tool server's
    working directory: the CRIU restore failed) or its derived paths were refused.  It stays,
    empty, after the copy is gone: removing a mount point would detach the bind in every copy's
    namespace.  (Called only where workers get mount namespaces: as root.)"""
    own = os.path.abspath(own)
    out = []
    for a in aliases_of(snap):
        if a == own or _under(a, own) or _under(own, a):
            continue
        if not os.path.lexists(a):
            try:
                os.makedirs(a, 0o700, exist_ok=True)
            except OSError:
                continue  # (under a file, or not ours to create: the copy fails there, loudly)
        if os.path.isdir(a) and not os.path.islink(a):
            out.append((own, a))
    return out


# --- persistence: a capture inside a bundle or a SnapshotStore entry --------------------------------
#
# ``pack`` copies a capture into ``DIR/workspace`` (files 0600, directories 0700: bundles are
# private) and returns its manifest, which goes into bundle.json and so is covered by its HMAC:
#
#     {"files": {rel: {"size", "sha256", "mode"}}, "dirs": {rel: mode}, "links": {rel: target}}
#
# ``unpack`` copies it back out into a new private directory and checks that copy against the
# manifest (exactly the listed entries, every sha256) before anything uses it; original modes are
# restored.  Entries other than files, directories and symlinks (FIFOs, sockets, devices) are not
# persisted.


def check_rel(rel: str) -> str:
    if (not rel or rel.startswith("/") or "\0" in rel or os.path.normpath(rel) != rel
            or rel.split(os.sep)[0] == ".."):
        raise SnapshotCorruptedError(f"workspace entry {rel!r} is not a plain relative path")
    return rel


def _walk(root: str, times: bool = False) -> dict:
    """The manifest of ``root`` as it is on disk (modes as found); with ``times``, every entry's
    mtime (ns) too, under ``"times"``."""
    import stat

    out: dict = {"files": {}, "dirs": {}, "links": {}, "other": []}
    if times:
        out["times"] = {}
    for d, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(d, name)
            rel = os.path.relpath(p, root)
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                out["links"][rel] = os.readlink(p)
            elif stat.S_ISDIR(st.st_mode):
                out["dirs"][rel] = stat.S_IMODE(st.st_mode)
            elif stat.S_ISREG(st.st_mode):
                out["files"][rel] = {"size": st.st_size, "sha256": sessiondir.file_digest(p),
                                     "mode": stat.S_IMODE(st.st_mode)}
            else:
                out["other"].append(rel)
                continue
            if times:
                out["times"][rel] = st.st_mtime_ns
    return out


def pack(captured: str, dest: str, *, times: bool = False) -> dict:
    """Copy the capture ``captured`` into the new directory ``dest``; returns its manifest (with
    ``times``: every entry's mtime, put back by :func:`unpack`; always the directory's own mode
    and mtime, under ``"root"``)."""
    import stat

    top = os.stat(captured)
    sessiondir.private_mkdir(dest)
    names = os.listdir(captured)
    if names:
        subprocess.run(["cp", "-a", "--reflink=auto", "--", *[os.path.join(captured, n) for n in names], dest],
                       check=True, capture_output=True)
    man = _walk(dest, times)
    for rel in man.pop("other"):  # FIFOs, sockets, devices: not persisted
        os.unlink(os.path.join(dest, rel))
    for rel in man["files"]:
        os.chmod(os.path.join(dest, rel), 0o600)
    for rel in man["dirs"]:
        os.chmod(os.path.join(dest, rel), 0o700)
    man["root"] = {"mode": stat.S_IMODE(top.st_mode), "mtime_ns": top.st_mtime_ns}
    order = read_order(captured)
    if order is not None:
        man["order"] = order
    return man


def unpack(src: str, manifest: dict, what: str, dst: str | None = None) -> str:
    """Copy a packed workspace out of ``src`` into a new private capture directory (``dst``, by
    default a new one in the session directory), verified against ``manifest`` (from
    HMAC-checked metadata); returns the capture's path.  Original modes are put back, and the
    mtimes where the manifest has them.

    Raises SnapshotCorruptedError when anything differs (the copy is removed)."""
    for rel in [*manifest.get("files", {}), *manifest.get("dirs", {}), *manifest.get("links", {})]:
        check_rel(rel)
    times = manifest.get("times", {})
    if not isinstance(times, dict) or not all(type(t) is int for t in times.values()):
        raise SnapshotCorruptedError(f"{what}: the signed file times are malformed")
    top = manifest.get("root")  # absent in bundles written before it was recorded
    if top is not None and not (isinstance(top, dict) and type(top.get("mode")) is int
                                and type(top.get("mtime_ns")) is int):
        raise SnapshotCorruptedError(f"{what}: the signed mode and time of the workspace directory are malformed")
    order = manifest.get("order")  # absent in bundles written before it was recorded
    if order is not None and not (_order_ok(order) and all(r == "" or check_rel(r) for r in order)):
        raise SnapshotCorruptedError(f"{what}: the signed listing order of the workspace is malformed")
    if not os.path.isdir(src) or os.path.islink(src):
        raise SnapshotCorruptedError(f"{what}: the workspace directory {src} is missing")
    dst = dst or os.path.join(sessiondir.session_dir(), f"ws-load-{os.urandom(6).hex()}")
    tmp = dst + ".tmp"
    try:
        sessiondir.private_mkdir(tmp)
        names = os.listdir(src)
        if names:
            subprocess.run(["cp", "-a", "--reflink=auto", "--", *[os.path.join(src, n) for n in names], tmp],
                           check=True, capture_output=True)
        got = _walk(tmp)  # check the copy, not the source: what is verified is what is used
        if got["other"] or set(got["dirs"]) != set(manifest.get("dirs", {})) \
                or got["links"] != manifest.get("links", {}) or set(got["files"]) != set(manifest.get("files", {})):
            raise SnapshotCorruptedError(f"{what}: the workspace files differ from the signed list "
                                         "(entries added, removed or changed type)")
        for rel, want in manifest["files"].items():
            have = got["files"][rel]
            if have["size"] != want["size"] or have["sha256"] != want["sha256"]:
                raise SnapshotCorruptedError(f"{what}: workspace file {rel} fails its sha256 check")
        for rel, want in manifest["files"].items():
            os.chmod(os.path.join(tmp, rel), int(want["mode"]) & 0o7777)
        # times last, deepest first: setting an entry's time leaves its directory's alone
        for rel in sorted(times, key=lambda r: (r.count("/"), r), reverse=True):
            if rel in got["files"] or rel in got["links"] or rel in got["dirs"]:
                os.utime(os.path.join(tmp, rel), ns=(times[rel], times[rel]), follow_symlinks=False)
        for rel in sorted(manifest.get("dirs", {}), key=len, reverse=True):
            os.chmod(os.path.join(tmp, rel), int(manifest["dirs"][rel]) & 0o7777)
        if top is not None:  # last: nothing below changes any more (the rename changes the parent)
            os.chmod(tmp, top["mode"] & 0o7777)
            os.utime(tmp, ns=(top["mtime_ns"], top["mtime_ns"]))
        if order is not None:
            with open(os.open(dst + ORDER, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600), "w") as f:
                json.dump(order, f)
        os.rename(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def adopt(snap, src: str, manifest: dict | None, origin: str | None, what: str,
          aliases: list | None = None) -> None:
    """Give a loaded ``snap`` the workspace packed at ``src`` (if ``manifest``), verified."""
    if manifest is None:
        return
    import weakref

    snap.workspace = unpack(src, manifest, what)
    snap.workspace_path = origin
    snap.workspace_aliases = tuple(a for a in aliases or () if isinstance(a, str) and a.startswith("/"))
    weakref.finalize(snap, drop_capture, snap.workspace)

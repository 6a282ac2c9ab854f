"""Where snapshot images live, and how they are made visible atomically and verified.

Each controller process gets one private session directory (0700) under :func:`base_dir`
(``$GYM_FORK_DIR`` or the temp dir); it is removed when the process exits, and, if the process
is killed before it can remove it, by the next gym_fork process (its lock, held for the
owner's lifetime, is then free: :mod:`~gym_fork.snapshots.reclaim`).  A snapshot is written
into ``.<id>.tmp``, listed in ``MANIFEST.json`` (sizes and file identities; sha256 once the
images leave this directory, see :func:`write_manifest`), and only then renamed to
``snap-<id>``: a crash leaves either a complete snapshot or none.  Restores verify the manifest
first.
"""

from __future__ import annotations

import atexit
import errno
import hashlib
import hmac
import json
import os
import re
import shutil
import tempfile
import threading
from typing import Any

from gym_fork import atfork
from gym_fork.errors import SnapshotCorruptedError
from gym_fork.snapshots import reclaim
from gym_fork.snapshots.files import is_no_space, no_space, open_regular, read_bounded

MANIFEST = "MANIFEST.json"
# logs, CRIU's stats, the manifest, and hidden files (a manifest being rewritten: .MANIFEST.json.PID)
_NOT_IMAGES = re.compile(r"(\.log|^stats-.*|^\..*|^" + re.escape(MANIFEST) + r")$")
_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}\Z")  # \Z: "$" would accept a trailing newline
_IMAGE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}")  # fullmatch: no "/", no "..", no "\n"
_MANIFEST_LIMIT = 64 << 20
_BLOCK = 1 << 20

_lock = threading.Lock()
_session: str | None = None
_owner_fd: int | None = None  # the flock-ed owner lock of _session, open for this process's lifetime
JOB_ENV = "GYM_FORK_CONTROL_FD"  # set inside a `gym-fork run` job (gym_fork.migration.control)


def is_image_name(name: str) -> bool:
    """Whether ``name`` in a dump directory is an image file (not a log, stats or the manifest)."""
    return not _NOT_IMAGES.search(name)


def base_dir() -> str:
    """The directory under which this user's private gym_fork directories go: ``$GYM_FORK_DIR``,
    else ``gym_fork-<uid>`` in the temp dir (not created here)."""
    return os.environ.get("GYM_FORK_DIR") or os.path.join(tempfile.gettempdir(), f"gym_fork-{os.geteuid()}")


def private_mkdir(path: str) -> str:
    """Create ``path`` (and its parents) if needed; it is 0700 either way. Returns ``path``."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def session_dir() -> str:
    """This process's private directory for images (created on first use, removed at exit; the
    directories of processes that were killed are reclaimed when it is created)."""
    global _session, _owner_fd
    with _lock:
        if _session is None or not os.path.isdir(_session):
            base = private_mkdir(base_dir())
            if os.environ.get(JOB_ENV):
                # inside a `gym-fork run` job, which CRIU checkpoints whole: a held lock would have
                # to travel with it, so no lock (and no reclaiming by others); the job's own exit
                # removes it
                _session = tempfile.mkdtemp(prefix=f"j{os.getpid()}-", dir=base)
            else:
                tmp = tempfile.mkdtemp(prefix=".new-", dir=base)
                _owner_fd = reclaim.hold(tmp)
                _session = os.path.join(base, f"s{os.getpid()}-{os.path.basename(tmp)[5:]}")
                os.rename(tmp, _session)  # visible only once its lock is held
                reclaim.reclaim_orphans(base, keep=_session, background=True)
            os.chmod(_session, 0o700)
            atexit.register(_remove_session, _session, os.getpid())
        return _session


def exit_log(create: bool = True) -> str | None:
    """The file in this process's session directory where the parents of its workers' copies
    write down how those copies ended (:mod:`gym_fork.worker.exits`); with ``create`` false,
    None where this process has no session directory (no worker of its can have written one)."""
    base = session_dir() if create else _session
    return None if base is None else os.path.join(base, "exits")


def current_session() -> str | None:
    """This process's session directory if it has one (none is created)."""
    return _session


def _remove_session(path: str, owner: int) -> None:
    if os.getpid() == owner:  # a forked child inherits atexit handlers: never the parent's dir
        shutil.rmtree(path, True)


def _after_fork_in_child() -> None:
    """A child forked without exec gets its own session directory when it needs one, and must
    not keep its parent's lock held (flock stays held while any copy of the descriptor is open)."""
    global _session, _owner_fd, _lock
    _lock = threading.Lock()
    _session = None
    if _owner_fd is not None:
        try:
            os.close(_owner_fd)
        except OSError:
            pass
        _owner_fd = None


atfork.in_child(_after_fork_in_child)


def is_valid_id(snap_id: str) -> bool:
    """Whether ``snap_id`` may name a snapshot (and so a directory): letters, digits, '-', '_'."""
    return bool(_ID_RE.match(snap_id))


def check_id(snap_id: str) -> str:
    """``snap_id`` unchanged if it is a valid snapshot id, else ValueError."""
    if not is_valid_id(snap_id):
        raise ValueError(f"invalid snapshot id {snap_id!r}: use letters, digits, '-' and '_' only")
    return snap_id


def file_digest(path: str) -> str:
    """The sha256 of a file, as hex."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def is_image_file_name(name: Any) -> bool:
    """Whether ``name`` can name an image file inside an images directory (see below)."""
    return isinstance(name, str) and bool(_IMAGE_NAME.fullmatch(name))


def check_image_name(name: Any, what: str) -> str:
    """``name`` unchanged if it can name an image file inside an images directory (a plain file
    name: no path separator, no ``..``, no newline), else SnapshotCorruptedError."""
    if not is_image_file_name(name):
        raise SnapshotCorruptedError(f"{what}: {name!r} cannot name an image file (a plain file name is "
                                     "expected); nothing was opened")
    return name


def write_manifest(dirpath: str, meta: dict, *, hashed: bool = False) -> int:
    """Record every image file in ``dirpath`` (images this process just dumped into its private
    directory): its size and identity -- device, inode and modification time, read right after
    the dump -- and, with ``hashed``, its sha256.  Returns their total size in bytes.

    Why identity and not always a hash: only this process (its uid, root) can write the 0700
    session directory, and any write, truncation or replacement of an image changes its inode,
    size or mtime, so a restore can tell a changed image in microseconds instead of re-reading
    every byte (~20 ms per 24 MB here).  The sha256 that a bundle, a store or a migration signs is
    computed when images leave this directory (:func:`verify` with ``digests=True``)."""
    files = {}
    total = 0
    for name in sorted(os.listdir(dirpath)):
        p = os.path.join(dirpath, name)
        if _NOT_IMAGES.search(name) or not os.path.isfile(p):
            continue
        st = os.lstat(p)
        entry: dict = {"size": st.st_size, "id": _identity(st)}
        if hashed:
            entry["sha256"] = file_digest(p)
        files[name] = entry
        total += st.st_size
    with open(os.path.join(dirpath, MANIFEST), "w") as f:
        json.dump({"files": files, "meta": meta}, f)
    return total


def _identity(st: os.stat_result) -> list[int]:
    """What changes when a file is written, truncated or replaced: device, inode, mtime (ns)."""
    return [st.st_dev, st.st_ino, st.st_mtime_ns]


def read_manifest(dirpath: str) -> dict:
    """``{"files": {name: {"size", "sha256"}}, "meta": ...}`` of one of *our* image directories
    (the session directory's, or a private copy): not signed, never read from a bundle or a
    store entry.  Raises SnapshotCorruptedError when it is missing or unreadable."""
    try:
        man = json.loads(read_bounded(os.path.join(dirpath, MANIFEST), _MANIFEST_LIMIT, what=dirpath))
    except ValueError as e:
        raise SnapshotCorruptedError(f"cannot read {MANIFEST} in {dirpath}: {e}") from e
    except SnapshotCorruptedError:
        if not os.path.lexists(os.path.join(dirpath, MANIFEST)):
            raise SnapshotCorruptedError(f"snapshot directory {dirpath} is missing or has no {MANIFEST}") from None
        raise
    if not isinstance(man, dict) or not isinstance(man.get("files"), dict):
        raise SnapshotCorruptedError(f"{MANIFEST} in {dirpath} is malformed")
    return man


def _hash_fd(fd: int, size: int, name: str, what: str, out: int | None = None) -> str:
    """sha256 of the first ``size`` bytes of ``fd`` (the file must have exactly that many), each
    piece also written to ``out`` if given: what is hashed is what is copied."""
    h = hashlib.sha256()
    left = size
    while left > 0:
        b = os.read(fd, min(left, _BLOCK))
        if not b:
            raise SnapshotCorruptedError(f"{what}: image {name} is shorter than its signed size (truncated)")
        h.update(b)
        if out is not None:
            view = memoryview(b)
            while view:
                view = view[os.write(out, view):]
        left -= len(b)
    return h.hexdigest()


def verify(dirpath: str, full: bool = True, *, digests: bool = False, rehash: bool = False) -> dict:
    """Raise SnapshotCorruptedError unless every image file that ``dirpath``'s MANIFEST.json lists
    is present, a regular file of its size, and unchanged.  For our own image directories (see
    :func:`read_manifest`); bundles and store entries are checked against their *signed* list
    by :func:`copy_verified`.

    An image this process dumped (its entry records an identity, :func:`write_manifest`) is
    unchanged when its device, inode and mtime are those recorded; ``rehash`` also checks its
    bytes against a recorded sha256.  An image copied in from a bundle or a store (a signed
    sha256, no identity) is re-hashed when ``full``.

    Args:
        digests: the caller signs or compares the digests (a bundle, a store entry, a migration):
            every entry of the returned ``files`` is ``{"size", "sha256"}``, computed now where
            none was recorded (after the identity check, and kept in the manifest for next time).

    Returns:
        The manifest ``{"files": {name: entry}, "meta": ...}``.
    """
    man = read_manifest(dirpath)
    added = False
    dfd = os.open(dirpath, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for name, want in man["files"].items():
            check_image_name(name, dirpath)
            if not isinstance(want, dict):
                raise SnapshotCorruptedError(f"{MANIFEST} in {dirpath} is malformed (entry {name!r})")
            fd, st = open_regular(name, dir_fd=dfd, what=f"snapshot image in {dirpath}")
            try:
                if st.st_size != want.get("size"):
                    raise SnapshotCorruptedError(f"snapshot image {dirpath}/{name} has {st.st_size} bytes, "
                                                 f"expected {want.get('size')}")
                ident = want.get("id")
                if ident is not None and _identity(st) != ident:
                    raise SnapshotCorruptedError(
                        f"snapshot image {dirpath}/{name} was changed after it was dumped (written, replaced "
                        "or touched: its inode or modification time differ); it is not restored")
                recorded = want.get("sha256")
                if recorded is not None and (ident is None and full or rehash):
                    if not hmac.compare_digest(_hash_fd(fd, st.st_size, name, dirpath), str(recorded)):
                        raise SnapshotCorruptedError(f"snapshot image {dirpath}/{name} fails its sha256 check (corrupted)")
                elif recorded is None and digests:
                    want["sha256"] = _hash_fd(fd, st.st_size, name, dirpath)
                    if ident is not None and _identity(os.fstat(fd)) != ident:  # changed while it was read
                        raise SnapshotCorruptedError(f"snapshot image {dirpath}/{name} changed while it was hashed")
                    added = True
            finally:
                os.close(fd)
    finally:
        os.close(dfd)
    if added:  # next time, no hashing: written aside and renamed (a reader sees old or new)
        tmp = os.path.join(dirpath, f".{MANIFEST}.{os.getpid()}")
        with open(tmp, "w") as f:
            json.dump(man, f)
        os.replace(tmp, os.path.join(dirpath, MANIFEST))
    if digests:
        man["files"] = {n: {"size": w["size"], "sha256": w["sha256"]} for n, w in man["files"].items()}
    return man


def streamed_as_dumped(dirpath: str, streamed: dict) -> bool:
    """Whether the image files of our ``dirpath``, hashed while they were streamed (``streamed``:
    name -> {size, digest}), are the ones its manifest lists, unchanged: the same names and sizes,
    each image this process dumped still the same file (identity, :func:`verify`), and any
    recorded sha256 equal to the streamed one.  Nothing is read again."""
    try:
        files = verify(dirpath, full=False)["files"]
    except SnapshotCorruptedError:
        return False
    if set(files) != set(streamed):
        return False
    return all(w.get("size") == streamed[n].get("size")
               and ("sha256" not in w or hmac.compare_digest(str(w["sha256"]), str(streamed[n].get("sha256"))))
               for n, w in files.items())


def copy_verified(src: str, files: dict, dest: str, what: str, *, full: bool = True,
                  ignore_extra: bool = False) -> int:
    """Copy the image files that a *signed* list names from ``src`` (a bundle's or a store
    entry's ``images/``, which others may be able to write to) into ``dest``, checking the bytes
    that are copied; returns the bytes copied.  What a restore then reads is this private copy,
    so nothing done to ``src`` after the check can change what is restored.

    ``src`` must hold exactly the files ``files`` lists (``name -> {"size", "sha256"}``): an
    extra file is refused (nothing unsigned reaches CRIU).  Each one is opened without following
    links and without blocking, must be a regular file of exactly the signed size, and is read
    only up to that size.  Nothing is opened that the signed list does not name.

    Args:
        src: the directory to copy from.
        files: the signed list (already HMAC-verified by the caller).
        dest: an existing private directory to copy into.
        what: names the bundle or entry in messages.
        full: check sha256 (else sizes only).
        ignore_extra: copy from one of our own directories, which also holds logs.

    Raises:
        SnapshotCorruptedError: an extra, missing, oddly typed, resized or altered file.
        NoSpaceError: ``dest``'s file system is full (what was copied is removed by the caller).
    """
    for name in files:
        check_image_name(name, what)
    try:
        sfd = os.open(src, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise SnapshotCorruptedError(f"{what}: its images directory cannot be opened ({e.strerror}; a "
                                     "directory, not a link, is expected)") from None
    dfd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    total = 0
    try:
        extra = sorted(set(os.listdir(sfd)) - set(files))
        if extra and not ignore_extra:
            raise SnapshotCorruptedError(
                f"{what}: images/ holds files the signed list does not name ({', '.join(map(repr, extra[:5]))}"
                f"{f' and {len(extra) - 5} more' if len(extra) > 5 else ''}); nothing was restored. Remove them, "
                "or save the snapshot again")
        for name, want in files.items():
            fd, st = open_regular(name, dir_fd=sfd, what=f"{what}: image")
            try:
                if st.st_size != want.get("size"):
                    raise SnapshotCorruptedError(f"{what}: image {name} is not the signed size (truncated, grown "
                                                 "or replaced); nothing was restored")
                out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                              dir_fd=dfd)
                try:
                    digest = _hash_fd(fd, want["size"], name, what, out)
                finally:
                    os.close(out)
                if full and not hmac.compare_digest(digest, str(want.get("sha256"))):
                    raise SnapshotCorruptedError(f"{what}: image {name} fails its sha256 check (corrupted or "
                                                 "altered); nothing was restored")
                total += want["size"]
            finally:
                os.close(fd)
    except OSError as e:
        if is_no_space(e):
            raise no_space(e, dest, f"a private copy of {what}", sum(f["size"] for f in files.values())) from e
        raise
    finally:
        os.close(sfd)
        os.close(dfd)
    return total


def export_images(src: str, files: dict, dest: str) -> None:
    """Put the image files ``files`` names from our private ``src`` (just verified) into the new
    directory ``dest`` (a bundle being written): hard links (images are never modified in
    place), or, across file systems, copies checked while they are made.  Nothing else of
    ``src`` (logs, stats, its manifest) goes along: a bundle holds exactly its signed files."""
    os.mkdir(dest, 0o700)
    names = list(files)
    try:
        for name in names:
            os.link(os.path.join(src, check_image_name(name, src)), os.path.join(dest, name))
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
            raise
        for name in os.listdir(dest):
            os.unlink(os.path.join(dest, name))
        copy_verified(src, files, dest, src, ignore_extra=True)


def write_signed_manifest(dest: str, files: dict, meta: dict) -> None:
    """Give a private copy made by :func:`copy_verified` the MANIFEST.json a restore checks."""
    with open(os.path.join(dest, MANIFEST), "w") as f:
        json.dump({"files": files, "meta": meta}, f)


def verify_received(received: dict, signed: dict, what: str) -> None:
    """Images hashed as they arrived (name -> {size, sha256 or blake3}, from the migration stream)
    must be exactly the signed ones: same names, sizes and digests, nothing missing, nothing extra.
    Raises SnapshotCorruptedError; the files are not read again."""
    import hmac

    if set(received) != set(signed):
        extra, missing = sorted(set(received) - set(signed)), sorted(set(signed) - set(received))
        raise SnapshotCorruptedError(f"{what}: the received images differ from the signed list "
                                     f"(extra {extra[:3]}, missing {missing[:3]}); nothing restored")
    for name, want in signed.items():
        got = received[name]
        alg = "blake3" if "blake3" in want else "sha256"  # streamed images may use the faster BLAKE3
        if got["size"] != want.get("size") or not hmac.compare_digest(str(got.get(alg)), str(want.get(alg))):
            raise SnapshotCorruptedError(f"{what}: image {name} fails its {alg} check (corrupted in transfer); "
                                         "nothing restored")


def commit(tmp: str, final: str) -> None:
    """Make a fully written snapshot directory visible in one step."""
    dfd = os.open(tmp, os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    os.rename(tmp, final)

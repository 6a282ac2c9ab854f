"""Where snapshot images live, and how they are made visible atomically and verified.

Each controller process gets one private session directory (0700) under :func:`base_dir`
(``$GYM_FORK_DIR`` or the temp dir); it is removed when the process exits.  A snapshot is written
into ``.<id>.tmp``, checksummed into ``MANIFEST.json``, and only then renamed to ``snap-<id>``:
a crash leaves either a complete snapshot or none.  Restores verify the manifest first.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import re
import shutil
import tempfile
import threading

from gym_fork.errors import SnapshotCorruptedError

MANIFEST = "MANIFEST.json"
_NOT_IMAGES = re.compile(r"(\.log|^stats-.*|^" + re.escape(MANIFEST) + r")$")
_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}\Z")  # \Z: "$" would accept a trailing newline

_lock = threading.Lock()
_session: str | None = None


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
    """This process's private directory for images (created on first use, removed at exit)."""
    global _session
    with _lock:
        if _session is None or not os.path.isdir(_session):
            base = private_mkdir(base_dir())
            _session = tempfile.mkdtemp(prefix=f"s{os.getpid()}-", dir=base)
            os.chmod(_session, 0o700)
            atexit.register(shutil.rmtree, _session, True)
        return _session


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


def write_manifest(dirpath: str, meta: dict) -> int:
    """Checksum every image file in ``dirpath``; returns their total size in bytes."""
    files = {}
    total = 0
    for name in sorted(os.listdir(dirpath)):
        p = os.path.join(dirpath, name)
        if _NOT_IMAGES.search(name) or not os.path.isfile(p):
            continue
        size = os.path.getsize(p)
        files[name] = {"size": size, "sha256": file_digest(p)}
        total += size
    with open(os.path.join(dirpath, MANIFEST), "w") as f:
        json.dump({"files": files, "meta": meta}, f)
    return total


def read_manifest(dirpath: str) -> dict:
    """``{"files": {name: {"size", "sha256"}}, "meta": ...}`` of an image directory (not checked).
    Raises SnapshotCorruptedError when it is missing or unreadable."""
    try:
        with open(os.path.join(dirpath, MANIFEST)) as f:
            return json.load(f)
    except FileNotFoundError:
        raise SnapshotCorruptedError(f"snapshot directory {dirpath} is missing or has no {MANIFEST}") from None
    except (OSError, ValueError) as e:
        raise SnapshotCorruptedError(f"cannot read {MANIFEST} in {dirpath}: {e}") from e


def verify(dirpath: str, full: bool = True) -> dict:
    """Raise SnapshotCorruptedError unless every image file is present and intact."""
    man = read_manifest(dirpath)
    for name, want in man["files"].items():
        p = os.path.join(dirpath, name)
        try:
            size = os.path.getsize(p)
        except OSError:
            raise SnapshotCorruptedError(f"snapshot image {p} is missing") from None
        if size != want["size"]:
            raise SnapshotCorruptedError(f"snapshot image {p} has {size} bytes, expected {want['size']}")
        if full and file_digest(p) != want["sha256"]:
            raise SnapshotCorruptedError(f"snapshot image {p} fails its sha256 check (corrupted)")
    return man


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

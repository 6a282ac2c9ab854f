"""A store's index (``DIR/index.json``) and its lock (``DIR/lock``).

The snapshot directories ``DIR/snaps/<id>/`` are the truth; the index is a cache of what a
listing or a budget needs (steps, env id, sizes, created, last used, pinned), rewritten
atomically and reconciled with the directories whenever the store is opened or collected, so a
crash between a rename and an index write loses nothing.  One writer at a time, also across
processes: :meth:`StoreIndex.locked` (a thread lock plus ``flock``).  A directory whose
bundle.json or recipe.json is damaged is moved into quarantine (:mod:`.quarantine`), never
deleted; a damaged index is simply rebuilt.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
import time
from collections.abc import Iterator

from gym_fork.errors import BundleDamagedError
from gym_fork.snapshots import quarantine, sessiondir
from gym_fork.snapshots.bundle import META, META_LIMIT, check_meta
from gym_fork.snapshots.chunks import read_recipe
from gym_fork.snapshots.files import allocated_bytes, atomic_write_json, is_no_space, read_bounded

FORMAT = 1
INDEX = "index.json"
PINNED = "PINNED"
_ENTRY_TYPES = {"steps": (int,), "created": (int, float), "last_used": (int, float), "logical_bytes": (int,),
                "own_bytes": (int,), "pinned": (bool,)}


def _entry_ok(e: object) -> bool:
    return isinstance(e, dict) and all(isinstance(e.get(k), t) for k, t in _ENTRY_TYPES.items())


class StoreIndex:
    """The index and lock of the store at ``root`` (whose ``snaps/`` must exist)."""

    def __init__(self, root: str):
        self.root = root
        self.lock = threading.RLock()  # threads of this process; flock serializes processes
        self._depth = 0  # nesting of locked() in the thread holding self.lock

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """The store's lock, for this thread and against other processes; reentrant (a nested
        call must not flock a second descriptor: that would wait for itself)."""
        with self.lock:
            if self._depth:
                self._depth += 1
                try:
                    yield
                finally:
                    self._depth -= 1
                return
            fd = os.open(os.path.join(self.root, "lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                self._depth = 1
                try:
                    yield
                finally:
                    self._depth = 0
            finally:
                os.close(fd)  # releases the flock

    def snap_dir(self, snap_id: str) -> str:
        return os.path.join(self.root, "snaps", sessiondir.check_id(snap_id))

    def read(self) -> dict:
        """The index; an empty one when it is missing or damaged (reconcile rebuilds it from the
        directories), without the entries whose fields have the wrong types."""
        try:
            idx = json.loads(read_bounded(os.path.join(self.root, INDEX), 256 << 20))
        except Exception:  # noqa: BLE001 - any damage: the index is only a cache
            idx = None
        if not (isinstance(idx, dict) and idx.get("format") == FORMAT and isinstance(idx.get("snapshots"), dict)):
            return {"format": FORMAT, "snapshots": {}}
        idx["snapshots"] = {sid: e for sid, e in idx["snapshots"].items() if _entry_ok(e)}
        return idx

    def write(self, idx: dict) -> None:
        """Rewrite the index; on a full disk the old one stays (it is a cache: reconcile fixes it)."""
        try:
            atomic_write_json(os.path.join(self.root, INDEX), idx)
        except OSError as e:
            if not is_no_space(e):
                raise

    def is_temp(self, name: str) -> bool:
        """Whether ``name`` in the store directory is an index being rewritten (gc removes it)."""
        return name.startswith(INDEX + ".tmp-")

    def entry_from_dir(self, snap_id: str) -> dict:
        """The index entry of a snapshot directory, from its bundle.json (types checked, not
        its HMAC: listing needs no key) and recipe.json.

        Raises:
            BundleDamagedError: either file is missing, unreadable, not JSON or malformed.
        """
        d = self.snap_dir(snap_id)
        what = f"snapshot {snap_id} in {self.root}"
        try:
            raw = read_bounded(os.path.join(d, META), META_LIMIT, what=what)
            meta = check_meta(json.loads(raw), what)
        except BundleDamagedError:
            raise
        except Exception as e:  # noqa: BLE001 - missing, not a regular file, not JSON
            raise BundleDamagedError(f"{what}: {META} is unusable ({e})") from None
        if meta.get("id") != snap_id:
            raise BundleDamagedError(f"{what}: its {META} describes snapshot {meta.get('id')!r}")
        images = meta.get("images")
        if not isinstance(images, dict) or not all(isinstance(v, dict) and type(v.get("size")) is int
                                                   for v in images.values()):
            raise BundleDamagedError(f"{what}: {META} has no valid image list")
        read_recipe(d, what)
        own = sum(allocated_bytes(os.path.join(r, n)) for r, _, fs in os.walk(d) for n in fs)
        return {"steps": meta["steps"], "env_id": meta["env_id"], "created": meta["created"],
                "parent_id": meta["parent_id"], "last_used": meta["saved"],
                "logical_bytes": sum(v["size"] for v in images.values()), "own_bytes": own,
                "pinned": os.path.exists(os.path.join(d, PINNED))}

    def quarantine(self, idx: dict, snap_id: str, reason: str) -> str | None:
        """Move a damaged entry into quarantine and drop it from ``idx``.  Call locked."""
        idx["snapshots"].pop(snap_id, None)
        return quarantine.move(self.root, snap_id, reason)

    def reconcile(self) -> dict:
        """Make the index list exactly the complete snapshot directories; returns it.  Call with
        :meth:`locked` held."""
        idx = self.read()
        snaps = idx["snapshots"]
        on_disk = {n for n in os.listdir(os.path.join(self.root, "snaps")) if sessiondir.is_valid_id(n)}
        changed = False
        for sid in list(snaps):
            if sid not in on_disk:
                del snaps[sid]
                changed = True
        for sid in sorted(on_disk - set(snaps)):
            try:
                snaps[sid] = self.entry_from_dir(sid)
            except BundleDamagedError as e:  # cannot happen through rename: damage or tampering
                self.quarantine(idx, sid, str(e))
            changed = True
        for sid, e in snaps.items():  # PINNED files are the truth for pins
            p = os.path.exists(os.path.join(self.snap_dir(sid), PINNED))
            if e.get("pinned") != p:
                e["pinned"] = p
                changed = True
        if changed or not os.path.exists(os.path.join(self.root, INDEX)):
            self.write(idx)
        return idx

    def set_pinned(self, snap_id: str, pinned: bool) -> None:
        """Pin or unpin a stored snapshot (its PINNED marker, then the index).  Call locked."""
        marker = os.path.join(self.snap_dir(snap_id), PINNED)
        if pinned:
            os.close(os.open(marker, os.O_WRONLY | os.O_CREAT, 0o600))  # (private, as every store file)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(marker)
        idx = self.read()
        if snap_id in idx["snapshots"]:
            idx["snapshots"][snap_id]["pinned"] = pinned
            self.write(idx)

    def touch(self, snap_id: str) -> None:
        """Mark a stored snapshot as just used.  Call locked."""
        idx = self.read()
        if snap_id in idx["snapshots"]:
            idx["snapshots"][snap_id]["last_used"] = time.time()
            self.write(idx)

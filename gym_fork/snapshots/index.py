"""A store's index (``DIR/index.json``) and its lock (``DIR/lock``).

The snapshot directories ``DIR/snaps/<id>/`` are the truth; the index is a cache of what a
listing or a budget needs (steps, env id, sizes, created, last used, pinned), rewritten
atomically and reconciled with the directories whenever the store is opened or collected, so a
crash between a rename and an index write loses nothing.  One writer at a time, also across
processes: :meth:`StoreIndex.locked` (a thread lock plus ``flock``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import threading
import time
from collections.abc import Iterator

from gym_fork.snapshots import sessiondir
from gym_fork.snapshots.files import allocated_bytes, atomic_write_json

FORMAT = 1
INDEX = "index.json"
PINNED = "PINNED"


class StoreIndex:
    """The index and lock of the store at ``root`` (whose ``snaps/`` must exist)."""

    def __init__(self, root: str):
        self.root = root
        self.lock = threading.RLock()  # threads of this process; flock serializes processes

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        with self.lock:
            fd = os.open(os.path.join(self.root, "lock"), os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)  # releases the flock

    def snap_dir(self, snap_id: str) -> str:
        return os.path.join(self.root, "snaps", sessiondir.check_id(snap_id))

    def read(self) -> dict:
        try:
            with open(os.path.join(self.root, INDEX)) as f:
                idx = json.load(f)
            if idx.get("format") == FORMAT:
                return idx
        except (OSError, ValueError):
            pass
        return {"format": FORMAT, "snapshots": {}}

    def write(self, idx: dict) -> None:
        atomic_write_json(os.path.join(self.root, INDEX), idx)

    def is_temp(self, name: str) -> bool:
        """Whether ``name`` in the store directory is an index being rewritten (gc removes it)."""
        return name.startswith(INDEX + ".tmp-")

    def entry_from_dir(self, snap_id: str) -> dict | None:
        """The index entry of a snapshot directory, from its bundle.json (None: incomplete)."""
        d = self.snap_dir(snap_id)
        try:
            with open(os.path.join(d, "bundle.json")) as f:
                meta = json.load(f)
        except (OSError, ValueError):
            return None
        logical = sum(v["size"] for v in meta.get("images", {}).values())
        own = sum(allocated_bytes(os.path.join(r, n)) for r, _, fs in os.walk(d) for n in fs)
        return {"steps": meta.get("steps"), "env_id": meta.get("env_id"), "created": meta.get("created"),
                "parent_id": meta.get("parent_id"), "last_used": meta.get("saved", time.time()),
                "logical_bytes": logical, "own_bytes": own,
                "pinned": os.path.exists(os.path.join(d, PINNED))}

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
            e = self.entry_from_dir(sid)
            if e is None:  # not a complete bundle: cannot happen through rename; remove it
                shutil.rmtree(self.snap_dir(sid), ignore_errors=True)
                continue
            snaps[sid] = e
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
            open(marker, "w").close()
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

"""``SnapshotStore``: a bounded, crash-safe, deduplicating directory of snapshots.

``ForkableEnv(..., store=SnapshotStore(dir, max_bytes=..., max_memory=...))`` spills in-memory
snapshots to disk beyond a memory budget, deletes the least recently used unpinned ones beyond a
disk budget, and keeps every written snapshot loadable by later processes
(:meth:`SnapshotStore.load`, ``gym-fork snapshots ls DIR``).  The pieces: the index and lock
(:mod:`~gym_fork.snapshots.index`), the shared page chunks (:mod:`~gym_fork.snapshots.chunks`),
the budgets (:mod:`~gym_fork.snapshots.budgets`); this class ties them together.

Layout (everything 0700/0600)::

    DIR/lock                flock: one writer at a time (also across processes)
    DIR/index.json          id -> steps, env id, sizes, created, last used, pinned (a cache)
    DIR/snaps/<id>/         bundle.json (as Snapshot.save, with HMAC), images/ (the images not
                            cut into chunks, + their sha256 manifest), recipe.json (the chunked
                            images as lists of chunks), PINNED, workspace/ (the env's files)
    DIR/chunks/ab/<sha256>  content-addressed chunks shared by all snapshots
    DIR/.tmp-*              snapshots being written (removed by gc once their writer is gone)

A snapshot is written into ``.tmp-*``, the file system is flushed, and the directory renamed
into ``snaps/``; only then is the index rewritten.  Before a restore the images are reassembled
from the chunks into the private session directory and checked against the sha256 manifest
that the bundle's HMAC covers.  Which images are cut into chunks, and where, the snapshot's
backend decides (CRIU: page images, along the dumped virtual addresses).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import weakref
from typing import Any, Iterator

from gym_fork.errors import SnapshotCorruptedError, StoreError
from gym_fork.snapshots import sessiondir
from gym_fork.snapshots.budgets import MemoryBudget, disk_evictions
from gym_fork.snapshots.bundle import bundle_meta, read_bundle_meta, sign_meta
from gym_fork.snapshots.chunks import ChunkFiles, count_refs
from gym_fork.snapshots.files import fsync_dir, syncfs
from gym_fork.snapshots.index import PINNED, StoreIndex
from gym_fork.snapshots.snapshot import Snapshot, backend_named
from gym_fork.snapshots.workspace import pack as pack_workspace

CHUNK_SIZE = 16 * 1024
_TMP_PREFIX = ".tmp-"


class SnapshotStore:
    """A directory of snapshots with memory and disk budgets; see the module docstring.

    Args:
        path: the store directory (created 0700).
        max_bytes: disk budget in bytes (None: unbounded).
        max_memory: budget for the memory held by in-memory (copy-on-write) snapshots, in bytes
            (the sum of ``Snapshot.memory_bytes()``).
        max_in_memory: budget as a number of in-memory snapshots.
        dedup: store page images as shared content-addressed chunks (else whole files).
        chunk_size: chunk size for ``dedup`` (a multiple of 4096).
        verify: ``"full"`` (check every chunk's sha256 when reassembling) or ``"size"``.

    Raises:
        ValueError: ``chunk_size`` is not a multiple of the page size.
    """

    def __init__(self, path: str, *, max_bytes: int | None = None, max_memory: int | None = None,
                 max_in_memory: int | None = None, dedup: bool = True, chunk_size: int = CHUNK_SIZE,
                 verify: str = "full"):
        if chunk_size % 4096:
            raise ValueError("chunk_size must be a multiple of 4096 (the page size)")
        self.path = os.path.abspath(path)
        self.max_bytes = max_bytes
        self.dedup = dedup
        self.chunk_size = chunk_size
        self.verify_mode = verify
        for sub in ("", "snaps"):
            sessiondir.private_mkdir(os.path.join(self.path, sub))
        self._chunks = ChunkFiles(os.path.join(self.path, "chunks"))
        self._index = StoreIndex(self.path)
        self._tlock = self._index.lock
        self._memory = MemoryBudget(max_memory, max_in_memory)
        self._handles: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
        self._recipes: dict[str, dict] = {}  # id -> recipe (immutable once written)
        # payloads that stand for images kept here (restores reassemble them), -> snapshot id
        self._stored: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
        self.stats = {"spilled": 0, "collected": 0, "evicted": 0, "written": 0}
        with self._index.locked():
            self._index.reconcile()

    @property
    def max_memory(self) -> int | None:
        return self._memory.max_memory

    @max_memory.setter
    def max_memory(self, value: int | None) -> None:
        self._memory.max_memory = value

    @property
    def max_in_memory(self) -> int | None:
        return self._memory.max_in_memory

    @max_in_memory.setter
    def max_in_memory(self, value: int | None) -> None:
        self._memory.max_in_memory = value

    def snapshot_dir(self, snap_id: str) -> str:
        """Where a stored snapshot's entry is (``DIR/snaps/<id>``; it may not exist).  Raises
        ValueError for an id that cannot name a snapshot."""
        return self._index.snap_dir(snap_id)

    _snap_dir = snapshot_dir

    def _recipe(self, snap_id: str) -> dict:
        r = self._recipes.get(snap_id)
        if r is None:
            try:
                with open(os.path.join(self._snap_dir(snap_id), "recipe.json")) as f:
                    r = json.load(f)
            except FileNotFoundError:
                r = {"chunk_size": self.chunk_size, "files": {}}
            self._recipes[snap_id] = r
        return r

    def _chunk_refs(self, ids: Any) -> dict[str, int]:
        return count_refs(self._recipe(sid) for sid in ids)

    # --- writing ---------------------------------------------------------------------------------
    def put(self, snap: Snapshot) -> str:
        """Write ``snap`` into the store; it stays usable, now restored from here.  Returns its
        directory.  The snapshot's frozen process (fork tier) ends: it now costs disk, not memory.

        Raises:
            StoreError: its backend keeps no image files (e.g. pickle).
        """
        with self._tlock:
            if os.path.isdir(self._snap_dir(snap.id)):
                self._attach(snap)
                return self._snap_dir(snap.id)
            backend = snap._backend
            snap.persist(keep_in_memory=False)  # e.g. a CRIU dump into the session dir
            payload = snap.payload()
            images, fields = backend.store_images(payload)
            meta = self._write(snap, images, fields)
            backend.release(payload)  # its images in the session dir: restores now come from here
            self._attach(snap, meta)
            self._enforce_disk(keep={snap.id})
        return self._snap_dir(snap.id)

    def _write(self, snap: Snapshot, images: str, fields: dict) -> dict:
        """Write ``snap``'s entry from the image files in ``images``; returns its bundle.json."""
        man = sessiondir.verify(images, full=True)  # never store a corrupted image
        with self._index.locked():
            tmp = sessiondir.private_mkdir(os.path.join(self.path, f"{_TMP_PREFIX}{snap.id}-{os.getpid()}-{os.urandom(3).hex()}"))
            try:
                imgs = sessiondir.private_mkdir(os.path.join(tmp, "images"))
                recipe: dict = {"chunk_size": self.chunk_size, "files": {}}
                for name in os.listdir(images):
                    src = os.path.join(images, name)
                    if not os.path.isfile(src) or name.endswith(".log"):
                        continue
                    lengths = (snap._backend.chunk_lengths(images, name, self.chunk_size)
                               if self.dedup and name in man["files"] else None)
                    if lengths is not None:
                        recipe["files"][name] = {"size": os.path.getsize(src), "chunks": self._chunks.put(src, lengths)}
                    else:
                        shutil.copyfile(src, os.path.join(imgs, name))
                        os.chmod(os.path.join(imgs, name), 0o600)
                meta = bundle_meta(snap, **fields, images=man["files"])
                if snap.workspace is not None:  # the env's files at the snapshot moment
                    meta["workspace"] = pack_workspace(snap.workspace, os.path.join(tmp, "workspace"))
                    meta["workspace_path"] = snap.workspace_path
                sign_meta(meta)
                with open(os.path.join(tmp, "recipe.json"), "w") as f:
                    json.dump(recipe, f)
                with open(os.path.join(tmp, "bundle.json"), "w") as f:
                    json.dump(meta, f, indent=1)
                if snap.pinned:
                    open(os.path.join(tmp, PINNED), "w").close()
                for name in ("recipe.json", "bundle.json", PINNED):
                    if os.path.exists(os.path.join(tmp, name)):
                        os.chmod(os.path.join(tmp, name), 0o600)
                syncfs(tmp)  # chunks, images, metadata durable before the snapshot is visible
                final = self._snap_dir(snap.id)
                os.rename(tmp, final)
                fsync_dir(os.path.dirname(final))
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            self._recipes[snap.id] = recipe
            idx = self._index.reconcile()
            e = idx["snapshots"].get(snap.id) or self._index.entry_from_dir(snap.id)
            e["last_used"] = time.time()
            idx["snapshots"][snap.id] = e
            self._index.write(idx)
            self.stats["written"] += 1
        return meta

    def _attach(self, snap: Snapshot, meta: dict | None = None) -> None:
        """Point ``snap`` at the store copy (restores reassemble it; release keeps it on disk)."""
        d = self._snap_dir(snap.id)
        if meta is None:
            with open(os.path.join(d, "bundle.json")) as f:
                meta = json.load(f)
        payload = snap._backend.payload_at(d, meta)
        self._stored[payload] = snap.id
        snap._keep_in(self, payload, d)
        self._handles[snap.id] = snap
        self._memory.forget(snap.id)

    # --- the env's hooks -------------------------------------------------------------------------
    def add(self, snap: Snapshot) -> None:
        """Track a snapshot just taken; enforce the memory budget."""
        snap._store = self
        with self._tlock:
            self._memory.add(snap)
            self._handles[snap.id] = snap
            self._enforce_memory()

    def touch(self, snap: Snapshot) -> None:
        """``snap`` was just used (restore/fork): most recently used now."""
        with self._tlock:
            if not self._memory.touch(snap.id) and os.path.isdir(self._snap_dir(snap.id)):
                with self._index.locked():
                    self._index.touch(snap.id)

    def set_pinned(self, snap_id: str, pinned: bool) -> None:
        with self._tlock:
            if not os.path.isdir(self._snap_dir(snap_id)):
                return  # in memory only: written with PINNED when it is spilled
            with self._index.locked():
                self._index.set_pinned(snap_id, pinned)

    @contextlib.contextmanager
    def reassembled(self, snap: Snapshot, payload: Any) -> Iterator[Any]:
        """``payload`` itself, or, if it stands for images kept here, a payload over those images
        reassembled (and verified) in the private session directory for the duration."""
        try:
            snap_id = self._stored.get(payload)
        except TypeError:  # bytes (pickle backend), None: not weak-referenceable, never stored
            snap_id = None
        if snap_id is None:
            yield payload
            return
        dest = os.path.join(sessiondir.session_dir(), f"m-{snap_id}-{os.urandom(4).hex()}")
        try:
            meta = self._materialize(snap_id, dest)
            yield snap._backend.payload_at(dest, meta)
        finally:
            shutil.rmtree(dest, ignore_errors=True)

    def in_memory(self) -> list[Snapshot]:
        with self._tlock:
            self.stats["collected"] += self._memory.collect()
            return self._memory.snapshots()

    def memory_bytes(self) -> int:
        return sum(s.memory_bytes() or 0 for s in self.in_memory())

    def _enforce_memory(self) -> None:
        self.stats["collected"] += self._memory.collect()
        while (victim := self._memory.victim()) is not None:
            self.put(victim)
            self.stats["spilled"] += 1

    # --- disk budget / removal -------------------------------------------------------------------
    def disk_bytes(self) -> int:
        """Bytes the store occupies: per-snapshot files plus every referenced chunk once."""
        idx = self._index.read()
        refs = self._chunk_refs(idx["snapshots"])
        return (sum(e.get("own_bytes", 0) for e in idx["snapshots"].values())
                + sum(self._chunks.disk_bytes(c) for c in refs))

    def _enforce_disk(self, keep: set = frozenset()) -> None:
        if self.max_bytes is None:
            return
        with self._index.locked():
            idx = self._index.reconcile()
            refs = self._chunk_refs(idx["snapshots"])
            sizes = {c: self._chunks.disk_bytes(c) for c in refs}
            for sid in disk_evictions(idx["snapshots"], self._recipe, refs, sizes, self.max_bytes, keep):
                self._remove_locked(idx, sid)
                self.stats["evicted"] += 1
            self._index.write(idx)
            self._chunks.drop_unreferenced(refs)

    def _remove_locked(self, idx: dict, sid: str) -> None:
        d = self._snap_dir(sid)
        trash = os.path.join(self.path, f"{_TMP_PREFIX}rm-{sid}-{os.urandom(3).hex()}")
        with contextlib.suppress(FileNotFoundError):
            os.rename(d, trash)  # invisible in one step, then deleted
            shutil.rmtree(trash, ignore_errors=True)
        idx["snapshots"].pop(sid, None)
        self._recipes.pop(sid, None)
        s = self._handles.get(sid)
        if s is not None:
            s.release()

    def remove(self, snap_id: str) -> None:
        """Delete one stored snapshot (and the chunks only it used).

        Raises:
            StoreError: no such snapshot here.
        """
        with self._index.locked():
            idx = self._index.reconcile()
            if snap_id not in idx["snapshots"]:
                raise StoreError(f"no snapshot {snap_id!r} in {self.path}")
            mine = self._chunk_refs([snap_id])
            self._remove_locked(idx, snap_id)
            self._index.write(idx)
            others = self._chunk_refs(idx["snapshots"])
            self._chunks.drop_unreferenced({c: others.get(c, 0) for c in mine})

    def gc(self) -> dict:
        """Remove what crashed writers left (temp dirs, orphan chunks), reconcile the index and
        enforce the disk budget.  Safe while other processes use the store (it takes the lock)."""
        out = {"tmp_removed": 0, "chunks_removed": 0}
        with self._index.locked():
            for name in os.listdir(self.path):
                if name.startswith(_TMP_PREFIX) or self._index.is_temp(name):
                    shutil.rmtree(os.path.join(self.path, name), ignore_errors=True)
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(self.path, name))
                    out["tmp_removed"] += 1
            idx = self._index.reconcile()
            out["chunks_removed"] = self._chunks.sweep(self._chunk_refs(idx["snapshots"]))
        self._enforce_disk()
        out["snapshots"] = len(self.list())
        out["disk_bytes"] = self.disk_bytes()
        return out

    # --- reading ---------------------------------------------------------------------------------
    def list(self) -> dict[str, dict]:
        """The index: snapshot id -> steps, env id, sizes, created, last used, pinned."""
        with self._index.locked():
            return self._index.reconcile()["snapshots"]

    def ids(self) -> list[str]:
        """The stored snapshot ids, oldest first."""
        snaps = self.list()
        return sorted(snaps, key=lambda s: snaps[s]["created"] or 0)

    def meta(self, snap_id: str) -> dict:
        """A stored snapshot's bundle.json (not verified; see :meth:`verify`)."""
        try:
            with open(os.path.join(self._snap_dir(snap_id), "bundle.json")) as f:
                return json.load(f)
        except FileNotFoundError:
            raise StoreError(f"no snapshot {snap_id!r} in {self.path}") from None

    def materialize(self, snap_id: str, dest: str) -> str:
        """Write the full images of ``snap_id`` into the new directory ``dest``, verified; returns
        ``dest``.  Raises SnapshotCorruptedError (gone, HMAC, chunk or image check failed)."""
        self._materialize(snap_id, dest)
        return dest

    def _materialize(self, snap_id: str, dest: str) -> dict:
        d = self._snap_dir(snap_id)
        if not os.path.isdir(d):
            raise SnapshotCorruptedError(f"snapshot {snap_id} is no longer in the store {self.path} "
                                         "(removed or evicted by the disk budget)")
        meta = read_bundle_meta(d)  # HMAC first: it covers every image's sha256
        sessiondir.private_mkdir(dest)
        imgs = os.path.join(d, "images")
        for name in os.listdir(imgs):
            try:
                os.link(os.path.join(imgs, name), os.path.join(dest, name))
            except OSError:
                shutil.copyfile(os.path.join(imgs, name), os.path.join(dest, name))
        full = self.verify_mode == "full"
        what = f"snapshot {snap_id}"
        for name, entry in self._recipe(snap_id)["files"].items():
            with open(os.path.join(dest, name), "wb") as out:
                for c in entry["chunks"]:
                    out.write(self._chunks.read(c, verify=full, what=what))
        man = sessiondir.read_manifest(dest)
        if man["files"] != meta["images"]:
            raise SnapshotCorruptedError(f"{what}: image manifest does not match bundle.json")
        sessiondir.verify(dest, full=full)
        return meta

    def verify(self, snap_id: str) -> dict:
        """Reassemble and check every image of ``snap_id`` (HMAC, chunk and file sha256); returns
        its bundle.json."""
        tmp = os.path.join(sessiondir.session_dir(), f"verify-{snap_id}-{os.urandom(3).hex()}")
        try:
            self._materialize(snap_id, tmp)
            return self.meta(snap_id)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def load(self, snap_id: str) -> Snapshot:
        """A :class:`Snapshot` of a stored snapshot (e.g. from an earlier process); restore it with
        ``ForkableEnv.from_snapshot(snap)`` or ``env.restore(snap)`` (same env id).

        Raises:
            StoreError: no such snapshot here.
            BundleError: its HMAC does not verify, or this machine cannot restore it.
        """
        with self._tlock:
            s = self._handles.get(snap_id)
            if s is not None and not s.released:
                return s
            d = self._snap_dir(snap_id)
            meta = read_bundle_meta(d) if os.path.isdir(d) else None
            if meta is None:
                raise StoreError(f"no snapshot {snap_id!r} in {self.path}")
            backend = backend_named(meta["backend"])
            backend.check_compatible(meta, d)
            payload = backend.payload_at(d, meta)
            self._stored[payload] = snap_id
            snap = Snapshot._from_meta(meta, backend, payload, sum(f["size"] for f in meta["images"].values()), d)
            snap._store = self
            snap.pinned = os.path.exists(os.path.join(d, PINNED))
            self._handles[snap_id] = snap
            return snap

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
    DIR/quarantine/<id>-<time>/   damaged entries, moved aside with the reason (never deleted
                            silently; ``gym-fork snapshots ls`` lists them)

A snapshot is written into ``.tmp-*``, the file system is flushed, and the directory renamed
into ``snaps/``; only then is the index rewritten.  A write that fails (a full disk:
:class:`~gym_fork.errors.NoSpaceError`) leaves nothing: its directory and the chunks it created
are removed, and the snapshot stays as it was.  Before a restore the images are reassembled into
the private session directory -- the files the entry's signed list names, copied and checked
while copied, and the chunked ones rebuilt and checked -- and the restore reads that copy, so
nothing done to the store directory after the check changes what is restored.  Which images
are cut into chunks, and where, the snapshot's backend decides (CRIU: page images, along the
dumped virtual addresses).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import shutil
import time
import weakref
import warnings
from typing import Any, Collection, Iterator

from gym_fork.errors import BundleDamagedError, BundleError, NoSpaceError, SnapshotCorruptedError, StoreError
from gym_fork.interrupts import held
from gym_fork.snapshots import private_dirs, quarantine, sessiondir
from gym_fork.snapshots.budgets import MemoryBudget, disk_evictions
from gym_fork.snapshots.bundle import bundle_meta, check_images, read_bundle_meta, sign_meta
from gym_fork.snapshots.chunks import ChunkFiles, count_refs, read_recipe
from gym_fork.snapshots.files import as_no_space, fsync_dir, syncfs
from gym_fork.snapshots.index import PINNED, StoreIndex
from gym_fork.snapshots.snapshot import Snapshot, backend_named
from gym_fork.snapshots.workspace import pack as pack_workspace

CHUNK_SIZE = 16 * 1024
_TMP_PREFIX = ".tmp-"


def _write_json(path: str, obj: Any) -> None:
    """A new file (0600) holding ``obj`` as JSON; not flushed (the caller flushes the file system)."""
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600), "w") as f:
        json.dump(obj, f, indent=1)


def _kept_in_another_store(snap: Snapshot, store: "SnapshotStore") -> bool:
    """Whether ``snap``'s payload stands for an entry of a store other than ``store``."""
    other = snap._store
    if other is None or other is store:
        return False
    try:
        return other._stored.get(snap.payload()) is not None
    except TypeError:  # (bytes, None: never stored)
        return False


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
        verify: ``"full"`` (check every image's sha256 when reassembling) or ``"size"``.

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
        # payloads that stand for images kept here (restores reassemble them) -> (snapshot id,
        # the signed image list it was loaded with: an entry swapped since is refused)
        self._stored: weakref.WeakKeyDictionary[Any, tuple[str, dict]] = weakref.WeakKeyDictionary()
        self._over_budget_said = False
        self.stats = {"spilled": 0, "collected": 0, "evicted": 0, "written": 0, "quarantined": 0}
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

    def _what(self, snap_id: str) -> str:
        return f"snapshot {snap_id} in {self.path}"

    # --- damage ----------------------------------------------------------------------------------
    def _quarantine(self, snap_id: str, reason: str) -> str | None:
        """Move a damaged entry aside (logged, listed by :meth:`damaged`); returns where to."""
        with self._index.locked():
            idx = self._index.read()
            where = self._index.quarantine(idx, snap_id, reason)
            self._index.write(idx)
        self._recipes.pop(snap_id, None)
        if where is not None:
            self.stats["quarantined"] += 1
        return where

    def _damaged(self, snap_id: str, e: BundleDamagedError) -> BundleDamagedError:
        where = self._quarantine(snap_id, str(e))
        return BundleDamagedError(f"{e}; the entry was moved to {where} (nothing deleted)" if where else str(e))

    def _read_meta(self, snap_id: str, *, require_hmac: bool = True) -> dict:
        """A stored entry's bundle.json (HMAC and types checked); a damaged one is quarantined.
        Raises StoreError (no such entry), BundleDamagedError, BundleError (HMAC)."""
        d = self._snap_dir(snap_id)
        if not os.path.isdir(d):
            raise StoreError(f"no snapshot {snap_id!r} in {self.path}")
        try:
            meta = read_bundle_meta(d, require_hmac=require_hmac)
            check_images(meta.get("images"), self._what(snap_id))
        except BundleDamagedError as e:
            raise self._damaged(snap_id, e) from None
        if meta["id"] != snap_id:
            raise SnapshotCorruptedError(f"{self._what(snap_id)}: the entry holds snapshot {meta['id']!r} (moved "
                                         "or swapped); nothing was used")
        return meta

    def damaged(self) -> list[dict]:
        """The quarantined entries: ``{"id", "path", "reason", "time"}`` (see :mod:`.quarantine`)."""
        return quarantine.entries(self.path)

    def check(self, *, hmac_too: bool = True) -> dict[str, str]:
        """Read every entry's bundle.json and recipe.json: damaged entries are quarantined (and
        then listed by :meth:`damaged`).  Returns the entries that are intact but whose HMAC
        does not verify with this machine's key (id -> reason; they stay where they are: another
        key is not damage)."""
        unverified = {}
        with self._index.locked():
            idx = self._index.reconcile()
            for sid in list(idx["snapshots"]):
                try:
                    self._index.entry_from_dir(sid)
                    if hmac_too:
                        read_bundle_meta(self._snap_dir(sid))
                except BundleDamagedError as e:
                    self._index.quarantine(idx, sid, str(e))
                    self._recipes.pop(sid, None)
                    self.stats["quarantined"] += 1
                except BundleError as e:
                    unverified[sid] = str(e)
            self._index.write(idx)
        return unverified

    # --- chunk references ------------------------------------------------------------------------
    def _recipe(self, snap_id: str) -> dict:
        """The entry's checked recipe (cached).  Raises BundleDamagedError."""
        r = self._recipes.get(snap_id)
        if r is None:
            r = read_recipe(self._snap_dir(snap_id), self._what(snap_id))
            self._recipes[snap_id] = r
        return r

    def _chunk_refs(self, ids: Any) -> dict[str, int]:
        """How often each chunk is used by the entries ``ids`` (their recipes must be intact)."""
        return count_refs(self._recipe(sid) for sid in ids)

    def _refs(self, idx: dict) -> dict[str, int]:
        """How often each chunk is used by the entries in ``idx`` (an entry whose recipe is
        damaged is quarantined and dropped from ``idx``) and by quarantined entries (whose
        chunks are kept).  Call locked."""
        recipes = []
        for sid in list(idx["snapshots"]):
            try:
                recipes.append(self._recipe(sid))
            except BundleDamagedError as e:
                self._index.quarantine(idx, sid, str(e))
                self.stats["quarantined"] += 1
        recipes += self._quarantined_recipes()[0]
        return count_refs(recipes)

    def _quarantined_recipes(self) -> tuple[list[dict], list[str]]:
        """The readable recipes of quarantined entries, and the entries whose recipe is not."""
        good, bad = [], []
        for path in quarantine.recipe_paths(self.path):
            try:
                good.append(read_recipe(os.path.dirname(path), path))
            except BundleDamagedError:
                bad.append(os.path.dirname(path))
        return good, bad

    # --- writing ---------------------------------------------------------------------------------
    def put(self, snap: Snapshot) -> str:
        """Write ``snap`` into the store; it stays usable, now restored from here.  Returns its
        directory.  The snapshot's frozen process (fork tier) ends: it now costs disk, not memory.

        Raises:
            StoreError: its backend keeps no image files (e.g. pickle).
            NoSpaceError: the disk is full; nothing of this write is left in the store, and the
                snapshot stays restorable (from the images it was persisted to).
        """
        with self._tlock:
            backend = snap._backend
            if os.path.isdir(self._snap_dir(snap.id)):  # stored already: restores come from here now
                old = snap.payload()
                self._attach(snap)
                backend.release(old)
                return self._snap_dir(snap.id)
            if _kept_in_another_store(snap, self):
                # its images are another store's entry (chunked, no MANIFEST): reassembled from
                # there (and verified) for the write; that store keeps its own copy
                with snap._open_payload() as payload:
                    images, fields = backend.store_images(payload)
                    meta = self._write(snap, images, fields)
                self._attach(snap, meta)
                self._enforce_disk(keep={snap.id})
                return self._snap_dir(snap.id)
            snap.persist(keep_in_memory=False)  # e.g. a CRIU dump into the session dir
            payload = snap.payload()
            images, fields = backend.store_images(payload)
            try:
                meta = self._write(snap, images, fields)
            except NoSpaceError:  # it holds no memory now: restorable from the session-dir images
                self._memory.forget(snap.id)
                raise
            backend.release(payload)  # its images in the session dir: restores now come from here
            self._attach(snap, meta)
            self._enforce_disk(keep={snap.id})
        return self._snap_dir(snap.id)

    def _write(self, snap: Snapshot, images: str, fields: dict) -> dict:
        """Write ``snap``'s entry from the image files in ``images``; returns its bundle.json.
        Raises NoSpaceError on a full disk (after removing its directory and new chunks)."""
        man = sessiondir.verify(images, full=True, digests=True)  # never store a corrupted image
        with self._index.locked():
            tmp = os.path.join(self.path, f"{_TMP_PREFIX}{snap.id}-{os.getpid()}-{os.urandom(3).hex()}")
            created: list[str] = []  # chunks this write adds: removed again if it fails
            try:
                sessiondir.private_mkdir(tmp)
                imgs = sessiondir.private_mkdir(os.path.join(tmp, "images"))
                recipe: dict = {"chunk_size": self.chunk_size, "files": {}}
                for name, want in sorted(man["files"].items()):  # the signed images, nothing else
                    src = os.path.join(images, sessiondir.check_image_name(name, images))
                    lengths = snap._backend.chunk_lengths(images, name, self.chunk_size) if self.dedup else None
                    if lengths is not None:
                        recipe["files"][name] = {"size": want["size"],
                                                 "chunks": self._chunks.put(src, lengths, created)}
                    else:
                        shutil.copyfile(src, os.path.join(imgs, name))
                        os.chmod(os.path.join(imgs, name), 0o600)
                meta = bundle_meta(snap, **fields, images=man["files"])
                if snap.workspace is not None:  # the env's files at the snapshot moment
                    meta["workspace"] = pack_workspace(snap.workspace, os.path.join(tmp, "workspace"), times=True)
                    meta["workspace_path"] = snap.workspace_path
                    if getattr(snap, "workspace_aliases", ()):
                        meta["workspace_aliases"] = list(snap.workspace_aliases)
                if getattr(snap, "private_dirs", None):  # the env's private directories at that moment
                    meta["private_dirs"] = private_dirs.pack(snap, os.path.join(tmp, "private_dirs"))
                sign_meta(meta)
                _write_json(os.path.join(tmp, "recipe.json"), recipe)  # flushed by the syncfs below
                _write_json(os.path.join(tmp, "bundle.json"), meta)
                if snap.pinned:
                    os.close(os.open(os.path.join(tmp, PINNED), os.O_WRONLY | os.O_CREAT, 0o600))
                syncfs(tmp)  # chunks, images, metadata durable before the snapshot is visible
                final = self._snap_dir(snap.id)
                os.rename(tmp, final)
            except BaseException as e:
                shutil.rmtree(tmp, ignore_errors=True)
                self._chunks.remove(created)
                full = as_no_space(e, self.path, f"snapshot {snap.id} into the store",
                                   sum(f["size"] for f in man["files"].values()))
                if full is not None and full is not e:
                    raise full from e
                raise
            with contextlib.suppress(OSError):
                fsync_dir(os.path.dirname(final))
            self._recipes[snap.id] = recipe
            idx = self._index.reconcile()
            e = idx["snapshots"].get(snap.id)
            if e is not None:
                e["last_used"] = time.time()
                self._index.write(idx)
            self.stats["written"] += 1
        return meta

    def _attach(self, snap: Snapshot, meta: dict | None = None) -> None:
        """Point ``snap`` at the store copy (restores reassemble it; release keeps it on disk)."""
        d = self._snap_dir(snap.id)
        if meta is None:
            meta = self._read_meta(snap.id)
        payload = snap._backend.payload_at(d, meta)
        self._stored[payload] = (snap.id, meta["images"])
        snap._keep_in(self, payload, d)
        self._handles[snap.id] = snap
        self._memory.forget(snap.id)

    # --- the env's hooks -------------------------------------------------------------------------
    def add(self, snap: Snapshot) -> None:
        """Track a snapshot just taken; enforce the memory budget.

        Raises:
            NoSpaceError: an older snapshot had to go to disk and the disk is full.  The snapshot
                just taken is released (a failed ``snapshot()`` changes nothing); the older one
                stays restorable (in memory, or, if its images were written, from them).
        """
        snap._store = self
        with self._tlock:
            self._memory.add(snap)
            self._handles[snap.id] = snap
            try:
                self._enforce_memory()
            except NoSpaceError as e:
                self._memory.forget(snap.id)
                snap.release()
                err = NoSpaceError(f"{e} [the store spills in-memory snapshots to disk to keep its memory budget "
                                   f"(max_in_memory={self.max_in_memory}, max_memory={self.max_memory}); the "
                                   "snapshot just taken was dropped; the one being spilled is not in the store but "
                                   "stays restorable in this process (store.put(it) once there is space); the env "
                                   "keeps running]")
                err.path, err.free_bytes, err.needed_bytes = e.path, e.free_bytes, e.needed_bytes
                raise err from e

    def touch(self, snap: Snapshot) -> None:
        """``snap`` was just used (restore/fork): most recently used now."""
        with self._tlock:
            if not self._memory.touch(snap.id) and os.path.isdir(self._snap_dir(snap.id)):
                with self._index.locked():
                    self._index.touch(snap.id)

    def set_pinned(self, snap_id: str, pinned: bool) -> None:
        """Pin or unpin ``snap_id``.  Pinning a snapshot that is still only in memory writes it
        into the store (:meth:`put`), so that later processes can :meth:`load` it.

        Raises:
            NoSpaceError: the disk is full (the snapshot is not in the store).
        """
        with self._tlock:
            if not os.path.isdir(self._snap_dir(snap_id)):
                snap = self._handles.get(snap_id)
                if pinned and snap is not None and not snap.released and snap._backend.storable:
                    self.put(snap)  # written with its PINNED marker
                return
            with self._index.locked():
                self._index.set_pinned(snap_id, pinned)

    @contextlib.contextmanager
    def reassembled(self, snap: Snapshot, payload: Any) -> Iterator[Any]:
        """``payload`` itself, or, if it stands for images kept here, a payload over those images
        reassembled (and verified) in the private session directory for the duration."""
        try:
            ref = self._stored.get(payload)
        except TypeError:  # bytes (pickle backend), None: not weak-referenceable, never stored
            ref = None
        if ref is None:
            yield payload
            return
        snap_id, images = ref
        dest = os.path.join(sessiondir.session_dir(), f"m-{snap_id}-{os.urandom(4).hex()}")
        try:
            meta = self._materialize(snap_id, dest, expect=images)
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
        with self._index.locked():
            idx = self._index.read()
            refs = self._refs(idx)
        return (sum(e.get("own_bytes", 0) for e in idx["snapshots"].values())
                + sum(self._chunks.disk_bytes(c) for c in refs))

    def _enforce_disk(self, keep: set = frozenset()) -> tuple[int, int]:
        """Evict until the disk budget holds; returns how many snapshots were evicted and the
        bytes that freed (their own files and the chunks only they used), for gc's report."""
        if self.max_bytes is None:
            return 0, 0
        with self._index.locked():
            idx = self._index.reconcile()
            refs = self._refs(idx)
            sizes = {c: self._chunks.disk_bytes(c) for c in refs}
            evicted = freed = 0
            with held():  # (the evicted entries' chunks go with them: cut before, they stayed until a gc())
                for sid in disk_evictions(idx["snapshots"], self._recipe, refs, sizes, self.max_bytes, keep):
                    freed += idx["snapshots"][sid].get("own_bytes", 0)
                    self._remove_locked(idx, sid, why=f"evicted from the store {self.path} by its disk budget "
                                                      f"(max_bytes={self.max_bytes}; pin() keeps one)")
                    self.stats["evicted"] += 1
                    evicted += 1
                self._index.write(idx)
                self._chunks.drop_unreferenced(refs)
            freed += sum(sizes[c] for c, n in refs.items() if n <= 0)
            left = (sum(e.get("own_bytes", 0) for e in idx["snapshots"].values())
                    + sum(sizes[c] for c, n in refs.items() if n > 0))
            if left <= self.max_bytes:
                self._over_budget_said = False
            elif not self._over_budget_said:  # only pinned (and the just written) snapshots are left
                self._over_budget_said = True  # said once per excess, not at every write
                self._warn_over_budget(idx, left, keep)
        return evicted, freed

    def _warn_over_budget(self, idx: dict, left: int, keep: Collection[str]) -> None:
        """A budget the store cannot keep is said, not silently broken: every evictable snapshot
        is gone and what cannot be evicted still exceeds ``max_bytes``."""
        pinned = sorted(sid for sid, e in idx["snapshots"].items() if e.get("pinned"))
        held = sorted(set(keep) - set(pinned))
        warnings.warn(
            f"gym_fork: the store {self.path} holds {left / 2**20:.1f} MiB, over its disk budget "
            f"max_bytes={self.max_bytes} ({self.max_bytes / 2**20:.1f} MiB), and nothing more can "
            f"be evicted: {len(pinned)} pinned snapshot(s) {pinned[:5]}"
            + (f" and the one just written {held}" if held else "")
            + " must stay. Unpin some (snap.unpin() or `gym-fork snapshots rm ID`) or raise max_bytes.",
            RuntimeWarning, stacklevel=4)

    def _remove_locked(self, idx: dict, sid: str, why: str | None = None) -> None:
        d = self._snap_dir(sid)
        trash = os.path.join(self.path, f"{_TMP_PREFIX}rm-{sid}-{os.urandom(3).hex()}")
        # (Ctrl-C waits until the entry is gone whole: cut after the rename, its files stayed
        # as an uncounted .tmp-rm directory until a gc(), and its snapshot unreleased)
        with held():
            with contextlib.suppress(FileNotFoundError):
                os.rename(d, trash)  # invisible in one step, then deleted
                shutil.rmtree(trash, ignore_errors=True)
            idx["snapshots"].pop(sid, None)
            self._recipes.pop(sid, None)
            s = self._handles.get(sid)
            if s is not None:
                s._released_why = why or f"removed from the store {self.path}"
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
            try:
                mine = count_refs([self._recipe(snap_id)])
            except BundleDamagedError:  # its chunks cannot be told: gc sweeps what nothing uses
                mine = {}
            with held():  # (its chunks go with it: cut before, they stayed on disk until a gc())
                self._remove_locked(idx, snap_id)
                others = self._refs(idx)
                self._index.write(idx)
                self._chunks.drop_unreferenced({c: others.get(c, 0) for c in mine})

    def gc(self, *, drop_quarantined: bool = False) -> dict:
        """Remove what crashed writers left (temp dirs, orphan chunks), check every entry (the
        damaged ones go to quarantine), reconcile the index and enforce the disk budget.  Safe
        while other processes use the store (it takes the lock).  ``drop_quarantined``: also
        delete the quarantined entries (each deletion is logged and reported).  ``evicted`` and
        ``evicted_bytes`` in the result: the snapshots the disk budget evicted, and the bytes freed."""
        out: dict[str, Any] = {"tmp_removed": 0, "chunks_removed": 0, "quarantine_dropped": [], "chunks_kept_for": []}
        with self._index.locked():
            for name in os.listdir(self.path):
                if name.startswith(_TMP_PREFIX) or self._index.is_temp(name):
                    shutil.rmtree(os.path.join(self.path, name), ignore_errors=True)
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(self.path, name))
                    out["tmp_removed"] += 1
            self.check(hmac_too=False)
            if drop_quarantined:
                out["quarantine_dropped"] = quarantine.drop_all(self.path)
            idx = self._index.reconcile()
            refs = self._refs(idx)
            # a quarantined entry whose recipe is unreadable: its chunks cannot be told from
            # garbage, so none is swept until the quarantine is dropped (never a silent loss)
            out["chunks_kept_for"] = self._quarantined_recipes()[1]
            if not out["chunks_kept_for"]:
                out["chunks_removed"] = self._chunks.sweep(refs)
            self._index.write(idx)
        out["evicted"], out["evicted_bytes"] = self._enforce_disk()
        out["snapshots"] = len(self.list())
        out["quarantined"] = len(self.damaged())
        out["disk_bytes"] = self.disk_bytes()
        return out

    # --- reading ---------------------------------------------------------------------------------
    def list(self) -> dict[str, dict]:
        """The index: snapshot id -> steps, env id, sizes, created, last used, pinned.  Damaged
        entries are not in it (see :meth:`damaged`)."""
        with self._index.locked():
            return self._index.reconcile()["snapshots"]

    def ids(self) -> list[str]:
        """The stored snapshot ids, oldest first."""
        snaps = self.list()
        return sorted(snaps, key=lambda s: snaps[s]["created"] or 0)

    def meta(self, snap_id: str) -> dict:
        """A stored snapshot's bundle.json (its types checked, not its HMAC or images; see
        :meth:`verify`).  Raises StoreError (no such entry) or BundleDamagedError (quarantined)."""
        return self._read_meta(snap_id, require_hmac=False)

    def materialize(self, snap_id: str, dest: str) -> str:
        """Write the full images of ``snap_id`` into the new directory ``dest``, verified; returns
        ``dest``.  Raises SnapshotCorruptedError (gone, HMAC, chunk or image check failed)."""
        self._materialize(snap_id, dest)
        return dest

    def _materialize(self, snap_id: str, dest: str, expect: dict | None = None) -> dict:
        """Copy (checking while copying) the entry's whole images and rebuild its chunked ones in
        ``dest``: exactly the signed list, nothing else.  ``expect``: the signed image list the
        snapshot was loaded with (an entry replaced since is refused).  Returns the bundle.json."""
        what = self._what(snap_id)
        d = self._snap_dir(snap_id)
        if not os.path.isdir(d):
            raise SnapshotCorruptedError(f"snapshot {snap_id} is no longer in the store {self.path} "
                                         "(removed or evicted by the disk budget)")
        meta = self._read_meta(snap_id)  # HMAC first: it covers every image's sha256
        signed = meta["images"]
        if expect is not None and signed != expect:
            raise SnapshotCorruptedError(f"{what}: the entry's images are not those it had when this snapshot "
                                         "was loaded (replaced or swapped); nothing was restored")
        try:
            chunked = self._recipe(snap_id)["files"] if expect is None else read_recipe(d, what)["files"]
        except BundleDamagedError as e:
            raise self._damaged(snap_id, e) from None
        odd = [n for n, e in chunked.items() if n not in signed or e["size"] != signed[n]["size"]]
        if odd:
            raise SnapshotCorruptedError(f"{what}: recipe.json does not match the signed image list ({odd[:3]}); "
                                         "nothing was restored")
        full = self.verify_mode == "full"
        sessiondir.private_mkdir(dest)
        try:
            sessiondir.copy_verified(os.path.join(d, "images"), {n: v for n, v in signed.items() if n not in chunked},
                                     dest, what, full=full)
            for name, entry in chunked.items():
                self._rebuild(name, entry["chunks"], signed[name], dest, what, full)
            sessiondir.write_signed_manifest(dest, signed, {"id": snap_id})
        except OSError as e:
            err = as_no_space(e, dest, f"the images of {what}")
            if err is not None:
                raise err from e
            raise
        return meta

    def _rebuild(self, name: str, chunks: list, want: dict, dest: str, what: str, full: bool) -> None:
        """Write the image ``name`` from its chunks into ``dest``, checked against ``want``."""
        sessiondir.check_image_name(name, what)
        h = hashlib.sha256()
        done = 0
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(os.path.join(dest, name), flags, 0o600)
        with os.fdopen(fd, "wb") as out:
            for c in chunks:
                data = self._chunks.read(c, verify=full, what=what, size=max(want["size"] - done, 0))
                if full:
                    h.update(data)
                out.write(data)
                done += len(data)
        if done != want["size"] or (full and not hmac.compare_digest(h.hexdigest(), want["sha256"])):
            raise SnapshotCorruptedError(f"{what}: image {name} rebuilt from its chunks fails its signed "
                                         f"{'sha256' if full else 'size'} check; nothing was restored")

    def verify(self, snap_id: str) -> dict:
        """Reassemble and check every image of ``snap_id`` (HMAC, exactly the signed files, chunk
        and file sha256); returns its bundle.json."""
        tmp = os.path.join(sessiondir.session_dir(), f"verify-{snap_id}-{os.urandom(3).hex()}")
        try:
            return self._materialize(snap_id, tmp)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def load(self, snap_id: str) -> Snapshot:
        """A :class:`Snapshot` of a stored snapshot (e.g. from an earlier process); restore it with
        ``ForkableEnv.from_snapshot(snap)`` or ``env.restore(snap)`` (same env id).

        Raises:
            StoreError: no such snapshot here.
            BundleError: its HMAC does not verify, or this machine cannot restore it.
            BundleDamagedError: its metadata is damaged (the entry is moved into quarantine).
        """
        with self._tlock:
            s = self._handles.get(snap_id)
            if s is not None and not s.released:
                return s
            d = self._snap_dir(snap_id)
            meta = self._read_meta(snap_id)
            backend = backend_named(meta["backend"])
            try:
                backend.check_compatible(meta, d)
            except BundleDamagedError as e:
                raise self._damaged(snap_id, e) from None
            payload = backend.payload_at(d, meta)
            self._stored[payload] = (snap_id, meta["images"])
            snap = Snapshot._from_meta(meta, backend, payload, sum(f["size"] for f in meta["images"].values()), d)
            snap._store = self
            snap.pinned = os.path.exists(os.path.join(d, PINNED))
            self._handles[snap_id] = snap
            return snap

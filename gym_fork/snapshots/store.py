"""A bounded, crash-safe, deduplicating snapshot store on disk.

``ForkableEnv(..., store=SnapshotStore(dir, max_bytes=..., max_memory=...))``:

* **memory budget** (``max_memory`` bytes, the sum of :meth:`Snapshot.memory_bytes` of the
  copy-on-write snapshots this store tracks, and/or ``max_in_memory`` snapshots): beyond it the
  least recently used in-memory snapshots are written into the store (CRIU images) and their
  frozen processes end.  A snapshot nobody references any more is collected (its frozen process
  ends) without being written: the store holds only weak references.
* **disk budget** (``max_bytes``, real bytes of the store directory): beyond it the least recently
  used *unpinned* snapshots are deleted (``snapshot.pin()`` protects one).  Deleted snapshots raise
  ``SnapshotReleasedError``/``SnapshotCorruptedError`` when restored.
* **survives the process**: every written snapshot is a bundle in ``DIR/snaps/<id>/``;
  :meth:`SnapshotStore.load` (or ``gym-fork snapshots ls DIR``) finds it later.

Layout (everything 0700/0600)::

    DIR/lock                flock: one writer at a time (also across processes)
    DIR/index.json          id -> steps, env id, sizes, created, last used, pinned (atomic rewrite)
    DIR/snaps/<id>/         bundle.json (as Snapshot.save, with HMAC), images/ (small CRIU images
                            + MANIFEST.json), recipe.json (pages-*.img as a list of chunks), PINNED,
                            workspace/ (the env's workspace files, when it has one; listed with
                            sha256 and mode in bundle.json, whole files, not deduplicated)
    DIR/chunks/ab/<sha256>  content-addressed chunks of page images, shared by all snapshots
    DIR/.tmp-*              snapshots being written (removed by gc once their writer is gone)

Crash safety: a snapshot is written into ``.tmp-*`` (chunks are written aside and renamed to
their content hash, so a visible chunk is always complete), the file system is synced, and the
directory is renamed into ``snaps/``; only then is the index rewritten (write aside + rename).
The ``snaps/`` directories are the truth; the index is reconciled with them whenever the store
is opened or collected, so a crash between rename and index write loses nothing.  Page images
are reassembled from chunks into the private session directory before a restore and checked
against the sha256 manifest that the bundle's HMAC covers.

Deduplication: ``pages-*.img`` hold the process's memory page by page (4 KiB aligned), so
consecutive snapshots of one worker share most chunks; only changed chunks are written.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import json
import os
import platform
import shutil
import sys
import threading
import time
import weakref
from collections import OrderedDict
from typing import Any, Iterator

from gym_fork import keys
from gym_fork.snapshots import sessiondir
from gym_fork.errors import SnapshotCorruptedError, StoreError

FORMAT = 1
INDEX = "index.json"
CHUNK_SIZE = 16 * 1024
_TMP_PREFIX = ".tmp-"
# payload object -> (store, snapshot id): CRIU payloads whose images live in a store
_STORE_PAYLOADS: "weakref.WeakKeyDictionary[Any, tuple[SnapshotStore, str]]" = weakref.WeakKeyDictionary()


def _syncfs(path: str) -> None:
    """Flush the file system holding ``path`` (one call instead of an fsync per chunk)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.syncfs(fd) != 0:
            os.sync()
    except (AttributeError, OSError):
        os.sync()
    finally:
        os.close(fd)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write_json(path: str, obj: Any) -> None:
    tmp = f"{path}.tmp-{os.getpid()}-{os.urandom(3).hex()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=0, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(os.path.dirname(path))


def _file_bytes(path: str) -> int:
    """Bytes a file really occupies (allocated blocks)."""
    try:
        return os.lstat(path).st_blocks * 512  # never follow a workspace symlink
    except OSError:
        return 0


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
    """

    def __init__(self, path: str, *, max_bytes: int | None = None, max_memory: int | None = None,
                 max_in_memory: int | None = None, dedup: bool = True, chunk_size: int = CHUNK_SIZE,
                 verify: str = "full"):
        if chunk_size % 4096:
            raise ValueError("chunk_size must be a multiple of 4096 (the page size)")
        self.path = os.path.abspath(path)
        self.max_bytes = max_bytes
        self.max_memory = max_memory
        self.max_in_memory = max_in_memory
        self.dedup = dedup
        self.chunk_size = chunk_size
        self.verify_mode = verify
        for sub in ("", "snaps", "chunks"):
            sessiondir.private_mkdir(os.path.join(self.path, sub))
        self._tlock = threading.RLock()
        self._live: OrderedDict[str, weakref.ref] = OrderedDict()  # in-memory snapshots, LRU first
        self._handles: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
        self._recipes: dict[str, dict] = {}  # id -> recipe (immutable once written)
        self.stats = {"spilled": 0, "collected": 0, "evicted": 0, "written": 0}
        with self._locked():
            self._reconcile()

    # --- locking / index -------------------------------------------------------------------------
    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._tlock:
            fd = os.open(os.path.join(self.path, "lock"), os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)  # releases the flock

    def _snap_dir(self, snap_id: str) -> str:
        return os.path.join(self.path, "snaps", sessiondir.check_id(snap_id))

    def _read_index(self) -> dict:
        try:
            with open(os.path.join(self.path, INDEX)) as f:
                idx = json.load(f)
            if idx.get("format") == FORMAT:
                return idx
        except (OSError, ValueError):
            pass
        return {"format": FORMAT, "snapshots": {}}

    def _write_index(self, idx: dict) -> None:
        _atomic_write_json(os.path.join(self.path, INDEX), idx)

    def _entry_from_dir(self, snap_id: str) -> dict | None:
        d = self._snap_dir(snap_id)
        try:
            with open(os.path.join(d, "bundle.json")) as f:
                meta = json.load(f)
        except (OSError, ValueError):
            return None
        logical = sum(v["size"] for v in meta.get("images", {}).values())
        own = sum(_file_bytes(os.path.join(r, n)) for r, _, fs in os.walk(d) for n in fs)
        return {"steps": meta.get("steps"), "env_id": meta.get("env_id"), "created": meta.get("created"),
                "parent_id": meta.get("parent_id"), "last_used": meta.get("saved", time.time()),
                "logical_bytes": logical, "own_bytes": own,
                "pinned": os.path.exists(os.path.join(d, "PINNED"))}

    def _reconcile(self) -> dict:
        """Make the index list exactly the complete snapshot directories (they are the truth)."""
        idx = self._read_index()
        snaps = idx["snapshots"]
        on_disk = {n for n in os.listdir(os.path.join(self.path, "snaps")) if sessiondir._ID_RE.match(n)}
        changed = False
        for sid in list(snaps):
            if sid not in on_disk:
                del snaps[sid]
                changed = True
        for sid in sorted(on_disk - set(snaps)):
            e = self._entry_from_dir(sid)
            if e is None:  # not a complete bundle: cannot happen through rename; move it aside
                shutil.rmtree(self._snap_dir(sid), ignore_errors=True)
                continue
            snaps[sid] = e
            changed = True
        for sid, e in snaps.items():  # PINNED files are the truth for pins
            p = os.path.exists(os.path.join(self._snap_dir(sid), "PINNED"))
            if e.get("pinned") != p:
                e["pinned"] = p
                changed = True
        if changed or not os.path.exists(os.path.join(self.path, INDEX)):
            self._write_index(idx)
        return idx

    # --- chunks ----------------------------------------------------------------------------------
    def _chunk_path(self, digest: str) -> str:
        return os.path.join(self.path, "chunks", digest[:2], digest)

    def _chunk_lengths(self, src: str) -> Iterator[int]:
        """Chunk boundaries of a pages-N.img: at every pagemap entry and at every ``chunk_size``
        multiple of the *virtual address*, so a page keeps its chunk when other mappings grow or
        shrink between snapshots (fixed offsets in the file would shift, and nothing would match)."""
        pm = os.path.join(os.path.dirname(src), os.path.basename(src).replace("pages-", "pagemap-", 1))
        total = os.path.getsize(src)
        try:
            import pycriu

            with open(pm, "rb") as f:
                entries = pycriu.images.load(f)["entries"][1:]
        except Exception:  # noqa: BLE001 - no pagemap (another layout): fixed-size chunks
            entries = []
        done = 0
        for e in entries:
            vaddr, end = e["vaddr"], e["vaddr"] + e["nr_pages"] * 4096
            while vaddr < end:
                nxt = min(end, (vaddr // self.chunk_size + 1) * self.chunk_size)
                yield nxt - vaddr
                done += nxt - vaddr
                vaddr = nxt
        if done != total and done:  # the pagemap does not describe this file: start over, fixed
            raise ValueError("pagemap mismatch")
        while done < total:
            yield min(self.chunk_size, total - done)
            done += self.chunk_size

    def _put_chunks(self, src: str) -> list[str]:
        """Split ``src`` into chunks stored by sha256; returns their digests."""
        out = []
        try:
            lengths = list(self._chunk_lengths(src))
        except ValueError:
            lengths = [self.chunk_size] * -(-os.path.getsize(src) // self.chunk_size)
        with open(src, "rb") as f:
            for n in lengths:
                data = f.read(n)
                if not data:
                    break
                digest = hashlib.sha256(data).hexdigest()
                final = self._chunk_path(digest)
                if not os.path.exists(final):
                    d = os.path.dirname(final)
                    if not os.path.isdir(d):
                        sessiondir.private_mkdir(d)
                    tmp = f"{final}.tmp-{os.getpid()}"
                    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                    with os.fdopen(fd, "wb") as cf:
                        cf.write(data)
                    os.rename(tmp, final)  # a visible chunk is always complete
                out.append(digest)
        return out

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
        refs: dict[str, int] = {}
        for sid in ids:
            for entry in self._recipe(sid)["files"].values():
                for c in entry["chunks"]:
                    refs[c] = refs.get(c, 0) + 1
        return refs

    # --- writing ---------------------------------------------------------------------------------
    def put(self, snap: Any) -> str:
        """Write ``snap`` (CRIU backend) into the store; it stays usable, now restored from here.

        The snapshot's frozen process (fork tier) ends: it now costs disk, not memory."""
        if snap.backend != "criu":
            raise StoreError(f"only criu snapshots can be stored, not {snap.backend!r}")
        with self._tlock:
            if os.path.isdir(self._snap_dir(snap.id)):
                self._attach(snap)
                return self._snap_dir(snap.id)
            snap.persist(keep_in_memory=False)  # CRIU dump into the session dir (outside the lock)
            payload = snap.payload()
            image = getattr(payload, "image", None) or payload
            self._write(snap, image)
            # the session-dir images are no longer needed: restores come from the store
            if getattr(image, "owned", False) and image.path.startswith(sessiondir.session_dir()):
                shutil.rmtree(image.path, ignore_errors=True)
            self._attach(snap, ino=image.ino, fork_tier=image.fork_tier)
            self._enforce_disk(keep={snap.id})
        return self._snap_dir(snap.id)

    def _write(self, snap: Any, image: Any) -> None:
        from gym_fork.snapshots.bundle import _canonical, _json_actions, _mapped_files
        from gym_fork.criu.status import criu_status

        man = sessiondir.verify(image.path, full=True)  # never store a corrupted image
        with self._locked():
            tmp = sessiondir.private_mkdir(os.path.join(self.path, f"{_TMP_PREFIX}{snap.id}-{os.getpid()}-{os.urandom(3).hex()}"))
            try:
                imgs = sessiondir.private_mkdir(os.path.join(tmp, "images"))
                recipe: dict = {"chunk_size": self.chunk_size, "files": {}}
                for name in os.listdir(image.path):
                    src = os.path.join(image.path, name)
                    if not os.path.isfile(src) or name.endswith(".log"):
                        continue
                    if self.dedup and name.startswith("pages-") and name in man["files"]:
                        recipe["files"][name] = {"size": os.path.getsize(src), "chunks": self._put_chunks(src)}
                    else:
                        shutil.copyfile(src, os.path.join(imgs, name))
                        os.chmod(os.path.join(imgs, name), 0o600)
                meta = {
                    "format": 1, "backend": "criu", "id": snap.id, "steps": snap.steps,
                    "parent_id": snap.parent_id, "created": snap.created, "saved": time.time(),
                    "env_id": snap.env_id, "actions": _json_actions(snap.actions),
                    "python": sys.executable, "python_version": platform.python_version(),
                    "kernel": platform.release(), "machine": platform.machine(),
                    "criu_version": criu_status().version, "ino": image.ino, "fork_tier": image.fork_tier,
                    "images": man["files"], "files": _mapped_files(image.path),
                }
                if snap.workspace is not None:  # the env's files at the snapshot moment
                    from gym_fork.snapshots.workspace import pack

                    meta["workspace"] = pack(snap.workspace, os.path.join(tmp, "workspace"))
                    meta["workspace_path"] = snap.workspace_path
                meta["hmac"] = keys.sign(_canonical(meta))
                with open(os.path.join(tmp, "recipe.json"), "w") as f:
                    json.dump(recipe, f)
                with open(os.path.join(tmp, "bundle.json"), "w") as f:
                    json.dump(meta, f, indent=1)
                if getattr(snap, "pinned", False):
                    open(os.path.join(tmp, "PINNED"), "w").close()
                for name in ("recipe.json", "bundle.json", "PINNED"):
                    if os.path.exists(os.path.join(tmp, name)):
                        os.chmod(os.path.join(tmp, name), 0o600)
                _syncfs(tmp)  # chunks, images, metadata durable before the snapshot is visible
                final = self._snap_dir(snap.id)
                os.rename(tmp, final)
                _fsync_dir(os.path.dirname(final))
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            self._recipes[snap.id] = recipe
            idx = self._reconcile()
            e = idx["snapshots"].get(snap.id) or self._entry_from_dir(snap.id)
            e["last_used"] = time.time()
            idx["snapshots"][snap.id] = e
            self._write_index(idx)
            self.stats["written"] += 1

    def _attach(self, snap: Any, ino: int | None = None, fork_tier: bool = True) -> None:
        """Point ``snap`` at the store copy (restores reassemble it; release keeps it on disk)."""
        from gym_fork.backends.criu import CriuPayload

        if ino is None:
            with open(os.path.join(self._snap_dir(snap.id), "bundle.json")) as f:
                meta = json.load(f)
            ino, fork_tier = meta["ino"], meta.get("fork_tier", False)
        payload = CriuPayload(self._snap_dir(snap.id), ino, fork_tier=fork_tier, owned=False)
        _STORE_PAYLOADS[payload] = (self, snap.id)
        snap._payload = payload
        snap._store = self
        snap.bundle_path = self._snap_dir(snap.id)
        self._handles[snap.id] = snap
        self._live.pop(snap.id, None)

    # --- the env's hooks -------------------------------------------------------------------------
    def add(self, snap: Any) -> None:
        """Track a snapshot just taken; enforce the memory budget."""
        snap._store = self
        with self._tlock:
            self._live[snap.id] = weakref.ref(snap)
            self._handles[snap.id] = snap
            self._enforce_memory()

    def touch(self, snap: Any) -> None:
        """``snap`` was just used (restore/fork): most recently used now."""
        with self._tlock:
            if snap.id in self._live:
                self._live.move_to_end(snap.id)
            elif os.path.isdir(self._snap_dir(snap.id)):
                with self._locked():
                    idx = self._read_index()
                    if snap.id in idx["snapshots"]:
                        idx["snapshots"][snap.id]["last_used"] = time.time()
                        self._write_index(idx)

    def set_pinned(self, snap_id: str, pinned: bool) -> None:
        with self._tlock:
            d = self._snap_dir(snap_id)
            if not os.path.isdir(d):
                return  # in memory only: written with PINNED when it is spilled
            with self._locked():
                marker = os.path.join(d, "PINNED")
                if pinned:
                    open(marker, "w").close()
                else:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(marker)
                idx = self._read_index()
                if snap_id in idx["snapshots"]:
                    idx["snapshots"][snap_id]["pinned"] = pinned
                    self._write_index(idx)

    def _collect(self) -> None:
        for sid, ref in list(self._live.items()):
            s = ref()
            if s is None or s.released:
                del self._live[sid]
                self.stats["collected"] += 1

    def in_memory(self) -> list[Any]:
        with self._tlock:
            self._collect()
            return [s for s in (r() for r in self._live.values()) if s is not None]

    def memory_bytes(self) -> int:
        return sum(s.memory_bytes() or 0 for s in self.in_memory())

    def _enforce_memory(self) -> None:
        self._collect()
        while self._live:
            live = [s for s in (r() for r in self._live.values()) if s is not None]
            over_n = self.max_in_memory is not None and len(live) > self.max_in_memory
            over_b = self.max_memory is not None and sum(s.memory_bytes() or 0 for s in live) > self.max_memory
            if not (over_n or over_b):
                return
            victim = live[0]  # least recently used
            self.put(victim)
            self.stats["spilled"] += 1

    # --- disk budget / removal -------------------------------------------------------------------
    def disk_bytes(self) -> int:
        """Bytes the store occupies: per-snapshot files plus every referenced chunk once."""
        idx = self._read_index()
        refs = self._chunk_refs(idx["snapshots"])
        return (sum(e.get("own_bytes", 0) for e in idx["snapshots"].values())
                + sum(_file_bytes(self._chunk_path(c)) for c in refs))

    def _enforce_disk(self, keep: set = frozenset()) -> None:
        if self.max_bytes is None:
            return
        with self._locked():
            idx = self._reconcile()
            snaps = idx["snapshots"]
            refs = self._chunk_refs(snaps)
            sizes = {c: _file_bytes(self._chunk_path(c)) for c in refs}
            total = sum(e.get("own_bytes", 0) for e in snaps.values()) + sum(sizes.values())
            order = sorted((e["last_used"], sid) for sid, e in snaps.items() if not e.get("pinned") and sid not in keep)
            for _, sid in order:
                if total <= self.max_bytes:
                    break
                total -= snaps[sid].get("own_bytes", 0)
                for entry in self._recipe(sid)["files"].values():
                    for c in entry["chunks"]:
                        refs[c] -= 1
                        if refs[c] == 0:
                            total -= sizes[c]
                self._remove_locked(idx, sid)
                self.stats["evicted"] += 1
            self._write_index(idx)
            self._drop_unreferenced_chunks(refs)

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

    def _drop_unreferenced_chunks(self, refs: dict[str, int]) -> None:
        for c, n in refs.items():
            if n <= 0:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self._chunk_path(c))

    def remove(self, snap_id: str) -> None:
        """Delete one stored snapshot (and the chunks only it used)."""
        with self._locked():
            idx = self._reconcile()
            if snap_id not in idx["snapshots"]:
                raise StoreError(f"no snapshot {snap_id!r} in {self.path}")
            mine = self._chunk_refs([snap_id])
            self._remove_locked(idx, snap_id)
            self._write_index(idx)
            others = self._chunk_refs(idx["snapshots"])
            self._drop_unreferenced_chunks({c: others.get(c, 0) for c in mine})

    def gc(self) -> dict:
        """Remove what crashed writers left (temp dirs, orphan chunks), reconcile the index and
        enforce the disk budget.  Safe while other processes use the store (it takes the lock)."""
        out = {"tmp_removed": 0, "chunks_removed": 0}
        with self._locked():
            for name in os.listdir(self.path):
                if name.startswith(_TMP_PREFIX) or (name.startswith(INDEX + ".tmp-")):
                    shutil.rmtree(os.path.join(self.path, name), ignore_errors=True)
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(self.path, name))
                    out["tmp_removed"] += 1
            idx = self._reconcile()
            refs = self._chunk_refs(idx["snapshots"])
            croot = os.path.join(self.path, "chunks")
            for sub in os.listdir(croot):
                for name in os.listdir(os.path.join(croot, sub)):
                    if ".tmp-" in name or name not in refs:
                        os.unlink(os.path.join(croot, sub, name))
                        out["chunks_removed"] += 1
        self._enforce_disk()
        out["snapshots"] = len(self.list())
        out["disk_bytes"] = self.disk_bytes()
        return out

    # --- reading ---------------------------------------------------------------------------------
    def list(self) -> dict[str, dict]:
        with self._locked():
            return self._reconcile()["snapshots"]

    def ids(self) -> list[str]:
        return sorted(self.list(), key=lambda s: self.list()[s]["created"] or 0)

    def meta(self, snap_id: str) -> dict:
        try:
            with open(os.path.join(self._snap_dir(snap_id), "bundle.json")) as f:
                return json.load(f)
        except FileNotFoundError:
            raise StoreError(f"no snapshot {snap_id!r} in {self.path}") from None

    def materialize(self, snap_id: str, dest: str) -> str:
        """Write the full CRIU images of ``snap_id`` into the new directory ``dest``, verified."""
        from gym_fork.snapshots.bundle import read_bundle_meta

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
        recipe = self._recipe(snap_id)
        full = self.verify_mode == "full"
        for name, entry in recipe["files"].items():
            with open(os.path.join(dest, name), "wb") as out:
                for c in entry["chunks"]:
                    try:
                        with open(self._chunk_path(c), "rb") as f:
                            data = f.read()
                    except FileNotFoundError:
                        raise SnapshotCorruptedError(f"snapshot {snap_id}: chunk {c} is missing") from None
                    if full and hashlib.sha256(data).hexdigest() != c:
                        raise SnapshotCorruptedError(f"snapshot {snap_id}: chunk {c} fails its sha256 check")
                    out.write(data)
        man = sessiondir.read_manifest(dest)
        if man["files"] != meta["images"]:
            raise SnapshotCorruptedError(f"snapshot {snap_id}: image manifest does not match bundle.json")
        sessiondir.verify(dest, full=full)
        return dest

    def verify(self, snap_id: str) -> dict:
        """Reassemble and check every image of ``snap_id`` (HMAC, chunk and file sha256)."""
        tmp = os.path.join(sessiondir.session_dir(), f"verify-{snap_id}-{os.urandom(3).hex()}")
        try:
            self.materialize(snap_id, tmp)
            return self.meta(snap_id)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def load(self, snap_id: str) -> Any:
        """A :class:`Snapshot` of a stored snapshot (e.g. from an earlier process); restore it with
        ``ForkableEnv.from_snapshot(snap)`` or ``env.restore(snap)`` (same env id)."""
        from gym_fork.backends import get_backend
        from gym_fork.snapshots.bundle import check_compatible, read_bundle_meta
        from gym_fork.snapshots.snapshot import Snapshot

        with self._tlock:
            s = self._handles.get(snap_id)
            if s is not None and not s.released:
                return s
            d = self._snap_dir(snap_id)
            meta = read_bundle_meta(d) if os.path.isdir(d) else None
            if meta is None:
                raise StoreError(f"no snapshot {snap_id!r} in {self.path}")
            check_compatible(meta, d)
            from gym_fork.backends.criu import CriuPayload

            payload = CriuPayload(d, meta["ino"], fork_tier=meta.get("fork_tier", False), owned=False)
            _STORE_PAYLOADS[payload] = (self, snap_id)
            snap = Snapshot(backend=get_backend("criu"), payload=payload,
                            size_bytes=sum(f["size"] for f in meta["images"].values()), steps=meta["steps"],
                            parent_id=meta.get("parent_id"), lineage=None, actions=meta.get("actions"),
                            snap_id=snap_id, env_id=meta.get("env_id"))
            snap.created = meta.get("created", snap.created)
            snap.bundle_path = d
            snap._store = self
            snap.pinned = os.path.exists(os.path.join(d, "PINNED"))
            from gym_fork.snapshots.workspace import adopt

            adopt(snap, os.path.join(d, "workspace"), meta.get("workspace"), meta.get("workspace_path"), d)
            self._handles[snap_id] = snap
            return snap


@contextlib.contextmanager
def materialized(payload: Any) -> Iterator[None]:
    """While inside, a payload whose images live in a store points at reassembled images."""
    try:
        ref = _STORE_PAYLOADS.get(payload)
    except TypeError:  # bytes (pickle backend), None: not weak-referenceable, never in a store
        ref = None
    if ref is None:
        yield
        return
    st, snap_id = ref
    dest = os.path.join(sessiondir.session_dir(), f"m-{snap_id}-{os.urandom(4).hex()}")
    orig = payload.path
    try:
        st.materialize(snap_id, dest)
        payload.path = dest
        yield
    finally:
        payload.path = orig
        shutil.rmtree(dest, ignore_errors=True)


# --- `gym-fork snapshots ...` ---------------------------------------------------------------------

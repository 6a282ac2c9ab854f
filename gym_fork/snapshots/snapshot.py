"""The :class:`Snapshot` handle (one saved moment of one env), and what it needs from a backend.

A snapshot holds an opaque *payload* and the backend that made it; everything it does with the
payload (persist, save, measure, free) it asks that backend, through the methods listed in
:class:`PayloadBackend`.  Snapshots read back from disk name their backend; the backends package
tells this layer how to find one by name (:func:`set_backend_resolver`), so the data layer never
imports the mechanism.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
import weakref
from collections import deque
from typing import Any, Callable, Iterator, Protocol

from gym_fork.errors import BundleError, SnapshotReleasedError
from gym_fork.snapshots import private_dirs
from gym_fork.snapshots.workspace import adopt as adopt_workspace
from gym_fork.snapshots.bundle import save_snapshot


def new_id() -> str:
    """A fresh snapshot id (16 hex digits)."""
    return uuid.uuid4().hex[:16]


class PayloadBackend(Protocol):
    """What snapshots, bundles and the store ask of a backend (see ``gym_fork.backends.base.Backend``)."""

    name: str
    storable: bool

    def release(self, payload: Any) -> None: ...
    def persist(self, payload: Any) -> Any: ...
    def evict(self, payload: Any) -> None: ...
    def is_persisted(self, payload: Any) -> bool: ...
    def memory_bytes(self, payload: Any) -> int | None: ...
    def bundle_write(self, payload: Any, dest_dir: str) -> dict: ...
    def check_compatible(self, meta: dict, path: str) -> None: ...
    def store_images(self, payload: Any) -> tuple[str, dict]: ...
    def payload_at(self, path: str, meta: dict) -> Any: ...
    def chunk_lengths(self, images_dir: str, name: str, chunk_size: int) -> list[int] | None: ...
    # optional (looked up with getattr): ``persisted_bytes(payload) -> int | None``, the size of
    # what persist() wrote (copy-on-write snapshots have no size before)


_resolve: Callable[[str], PayloadBackend] | None = None


def set_backend_resolver(resolve: Callable[[str], PayloadBackend]) -> None:
    """Install how a backend name read from disk becomes a backend (done by ``gym_fork.backends``)."""
    global _resolve
    _resolve = resolve


def backend_named(name: str) -> PayloadBackend:
    """The backend a bundle or store entry names.  Raises BundleError for an unknown name."""
    if _resolve is None:  # gym_fork/__init__ imports the backends: only a broken install gets here
        raise BundleError(f"no backend registry is loaded to read a {name!r} snapshot; import gym_fork first")
    return _resolve(name)


class Snapshot:
    """A saved state of a :class:`~gym_fork.ForkableEnv`, restorable any number of times.

    Attributes:
        id: unique id (16 hex digits).
        backend: name of the backend that took it (``"criu"``, ``"pickle"``, ...).
        steps: steps since the last ``reset()`` at the moment it was taken (its depth).
        size_bytes: what it occupies (image files or pickle bytes); 0 for a copy-on-write snapshot
            until it is persisted (``persist()``, a store, ``save()``).
        created: ``time.time()`` when it was taken.
        parent_id: id of the snapshot this state descends from (the previous snapshot taken or
            restored on the same timeline since the last reset), or ``None``.
        actions: the actions taken from ``parent_id`` (or from reset) to this state, when the env
            records them (``record_actions=True``), else ``None``.

    Resources (processes, image files) are freed by :meth:`release`, when the env that took the
    snapshot is closed, or when the last reference to the snapshot goes away.
    """

    pinned: bool = False  # protected from a SnapshotStore's disk budget (see pin())
    workspace: str | None = None  # private copy of the env's workspace at this moment (workspace.py)
    workspace_path: str | None = None  # the live workspace directory it was captured from
    workspace_aliases: tuple[str, ...] = ()  # other paths its worker saw that directory at (workspace.binds_for)
    private_dirs: str | None = None  # the env's private_dirs at this moment, copied (private_dirs.py)
    private_dirs_paths: tuple[str, ...] | None = None  # which directories those are
    _file_finalizers: tuple = ()  # deletes captured files on release() (or when garbage-collected)
    _store: Any = None  # the SnapshotStore tracking this snapshot, if any
    # what the taking env's controller mirrored of its worker at this moment (spaces, metadata,
    # render_mode, spec: gym_fork.proxy), so a restore brings the mirror back too; None when
    # loaded (the restored worker is then asked)
    _mirror: dict | None = None
    #: whether its worker polled for requests when it was taken (ForkableEnv._set_worker_polling);
    #: not stored with it: a snapshot loaded from disk counts as polling
    _worker_polls = True
    _restored: list | None = None  # [restored yet?], shared with the taking env's RestoreRate
    #: (the taking env, its worker) as weak references, while that worker is the init of the PID
    #: namespace this snapshot's frozen process lives in: see ForkableEnv._spare_namespace
    _namespace_of: tuple | None = None

    def __init__(self, *, backend: PayloadBackend, payload: Any, size_bytes: int, steps: int,
                 parent_id: str | None, lineage: str | None, actions: list | None,
                 snap_id: str | None = None, env_id: str | None = None):
        self.id = snap_id or new_id()
        self.backend: str = backend.name
        self._size_bytes = size_bytes
        self.steps = steps
        self.created = time.time()
        self.parent_id = parent_id
        self.actions = actions
        self.lineage = lineage  # None: loaded from a bundle, restorable into any env with env_id
        self.env_id = env_id
        self.bundle_path: str | None = None
        self._payload = payload
        self._backend = backend
        self._finalizer = weakref.finalize(self, backend.release, payload)

    @classmethod
    def _from_meta(cls, meta: dict, backend: PayloadBackend, payload: Any, size_bytes: int, path: str) -> "Snapshot":
        """A snapshot read back from the bundle or store entry at ``path`` (``meta``: its verified
        bundle.json), with its workspace files verified into a private copy."""
        snap = cls(backend=backend, payload=payload, size_bytes=size_bytes, steps=meta["steps"],
                   parent_id=meta.get("parent_id"), lineage=None, actions=meta.get("actions"),
                   snap_id=meta["id"], env_id=meta.get("env_id"))
        snap.created = meta.get("created", snap.created)
        snap.bundle_path = path
        adopt_workspace(snap, os.path.join(path, "workspace"), meta.get("workspace"), meta.get("workspace_path"), path,
                        meta.get("workspace_aliases"))
        private_dirs.adopt(snap, os.path.join(path, "private_dirs"), meta.get("private_dirs"), path)
        return snap

    def _note_restored(self) -> None:
        """This snapshot was restored (counts in its taking env's :class:`RestoreRate`)."""
        if self._restored is not None:
            self._restored[0] = True

    def pin(self, pinned: bool = True) -> "Snapshot":
        """Protect this snapshot from eviction by its :class:`~gym_fork.snapshots.store.SnapshotStore`'s
        disk budget (``pin(False)`` / :meth:`unpin` undoes it). Returns the snapshot.

        A snapshot tracked by a store that is still only in memory is also written into the store
        (it stays in memory as well), so a later process can ``SnapshotStore(DIR).load(id)`` it.

        Raises:
            NoSpaceError: it had to be written and the disk is full (it stays unpinned).
        """
        was, self.pinned = self.pinned, bool(pinned)
        if self._store is not None:
            try:
                self._store.set_pinned(self.id, self.pinned)
            except BaseException:
                self.pinned = was
                raise
        return self

    def unpin(self) -> "Snapshot":
        return self.pin(False)

    @property
    def payload_backend(self) -> PayloadBackend:
        """The backend object that made this snapshot and holds its payload (``backend`` is its
        name): envs restore through it, bundles, the store and migration write the payload with it."""
        return self._backend

    @property
    def released(self) -> bool:
        return not self._finalizer.alive

    def release(self) -> None:
        """Free the snapshot's resources now. Restoring it afterwards raises SnapshotReleasedError."""
        self._finalizer()
        for fin in self._file_finalizers:  # captured files (private_dirs) go with it
            fin()
        self._payload = None

    @property
    def size_bytes(self) -> int:
        """What the snapshot occupies on disk (its image files or pickle bytes); 0 for a
        copy-on-write snapshot until its images exist -- written by :meth:`persist`, or by a
        restore or fork that needed them (a copy with workspace binds, as root)."""
        if not self._size_bytes and self._payload is not None:
            measure = getattr(self._backend, "persisted_bytes", None)
            self._size_bytes = (measure(self._payload) if measure is not None else None) or 0
        return self._size_bytes

    @size_bytes.setter
    def size_bytes(self, value: int) -> None:
        self._size_bytes = value

    def persist(self, *, keep_in_memory: bool = True) -> "Snapshot":
        """Make sure the snapshot is on disk: CRIU images (a copy-on-write snapshot is only in
        memory until then), or the pickle backend's bytes as a private file. With
        ``keep_in_memory=False`` the frozen process (or the bytes) is then released, so the
        snapshot costs no memory and later restores come from the disk."""
        payload = self._backend.persist(self.payload())
        if payload is not self._payload:  # another object stands for it now (pickle: its file)
            self._finalizer.detach()
            self._finalizer = weakref.finalize(self, self._backend.release, payload)
            self._payload = payload
        _ = self.size_bytes  # measured now, while its images are where this process wrote them
        if not keep_in_memory:
            self._backend.evict(self._payload)
        return self

    def save(self, path: str, *, key: bytes | None = None) -> str:
        """Write a self-contained bundle (images or pickle payload, metadata, checksums, an
        HMAC) to the new directory ``path``; :func:`gym_fork.load_snapshot` reads it back, in
        another process or on another machine with the same Python and libraries.  A snapshot of
        an env with a ``workspace`` carries its captured files in the bundle (``workspace/``)."""
        return save_snapshot(self, path, key=key)

    @property
    def persisted(self) -> bool:
        return self._backend.is_persisted(self.payload())

    def memory_bytes(self) -> int | None:
        """Memory the snapshot holds privately right now (copy-on-write snapshots: the pages the
        running env has rewritten since), or None where that does not apply."""
        return self._backend.memory_bytes(self.payload())

    def payload(self) -> Any:
        if self.released:
            why = getattr(self, "_released_why", None) or "explicitly, or because the env that took it was closed"
            raise SnapshotReleasedError(f"snapshot {self.id} was released ({why}); take a new snapshot")
        return self._payload

    @contextlib.contextmanager
    def _open_payload(self) -> Iterator[Any]:
        """The payload to restore or save from, for the duration: the payload itself, or, for a
        snapshot kept in a SnapshotStore, one over its images reassembled from the store's chunks.
        Raises SnapshotReleasedError (released) or SnapshotCorruptedError (the store's copy)."""
        payload = self.payload()
        if self._store is None:
            yield payload
            return
        with self._store.reassembled(self, payload) as p:
            yield p

    def _keep_in(self, store: Any, payload: Any, path: str) -> None:
        """From now on this snapshot's images are in ``store`` (at ``path``); ``payload`` stands for
        them (:meth:`_open_payload` reassembles them)."""
        self._payload = payload
        self._store = store
        self.bundle_path = path

    def __repr__(self) -> str:
        state = "released" if self.released else f"{self.size_bytes / 1e6:.2f} MB"
        return (f"Snapshot(id={self.id!r}, backend={self.backend!r}, steps={self.steps}, "
                f"parent_id={self.parent_id!r}, {state})")


class RestoreRate:
    """How many of an env's recent snapshots were restored, as a guess whether the next one will
    be: then it is worth a *ready copy*, which a fork-tier snapshot's frozen process forks ahead
    of a restore (a restore with one takes ~1.3 ms, without ~5 ms, for LunarLander here). A ready
    copy costs ~3 ms of CPU whether or not it is used, while the learner and its worker want the
    CPUs: taking a snapshot every step went from 3.5 to 6.8 ms a step with one for each, and
    ``explore(..., return_snapshots=True)``, which keeps every branch's end and restores one, was
    1.45x slower with one for each (16 branches).

    The first :data:`WARMUP` snapshots get one; then a snapshot gets one when at least
    :data:`SHARE` of the last :data:`WINDOW` snapshots were restored. A snapshot without one forks
    its ready copies from its first restore on (see :func:`gym_fork.worker.loop.frozen_loop`).

    Example::

        >>> rate = RestoreRate()
        >>> marks = [rate.taken() for _ in range(8)]   # eight snapshots, none restored
        >>> rate.likely()
        False
        >>> marks[-1][0] = marks[-2][0] = True         # two of them restored: 2 of 8 >= 25 %
        >>> rate.likely()
        True
    """

    WINDOW, WARMUP, SHARE = 16, 4, 0.25

    def __init__(self) -> None:
        self._recent: deque[list] = deque(maxlen=self.WINDOW)

    def taken(self, snap: "Snapshot | None" = None) -> list:
        """Count a new snapshot; returns its mark (``[restored yet?]``), also set on ``snap``."""
        mark = [False]
        if snap is not None:
            snap._restored = mark
        self._recent.append(mark)
        return mark

    def likely(self) -> bool:
        """Whether the next snapshot is likely to be restored (worth a ready copy)."""
        n = len(self._recent)
        return n < self.WARMUP or sum(1 for m in self._recent if m[0]) >= self.SHARE * n

"""The cloudpickle backend: the env runs in this process; a snapshot is a pickle of it.

For machines without CRIU.  It is exact only for envs whose whole state is plain Python and
NumPy (classic control, toy text, most custom envs).  It *refuses* Gymnasium's ``EzPickle``
envs (Box2D, MuJoCo, ALE): their pickle holds only constructor arguments, so a naive pickle
"restores" a fresh, different env without any error.  Every first snapshot of an env is also
checked (and again its 2nd, 4th, 8th, ..., from those later states): the copy must hold the
original's state attribute by attribute (``__slots__`` too), and a copy stepped with the same
actions, then reset, must answer as the original does, asked in a ``fork()`` child (an object
compared with ``is``, a dict keyed by ``id()``), and as a second copy does (state outside the
pickle; :mod:`gym_fork.backends.exactness`).  Every snapshot looks for sets whose order a pickle
changes, arrays that share memory and a module's sentinel objects
(:mod:`gym_fork.snapshots.set_order`).  And every call into the env is watched for draws from
generators outside the pickle -- the global RNGs of ``random``/``numpy``/``torch``, a generator
the env's module keeps (:mod:`gym_fork.backends.rng_watch`): once the env drew from one, its
snapshots and restores are refused, and a restored copy that draws raises at that call.  What the
checks cannot see is state a C library or another module keeps, reached only in steps the checks
did not take: ``backend="criu"`` copies the whole process.

A snapshot's payload is the pickle's bytes while it is only in memory, and a :class:`PickleFile`
once it is on disk (``Snapshot.persist()``, or a :class:`~gym_fork.SnapshotStore` that spilled or
keeps it): the same bytes as ``payload.pkl`` in a private directory, with their sha256, which
is checked before anything unpickles them.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import platform
import shutil
import types
from collections import deque
from typing import Any

import cloudpickle
import gymnasium as gym
import numpy as np

from gym_fork.backends.base import _READS, Backend, Handle, LocalHandle
from gym_fork.backends.exactness import copies_diverge
from gym_fork.backends.rng_watch import RngWatch
from gym_fork.errors import BundleDamagedError, BundleError, SnapshotCorruptedError, UnpicklableEnvError, UnsupportedEnvError
from gym_fork.snapshots.bundle import check_field
from gym_fork.snapshots.set_order import copy_problem, slot_items, str_hash_probe
from gym_fork.snapshots import sessiondir
from gym_fork.snapshots.files import read_bounded
from gym_fork.worker.commands import EnvServer, EnvSource, build_env

PAYLOAD = "payload.pkl"  # in a bundle
_LEGACY_PAYLOAD_LIMIT = 16 << 30  # bundles whose payload size is not signed: read at most this


def refuse_if_ezpickle(env: gym.Env) -> None:
    layer = env
    while True:
        if isinstance(layer, gym.utils.EzPickle):
            raise UnsupportedEnvError(
                f"the pickle backend cannot snapshot {type(env.unwrapped).__name__} "
                f"({env.spec.id if env.spec else type(env.unwrapped).__module__}): it is a gymnasium EzPickle "
                "env, whose pickle holds only its constructor arguments, so a copy would be a fresh, "
                "different env. Use backend='criu' (see `gym-fork doctor`), which snapshots the "
                "whole process."
            )
        if not isinstance(layer, gym.Wrapper):
            return
        layer = layer.env


def state_difference(a: Any, b: Any, path: str = "env", depth: int = 0, seen: set | None = None) -> str | None:
    """Where two object graphs differ (an attribute path), or None when they hold equal state.

    Compares instance ``__dict__``s, containers, NumPy arrays (bytes) and generators (bit-generator
    state) recursively; callables and modules are compared by identity of their qualified name only.
    """
    seen = set() if seen is None else seen
    if type(a) is not type(b):
        return f"{path} (type {type(a).__name__} vs {type(b).__name__})"
    if isinstance(a, (int, float, complex, str, bytes, bool, type(None), np.generic)):
        # (before `seen`: equal small ints and strings are one object, met all over the graph)
        return None if (a == b or (a != a and b != b)) else path
    if depth > 12 or id(a) in seen:
        return None
    seen.add(id(a))
    if isinstance(a, np.ndarray):
        ok = a.dtype == b.dtype and a.shape == b.shape and (a.dtype == object or a.tobytes() == b.tobytes())
        return None if ok else path
    if isinstance(a, np.random.Generator):
        return None if a.bit_generator.state == b.bit_generator.state else path
    if isinstance(a, dict):
        # keys matched by position (a pickle keeps a dict's order): a key that is an object
        # compared by identity is the copy's own object, equal in state, not in identity
        if len(a) != len(b):
            return f"{path} (keys)"
        for (ka, va), (kb, vb) in zip(a.items(), b.items()):
            if state_difference(ka, kb, f"{path} (key {ka!r})", depth + 1, seen):
                return f"{path} (keys)"
            d = state_difference(va, vb, f"{path}[{ka!r}]", depth + 1, seen)
            if d:
                return d
        return None
    if isinstance(a, (set, frozenset)):
        if len(a) != len(b) or (all(map(_by_value, a)) and a != b):
            return f"{path} (elements)"
        return None
    if isinstance(a, deque):
        a, b = list(a), list(b)
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return f"{path} (length)"
        for i, (x, y) in enumerate(zip(a, b)):
            d = state_difference(x, y, f"{path}[{i}]", depth + 1, seen)
            if d:
                return d
        return None
    if callable(a) and not hasattr(a, "__dict__") or isinstance(a, type):
        return None
    da, db = getattr(a, "__dict__", None), getattr(b, "__dict__", None)
    if isinstance(da, dict) and isinstance(db, dict):
        d = state_difference(da, db, path, depth + 1, seen)
        if d:
            return d
    # __slots__ (a __getstate__ may leave some out: the copy then lacks them, or holds others)
    sa, sb = dict(slot_items(a)), dict(slot_items(b))
    if sa.keys() != sb.keys():
        return f"{path} (slots {sorted(sa.keys() ^ sb.keys())} set in one only)"
    for k in sa:
        d = state_difference(sa[k], sb[k], f"{path}.{k}", depth + 1, seen)
        if d:
            return d
    return None


def _by_value(x: Any) -> bool:
    """An element a set holds by value (equal across a pickle), not by identity."""
    return type(x).__eq__ is not object.__eq__ or isinstance(x, (type, types.FunctionType, types.ModuleType))


class PickleFile:
    """A pickle snapshot on disk: ``payload.pkl`` in the private directory ``path``.

    Args:
        path: the directory (the session directory's, a store's entry or its reassembled copy).
        sha256: the payload's digest (hex), checked before the file's bytes are unpickled.
        size: the payload's size in bytes.
        str_hash_probe: the saving process's string-hash probe (see :func:`str_hash_probe`).
        blob: the bytes, while the snapshot is also kept in memory (``persist()`` without eviction).
        owned: whether releasing the snapshot deletes ``path`` (a store's entry is the store's).
    """

    __slots__ = ("path", "sha256", "size", "str_hash_probe", "blob", "owned", "__weakref__")

    def __init__(self, path: str, sha256: str, size: int, str_hash_probe: int | None,
                 blob: bytes | None = None, owned: bool = False):
        self.path, self.sha256, self.size, self.str_hash_probe = path, sha256, size, str_hash_probe
        self.blob, self.owned = blob, owned

    def read(self) -> bytes:
        """The payload's bytes, from memory or from the file (at most ``size`` bytes, checked
        against ``sha256``). Raises SnapshotCorruptedError, and then nothing was unpickled."""
        if self.blob is not None:
            return self.blob
        try:
            data = read_bounded(os.path.join(self.path, PAYLOAD), self.size, what=self.path)
        except SnapshotCorruptedError as e:
            raise SnapshotCorruptedError(f"{e}; it was not unpickled") from None
        if len(data) != self.size or not hmac.compare_digest(hashlib.sha256(data).hexdigest(), self.sha256):
            raise SnapshotCorruptedError(f"{self.path}/{PAYLOAD} fails its sha256 check (changed since it was "
                                         "written); it was not unpickled")
        return data


def payload_bytes(payload: bytes | PickleFile) -> bytes:
    """The pickle bytes of a pickle snapshot's payload, wherever it is kept."""
    return payload.read() if isinstance(payload, PickleFile) else payload


def _hash_order_problem(payload: bytes, where: str) -> None:
    """Raise BundleError when a pickle saved by a process whose string hashes differ from this
    one's holds a set that would iterate in another order here (the payload is authentic: its
    sha256 was checked, so it may be unpickled to look)."""
    try:
        state = cloudpickle.loads(payload)
    except Exception as e:  # noqa: BLE001
        raise SnapshotCorruptedError(f"{where}: the pickle snapshot does not load: {type(e).__name__}: {e}") from e
    found = copy_problem(state[0], cross_process=True)
    if found is not None:
        raise BundleError(
            f"{where}: this pickle snapshot was saved by a process whose string hashes differ from this "
            f"one's, and the env holds {found[0]}: here it would iterate in another order, so the env could "
            "continue differently. Start both processes with the same PYTHONHASHSEED (e.g. "
            "PYTHONHASHSEED=0), keep that set in a fixed order in the env (sorted(...), a dict or a "
            "list), or save it with backend='criu'. Nothing was restored.")


class _Lineage:
    """What the handles of one env lineage (an env, its restores and forks) learned about it: the
    first draw its env made from a generator outside its pickle (:mod:`.rng_watch`), as words."""

    outside: str | None = None


class _PickleHandle(LocalHandle):
    verified = False  # the exactness check ran (and could step the copies) for this env lineage
    snapshots = 0  # taken through this handle (the check runs again at the 2nd, 4th, 8th, ...)
    restored = False  # made by restore(): a draw from outside the pickle makes it go on differently

    def __init__(self, server: EnvServer, lineage: _Lineage) -> None:
        super().__init__(server)
        self.lineage = lineage
        self.rngs = RngWatch(server.env)

    def request(self, cmd: str, *args: Any) -> Any:
        if cmd in _READS or self.lineage.outside is not None and not self.restored:
            return super().request(cmd, *args)
        before = self.rngs.fingerprint()
        try:
            return super().request(cmd, *args)
        finally:
            drew = self.rngs.changed(before)
            if drew is not None:
                self._drew(cmd, drew)

    def _drew(self, cmd: str, rng: str) -> None:
        when = "at reset()" if cmd == "reset" else f"at step {self.server.steps}" if cmd == "step" else f"in {cmd!r}"
        what = (f"the env drew from {rng} {when}, which a pickle snapshot does not hold, so a restored copy "
                "draws other numbers there")
        if self.lineage.outside is None:
            self.lineage.outside = what
        if self.restored:
            # this copy is such a restored copy: from this call on it is not the original's future
            raise UnsupportedEnvError(
                f"{what}: this env, restored from a pickle snapshot, has just gone on differently from the "
                "original. Use backend='criu', which snapshots the whole process; or keep all randomness on the "
                "env (its own np_random / random.Random / torch.Generator, which the pickle holds).")

    def kill(self) -> None:
        if not self.closed:
            try:
                self.server.env.close()
            finally:
                self.closed = True


class PickleBackend(Backend):
    name = "pickle"
    storable = True  # a persisted payload is a file (PickleFile) that a SnapshotStore can keep

    def __init__(self) -> None:
        self.lineage = _Lineage()  # shared by the handles it makes (an env's, its restores', forks')

    def _refuse_outside_rng(self, what: str) -> None:
        if self.lineage.outside is not None:
            raise UnsupportedEnvError(
                f"{what} refused: {self.lineage.outside}. The pickle snapshots of this env cannot be exact; "
                "use backend='criu', which snapshots the whole process, or keep all randomness on the env (its "
                "own np_random / random.Random / torch.Generator). Nothing was done.")

    def start(self, source: EnvSource) -> tuple[Handle, dict]:
        env = build_env(source)
        try:
            refuse_if_ezpickle(env)
        except UnsupportedEnvError:
            env.close()
            raise
        server = EnvServer(env)
        return _PickleHandle(server, self.lineage), server.cmd_meta()

    def snapshot(self, handle: Handle, snap_id: str, *, ready_copy: bool = True) -> tuple[bytes, int]:
        # (ForkableEnv.snapshot holds the handle's gate: no other thread steps the env meanwhile)
        assert isinstance(handle, _PickleHandle)
        handle.check_whole("snapshot()")
        self._refuse_outside_rng("snapshot()")
        s = handle.server
        try:
            blob = cloudpickle.dumps((s.env, s.last_obs, s.last_info, s.steps))
        except Exception as e:  # noqa: BLE001
            raise UnpicklableEnvError(
                f"cloudpickle cannot capture this env ({type(e).__name__}: {e}); use backend='criu'"
            ) from e
        handle.snapshots += 1
        if not handle.verified:
            # verified once a check could step the copies (not before reset(): then again next time)
            handle.verified = self._check_copy(s.env, blob)
        elif handle.snapshots & (handle.snapshots - 1) == 0:
            # again from a later state, at the 2nd, 4th, 8th, ... snapshot: an env that reaches
            # for state outside the pickle only later (a global RNG drawn from on some event)
            # passed the first check, whose 8 steps never met that event
            self._check_copy(s.env, blob)
        else:  # a set can start to lose its order later (it shrank): looked for at every snapshot
            self._check_copy_problems(s.env)
        return blob, len(blob)

    @staticmethod
    def _check_copy_problems(env: gym.Env) -> None:
        found = copy_problem(env)
        if found is not None:
            where, fix = found
            raise UnsupportedEnvError(
                f"a pickled copy of {type(env.unwrapped).__name__} would not go on like the original: it holds "
                f"{where}, so a restore could continue differently; {fix}. Nothing was snapshotted.")

    def check_exact(self, handle: Handle) -> None:
        """Raise UnsupportedEnvError (UnpicklableEnvError when it does not pickle at all) unless this
        env pickles exactly right now. Does not mark the handle verified: its first snapshot
        checks again (after reset())."""
        assert isinstance(handle, _PickleHandle)
        handle.check_whole("snapshot()")
        s = handle.server
        try:
            blob = cloudpickle.dumps((s.env, s.last_obs, s.last_info, s.steps))
        except Exception as e:  # noqa: BLE001
            raise UnpicklableEnvError(f"cloudpickle cannot capture this env ({type(e).__name__}: {e}); "
                                      "use backend='criu'") from e
        self._check_copy(s.env, blob)

    @staticmethod
    def _check_copy(env: gym.Env, blob: bytes) -> bool:
        """Raise UnsupportedEnvError unless copies made from ``blob`` are exact: the same state
        attribute by attribute, and the same behaviour (two copies stepped with the same actions
        answer identically: state outside the pickle, e.g. the global RNGs, is caught). Returns
        whether the copies could be stepped (False before reset(): check again later)."""
        name = type(env.unwrapped).__name__
        PickleBackend._check_copy_problems(env)
        diff = state_difference(env, cloudpickle.loads(blob)[0])
        if diff is not None:
            raise UnsupportedEnvError(
                f"a pickled copy of {name} differs from the original at {diff} (its state does not "
                "survive pickling); use backend='criu'"
            )
        why, stepped = copies_diverge(blob, env.action_space, unpack=lambda t: t[0], original=env)
        if why is not None and why.startswith("the original"):
            raise UnsupportedEnvError(
                f"{why}, so a restore of {name} would go on differently: part of its state does not survive "
                "pickling (an object compared with `is`, a dict keyed by id(), state a __getstate__ leaves "
                "out). Use backend='criu', which snapshots the whole process.")
        if why is not None:
            raise UnsupportedEnvError(
                f"two pickled copies of {name} stepped with the same actions diverge ({why}): part of its "
                "state is not in the pickle (e.g. it draws from the global RNGs of random, numpy or torch, or "
                "keeps state in a module or a C library), so a restore would continue differently. Use "
                "backend='criu', which snapshots the whole process; or keep all state on the env (its own "
                "np_random / random.Random / torch.Generator)."
            )
        return stepped > 0

    def restore(self, payload: bytes | PickleFile, binds: Any = None, *, hold_tree: bool = False) -> Handle:
        # (hold_tree: the env is all there is; it runs only when called)
        if binds:
            raise UnsupportedEnvError("private directories need the criu backend (mount namespaces), not pickle")
        self._refuse_outside_rng("restore()")
        if isinstance(payload, PickleFile):
            data = payload.read()  # sha256 checked first
            if payload.blob is None and payload.str_hash_probe != str_hash_probe():
                _hash_order_problem(data, payload.path)  # a store entry another process wrote
            payload = data
        try:
            env, obs, info, steps = cloudpickle.loads(payload)
        except Exception as e:  # noqa: BLE001
            raise SnapshotCorruptedError(f"the pickle snapshot does not load: {type(e).__name__}: {e}") from e
        server = EnvServer(env)
        server.last_obs, server.last_info, server.steps = obs, info, steps
        h = _PickleHandle(server, self.lineage)
        h.verified = h.restored = True
        return h

    def release(self, payload: bytes | PickleFile) -> None:
        if isinstance(payload, PickleFile) and payload.owned:
            shutil.rmtree(payload.path, ignore_errors=True)
        # plain bytes: the garbage collector frees them

    # --- on disk: Snapshot.persist(), SnapshotStore --------------------------------------------
    def persist(self, payload: bytes | PickleFile) -> PickleFile:
        """The bytes written as ``payload.pkl`` into a new private directory of this process's
        session directory (kept in memory too until :meth:`evict`)."""
        if isinstance(payload, PickleFile):
            return payload
        path = os.path.join(sessiondir.session_dir(), f"pk-{os.urandom(6).hex()}")
        os.mkdir(path, 0o700)
        try:
            fd = os.open(os.path.join(path, PAYLOAD), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(payload)
            sessiondir.write_manifest(path, {"backend": "pickle"}, hashed=False)
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        return PickleFile(path, hashlib.sha256(payload).hexdigest(), len(payload), str_hash_probe(),
                          blob=payload, owned=True)

    def evict(self, payload: bytes | PickleFile) -> None:
        if isinstance(payload, PickleFile):
            payload.blob = None  # restores read (and check) the file from now on

    def is_persisted(self, payload: bytes | PickleFile) -> bool:
        return isinstance(payload, PickleFile)

    def persisted_bytes(self, payload: bytes | PickleFile) -> int | None:
        return payload.size if isinstance(payload, PickleFile) else None

    def memory_bytes(self, payload: bytes | PickleFile) -> int | None:
        """The pickle's bytes while it is held in memory (a store's ``max_memory`` counts them)."""
        if isinstance(payload, PickleFile):
            return len(payload.blob) if payload.blob is not None else 0
        return len(payload)

    def store_images(self, payload: bytes | PickleFile) -> tuple[str, dict]:
        assert isinstance(payload, PickleFile), "persist() first"
        return payload.path, {"payload_sha256": payload.sha256, "payload_size": payload.size,
                              "str_hash_probe": payload.str_hash_probe}

    def payload_at(self, path: str, meta: dict) -> PickleFile:
        return PickleFile(path, meta["payload_sha256"], meta["payload_size"], meta.get("str_hash_probe"))

    def bundle_write(self, payload: bytes | PickleFile, dest_dir: str) -> dict:
        """``payload.pkl``; its size and sha256 go into the signed metadata, with the string-hash
        probe of the process that *pickled* it (a store entry's: written by another process, maybe;
        this one's stamped on it, a bundle exported here passed the set-order check wherever this
        process's hashes hold, and restored a set in another order, silently)."""
        probe = payload.str_hash_probe if isinstance(payload, PickleFile) else str_hash_probe()
        payload = payload_bytes(payload)
        with open(os.path.join(dest_dir, PAYLOAD), "wb") as f:
            f.write(payload)
        return {"payload_sha256": hashlib.sha256(payload).hexdigest(), "payload_size": len(payload),
                "str_hash_probe": probe}

    def bundle_read(self, bundle_dir: str, meta: dict, received: dict | None = None) -> tuple[bytes, int]:
        """The pickle bytes (a regular file, opened without following links or blocking, read up
        to the signed size), checked against the signed sha256 before anything unpickles them."""
        limit = meta.get("payload_size")
        if limit is None:  # bundles saved before the size was signed
            limit = _LEGACY_PAYLOAD_LIMIT
        try:
            payload = read_bounded(os.path.join(bundle_dir, PAYLOAD), limit, what=bundle_dir)
        except SnapshotCorruptedError as e:
            raise SnapshotCorruptedError(f"{e}; it was not unpickled") from None
        if not hmac.compare_digest(hashlib.sha256(payload).hexdigest(), meta["payload_sha256"]):
            raise SnapshotCorruptedError(f"{bundle_dir}/{PAYLOAD} fails its sha256 check; it was not unpickled")
        if meta.get("str_hash_probe") != str_hash_probe():
            # Saved where strings hashed differently (or before the probe was signed): a set whose
            # order follows the hashes would iterate differently here.
            _hash_order_problem(payload, bundle_dir)
        return payload, len(payload)

    def check_compatible(self, meta: dict, path: str) -> None:
        """The pickle fields' types (BundleDamagedError); a payload pickled by another Python
        minor version (BundleError: cloudpickle keeps code defined in ``__main__`` or a notebook
        as that version's bytecode, which this interpreter would run with other meanings)."""
        theirs = check_field(meta, "python_version", (str,), path, optional=True)
        ours = platform.python_version()
        if theirs is not None and theirs.split(".")[:2] != ours.split(".")[:2]:
            raise BundleError(
                f"{path}: this pickle snapshot was saved by Python {theirs}, and this is Python {ours}: "
                "cloudpickle keeps the code of classes and functions defined in a script or notebook as "
                f"Python {'.'.join(theirs.split('.')[:2])} bytecode, which another minor version would run "
                "with other meanings (or fail on). Load it with that Python version, or save the env with "
                "backend='criu' (a bundle of the whole process, interpreter included). Nothing was loaded.")
        check_field(meta, "payload_sha256", (str,), path)
        check_field(meta, "str_hash_probe", (int,), path, optional=True)
        size = check_field(meta, "payload_size", (int,), path, optional=True)
        if size is not None and size < 0:
            raise BundleDamagedError(f"{path}: bundle.json field 'payload_size' is negative; nothing was loaded")

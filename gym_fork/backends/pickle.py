"""The cloudpickle backend: the env runs in this process; a snapshot is a pickle of it.

For machines without CRIU.  It is exact only for envs whose whole state is plain Python and
NumPy (classic control, toy text, most custom envs).  It *refuses* Gymnasium's ``EzPickle``
envs (Box2D, MuJoCo, ALE): their pickle holds only constructor arguments, so a naive pickle
"restores" a fresh, different env without any error.  Every first snapshot of an env is also
checked: the copy must hold the original's state attribute by attribute, and two copies stepped
with the same actions must answer identically (:mod:`gym_fork.backends.exactness`: state outside
the pickle, such as the global RNGs of ``random``/``numpy``/``torch``, is caught).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import types
from typing import Any

import cloudpickle
import gymnasium as gym
import numpy as np

from gym_fork.backends.base import Backend, Handle, LocalHandle
from gym_fork.backends.exactness import copies_diverge
from gym_fork.errors import BundleDamagedError, BundleError, SnapshotCorruptedError, SnapshotError, UnsupportedEnvError
from gym_fork.snapshots.bundle import check_field
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
    if depth > 12 or id(a) in seen:
        return None
    seen.add(id(a))
    if type(a) is not type(b):
        return f"{path} (type {type(a).__name__} vs {type(b).__name__})"
    if isinstance(a, np.ndarray):
        ok = a.dtype == b.dtype and a.shape == b.shape and (a.dtype == object or a.tobytes() == b.tobytes())
        return None if ok else path
    if isinstance(a, np.random.Generator):
        return None if a.bit_generator.state == b.bit_generator.state else path
    if isinstance(a, (int, float, complex, str, bytes, bool, type(None), np.generic)):
        return None if (a == b or (a != a and b != b)) else path
    if isinstance(a, dict):
        if a.keys() != b.keys():
            return f"{path} (keys)"
        for k in a:
            d = state_difference(a[k], b[k], f"{path}[{k!r}]", depth + 1, seen)
            if d:
                return d
        return None
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
        return state_difference(da, db, path, depth + 1, seen)
    return None


# Types whose instances hash alike in every process (``str`` and ``bytes`` hashes are seeded per
# process, PYTHONHASHSEED; a plain object hashes by its address).
_STABLE_HASH = (int, float, bool, complex, type(None), np.number, np.bool_)
#: how deep set_order_problem looks (gymnasium's wrappers take ~4 levels; cycles end at `seen`)
_SET_DEPTH = 32
_BY_NAME = (type, types.FunctionType, types.BuiltinFunctionType, types.ModuleType, types.MethodType)
_LEAVES = (int, float, bool, complex, str, bytes, type(None), np.ndarray, np.generic, np.random.Generator)
#: what pickle's hash-order note says a user can do about it
_SET_ORDER_FIX = ("iterate it in a fixed order (sorted(...)), or keep a dict (ordered by insertion) or a list "
                  "instead; or use backend='criu', which snapshots the whole process")


def _hashed_by_address(x: Any) -> bool:
    """An object whose hash is its address (no ``__hash__`` of its own), and which a pickle holds
    by value: its unpickled copy is a new object with another hash. Classes, functions and
    modules are pickled by name and come back as themselves."""
    return type(x).__hash__ is object.__hash__ and not isinstance(x, _BY_NAME)


def _hash_stable(x: Any) -> bool:
    if isinstance(x, _STABLE_HASH):
        return True
    return type(x) in (tuple, frozenset) and all(_hash_stable(y) for y in x)


def set_order_problem(obj: Any, cross_process: bool = False, path: str = "env") -> str | None:
    """Where a pickled copy of ``obj`` would iterate a set in another order than ``obj`` does, or
    None.

    A pickle holds a set's elements in iteration order, and loading adds them to an empty set one
    by one. The copy may lay them out differently: a set that shrank keeps its larger table, so
    ``{14, 35, 700}`` left over from ``set(range(0, 1000, 7))`` iterates 14, 35, 700 and its copy
    35, 700, 14; and in another process, strings and bytes hash differently (PYTHONHASHSEED), as do
    objects hashed by their address. An env that iterates such a set (the next goal, the items an
    observation lists) would then go on differently, silently. With ``cross_process`` (a copy
    loaded in a process whose string hashes differ), any set of two or more elements that are not
    numbers counts.

    Walks instance ``__dict__``s, dicts, lists, tuples and sets (as :func:`state_difference`
    compares them), up to :data:`_SET_DEPTH` levels deep.
    """
    seen: set[int] = set()
    # (object, where it hangs: (parent's entry, key, kind) or None, depth); a path string is
    # built only for what is reported
    todo: list[tuple[Any, Any, int]] = [(obj, None, 0)]
    leaves, add, push = _LEAVES, seen.add, todo.append
    while todo:
        entry = todo.pop()
        x, _at, depth = entry
        if depth > _SET_DEPTH or id(x) in seen:
            continue
        add(id(x))
        if isinstance(x, (set, frozenset)):
            if len(x) < 2:
                continue
            items = list(x)
            odd = next((i for i in items if not _hash_stable(i)), None) if cross_process else None
            if odd is not None:
                return f"{_path(entry, path)} (a {type(x).__name__} of {type(odd).__name__}s, whose order follows the hash seed)"
            odd = next((i for i in items if _hashed_by_address(i)), None)
            if odd is not None:  # a copy's elements are new objects, at other addresses
                return (f"{_path(entry, path)} (a {type(x).__name__} of {type(odd).__name__} objects, hashed by their "
                        "address, which a copy's objects do not share)")
            if items != list(type(x)(items) if type(x) in (set, frozenset) else set(items)):
                return f"{_path(entry, path)} (a {type(x).__name__} whose order changes when it is pickled)"
            continue
        if isinstance(x, dict):
            pairs = x.items()
            kind = "item"
        elif isinstance(x, (list, tuple)):
            pairs = enumerate(x)
            kind = "item"
        elif isinstance(x, type) or (callable(x) and not hasattr(x, "__dict__")):
            continue
        else:
            d = getattr(x, "__dict__", None)
            if not isinstance(d, dict):
                continue
            pairs = d.items()
            kind = "attr"
        for k, v in pairs:
            if isinstance(v, leaves) or type(v) is tuple and all([isinstance(e, leaves) for e in v]):
                continue  # (a tuple of plain values, e.g. a transition table's rows: nothing to look at)
            push((v, (entry, k, kind), depth + 1))
    return None


def _path(entry: tuple, root: str) -> str:
    keys = []
    at = entry[1]
    while at is not None:
        parent, k, kind = at
        keys.append(f".{k}" if kind == "attr" else f"[{k!r}]")
        at = parent[1]
    return root + "".join(reversed(keys))


def str_hash_probe() -> int:
    """This process's hash of a fixed string: equal in two processes exactly when their string
    hashes agree (the same PYTHONHASHSEED)."""
    return hash("gym_fork: string hash probe")


class _PickleHandle(LocalHandle):
    verified = False  # the exactness check ran (and could step the copies) for this env lineage

    def kill(self) -> None:
        if not self.closed:
            try:
                self.server.env.close()
            finally:
                self.closed = True


class PickleBackend(Backend):
    name = "pickle"

    def start(self, source: EnvSource) -> tuple[Handle, dict]:
        env = build_env(source)
        try:
            refuse_if_ezpickle(env)
        except UnsupportedEnvError:
            env.close()
            raise
        server = EnvServer(env)
        return _PickleHandle(server), server.cmd_meta()

    def snapshot(self, handle: Handle, snap_id: str, *, ready_copy: bool = True) -> tuple[bytes, int]:
        assert isinstance(handle, _PickleHandle)
        s = handle.server
        try:
            blob = cloudpickle.dumps((s.env, s.last_obs, s.last_info, s.steps))
        except Exception as e:  # noqa: BLE001
            raise SnapshotError(
                f"cloudpickle cannot capture this env ({type(e).__name__}: {e}); use backend='criu'"
            ) from e
        if not handle.verified:
            # verified once a check could step the copies (not before reset(): then again next time)
            handle.verified = self._check_copy(s.env, blob)
        else:  # a set can start to lose its order later (it shrank): looked for at every snapshot
            self._check_set_order(s.env)
        return blob, len(blob)

    @staticmethod
    def _check_set_order(env: gym.Env) -> None:
        where = set_order_problem(env)
        if where is not None:
            raise UnsupportedEnvError(
                f"a pickled copy of {type(env.unwrapped).__name__} would iterate {where} in another order, "
                f"so a restore could continue differently; {_SET_ORDER_FIX}. Nothing was snapshotted.")

    def check_exact(self, handle: Handle) -> None:
        """Raise (UnsupportedEnvError / SnapshotError) unless this env pickles exactly right now.
        Does not mark the handle verified: its first snapshot checks again (after reset())."""
        assert isinstance(handle, _PickleHandle)
        s = handle.server
        try:
            blob = cloudpickle.dumps((s.env, s.last_obs, s.last_info, s.steps))
        except Exception as e:  # noqa: BLE001
            raise SnapshotError(f"cloudpickle cannot capture this env ({type(e).__name__}: {e})") from e
        self._check_copy(s.env, blob)

    @staticmethod
    def _check_copy(env: gym.Env, blob: bytes) -> bool:
        """Raise UnsupportedEnvError unless copies made from ``blob`` are exact: the same state
        attribute by attribute, and the same behaviour (two copies stepped with the same actions
        answer identically: state outside the pickle, e.g. the global RNGs, is caught). Returns
        whether the copies could be stepped (False before reset(): check again later)."""
        name = type(env.unwrapped).__name__
        PickleBackend._check_set_order(env)
        diff = state_difference(env, cloudpickle.loads(blob)[0])
        if diff is not None:
            raise UnsupportedEnvError(
                f"a pickled copy of {name} differs from the original at {diff} (its state does not "
                "survive pickling); use backend='criu'"
            )
        why, stepped = copies_diverge(blob, env.action_space, unpack=lambda t: t[0])
        if why is not None:
            raise UnsupportedEnvError(
                f"two pickled copies of {name} stepped with the same actions diverge ({why}): part of its "
                "state is not in the pickle (e.g. it draws from the global RNGs of random, numpy or torch, or "
                "keeps state in a module or a C library), so a restore would continue differently. Use "
                "backend='criu', which snapshots the whole process; or keep all state on the env (its own "
                "np_random / random.Random / torch.Generator)."
            )
        return stepped > 0

    def restore(self, payload: bytes, binds: Any = None) -> Handle:
        if binds:
            raise UnsupportedEnvError("private directories need the criu backend (mount namespaces), not pickle")
        try:
            env, obs, info, steps = cloudpickle.loads(payload)
        except Exception as e:  # noqa: BLE001
            raise SnapshotCorruptedError(f"the pickle snapshot does not load: {type(e).__name__}: {e}") from e
        server = EnvServer(env)
        server.last_obs, server.last_info, server.steps = obs, info, steps
        h = _PickleHandle(server)
        h.verified = True
        return h

    def release(self, payload: bytes) -> None:
        pass  # plain bytes: the garbage collector frees them

    def bundle_write(self, payload: bytes, dest_dir: str) -> dict:
        """``payload.pkl``; its size and sha256 go into the signed metadata."""
        with open(os.path.join(dest_dir, PAYLOAD), "wb") as f:
            f.write(payload)
        return {"payload_sha256": hashlib.sha256(payload).hexdigest(), "payload_size": len(payload),
                "str_hash_probe": str_hash_probe()}

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
            # order follows the hashes would iterate differently here. The payload is authentic
            # (signed metadata, sha256 above), so it may be unpickled to look.
            try:
                state = cloudpickle.loads(payload)
            except Exception as e:  # noqa: BLE001
                raise SnapshotCorruptedError(f"{bundle_dir}: the pickle snapshot does not load: {type(e).__name__}: {e}") from e
            where = set_order_problem(state[0], cross_process=True)
            if where is not None:
                raise BundleError(
                    f"{bundle_dir}: this pickle snapshot was saved by a process whose string hashes differ from this "
                    f"one's, and the env holds {where}: here it would iterate in another order, so the env could "
                    "continue differently. Start both processes with the same PYTHONHASHSEED (e.g. "
                    "PYTHONHASHSEED=0), keep that set in a fixed order in the env (sorted(...), a dict or a "
                    "list), or save it with backend='criu'. Nothing was restored.")
        return payload, len(payload)

    def check_compatible(self, meta: dict, path: str) -> None:
        """The pickle fields' types (BundleDamagedError)."""
        check_field(meta, "payload_sha256", (str,), path)
        check_field(meta, "str_hash_probe", (int,), path, optional=True)
        size = check_field(meta, "payload_size", (int,), path, optional=True)
        if size is not None and size < 0:
            raise BundleDamagedError(f"{path}: bundle.json field 'payload_size' is negative; nothing was loaded")

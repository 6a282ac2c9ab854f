"""The cloudpickle backend: the env runs in this process; a snapshot is a pickle of it.

For machines without CRIU.  It is exact only for envs whose whole state is plain Python and
NumPy (classic control, toy text, most custom envs).  It *refuses* Gymnasium's ``EzPickle``
envs (Box2D, MuJoCo, ALE): their pickle holds only constructor arguments, so a naive pickle
"restores" a fresh, different env without any error.  Every first snapshot of an env is also
checked (and again its 2nd, 4th, 8th, ..., from those later states): the copy must hold the
original's state attribute by attribute, and two copies stepped with the same actions, then reset,
must answer identically (:mod:`gym_fork.backends.exactness`: state outside the pickle, such as the
global RNGs of ``random``/``numpy``/``torch``, is caught).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import platform
from typing import Any

import cloudpickle
import gymnasium as gym
import numpy as np

from gym_fork.backends.base import Backend, Handle, LocalHandle
from gym_fork.backends.exactness import copies_diverge
from gym_fork.errors import BundleDamagedError, BundleError, SnapshotCorruptedError, UnpicklableEnvError, UnsupportedEnvError
from gym_fork.snapshots.bundle import check_field
from gym_fork.snapshots.set_order import copy_problem, str_hash_probe
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


#: what pickle's hash-order note says a user can do about it
class _PickleHandle(LocalHandle):
    verified = False  # the exactness check ran (and could step the copies) for this env lineage
    snapshots = 0  # taken through this handle (the check runs again at the 2nd, 4th, 8th, ...)

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
            found = copy_problem(state[0], cross_process=True)
            if found is not None:
                where = found[0]
                raise BundleError(
                    f"{bundle_dir}: this pickle snapshot was saved by a process whose string hashes differ from this "
                    f"one's, and the env holds {where}: here it would iterate in another order, so the env could "
                    "continue differently. Start both processes with the same PYTHONHASHSEED (e.g. "
                    "PYTHONHASHSEED=0), keep that set in a fixed order in the env (sorted(...), a dict or a "
                    "list), or save it with backend='criu'. Nothing was restored.")
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

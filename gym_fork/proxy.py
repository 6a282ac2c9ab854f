"""What ``ForkableEnv.unwrapped`` is: a stand-in for the env in the worker that acts on the
worker, never on a copy.

The env lives in another process, so the learner can hold copies of its values but not the env's
objects.  The rule this module keeps: whatever a user does through ``env.unwrapped`` either
reaches the env in the worker or raises -- it never silently changes a local copy.

* **Attribute writes** run in the worker: ``env.unwrapped.force_mag = 30.0``.
* **Method calls** run in the worker: ``env.unwrapped.set_state(qpos, qvel)``; arguments and
  results are pickled (a result is the caller's own copy).
* **Reading plain data** (numbers, strings, arrays, spaces, and lists/dicts/tuples of those)
  gives a copy.  Copies of arrays are read-only, except that item assignment
  (``env.unwrapped.model.body_mass[1] = 2.0``) is forwarded to the worker; copies of lists, dicts
  and sets refuse changes (assign a new value to the attribute instead).
* **Reading any other object** (``env.unwrapped.data``, ``env.unwrapped.np_random``) gives a
  :class:`RemoteObject`: a live reference by path (``env.unwrapped.data``), on which the same
  rules apply.  ``copy.deepcopy(ref)`` fetches a local copy of the object.

Every read, write or call is one round trip to the worker (tens of microseconds).
"""

from __future__ import annotations

import copy as _copy
from typing import Any

import gymnasium as gym
import numpy as np

from gym_fork.worker import refs

_MIRRORED = ("observation_space", "action_space", "metadata", "render_mode", "spec")


def read(owner: Any, path: tuple) -> Any:
    """The object at ``path`` in ``owner``'s worker, as the learner sees it (module docstring)."""
    kind, x = owner._request("ref_get", path)
    if kind == refs.VALUE:
        return freeze(x, owner, path)
    if kind == refs.CALLABLE:
        return RemoteMethod(owner, path, x)
    return RemoteObject(owner, path, x)


def _read_only(path: tuple) -> TypeError:
    where = refs.render(path)
    return TypeError(f"{where} is a read-only copy of a value in the env's worker process: changing it "
                     f"would not change the env. Assign a new value instead ({where} = ...), or make a "
                     "local copy first (copy.copy(x)) if a local change is what you want.")


class WorkerEnv(gym.Env):
    """The local stand-in for the base env in the worker (what ``ForkableEnv.unwrapped`` is).

    Spaces, ``metadata``, ``render_mode`` and ``spec`` are the base env's, copied at start-up (and
    kept in step when set through this object); everything else is read from, written to and
    called in the worker (module docstring).  ``step``/``reset``/``render``/``close`` go through the owning
    :class:`~gym_fork.ForkableEnv`, which keeps its step count and action record.
    """

    def __init__(self, owner: Any, meta: dict):
        object.__setattr__(self, "_owner", owner)
        object.__setattr__(self, "_type_name", meta["unwrapped_type"])
        self._adopt(meta)

    def _adopt(self, meta: dict) -> None:
        """Take the mirrored attributes from ``meta`` (the worker's, e.g. after a restore): the
        base env's (a worker of an older gym_fork sent only the outer stack's)."""
        base = meta.get("unwrapped", meta)
        for name in _MIRRORED:
            object.__setattr__(self, name, base[name])

    def step(self, action: Any) -> tuple:
        return self._owner.step(action)

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple:
        return self._owner.reset(seed=seed, options=options)

    def render(self) -> Any:
        return self._owner.render()

    def close(self) -> None:
        self._owner.close()

    # gymnasium.Env declares these at class level, so __getattr__ would never see them.
    @property
    def np_random(self) -> Any:  # type: ignore[override]
        return read(self._owner, ("unwrapped", ("a", "np_random")))

    @property
    def _np_random(self) -> Any:
        return read(self._owner, ("unwrapped", ("a", "_np_random")))

    @property
    def np_random_seed(self) -> Any:  # type: ignore[override]
        return read(self._owner, ("unwrapped", ("a", "np_random_seed")))

    @property
    def _np_random_seed(self) -> Any:
        return read(self._owner, ("unwrapped", ("a", "_np_random_seed")))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_owner", "_type_name"):
            raise AttributeError(name)
        return read(self._owner, ("unwrapped", ("a", name)))

    def __setattr__(self, name: str, value: Any) -> None:
        self._owner._request("ref_set", ("unwrapped", ("a", name)), value)
        if name in _MIRRORED:  # keep the local copies in step with the worker's: the base env's,
            self._owner._refresh_meta()  # and the outer stack's, which may follow it or not

    def __delattr__(self, name: str) -> None:
        self._owner._request("ref_del", ("unwrapped", ("a", name)))

    def __deepcopy__(self, memo: dict) -> Any:
        return _copy.deepcopy(self._owner, memo).unwrapped  # an exact fork, seen from its base env

    def __reduce_ex__(self, protocol: Any) -> Any:
        return self._owner.__reduce_ex__(protocol)  # refuses, naming what to do instead

    def __str__(self) -> str:
        return f"<{self._type_name} in a gym_fork worker>"

    __repr__ = __str__


class RemoteObject:
    """A live reference to an object in the env's worker, by path (``env.unwrapped.data``).

    Attribute reads, writes, item access and calls act on the worker's object, by the rules of
    :mod:`gym_fork.proxy`.  ``copy.deepcopy(ref)`` / ``copy.copy(ref)`` fetch a local copy of the
    object (it must pickle); ``len()`` and ``in`` are asked of the worker; iterating is refused
    (fetch a copy first).
    """

    __slots__ = ("_gf_owner", "_gf_path", "_gf_type")

    def __init__(self, owner: Any, path: tuple, type_name: str):
        object.__setattr__(self, "_gf_owner", owner)
        object.__setattr__(self, "_gf_path", path)
        object.__setattr__(self, "_gf_type", type_name)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return read(self._gf_owner, self._gf_path + (("a", name),))

    def __setattr__(self, name: str, value: Any) -> None:
        self._gf_owner._request("ref_set", self._gf_path + (("a", name),), value)

    def __delattr__(self, name: str) -> None:
        self._gf_owner._request("ref_del", self._gf_path + (("a", name),))

    def __getitem__(self, key: Any) -> Any:
        return read(self._gf_owner, self._gf_path + (("i", key),))

    def __setitem__(self, key: Any, value: Any) -> None:
        self._gf_owner._request("ref_set", self._gf_path + (("i", key),), value)

    def __delitem__(self, key: Any) -> None:
        self._gf_owner._request("ref_del", self._gf_path + (("i", key),))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return call(self._gf_owner, self._gf_path, args, kwargs)

    def __len__(self) -> int:
        return self._gf_owner._request("ref_call", self._gf_path + (("a", "__len__"),), (), {})

    def __contains__(self, item: Any) -> bool:
        return self._gf_owner._request("ref_call", self._gf_path + (("a", "__contains__"),), (item,), {})

    def __iter__(self):
        raise TypeError(f"{refs.render(self._gf_path)} is a reference to a {self._gf_type} in the env's worker "
                        "process and cannot be iterated item by item; fetch a local copy first: "
                        "copy.deepcopy(ref)")

    def __copy__(self) -> Any:
        return self._gf_owner._request("ref_value", self._gf_path)

    def __deepcopy__(self, memo: dict) -> Any:
        return self._gf_owner._request("ref_value", self._gf_path)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(f"cannot pickle {refs.render(self._gf_path)}, a reference into a gym_fork worker; "
                        "pickle a local copy instead: copy.deepcopy(ref)")

    def __repr__(self) -> str:
        return f"<{self._gf_type} in a gym_fork worker: {refs.render(self._gf_path)}>"


class RemoteMethod:
    """A function or method of the env in the worker; calling it runs it there (arguments and
    result are pickled)."""

    __slots__ = ("_gf_owner", "_gf_path", "__name__", "__qualname__")

    def __init__(self, owner: Any, path: tuple, qualname: str):
        self._gf_owner = owner
        self._gf_path = path
        self.__qualname__ = qualname
        self.__name__ = qualname.rsplit(".", 1)[-1]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return call(self._gf_owner, self._gf_path, args, kwargs)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(f"cannot pickle {refs.render(self._gf_path)}, a method of the env in a gym_fork worker")

    def __repr__(self) -> str:
        return f"<method {self.__qualname__} in a gym_fork worker: {refs.render(self._gf_path)}>"


def call(owner: Any, path: tuple, args: tuple, kwargs: dict, or_get: bool = False) -> Any:
    """Call the object at ``path`` in the worker. Arguments travel as copies, so an array the
    callee fills in place -- an out-parameter, such as the buffer of ALE's
    ``getScreenGrayscale(buf)``, which Gymnasium's ``AtariPreprocessing`` passes -- would be
    filled in the worker's copy only (the caller's stayed all zeros, silently): every writeable
    array argument's final content is copied back into the caller's array, and a result that is
    one of them is the caller's array itself."""
    outs = [i for i, a in enumerate(args) if isinstance(a, np.ndarray) and a.flags.writeable]
    keys = [k for k, a in kwargs.items() if isinstance(a, np.ndarray) and a.flags.writeable]
    if not outs and not keys:
        return owner._request("ref_call", path, args, kwargs, or_get)
    result, which, finals = owner._request("ref_call_out", path, args, kwargs, outs, keys, or_get)
    mine = [args[i] for i in outs] + [kwargs[k] for k in keys]
    for a, final in zip(mine, finals):
        np.copyto(a, final, casting="no")
    return mine[which] if which is not None else result


# --- copies of plain data ------------------------------------------------------------------------
def freeze(x: Any, owner: Any = None, path: tuple | None = None) -> Any:
    """The learner's copy of a plain value read at ``path``: arrays read-only (item assignment
    forwarded when ``owner`` is given), lists/dicts/sets refusing changes, tuples frozen inside."""
    t = type(x)
    if t is np.ndarray:
        return WorkerArray.of(x, owner, path)
    if t is list:
        return FrozenList([freeze(v, owner, _item(path, i)) for i, v in enumerate(x)], path)
    if t is tuple:
        return tuple(freeze(v, owner, _item(path, i)) for i, v in enumerate(x))
    if t is dict:
        return FrozenDict({k: freeze(v, owner, _item(path, k)) for k, v in x.items()}, path)
    if t is set:
        return FrozenSet(x, path)
    return x


def _item(path: tuple | None, key: Any) -> tuple | None:
    return None if path is None else path + (("i", key),)


class WorkerArray(np.ndarray):
    """A read-only copy of an array in the env's worker.  ``a[i] = v`` is forwarded (the worker's
    array and this copy both change); every other write raises numpy's read-only error.  Anything
    computed from it (slices, arithmetic, ``copy()``) is a plain ``numpy.ndarray``."""

    _gf_ref: tuple | None = None

    @classmethod
    def of(cls, arr: np.ndarray, owner: Any, path: tuple | None) -> "WorkerArray":
        out = np.array(arr, copy=True).view(cls)  # in-process (pickle backend) it would be the env's own
        out._gf_ref = (owner, path) if owner is not None and path is not None else None
        out.flags.writeable = False
        return out

    def __array_finalize__(self, obj: Any) -> None:
        self._gf_ref = None

    def __array_wrap__(self, arr: np.ndarray, context: Any = None, return_scalar: bool = False) -> Any:
        if return_scalar:
            return arr[()]
        return arr.view(np.ndarray) if type(arr) is not np.ndarray else arr

    def __getitem__(self, key: Any) -> Any:
        out = super().__getitem__(key)
        return out.view(np.ndarray) if isinstance(out, WorkerArray) else out

    def __setitem__(self, key: Any, value: Any) -> None:
        ref = self._gf_ref
        if ref is None:
            super().__setitem__(key, value)  # read-only: numpy raises
            return
        owner, path = ref
        owner._request("ref_set", path + (("i", key),), value)
        self.flags.writeable = True
        try:
            super().__setitem__(key, value)
        finally:
            self.flags.writeable = False

    def copy(self, order: Any = "C") -> np.ndarray:  # type: ignore[override]
        return np.array(self, order=order, copy=True)

    def __copy__(self) -> np.ndarray:
        return np.array(self, copy=True)

    def __deepcopy__(self, memo: dict) -> np.ndarray:
        return _copy.deepcopy(np.asarray(self), memo)

    def __reduce_ex__(self, protocol: Any) -> Any:
        return np.asarray(self).__reduce_ex__(protocol)  # a plain ndarray on the other side

    def __reduce__(self) -> Any:
        return np.asarray(self).__reduce__()

    def __repr__(self) -> str:
        return repr(np.asarray(self))


class _Frozen:
    """What the frozen copies of a list, dict and set share: changing one raises (it would not
    change the env), and a copy or pickle of one is the plain builtin (``_plain``)."""

    _plain: type

    def __init__(self, items: Any = (), path: tuple | None = None):
        super().__init__(items)  # type: ignore[call-arg]
        self._gf_path = path

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise _read_only(self._gf_path or ("unwrapped",))

    def __reduce_ex__(self, protocol: Any) -> Any:
        return (self._plain, (self._plain(self),))

    def __copy__(self) -> Any:
        return self._plain(self)

    def __deepcopy__(self, memo: dict) -> Any:
        return _copy.deepcopy(self._plain(self), memo)


class FrozenList(_Frozen, list):
    """A copy of a list in the env's worker; changing it raises (it would not change the env)."""

    _plain = list
    __setitem__ = __delitem__ = __iadd__ = __imul__ = _Frozen._refuse
    append = extend = insert = pop = remove = clear = sort = reverse = _Frozen._refuse


class FrozenDict(_Frozen, dict):
    """A copy of a dict in the env's worker; changing it raises (it would not change the env)."""

    _plain = dict
    __setitem__ = __delitem__ = __ior__ = _Frozen._refuse
    pop = popitem = clear = update = setdefault = _Frozen._refuse


class FrozenSet(_Frozen, set):
    """A copy of a set in the env's worker; changing it raises (it would not change the env)."""

    _plain = set
    add = discard = remove = pop = clear = update = _Frozen._refuse
    difference_update = intersection_update = symmetric_difference_update = _Frozen._refuse
    __ior__ = __iand__ = __isub__ = __ixor__ = _Frozen._refuse

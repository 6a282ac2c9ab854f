"""Whether a pickled copy of an object graph goes on like the original: the order of its sets and
the memory its NumPy arrays share.

A pickle holds a set's elements in iteration order, and loading adds them to an empty set one by
one, which may lay them out differently (see :func:`set_order_problem`).  A pickle holds each
array's values on their own: two arrays that share memory (a view kept beside the array it looks
into) come back as two separate arrays, and a write through one no longer shows in the other.
The pickle backend refuses snapshots where either happens (:func:`copy_problem`), and
:mod:`gym_fork.worker.commands` refuses to ship such an env instance to its worker (another
process, where strings also hash differently).
"""

from __future__ import annotations

import sys
import types
from collections import deque
from itertools import chain, repeat
from operator import attrgetter, is_not
from typing import Any

import numpy as np
from numpy import ndarray

# Types whose instances hash alike in every process (``str`` and ``bytes`` hashes are seeded per
# process, PYTHONHASHSEED; a plain object hashes by its address).
_STABLE_HASH = (int, float, bool, complex, type(None), np.number, np.bool_)
#: how deep set_order_problem looks (gymnasium's wrappers take ~4 levels; cycles end at `seen`)
_SET_DEPTH = 32
_BY_NAME = (type, types.FunctionType, types.BuiltinFunctionType, types.ModuleType, types.MethodType)
_LEAVES = (int, float, bool, complex, str, bytes, type(None), np.ndarray, np.generic, np.random.Generator)
# exact types of plain values (numpy scalars: the common ones), for _plain's set comparison
_LEAF_TYPES = frozenset({int, float, bool, complex, str, bytes, type(None), np.ndarray, np.float64, np.float32,
                         np.int64, np.int32, np.bool_, np.uint8})


def _hashed_by_address(x: Any) -> bool:
    """An object whose hash is its address (no ``__hash__`` of its own), and which a pickle holds
    by value: its unpickled copy is a new object with another hash. Classes, functions and
    modules are pickled by name and come back as themselves."""
    return type(x).__hash__ is object.__hash__ and not isinstance(x, _BY_NAME)


def _hash_stable(x: Any) -> bool:
    if isinstance(x, _STABLE_HASH):
        return True
    return type(x) in (tuple, frozenset) and all(_hash_stable(y) for y in x)


#: what to do about a set whose order a copy would change
SET_ORDER_FIX = ("iterate it in a fixed order (sorted(...)), or keep a dict (ordered by insertion) or a list "
                 "instead; or use backend='criu', which snapshots the whole process")
#: what to do about an object a module holds as a global (compared with ``is``, e.g. a sentinel)
MODULE_GLOBAL_FIX = ("compare with a value that pickles as itself (None, an Enum member, a class) instead of "
                     "a module-level object(); or use backend='criu', which snapshots the whole process")
#: what to do about arrays that share memory
SHARED_MEMORY_FIX = ("keep the one array and index it where it is used (self.grid[1] at each use, not a view "
                     "stored beside it), or store a copy; or use backend='criu', which snapshots the whole process")


def set_order_problem(obj: Any, cross_process: bool = False, path: str = "env") -> str | None:
    """Where a pickled copy of ``obj`` would not go on like ``obj`` (:func:`copy_problem`), as
    words, or None."""
    found = copy_problem(obj, cross_process, path)
    return None if found is None else found[0]


def address_order_hazard(obj: Any, path: str = "env") -> str | None:
    """Where ``obj`` holds a set of objects hashed by their address, or None. Such a set iterates
    in the order its objects lie in memory, which no copy keeps -- not a pickled one, and not a
    process copy either, once either allocates new objects (gym_fork's own loop allocates
    differently in the original and in a restored copy). An env that iterates it is not
    reproducible (Gymnasium's checker finds it nondeterministic too); ``gym-fork check`` names it
    when a restore diverges."""
    found = copy_problem(obj, path=path, address_only=True)
    return None if found is None else found[0]


def copy_problem(obj: Any, cross_process: bool = False, path: str = "env", *,
                 address_only: bool = False) -> tuple[str, str] | None:
    """``(where, what to do)`` when a pickled copy of ``obj`` would not go on like ``obj``: it
    would iterate a set in another order, or hold apart arrays that share memory here; else None.

    A pickle holds a set's elements in iteration order, and loading adds them to an empty set one
    by one. The copy may lay them out differently: a set that shrank keeps its larger table, so
    ``{14, 35, 700}`` left over from ``set(range(0, 1000, 7))`` iterates 14, 35, 700 and its copy
    35, 700, 14; and in another process, strings and bytes hash differently (PYTHONHASHSEED), as do
    objects hashed by their address. An env that iterates such a set (the next goal, the items an
    observation lists) would then go on differently, silently. With ``cross_process`` (a copy
    loaded in a process whose string hashes differ), any set of two or more elements that are not
    numbers counts.

    Arrays: two distinct ``ndarray`` objects over the same memory (one a view of the other, or
    both of a third buffer), at least one of them writable; or a writable view of an object the
    walk holds otherwise (a simulator's state arrays kept beside the simulator). A pickle memoizes
    objects, not memory: the copy's arrays are separate.

    Walks instance ``__dict__``s, dicts, lists, tuples and sets (as :func:`state_difference`
    compares them), up to :data:`_SET_DEPTH` levels deep.
    """
    seen: set[int] = set()
    arrays: list[tuple[np.ndarray, Any]] = []  # (array, where it hangs) for the memory check
    in_lists: set[int] = set()  # ids of the arrays in lists of plain values (their views are in `arrays`)
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
            odd = next((i for i in items if not _hash_stable(i)), None) if cross_process and not address_only else None
            if odd is not None:
                return (f"{_path(entry, path)} (a {type(x).__name__} of {type(odd).__name__}s, whose order follows "
                        "the hash seed)", SET_ORDER_FIX)
            odd = next((i for i in items if _hashed_by_address(i)), None)
            if odd is not None:  # a copy's elements are new objects, at other addresses
                return (f"{_path(entry, path)} (a {type(x).__name__} of {type(odd).__name__} objects, hashed by their "
                        "address, which a copy's objects do not share)", SET_ORDER_FIX)
            if address_only:
                continue
            if items != list(type(x)(items) if type(x) in (set, frozenset) else set(items)):
                return f"{_path(entry, path)} (a {type(x).__name__} whose order changes when it is pickled)", SET_ORDER_FIX
            continue
        if isinstance(x, dict):
            pairs = x.items()
            kind = "item"
        elif isinstance(x, (list, tuple)):
            kinds = _plain(x)
            if kinds is not None:
                if ndarray in kinds:  # (a list of frames: views of one buffer?)
                    _list_arrays(x, kinds, entry, arrays, in_lists)
                continue
            pairs = enumerate(x)
            kind = "item"
        elif isinstance(x, deque):
            pairs = enumerate(x)
            kind = "item"
        elif isinstance(x, type) or (callable(x) and not hasattr(x, "__dict__")):
            continue
        else:
            if depth and not address_only and type(x).__eq__ is object.__eq__:  # (identity: a module's own?)
                name = module_global_name(x)
                if name is not None:
                    return (f"{_path(entry, path)} (the module global {name}, a {type(x).__name__} that a pickled "
                            "copy holds as a new object: `is` tests against the global fail in the copy)",
                            MODULE_GLOBAL_FIX)
            d = getattr(x, "__dict__", None)
            slots = slot_items(x)
            if not isinstance(d, dict) and not slots:
                continue
            pairs = chain(d.items(), slots) if isinstance(d, dict) else slots
            kind = "attr"
        for k, v in pairs:
            if not isinstance(v, leaves):  # (lists and tuples of plain values: _plain, when popped)
                push((v, (entry, k, kind), depth + 1))
            elif isinstance(v, ndarray):  # (subclasses too: a masked array's view shares its data)
                arrays.append((v, (entry, k, kind)))
                if v.dtype.hasobject:  # an object array holds Python objects: walk them as a list's items
                    push((v.ravel().tolist() if v.base is None else list(v.flat), (entry, k, kind), depth + 1))
    return None if address_only else _shared_memory(arrays, in_lists, seen, path)


_SLOT_NAMES: dict[type, tuple[str, ...]] = {}


def _slot_names(cls: type) -> tuple[str, ...]:
    names = _SLOT_NAMES.get(cls)
    if names is None:
        found: list[str] = []
        for c in cls.__mro__:
            declared = c.__dict__.get("__slots__", ())
            for name in (declared,) if isinstance(declared, str) else declared:
                if name not in ("__dict__", "__weakref__"):
                    # (a private name is stored mangled: __x of class C is _C__x)
                    found.append(f"_{c.__name__.lstrip('_')}{name}" if name.startswith("__") else name)
        names = _SLOT_NAMES[cls] = tuple(found)
    return names


def slot_items(x: Any) -> list[tuple[str, Any]]:
    """The ``__slots__`` attributes ``x`` has set, across its classes (a pickle holds them)."""
    names = _slot_names(type(x))
    if not names:
        return []
    out = []
    for name in names:
        try:
            out.append((name, object.__getattribute__(x, name)))
        except AttributeError:  # (declared, not set)
            pass
    return out


# id -> (module, name) of module globals compared by identity, rebuilt when modules come or go
_globals_cache: tuple[int, dict[int, tuple[str, str]]] = (-1, {})


def module_global_name(x: Any) -> str | None:
    """``"module.name"`` when ``x`` is a module's global (a sentinel ``_UNSET = object()``) that a
    pickle copies: its unpickled copy is a new object, so ``copy.attr is module._UNSET`` is false
    where the original's was true. None for objects pickled by reference (an Enum member, a
    logger): they come back as themselves."""
    global _globals_cache
    n = len(sys.modules)
    if _globals_cache[0] != n:
        found: dict[int, tuple[str, str]] = {}
        for mod_name, mod in list(sys.modules.items()):
            try:
                items = list(vars(mod).items())
            except TypeError:
                continue
            for k, v in items:
                t = type(v)  # (not isinstance: a deprecated global's __class__ warns when read)
                if (t.__eq__ is object.__eq__ and not issubclass(t, _BY_NAME) and not callable(v)
                        and not issubclass(t, _LEAVES) and not k.startswith("__")):
                    found.setdefault(id(v), (mod_name, k))
        _globals_cache = (n, found)
    hit = _globals_cache[1].get(id(x))
    if hit is None:
        return None
    mod = sys.modules.get(hit[0])
    if mod is None or vars(mod).get(hit[1]) is not x:  # (gone: its id may be another object's now)
        return None
    try:
        import cloudpickle

        if cloudpickle.loads(cloudpickle.dumps(x)) is x:  # pickled by reference
            return None
    except Exception:  # noqa: BLE001 - not picklable: the snapshot itself says so
        return None
    return f"{hit[0]}.{hit[1]}"


def _list_arrays(seq: list | tuple, kinds: set[type], entry: tuple, arrays: list, in_lists: set[int]) -> None:
    """Note the arrays of a list of plain values: every one's id (a view elsewhere may look into
    it), and the views among them with where they hang. At C speed while none is a view (a
    history of observations), so a long list costs milliseconds."""
    if kinds == {ndarray}:
        bases = list(map(_BASE, seq))
        in_lists.update(map(id, seq))
        if not any(map(is_not, bases, repeat(None))):  # (not bases.count(None): that compares arrays)
            return
    else:
        in_lists.update(id(a) for a in seq if isinstance(a, ndarray))
    arrays.extend((a, (entry, i, "item")) for i, a in enumerate(seq) if isinstance(a, ndarray) and a.base is not None)


_BASE = attrgetter("base")


def _shared_memory(arrays: list[tuple[np.ndarray, Any]], in_lists: set[int], seen: set[int],
                   path: str) -> tuple[str, str] | None:
    """Two arrays over one buffer among ``arrays`` (and the arrays of ``in_lists``), or a view of an
    object in ``seen``, as a finding."""
    owners: dict[int, tuple[np.ndarray, Any]] = {}
    for a, at in arrays:
        base = a.base
        if base is None:
            owner: Any = a
        else:
            while isinstance(base, ndarray) and base.base is not None:
                base = base.base
            owner = base
        first = owners.setdefault(id(owner), (a, at))
        if first[0] is not a and (a.flags.writeable or first[0].flags.writeable):
            return (f"{_path((None, first[1], 0), path)} and {_path((None, at, 0), path)} (arrays over the same "
                    "memory, which a pickled copy holds apart: a write through one would no longer show in "
                    "the other)", SHARED_MEMORY_FIX)
        if owner is a or not a.flags.writeable:
            continue
        if isinstance(owner, ndarray) and id(owner) in in_lists:
            return (f"{_path((None, at, 0), path)} (a view of an array in a list the env also holds, which a "
                    "pickled copy holds apart: a write through one would no longer show in the other)",
                    SHARED_MEMORY_FIX)
        if not isinstance(owner, ndarray) and id(owner) in seen:
            return (f"{_path((None, at, 0), path)} (a view of memory that {type(owner).__name__} holds, which a "
                    "pickled copy holds apart)", SHARED_MEMORY_FIX)
    return None


def _plain(seq: list | tuple) -> set[type] | None:
    """The element types when a list or tuple holds only plain values (their types), or only
    tuples of plain values (``{tuple}``: a replay buffer, a transition table's rows): nothing in
    it to walk into; else None. Element types are gathered at C speed, so a million rows cost
    tens of milliseconds, not a Python loop each."""
    kinds = set(map(type, seq))
    if kinds <= _LEAF_TYPES:
        return kinds
    if kinds == {tuple} and set(map(type, chain.from_iterable(seq))) <= _LEAF_TYPES:
        return kinds
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

"""Whether a pickled copy iterates every set of an object graph in the order the original does.

A pickle holds a set's elements in iteration order, and loading adds them to an empty set one by
one, which may lay them out differently (see :func:`set_order_problem`). The pickle backend
refuses snapshots where that happens, and :mod:`gym_fork.worker.commands` refuses to ship such an
env instance to its worker (another process, where strings hash differently).
"""

from __future__ import annotations

import types
from itertools import chain
from typing import Any

import numpy as np

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
            if _plain(x):
                continue
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
            if not isinstance(v, leaves):  # (lists and tuples of plain values: _plain, when popped)
                push((v, (entry, k, kind), depth + 1))
    return None


def _plain(seq: list | tuple) -> bool:
    """Whether a list or tuple holds only plain values, or only tuples of plain values (a replay
    buffer, a transition table's rows): nothing in it to look at. Element types are gathered
    at C speed, so a million rows cost tens of milliseconds, not a Python loop each."""
    kinds = set(map(type, seq))
    if kinds <= _LEAF_TYPES:
        return True
    return kinds == {tuple} and set(map(type, chain.from_iterable(seq))) <= _LEAF_TYPES


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

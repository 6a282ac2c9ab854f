"""Paths into the worker's env: what ``env.unwrapped.x``, ``env.unwrapped.f(...)``,
``env.unwrapped.data.qpos[0] = v`` and ``env.get_wrapper_attr(...)`` in the learner act on.

The learner never holds the env's objects, only *paths* to them, resolved again on every use, so
an attribute write or a method call always reaches the live env (also after a restore, which
replaces the worker).  A path is ``(root, *steps)``: root ``"unwrapped"`` (the base env) or
``"wrapper"`` (the outermost layer of the worker's stack; its first step is looked up with
Gymnasium's ``get_wrapper_attr``, which searches the layers from the outside in), each step
``("a", name)`` (an attribute) or ``("i", key)`` (an item).

Reading a path answers how the learner should see the object (:func:`describe`):
``("value", v)`` for plain data, which travels as a copy (numbers, strings, arrays, spaces and
containers of those), ``("callable", name)`` for a function or method (the learner calls it here),
``("object", type name)`` for anything else (the learner keeps the path: a live reference).
"""

from __future__ import annotations

import enum
import inspect
from typing import Any

import gymnasium as gym
import numpy as np

VALUE, CALLABLE, OBJECT = "value", "callable", "object"
_SCALARS = (type(None), bool, int, float, complex, str, bytes, np.generic, np.dtype, enum.Enum, range)
_CONTAINERS = (tuple, list, frozenset, set)
_MAX_DEPTH = 16


def resolve(env: gym.Env, path: tuple) -> Any:
    """The object ``path`` names in ``env`` (the worker's whole stack).

    Raises:
        AttributeError, KeyError, IndexError: a step names nothing.
        ValueError: a malformed path.
    """
    root, steps = path[0], path[1:]
    if root == "unwrapped":
        obj: Any = env.unwrapped
    elif root == "wrapper" and steps and steps[0][0] == "a":
        obj, steps = env.get_wrapper_attr(steps[0][1]), steps[1:]
    else:
        raise ValueError(f"bad path {path!r}")
    for kind, key in steps:
        obj = getattr(obj, key) if kind == "a" else obj[key]
    return obj


def describe(obj: Any) -> tuple:
    """How the learner sees ``obj``: ``("value", obj)``, ``("callable", name)`` or ``("object", type)``."""
    if is_plain(obj):
        return (VALUE, obj)
    if inspect.isroutine(obj):
        return (CALLABLE, getattr(obj, "__qualname__", getattr(obj, "__name__", type(obj).__name__)))
    return (OBJECT, type(obj).__qualname__)


def is_plain(obj: Any, depth: int = 0) -> bool:
    """Plain data: what a copy in the learner stands for exactly (it holds no live env state
    that a method could change behind the copy's back)."""
    if isinstance(obj, _SCALARS) or isinstance(obj, gym.spaces.Space):
        return True
    if depth > _MAX_DEPTH:
        return False
    if type(obj) is np.ndarray:
        return obj.dtype != object or all(is_plain(x, depth + 1) for x in obj.flat)
    if type(obj) in _CONTAINERS:
        return all(is_plain(x, depth + 1) for x in obj)
    if type(obj) is dict:
        return all(is_plain(k, depth + 1) and is_plain(v, depth + 1) for k, v in obj.items())
    return False


def get(env: gym.Env, path: tuple) -> tuple:
    """:func:`describe` of the object at ``path``."""
    return describe(resolve(env, path))


def assign(env: gym.Env, path: tuple, value: Any) -> None:
    """``<path> = value``: an attribute or item assignment on the object one step up."""
    parent, (kind, key) = resolve(env, path[:-1]), path[-1]
    if kind == "a":
        setattr(parent, key, value)
    else:
        parent[key] = value


def delete(env: gym.Env, path: tuple) -> None:
    """``del <path>``."""
    parent, (kind, key) = resolve(env, path[:-1]), path[-1]
    if kind == "a":
        delattr(parent, key)
    else:
        del parent[key]


def call(env: gym.Env, path: tuple, args: tuple, kwargs: dict, or_get: bool = False) -> Any:
    """Call the object at ``path``; its result travels back as a copy (it must pickle).

    Args:
        or_get: a non-callable object is returned (as a copy) instead of raising TypeError, as
            Gymnasium's ``VectorEnv.call`` does.
    """
    obj = resolve(env, path)
    if callable(obj):
        return obj(*args, **kwargs)
    if or_get and not args and not kwargs:
        return obj
    raise TypeError(f"{type(obj).__name__!r} object at {render(path)} is not callable")


def set_wrapper_attr(env: gym.Env, name: str, value: Any, force: bool) -> bool:
    """Gymnasium's ``env.set_wrapper_attr`` on the worker's stack (``force``: create the attribute
    on the outermost layer when no layer has it)."""
    return bool(env.set_wrapper_attr(name, value, force=force))


def render(path: tuple) -> str:
    """``path`` as Python source: ``env.unwrapped.data.qpos[0]``."""
    root, steps = path[0], path[1:]
    out = "env.unwrapped" if root == "unwrapped" else "env"
    for i, (kind, key) in enumerate(steps):
        if root == "wrapper" and i == 0:
            out += f".get_wrapper_attr({key!r})"
        else:
            out += f".{key}" if kind == "a" else f"[{key!r}]"
    return out

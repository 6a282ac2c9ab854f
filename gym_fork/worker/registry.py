"""Envs the user defined and registered in their own script work in the worker too.

A worker is a fresh Python process: it has Gymnasium's own envs, but not what the user's script
registered (``gym.register("MyEnv-v0", entry_point=MyEnv)``), nor the script's ``__main__``
classes, nor the script's directory on ``sys.path``.  So ``gym_fork.make("MyEnv-v0")`` would
raise ``NameNotFound`` in the worker, and an env built from a ``__main__`` class could not even
answer its first request (plain pickle finds no ``__main__.MyEnv`` in the worker).

:func:`pack` (learner side) bundles what the worker needs to see the same registry: every spec
that is not Gymnasium's or ALE's own (the worker gets those itself), with ``__main__`` entry
points shipped by value (cloudpickle), the ``__main__`` objects that string entry points
(``"__main__:MyEnv"``) name, and the learner's ``sys.path`` entries.  :func:`install` (worker
side) appends the missing path entries, puts the ``__main__`` objects into the worker's own
``__main__``, and registers the specs the worker lacks, exactly as they are.  A package that
registers the same id again when the env's module is imported replaces the shipped spec with its
own, equal one, without Gymnasium's "Overriding environment" warning.  :func:`publish_main_types`
makes every ``__main__`` class of a built env findable by name in the worker, so results that
hold them pickle back to the learner, where the name finds the user's class.
"""

from __future__ import annotations

import pickle
import re
import sys
import warnings
from typing import Any

import cloudpickle
import gymnasium as gym

# Envs whose registration the worker gets by itself (Gymnasium's own; ALE's, registered by
# build_env for "ALE/" ids and by install() where the learner registered them): not shipped.
_OWN_PREFIXES = ("gymnasium.", "ale_py.")
_cache: tuple[tuple, bytes | None] | None = None


def pack(needed: str | None = None) -> bytes | None:
    """What the worker needs to know of this process's env registry and ``sys.path``.

    Args:
        needed: an env id the worker is about to make: its spec must ship.

    Raises:
        pickle.PicklingError (or what cloudpickle raises): the spec of ``needed`` cannot be sent.
    """
    global _cache
    specs = [s for s in gym.registry.values() if _ship(s)]
    # ALE's envs registered here (gym.register_envs(ale_py)): a factory's gym.make("ALE/...")
    # must find them in the worker too (not only an "ALE/" id, which build_env registers for)
    ale = any(k.startswith("ALE/") for k in gym.registry)
    key = (tuple(map(id, specs)), tuple(sys.path), needed, ale)
    if _cache is not None and _cache[0] == key:
        return _cache[1]
    shipped, main_objects = [], {}
    for spec in specs:
        objects = _main_objects(spec)
        try:
            cloudpickle.dumps((spec, objects))
        except Exception:  # noqa: BLE001 - a spec that cannot travel: only an error if it is needed
            if spec.id == needed:
                raise
            continue
        shipped.append(spec)
        main_objects.update(objects)
    # The path travels even with no spec: a factory pickled by reference imports its module there.
    blob = pickle.dumps((list(sys.path), cloudpickle.dumps((shipped, main_objects)), ale))
    _cache = (key, blob)
    return blob


def install(blob: bytes) -> None:
    """Make this process's registry, ``__main__`` and ``sys.path`` cover what :func:`pack` saw."""
    paths, payload, *more = pickle.loads(blob)
    for p in paths:  # first: unpickling the specs may import the user's modules
        if p not in sys.path:
            sys.path.append(p)
    if more and more[0] and not any(k.startswith("ALE/") for k in gym.registry):
        try:
            import ale_py

            gym.register_envs(ale_py)
        except ImportError:  # (the learner's factory then says so itself, when it makes one)
            pass
    specs, main_objects = cloudpickle.loads(payload)
    main = sys.modules["__main__"]
    for name, obj in main_objects.items():
        if not hasattr(main, name):
            setattr(main, name, obj)
    added = []
    for spec in specs:
        if spec.id not in gym.registry:
            gym.registry[spec.id] = spec
            added.append(spec.id)
            _publish(spec.entry_point)
    if added:
        ids = "|".join(re.escape(i) for i in added)
        warnings.filterwarnings("ignore", message=rf".*Overriding environment ({ids}) already in registry")


def publish_main_types(env: gym.Env) -> None:
    """Every layer of ``env`` whose class was defined in the user's ``__main__`` becomes
    findable as ``__main__.<name>`` here (pickled by reference, it is the user's class there)."""
    layer: Any = env
    while True:
        _publish(type(layer))
        if not isinstance(layer, gym.Wrapper):
            return
        layer = layer.env


def _publish(obj: Any) -> None:
    name = getattr(obj, "__qualname__", "")
    if getattr(obj, "__module__", None) == "__main__" and name.isidentifier():
        main = sys.modules["__main__"]
        if not hasattr(main, name):
            setattr(main, name, obj)


def _ship(spec: Any) -> bool:
    ep = spec.entry_point
    if isinstance(ep, str):
        return not ep.startswith(_OWN_PREFIXES)
    return not getattr(ep, "__module__", "").startswith(_OWN_PREFIXES)


def _main_objects(spec: Any) -> dict:
    """The learner's ``__main__`` objects a string entry point ``"__main__:Name"`` names."""
    ep = spec.entry_point
    if isinstance(ep, str) and ep.startswith("__main__:"):
        name = ep.split(":", 1)[1]
        obj = getattr(sys.modules["__main__"], name, None)
        if obj is not None:
            return {name: obj}
    return {}

"""Randomness of its own for a copy: ``fork(..., rng="reseed")``, ``explore()``'s default.

A copy starts with its snapshot's generators in the snapshot's state, so copies stepped alike go
on alike.  Reseeding gives each copy its own streams and leaves the simulated state untouched.
An env draws its randomness from wherever its author put it, not only from ``np_random``: a
``self.noise = np.random.default_rng(seed)``, a generator inside a component object, Python's
``random`` module, NumPy's legacy ``np.random.*``.  Reseeding only ``np_random`` left the copies
of such an env identical -- ``explore(n_branches=16)`` returned one branch sixteen times, and
nothing said so.  Reseeded here:

- every ``numpy.random.Generator``, ``numpy.random.RandomState``, ``random.Random`` and
  ``torch.Generator`` reachable
  from the env and its wrappers through instance attributes (``__slots__`` too), dicts, lists and tuples (the env's
  ``np_random``, a wrapper's ``_np_random``, the spaces' generators, an env's own generators);
- ALE's emulator RNG (sticky actions);
- in a worker process, where the env has the process to itself: generators in the module globals
  of the env's and its wrappers' classes (those their methods see: a class from the user's script
  travels by value, with globals of its own), and the process-wide ones -- ``random``'s, NumPy's
  legacy global ``RandomState`` and, when the env loaded torch, torch's default generator.  Not
  in the learner's process (the pickle backend's in-process copies): there those are the
  learner's own, shared with the env the copy was made from.

A policy that ``explore(..., policy_in_worker=True)`` runs inside the copy gets the same
treatment from the copy's seed (:func:`reseed_policy`): the one policy every branch gets a copy
of, and generators that unpickling it brought into the process (torch's).

Each generator is reseeded in place (whoever holds it sees the new stream) from a seed derived
from the copy's seed and the generator's place in a fixed walk order, so a branch is reproducible
from its seed.  Not reseeded: randomness out of reach of that walk (inside C libraries, an env's
closures, objects more than :data:`WALK_DEPTH` levels down; past :data:`WALK_LIMIT` objects, which is
said with a RuntimeWarning).
"""

from __future__ import annotations

import random
import sys
import types
import weakref
from collections import deque
from typing import Any

import gymnasium as gym
import numpy as np

#: how many levels of attributes / items below the env the walk looks for generators
WALK_DEPTH = 8
#: how many objects the walk visits at most (an env holding a huge buffer is not walked whole)
WALK_LIMIT = 50_000

_GENERATORS = (np.random.Generator, np.random.RandomState, random.Random)
# values that hold no generator: never descended into
_LEAVES = (str, bytes, bytearray, int, float, complex, bool, type(None), np.ndarray, np.generic,
           memoryview, range, type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
           types.MethodType, weakref.ref, weakref.ProxyType, weakref.CallableProxyType)

_own_process = False


def own_process() -> None:
    """Declare that this process runs one env and nothing else (a worker): reseeding may then
    also reseed module-level and process-wide generators."""
    global _own_process
    _own_process = True


def generators_of(env: gym.Env, *, process_wide: bool | None = None) -> list[tuple[str, Any]]:
    """The random generators a copy of ``env`` draws from, as ``(where, generator)`` in a fixed
    order (breadth first through the env's attributes, then module globals, then the process-wide
    ones); each generator once.  ``process_wide``: include module globals and process-wide
    generators (default: when this process is a worker)."""
    if process_wide is None:
        process_wide = _own_process
    found: dict[int, tuple[str, Any]] = {}
    # every layer of the wrapper stack is a root: a deep stack (Atari's) does not push the env
    # itself below the walk's depth
    roots: list[tuple[Any, str]] = []
    modules: list[tuple[str, dict]] = []  # (a module's name, the globals its classes' code sees)
    seen_globals: set[int] = set()
    layer: Any = env
    where = "env"
    while True:
        roots.append((layer, where))
        name = type(layer).__module__
        if not name.startswith(("gymnasium.", "gym_fork.")):  # (Gymnasium's own keep none there)
            for namespace in _class_globals(type(layer)):
                if id(namespace) not in seen_globals:
                    seen_globals.add(id(namespace))
                    modules.append((name, namespace))
        if not isinstance(layer, gym.Wrapper):
            break
        layer, where = layer.env, where + ".env"
    if process_wide:
        for name, namespace in modules:
            # its names, without __builtins__, __spec__ and the like
            roots.append(({k: v for k, v in namespace.items() if not k.startswith("__")}, f"{name}."))
    _walk(roots, found)
    if process_wide:
        for where, g in _process_generators():
            found.setdefault(id(g), (where, g))
    return list(found.values())


def _class_globals(cls: type) -> list[dict]:
    """The module globals a class's code reads: those of its methods (a class defined in the
    user's script travels to the worker by value, and its methods keep globals of their own, not
    the worker's ``__main__``'s), else its module's."""
    out, ids = [], set()
    for v in vars(cls).values():
        f = getattr(v, "__func__", v)  # (classmethod, staticmethod)
        g = getattr(f, "__globals__", None)
        if type(g) is dict and id(g) not in ids:
            ids.add(id(g))
            out.append(g)
    if not out:
        module = sys.modules.get(cls.__module__)
        if module is not None:
            out.append(vars(module))
    return out


_LEAF, _GEN, _DICT, _SEQ, _OBJ = range(5)
_kinds: dict[type, int] = {}  # what the walk does with a value of each type (decided once per type)


def _kind(t: type) -> int:
    k = _kinds.get(t)
    if k is None:
        torch_generator = t.__name__ == "Generator" and t.__module__ in ("torch", "torch._C")  # (not imported here)
        k = (_GEN if issubclass(t, _GENERATORS) or torch_generator else _LEAF if issubclass(t, _LEAVES) else
             _DICT if issubclass(t, dict) else _SEQ if issubclass(t, (list, tuple)) else _OBJ)
        _kinds[t] = k
    return k


def _walk(roots: list[tuple[Any, str]], found: dict[int, tuple[str, Any]]) -> None:
    """Breadth first from ``roots``; each object once. Where a generator hangs is kept as a chain
    of (parent, key) links and spelled out only for the generators found."""
    seen: set[int] = set()
    # (object, link: (parent link, key, how) or the root's name, depth)
    todo: deque[tuple[Any, Any, int]] = deque((obj, where, 0) for obj, where in roots)
    push, pop, kinds = todo.append, todo.popleft, _kinds
    visited = 0
    while todo:
        if visited >= WALK_LIMIT:
            import warnings

            warnings.warn(
                f"gym_fork reseed: the walk for random generators stopped after {WALK_LIMIT} objects (the env holds "
                "that many, e.g. a long history list); a generator further in keeps the snapshot's stream in every "
                "copy. Keep generators in plain attributes of the env (they are found first), or reseed it yourself "
                "after fork().", RuntimeWarning, stacklevel=2)
            break
        x, link, depth = pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        visited += 1
        k = kinds.get(type(x)) or _kind(type(x))
        if k == _GEN:
            found.setdefault(id(x), (_spell(link), x))
            continue
        if depth >= WALK_DEPTH:
            continue
        if k == _DICT:
            items, how = list(x.items()), "item"
        elif k == _SEQ:
            items, how = enumerate(x), "item"
        elif k == _OBJ:
            try:
                d = getattr(x, "__dict__", None)
            except Exception:  # noqa: BLE001 - an object that will not show its attributes holds none we reach
                continue
            items = list(d.items()) if type(d) is dict else []
            slots = _slots.get(type(x))
            if slots is None:
                slots = _slots[type(x)] = _slot_names(type(x))
            for name in slots:  # (an object with __slots__ keeps those attributes outside __dict__)
                try:
                    items.append((name, getattr(x, name)))
                except Exception:  # noqa: BLE001 - an empty slot
                    pass
            how = "attr"
        else:
            continue
        for key, v in items:
            kv = kinds.get(type(v))
            if kv is None:
                kv = _kind(type(v))
            if kv != _LEAF:
                push((v, (link, key, how), depth + 1))


_slots: dict[type, tuple[str, ...]] = {}


def _slot_names(t: type) -> tuple[str, ...]:
    """The ``__slots__`` attribute names along ``t``'s MRO (no ``__dict__``/``__weakref__``)."""
    names: list[str] = []
    for c in t.__mro__:
        declared = c.__dict__.get("__slots__", ())
        for name in (declared,) if isinstance(declared, str) else declared:
            if name not in ("__dict__", "__weakref__") and name not in names:
                names.append(name)
    return tuple(names)


def _spell(link: Any) -> str:
    """``env.env._np_random``, ``module.name``, ``env.levels[2]``: where a link leads."""
    parts = []
    while isinstance(link, tuple):
        link, key, how = link
        parts.append(f".{key}" if how == "attr" or (isinstance(link, str) and link.endswith(".")) else f"[{key!r}]")
    root = link[:-1] if link.endswith(".") else link
    return root + "".join(reversed(parts))


def _process_generators() -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = [("random (the module's generator)", random._inst),  # type: ignore[attr-defined]
                                  ("numpy.random (the legacy global RandomState)", np.random.mtrand._rand)]
    torch = sys.modules.get("torch")  # only if the env (or a policy in the worker) loaded it
    if torch is not None and hasattr(torch, "default_generator"):
        out.append(("torch.default_generator", torch.default_generator))
    return out


def reseed_env(env: gym.Env, seed: int, reseeded: dict[int, Any] | None = None,
               skip: tuple[str, ...] = (), found: list[tuple[str, Any]] | None = None) -> list[str]:
    """Give a copy its own randomness (see the module docstring). Returns where the reseeded
    generators hang, in the order they were reseeded; ``reseeded`` (if given) gets each of them,
    by id, so that :func:`reseed_policy` leaves them alone. ``skip``: generators, by where they
    hang, that are not the env's (torch's, imported by a policy loaded ahead). ``found``:
    :func:`generators_of` ``(env)`` found earlier on these very objects (see
    ``EnvServer.generators``); not used where this makes generators of its own first."""
    u = env.unwrapped
    ale = getattr(u, "ale", None)
    if ale is not None and hasattr(ale, "cloneState") and hasattr(u, "seed_game") and hasattr(u, "load_game"):
        # ALE takes a new RNG seed only on a ROM reload, which resets the game: keep the game
        # state aside (without its RNG), reseed + reload, then put the game state back.
        state = ale.cloneState(include_rng=False)
        u.seed_game(int(np.random.SeedSequence(seed).generate_state(1, np.uint32)[0]))
        found = None  # (seed_game makes the env a new np_random)
        u.load_game()
        ale.restoreState(state)
    if getattr(u, "_np_random", None) is None:  # never seeded: Gymnasium would make one from entropy
        u.np_random = np.random.Generator(np.random.PCG64(0))  # (reseeded below, with the rest)
        found = None  # (a generator the list cannot hold)
    done = []
    for i, (where, g) in enumerate(generators_of(env) if found is None else found):
        if where in skip:
            continue
        _reseed(g, np.random.SeedSequence(seed, spawn_key=(i + 1,)))
        done.append(where)
        if reseeded is not None:
            reseeded[id(g)] = g  # (kept alive with it: an id is not reused while it is recorded)
    # as Gymnasium's np_random setter says of a generator it cannot trace to a seed: the seed
    # reset() was given no longer describes the stream (-1), rather than a seed that misleads
    layer: Any = env
    while True:
        if getattr(layer, "_np_random_seed", None) is not None:
            layer._np_random_seed = -1
        if not isinstance(layer, gym.Wrapper):
            break
        layer = layer.env
    return done


def reseed_policy(policy: Any, seed: int, reseeded: dict[int, Any], *, own_generators: bool) -> list[str]:
    """Give the policy a branch runs in its worker (``explore(..., policy_in_worker=True)``)
    randomness of the copy's own, after :func:`reseed_env` gave the env its: a copy's seed then
    decides the whole branch.

    - ``own_generators``: also the generators the policy holds -- in its attributes, in the
      variables a function closes over or its defaults, and (in a worker) in the module globals
      its code names.  For one policy that every branch gets a copy of: each copy would otherwise
      draw the same numbers.  (One policy per branch keeps the seeds its author gave it.)
    - In a worker: process-wide generators that appeared since the env's reseed -- torch's, when
      unpickling the policy first imported torch (seeded from fresh entropy at import: the branch
      would not be reproducible from its seed).

    Generators in ``reseeded`` (the env's, and those of an earlier call) are left alone; those
    reseeded here are added.  Returns where they hang."""
    found: dict[int, tuple[str, Any]] = {}
    if own_generators:
        _walk(_callable_roots(policy), found)
    if _own_process:
        for where, g in _process_generators():
            found.setdefault(id(g), (where, g))
    done = []
    # spawn keys of two numbers: never one of the env's (one number each)
    for i, (where, g) in enumerate(found.values()):
        if id(g) in reseeded:
            continue
        _reseed(g, np.random.SeedSequence(seed, spawn_key=(0, i + 1)))
        reseeded[id(g)] = g
        done.append(where)
    return done


def _callable_roots(policy: Any, where: str = "policy", depth: int = 0) -> list[tuple[Any, str]]:
    """Where a policy's generators may hang: the object itself (its attributes), and for a
    function or method what it closes over, its defaults, the object it is bound to and (only
    in a worker: elsewhere they are the caller's own modules) the globals its code names."""
    roots: list[tuple[Any, str]] = [(policy, where)]
    if depth > 3:
        return roots
    if isinstance(policy, types.MethodType):
        return roots + _callable_roots(policy.__self__, f"{where}.__self__", depth + 1)
    inner = getattr(policy, "func", None)  # functools.partial
    if isinstance(inner, (types.FunctionType, types.MethodType)) and not isinstance(policy, types.FunctionType):
        roots += _callable_roots(inner, f"{where}.func", depth + 1)
        roots += [(list(getattr(policy, "args", ())), f"{where}.args"),
                  (dict(getattr(policy, "keywords", None) or {}), f"{where}.keywords")]
    if not isinstance(policy, types.FunctionType):
        call = getattr(type(policy), "__call__", None)
        if isinstance(call, types.FunctionType) and call.__closure__:
            roots += _function_roots(call, f"{where}.__call__")
        return roots
    return roots + _function_roots(policy, where)


def _function_roots(f: types.FunctionType, where: str) -> list[tuple[Any, str]]:
    code = f.__code__
    cells = {}
    for name, cell in zip(code.co_freevars, f.__closure__ or ()):
        try:
            cells[name] = cell.cell_contents
        except ValueError:  # an empty cell
            pass
    roots: list[tuple[Any, str]] = [(cells, f"{where}.<closure>."), (list(f.__defaults__ or ()), f"{where}.__defaults__"),
                                    (dict(f.__kwdefaults__ or {}), f"{where}.__kwdefaults__")]
    if _own_process:
        names: set[str] = set()
        todo = [code]
        while todo:  # the names of nested functions' code too (a comprehension, an inner def)
            c = todo.pop()
            names.update(c.co_names)
            todo += [k for k in c.co_consts if isinstance(k, types.CodeType)]
        g = f.__globals__
        roots.append(({n: g[n] for n in sorted(names) if n in g}, f"{f.__module__}."))
    return roots


def _reseed(g: Any, ss: np.random.SeedSequence) -> None:
    """Reseed ``g`` in place from ``ss``, keeping its kind of generator."""
    if isinstance(g, np.random.Generator):
        bit = g.bit_generator
        bit.state = type(bit)(ss).state
    elif isinstance(g, np.random.RandomState):
        g.seed(ss.generate_state(4, np.uint32))
    elif isinstance(g, random.Random):
        g.seed(int.from_bytes(ss.generate_state(4, np.uint32).tobytes(), "little"))
    else:  # torch.Generator
        g.manual_seed(int(ss.generate_state(1, np.uint64)[0] >> 1))

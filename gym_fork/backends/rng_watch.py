"""Which random generators outside an env's pickle its calls draw from, seen as they happen.

A pickle of an env holds the env's own generators (``np_random``, a ``random.Random`` it keeps)
and not the process's: the global RNGs of ``random``, ``numpy`` and ``torch``, or a generator its
module keeps as a global.  An env that draws from one of those goes on differently after a pickle
restore, from the first draw on.  The pickle backend's behavioural check steps copies a few
steps at a time and misses a draw that happens only now and then (every 25th step, on some
event); this watch does not: a pickle handle fingerprints those generators before and after
each call into the env (a few microseconds: their raw state is compared, not copied into Python
objects), so a draw by the env -- not by the learner between calls -- is seen when it happens.
(Not seen: a draw of one normal from numpy's legacy global RNG that only uses up the second of a
pair it cached, where that state is not readable; the next draw that needs new words is.)

Example:
    >>> import numpy as np
    >>> watch = RngWatch(object())
    >>> before = watch.fingerprint()
    >>> _ = np.random.random()
    >>> watch.changed(before)
    'numpy.random (the global RNG)'
"""

from __future__ import annotations

import ctypes
import pickle
import random
import sys
from typing import Any, Callable

import numpy as np

_MT_WORDS = 624
_HEAD = object.__basicsize__  # PyObject_HEAD: where a C object's own fields begin


def _python_random_probe(r: random.Random) -> Callable[[], Any]:
    """The state of a ``random.Random`` as bytes: its C fields (the index and 624 words, read in
    place: ``getstate()`` builds a 625-int tuple, ~8 us) and ``gauss_next``. Checked once against
    ``getstate()``; where the layout differs (another interpreter), ``getstate()`` it is."""
    addr, size = id(r) + _HEAD, 4 + 4 * _MT_WORDS
    try:
        raw = ctypes.string_at(addr, size)
        version, words, _ = r.getstate()
        index = int.from_bytes(raw[:4], sys.byteorder)
        ok = index == words[-1] and list(np.frombuffer(raw[4:], dtype=np.uint32)) == list(words[:-1])
    except Exception:  # noqa: BLE001
        ok = False
    if ok:
        # the index and the first 8 words: every draw moves the index, and one that brings it
        # round to where it was (624k words) has regenerated every word (reading all 2.5 kB per
        # call doubled a CartPole step's cost, in cache misses)
        head = (ctypes.c_char * (4 + 4 * 8)).from_address(addr)  # (a view: .raw copies 36 bytes)
        return lambda: (head.raw, r.gauss_next)
    return r.getstate


def _numpy_probe(rng: np.random.RandomState | np.random.Generator) -> Callable[[], Any]:
    """The state of a NumPy generator: an MT19937's 624 words and position read in place (its
    ``state`` property builds a dict and copies them, ~35 us); any other bit generator's state
    as a pickle (PCG64's is two integers)."""
    bg = rng._bit_generator if isinstance(rng, np.random.RandomState) else rng.bit_generator
    if isinstance(bg, np.random.MT19937):
        addr, size = bg.ctypes.state_address, 4 * _MT_WORDS + 4
        st = bg.state["state"]
        raw = ctypes.string_at(addr, size)
        if (np.frombuffer(raw[:-4], dtype=np.uint32) == st["key"]).all() and \
                int.from_bytes(raw[-4:], sys.byteorder, signed=True) == st["pos"]:
            # the position, and the first 8 words (as for random above)
            pos = (ctypes.c_char * 4).from_address(addr + 4 * _MT_WORDS)
            head = (ctypes.c_char * (4 * 8)).from_address(addr)
            return lambda bg=bg: (pos.raw, head.raw)  # (bg held: the memory stays its)
    return lambda: pickle.dumps(bg.state)


def _torch_probe() -> Callable[[], Any] | None:
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    gen = torch.default_generator
    return lambda: gen.get_state().numpy().tobytes()


#: modules whose generators are not an env's (the globals of random/numpy are watched by name)
_NOT_ENV_MODULES = ("random", "numpy", "torch", "gymnasium", "gym_fork", "builtins")


class RngWatch:
    """Fingerprints the generators a pickle of ``env`` does not hold: the global RNGs of
    ``random``, ``numpy`` (and ``torch``, once imported), and the ``random.Random`` /
    ``numpy.random`` generators held as globals by the modules that define the env's classes
    (its wrappers' included)."""

    def __init__(self, env: Any) -> None:
        self._probes: list[tuple[str, Callable[[], Any]]] = [
            ("random (the global RNG)", _python_random_probe(random._inst)),  # type: ignore[attr-defined]
            ("numpy.random (the global RNG)", _numpy_probe(np.random.mtrand._rand)),
        ]
        self._torch = False
        seen: set[int] = set()
        for mod_name in _env_modules(env):
            mod = sys.modules.get(mod_name)
            for name, v in list(vars(mod).items()) if mod is not None else ():
                if id(v) in seen or not isinstance(v, (random.Random, np.random.RandomState, np.random.Generator)):
                    continue
                seen.add(id(v))
                probe = _python_random_probe(v) if isinstance(v, random.Random) else _numpy_probe(v)
                self._probes.append((f"{mod_name}.{name} (a generator its module holds)", probe))

    @property
    def _fns(self) -> list[Callable[[], Any]]:
        fns = self.__dict__.get("_fns_cache")
        if fns is None or len(fns) != len(self._probes):
            fns = self.__dict__["_fns_cache"] = [p for _, p in self._probes]
        return fns

    def _with_torch(self) -> None:
        if "torch" in sys.modules:
            probe = _torch_probe()
            if probe is not None:
                self._probes.append(("torch (the global RNG)", probe))
            self._torch = True

    def fingerprint(self) -> list:
        """The watched generators' states, as comparable values."""
        if not self._torch:
            self._with_torch()
        return [p() for p in self._fns]

    def changed(self, before: list) -> str | None:
        """The first generator whose state is not what ``before`` held (by name), or None."""
        now = self.fingerprint()
        if now == before:
            return None
        for (name, _), a, b in zip(self._probes, before, now):
            if a != b:
                return name
        return None


def _env_modules(env: Any) -> list[str]:
    """The modules defining the classes of ``env``'s layers (wrappers and the unwrapped env)."""
    out: list[str] = []
    layer, depth = env, 0
    while layer is not None and depth < 64:
        for cls in type(layer).__mro__:
            mod = cls.__module__ or ""
            if mod not in out and mod.split(".")[0] not in _NOT_ENV_MODULES:
                out.append(mod)
        layer, depth = getattr(layer, "env", None), depth + 1
    return out

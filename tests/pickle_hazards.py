"""Envs whose pickled copy goes on differently from the original in ways two pickled copies
compared with each other cannot show (both are alike, and alike wrong), found by an audit of the
pickle backend: identity with a module global, dicts keyed by ``id()``, a global RNG drawn from
only now and then, sets and array views inside a ``deque`` or a ``__slots__`` object, and a
``__getstate__`` that leaves state out.  Each lives in a module (not a test function) as user
code does, so cloudpickle pickles its classes by reference."""

from __future__ import annotations

import random
import threading
from collections import deque

import gymnasium as gym
import numpy as np

_UNSET = object()  # a sentinel, compared with `is`: a pickled copy holds a new object instead
_RNG = random.Random(7)  # a module-level generator the env draws from now and then
_LOCK = threading.Lock()  # what an info may hand out that no pickle can carry


class _Base(gym.Env):
    metadata = {"render_modes": []}

    def __init__(self) -> None:
        self.observation_space = gym.spaces.Box(-1e9, 1e9, (2,), np.float64)
        self.action_space = gym.spaces.Discrete(3)
        self.t = 0

    def _out(self, value: float):
        return np.array([self.t, value], dtype=np.float64), 0.0, False, self.t >= 60, {}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.array([0.0, 0.0]), {}


class SentinelEnv(_Base):
    """Remembers the last action, `_UNSET` until the first: a copy's `pending` is not `_UNSET`."""

    def reset(self, *, seed=None, options=None):
        self.pending = _UNSET
        return super().reset(seed=seed, options=options)

    def step(self, action):
        self.t += 1
        value = 100.0 if self.pending is _UNSET else float(self.pending)
        self.pending = _UNSET if action == 0 else int(action)
        return self._out(value)


class _Item:
    def __init__(self, worth: int) -> None:
        self.worth = worth


class IdKeyedEnv(_Base):
    """Counts visits per item in a dict keyed by `id(item)`: a copy's items have other ids."""

    def reset(self, *, seed=None, options=None):
        self.items = [_Item(w) for w in (3, 5, 9)]
        self.visits = {id(it): 0 for it in self.items}
        return super().reset(seed=seed, options=options)

    def step(self, action):
        self.t += 1
        item = self.items[int(action)]
        self.visits[id(item)] = self.visits.get(id(item), 0) + 1
        return self._out(float(sum(self.visits.get(id(it), 0) * it.worth for it in self.items)))


class OccasionalGlobalEnv(_Base):
    """Draws from numpy's global RNG on every 25th step only."""

    def step(self, action):
        self.t += 1
        noise = float(np.random.random()) if self.t % 25 == 0 else 0.0
        return self._out(float(action) + noise)


class OccasionalModuleRngEnv(_Base):
    """Draws from the module-level `_RNG` on every 25th step only."""

    def step(self, action):
        self.t += 1
        noise = _RNG.random() if self.t % 25 == 0 else 0.0
        return self._out(float(action) + noise)


class _Slotted:
    __slots__ = ("goals", "row")


class HiddenHazardEnv(_Base):
    """A shrunk set, or an array and its view, kept where the walk did not look: in a `deque`
    (``where="deque"``) or in a `__slots__` object (``where="slots"``)."""

    def __init__(self, where: str, what: str) -> None:
        super().__init__()
        self.where, self.what = where, what

    def reset(self, *, seed=None, options=None):
        goals = set(range(0, 1000, 7))
        for g in list(goals)[:130]:
            goals.discard(g)
        grid = np.zeros((3, 4))
        if self.where == "deque":
            self.box = deque([goals] if self.what == "set" else [grid, grid[1]])
        else:
            self.box = _Slotted()
            self.box.goals = goals if self.what == "set" else grid
            self.box.row = grid[1]
        return super().reset(seed=seed, options=options)

    def _goals(self):
        return self.box[0] if self.where == "deque" else self.box.goals

    def step(self, action):
        self.t += 1
        if self.what == "set":
            goals = self._goals()
            value = float(next(iter(goals), -1))
            goals.discard(next(iter(goals), None))
        else:
            grid, row = (self.box[0], self.box[1]) if self.where == "deque" else (self.box.goals, self.box.row)
            row[int(action)] += 1.0  # a write through the view shows in the grid, not in a copy's
            value = float(grid.sum())
        return self._out(value)


class _Counter:
    """Drops `count` from its pickle (a cache it thinks it can rebuild): a copy starts at 0."""

    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 0

    def __getstate__(self):
        return None

    def __setstate__(self, state):
        self.count = 0


class DroppedStateEnv(_Base):
    def reset(self, *, seed=None, options=None):
        self.counter = _Counter()
        return super().reset(seed=seed, options=options)

    def step(self, action):
        self.t += 1
        self.counter.count += int(action) + 1
        return self._out(float(self.counter.count))


class _Key:
    def __init__(self, name: str) -> None:
        self.name = name


class ObjectKeyedEnv(_Base):
    """A dict keyed by plain objects (hashed by address, compared by identity): exact when pickled
    (the keys come back as the copy's own objects) -- no reason to refuse it."""

    def reset(self, *, seed=None, options=None):
        self.keys = [_Key("a"), _Key("b"), _Key("c")]
        self.score = {k: 0 for k in self.keys}
        return super().reset(seed=seed, options=options)

    def step(self, action):
        self.t += 1
        self.score[self.keys[int(action)]] += 1
        return self._out(float(sum(v * (i + 1) for i, v in enumerate(self.score.values()))))


class LockInInfoEnv(_Base):
    """Exact, but its info holds a lock: the original's answers cannot come back from the fork()
    child that stepped it (a pipe carries pickles)."""

    def step(self, action):
        self.t += 1
        out = self._out(float(action))
        if self.t >= 3:  # (not in the info a snapshot at step 1 keeps)
            out[4]["lock"] = _LOCK
        return out


def lock_in_info():
    return LockInInfoEnv()


def sentinel():
    return SentinelEnv()


def id_keyed():
    return IdKeyedEnv()


def occasional_global():
    return OccasionalGlobalEnv()


def occasional_module_rng():
    return OccasionalModuleRngEnv()


def hidden(where: str, what: str):
    return lambda: HiddenHazardEnv(where, what)


def dropped_state():
    return DroppedStateEnv()


def object_keyed():
    return ObjectKeyedEnv()

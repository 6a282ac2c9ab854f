"""gym_fork: snapshot(), restore() and fork() for any Gymnasium environment.

>>> import gym_fork
>>> env = gym_fork.make("CartPole-v1")     # backend="auto": CRIU when usable, else pickle

The public names load on first use (PEP 562): an env worker process imports
``gym_fork.worker`` only, not the controller's backends, store and CRIU client, so every worker
-- and every fork() of one, and every CRIU image of one -- is that much smaller.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers and the API docs see; at run time, loaded on first use
    from gym_fork import errors
    from gym_fork.backends.bundles import load_snapshot
    from gym_fork.check import check_env
    from gym_fork.costs import measure_costs
    from gym_fork.env import ForkableEnv, make
    from gym_fork.errors import BundleError, GymForkError
    from gym_fork.exploration import Branch, ExploreResult, explore
    from gym_fork.snapshots.snapshot import Snapshot
    from gym_fork.snapshots.store import SnapshotStore
    from gym_fork.vec_env import ForkableVecEnv
    from gym_fork.wrapped import find_forkable, restore_of, snapshot_of

# public name -> the module that defines it
_PUBLIC = {
    "errors": "gym_fork.errors",
    "BundleError": "gym_fork.errors",
    "GymForkError": "gym_fork.errors",
    "load_snapshot": "gym_fork.backends.bundles",
    "Branch": "gym_fork.exploration",
    "ExploreResult": "gym_fork.exploration",
    "explore": "gym_fork.exploration",
    "ForkableEnv": "gym_fork.env",
    "make": "gym_fork.env",
    "Snapshot": "gym_fork.snapshots.snapshot",
    "SnapshotStore": "gym_fork.snapshots.store",
    "find_forkable": "gym_fork.wrapped",
    "restore_of": "gym_fork.wrapped",
    "snapshot_of": "gym_fork.wrapped",
    "check_env": "gym_fork.check",
    "measure_costs": "gym_fork.costs",
    # needs stable-baselines3 (and torch)
    "ForkableVecEnv": "gym_fork.vec_env",
}


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'gym_fork' has no attribute {name!r}")
    if module != "gym_fork.errors":
        # the backends register themselves with the data layer (which never imports them): a
        # SnapshotStore or a loaded bundle must find the backend its snapshots name
        importlib.import_module("gym_fork.backends")
    mod = importlib.import_module(module)
    value = mod if name == "errors" else getattr(mod, name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))


__all__ = ["SnapshotStore", "ForkableVecEnv", "load_snapshot", "BundleError", "ForkableEnv", "make", "Snapshot",
           "GymForkError", "errors", "explore", "Branch", "ExploreResult", "snapshot_of", "restore_of",
           "find_forkable", "check_env", "measure_costs"]
__version__ = "0.1.0"

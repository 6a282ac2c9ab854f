"""gym_fork: snapshot(), restore() and fork() for any Gymnasium environment.

>>> import gym_fork
>>> env = gym_fork.make("CartPole-v1")     # backend="auto": CRIU when usable, else pickle

The public names load on first use (PEP 562): an env worker process imports
``gym_fork.worker`` only, not the controller's backends, store and CRIU client, so every worker
-- and every fork() of one, and every CRIU image of one -- is that much smaller.
"""

from __future__ import annotations

import importlib
from typing import Any

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
           "find_forkable", "check_env"]
__version__ = "0.1.0"

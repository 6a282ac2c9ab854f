"""gym_fork: snapshot(), restore() and fork() for any Gymnasium environment.

>>> import gym_fork
>>> env = gym_fork.make("CartPole-v1")     # backend="auto": CRIU when usable, else pickle
"""

from gym_fork import errors
from gym_fork.errors import BundleError
from gym_fork.backends.bundles import load_snapshot
from gym_fork.exploration import Branch, ExploreResult, explore
from gym_fork.env import ForkableEnv, make
from gym_fork.errors import GymForkError
from gym_fork.snapshots.snapshot import Snapshot
from gym_fork.snapshots.store import SnapshotStore
from gym_fork.wrapped import find_forkable, restore_of, snapshot_of
from gym_fork.check import check_env



def __getattr__(name: str):
    # ForkableVecEnv needs stable-baselines3 (and torch): import it only when asked for.
    if name == "ForkableVecEnv":
        from gym_fork.vec_env import ForkableVecEnv

        return ForkableVecEnv
    raise AttributeError(f"module 'gym_fork' has no attribute {name!r}")


__all__ = ["SnapshotStore", "ForkableVecEnv", "load_snapshot", "BundleError", "ForkableEnv", "make", "Snapshot", "GymForkError", "errors", "explore", "Branch", "ExploreResult", "snapshot_of", "restore_of", "find_forkable", "check_env"]
__version__ = "0.1.0"

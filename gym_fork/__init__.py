"""gym_fork: snapshot(), restore() and fork() for any Gymnasium environment.

>>> import gym_fork
>>> env = gym_fork.make("CartPole-v1")     # backend="auto": CRIU when usable, else pickle
"""

from gym_fork import errors
from gym_fork.branching import Branch, ExploreResult, explore
from gym_fork.env import ForkableEnv, make
from gym_fork.errors import GymForkError
from gym_fork.snapshot import Snapshot

__all__ = ["ForkableEnv", "make", "Snapshot", "GymForkError", "errors", "explore", "Branch", "ExploreResult"]
__version__ = "0.1.0"

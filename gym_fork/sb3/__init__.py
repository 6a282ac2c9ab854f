"""Stable-Baselines3 integration (``pip install gym_fork[sb3]``).

* :class:`BranchExplorationCallback`: branch exploration at fork points during ``model.learn()``.
* :class:`LiveMigrationCallback`: move the whole training job to another node at a step boundary.
"""

from gym_fork.sb3.exploration import BranchExplorationCallback, Transition
from gym_fork.sb3.migration import LiveMigrationCallback

__all__ = ["BranchExplorationCallback", "LiveMigrationCallback", "Transition"]

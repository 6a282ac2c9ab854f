"""gym_fork on a Ray cluster (extra ``gym_fork[ray]``).

* :class:`RayBranchPool`: :func:`gym_fork.explore` fanned out over the cluster's nodes, one host
  actor per node; a snapshot's bundle travels through the object store once per node and is
  verified and restored once there.
* :class:`RayNode`: a migration target, ``env.migrate(RayNode(node_id))`` (one migration host
  actor per node; hops chain: :mod:`gym_fork.ray.migration`).

``import ray`` in this package is the top-level Ray (absolute imports), not ``gym_fork.ray``.
"""

from __future__ import annotations

from gym_fork.ray.node import RayNode
from gym_fork.ray.pool import BranchesFailedError, BranchFailure, PoolExploreResult, RayBranchPool

__all__ = ["RayBranchPool", "BranchesFailedError", "BranchFailure", "PoolExploreResult", "RayNode"]

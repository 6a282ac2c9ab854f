"""gym_fork on a Ray cluster (extra ``gym_fork[ray]``).

* :class:`RayBranchPool`: :func:`gym_fork.explore` fanned out over the cluster's nodes, one host
  actor per node; a snapshot's bundle travels through the object store once per node and is
  verified and restored once there.
* :class:`RayNode`: a migration target, ``env.migrate(RayNode(node_id))`` (one migration host
  actor per node; hops chain: :mod:`gym_fork.ray.env_migration`), and
  ``LiveMigrationCallback(RayNode(node_id))`` (a whole ``gym-fork run`` job moves into that node's
  host; the supervisor, not the job, talks to Ray: :mod:`gym_fork.ray.targets`, registered as
  the ``"ray"`` target kind through an entry point).

``import ray`` in this package is the top-level Ray (absolute imports), not ``gym_fork.ray``.
``from gym_fork.ray import RayNode`` does not import Ray (a migratable job must stay Ray-free:
CRIU cannot dump a process holding Ray's connections); the pool classes load it on first use.
"""

from __future__ import annotations

from typing import Any

from gym_fork.ray.node import RayNode

__all__ = ["RayBranchPool", "BranchesFailedError", "BranchFailure", "PoolExploreResult", "RayNode"]
_POOL = {"RayBranchPool", "BranchesFailedError", "BranchFailure", "PoolExploreResult"}


def __getattr__(name: str) -> Any:
    if name in _POOL:
        from gym_fork.ray import pool

        return getattr(pool, name)
    raise AttributeError(f"module 'gym_fork.ray' has no attribute {name!r}")

"""``RayNode``: a migration target named by Ray node id (kept import-light: the migration code in
:mod:`gym_fork.ray.migration` is loaded only when an env actually migrates)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RayNode:
    """A migration target: the Ray node with this id (``ray.nodes()[i]["NodeID"]``), for
    ``env.migrate(RayNode(node_id))``."""

    node_id: str

    def __str__(self) -> str:
        return f"ray:{self.node_id[:12]}"

    def _gym_fork_migrate(self, env: Any, *, token: str | bytes | None = None, timeout: float = 60.0,
                          **_ignored: Any) -> dict:
        from gym_fork.ray.migration import migrate_env_to_node

        return migrate_env_to_node(env, self, token=token, timeout=timeout)

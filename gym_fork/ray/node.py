"""``RayNode``: a migration target named by Ray node id. Import-light: the migration code is
loaded only when an env actually migrates, and a training job that names a ``RayNode`` for
:class:`~gym_fork.sb3.LiveMigrationCallback` never imports Ray."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

JOB_TARGET_PREFIX = "ray:"


@dataclass(frozen=True)
class RayNode:
    """A migration target: the Ray node with this id (``ray.nodes()[i]["NodeID"]``), for
    ``env.migrate(RayNode(node_id))`` and ``LiveMigrationCallback(RayNode(node_id))``."""

    node_id: str

    def __post_init__(self) -> None:
        if not isinstance(self.node_id, str) or not self.node_id or ":" in self.node_id:
            raise ValueError(f"not a Ray node id: {self.node_id!r}")

    def __str__(self) -> str:
        return f"ray:{self.node_id[:12]}"

    @property
    def job_target(self) -> str:
        """The target string a managed job sends its supervisor (``"ray:<node id>"``): the
        supervisor (``gym-fork run``), which is not checkpointed, resolves it through Ray."""
        return JOB_TARGET_PREFIX + self.node_id

    def _gym_fork_migrate(self, env: Any, *, token: str | bytes | None = None, timeout: float = 60.0,
                          live: bool = False, **_ignored: Any) -> Any:
        if live:
            from gym_fork.ray.env_migration import migrate_env_to_node_live

            return migrate_env_to_node_live(env, self, token=token, timeout=timeout)
        from gym_fork.ray.env_migration import migrate_env_to_node

        return migrate_env_to_node(env, self, token=token, timeout=timeout)


def parse_job_target(target: str) -> str | None:
    """The node id of a ``"ray:<node id>"`` job target, else None (an agent's ``host:port``)."""
    if isinstance(target, str) and target.startswith(JOB_TARGET_PREFIX):
        nid = target[len(JOB_TARGET_PREFIX):]
        if not nid or ":" in nid:
            raise ValueError(f"not a Ray node target: {target!r} (want 'ray:<node id>')")
        return nid
    return None

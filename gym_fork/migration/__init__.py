"""Live migration between nodes: the node agent (``gym-fork agent``), ``ForkableEnv.migrate``,
managed jobs (``gym-fork run``) and their whole-tree migration. See ARCHITECTURE.md."""

from gym_fork.errors import (
    AgentUnreachableError,
    AuthenticationError,
    MigratedEnvError,
    MigrationError,
    RemoteRestoreError,
    TransferError,
)

__all__ = ["MigrationError", "AgentUnreachableError", "AuthenticationError", "TransferError",
           "RemoteRestoreError", "MigratedEnvError"]

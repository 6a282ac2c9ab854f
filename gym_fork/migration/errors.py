"""Typed errors of live migration. All are :class:`gym_fork.GymForkError`; on every one of them
the source (env or job) keeps running unchanged."""

from __future__ import annotations

from gym_fork.errors import GymForkError


class MigrationError(GymForkError):
    """A migration failed; the source keeps running unchanged. The message says what happened."""


class AgentUnreachableError(MigrationError):
    """No agent answered at the target address (down, wrong address, or timed out)."""


class AuthenticationError(MigrationError):
    """The agent refused our token, or the agent could not prove it knows the token."""


class TransferError(MigrationError):
    """The connection to the agent broke while the checkpoint was being sent or confirmed."""


class RemoteRestoreError(MigrationError):
    """The agent received the checkpoint but refused or failed to restore it (integrity check,
    incompatible machine, CRIU restore failure, no disk space); ``remote_type`` names its error."""

    def __init__(self, message: str, remote_type: str = ""):
        super().__init__(message)
        self.remote_type = remote_type


class MigratedEnvError(MigrationError):
    """The operation is not available on an env whose worker runs on another node."""

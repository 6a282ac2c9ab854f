"""The job's side of its control channel: a managed job (``gym-fork run``) asks its supervisor
to move it, over the unix socket whose fd is in ``$GYM_FORK_CONTROL_FD``. Strictly request and
reply, so that the job is blocked in ``recv`` (nothing in flight) while it is checkpointed."""

from __future__ import annotations

import os
import socket
from typing import Any

from gym_fork.errors import MigrationError
from gym_fork.worker.channel import Channel

CONTROL_ENV = "GYM_FORK_CONTROL_FD"


def is_managed_job() -> bool:
    """Whether this process was started by ``gym-fork run`` (it has a control channel)."""
    return bool(os.environ.get(CONTROL_ENV))


def _ask_supervisor(cmd: str, args: dict) -> dict:
    fd = os.environ.get(CONTROL_ENV)
    if not fd:
        raise MigrationError("this process is not a managed job: start it with `gym-fork run -- python ...`")
    sock = socket.socket(fileno=int(fd))
    try:
        chan = Channel(sock)
        chan.send((cmd, args))
        return chan.recv()
    finally:
        sock.detach()  # the fd stays open: it is the job's control channel for good


def request_migration(target: str, **info: Any) -> dict:
    """Ask this job's supervisor to move the whole job to ``target``.

    Blocks until the job runs on the target -- there it returns ``{"status": "arrived", ...}``
    -- or the move failed: then it returns ``{"status": "failed", "error": ...}`` here.

    Raises:
        MigrationError: this process is not a managed job.
    """
    return _ask_supervisor("migrate", dict(info, target=target))


def prepare_migration(targets: list[str]) -> dict:
    """Tell this job's supervisor where the job may move, at training start: target kinds that
    need set-up (e.g. hosts to start) do it in the background then. Answered at once.

    Raises:
        MigrationError: this process is not a managed job.
    """
    return _ask_supervisor("prepare", {"targets": list(targets)})

"""Every exception gym_fork raises on purpose.

All derive from :class:`GymForkError`, so ``except gym_fork.GymForkError`` catches them all.
Each message says what went wrong *and* what to do about it.
"""

from __future__ import annotations

from typing import Any


class GymForkError(Exception):
    """Base class of all gym_fork errors."""


class BackendUnavailableError(GymForkError):
    """The requested snapshot backend cannot run here (no CRIU, no privileges, ...)."""


class EnvNotShippableError(GymForkError):
    """An env instance could not be sent to the worker process."""


class NotSendableError(GymForkError, TypeError):
    """An argument for the env's worker (a value set on ``env.unwrapped``, an action, a call's
    arguments) does not pickle, so it cannot cross to the worker's process.  Nothing was sent; the
    env is unchanged and goes on."""


class UnsupportedEnvError(GymForkError):
    """The chosen backend cannot capture this env's state exactly (e.g. pickle on Box2D)."""


class SnapshotError(GymForkError):
    """Taking a snapshot failed. The running env is unchanged and no snapshot was created."""


class UnpicklableEnvError(UnsupportedEnvError, SnapshotError):
    """The pickle backend cannot pickle this env at all (it holds an open file, a lock, a
    process handle, ...): it is refused, not copied wrongly.  Use the default backend, whose
    snapshots are whole processes (``backend="criu"``)."""


class UncapturableStateError(SnapshotError):
    """The env holds something no available snapshot mechanism captures exactly (a connection to
    another machine, a file open for writing, a listening address without a network namespace of
    its own, CRIU unavailable for a process tree, ...).  Raised before anything was copied or
    diverged; the env keeps running.  ``resources`` lists what was found (kind, pid, fd, path or
    peer, and the fix for each); the message names them and what to do."""

    def __init__(self, message: str, resources: list | None = None):
        super().__init__(message)
        self.resources = list(resources or [])


class RestoreError(GymForkError):
    """Restoring a snapshot failed. The running env is unchanged."""


class UncapturedFilesError(UncapturableStateError, RestoreError):
    """The env wrote files outside its ``workspace=`` (``paths``), whose content no snapshot
    holds: a snapshot of it now, or a restore or fork of an earlier snapshot, would continue
    with the files as they are now, not as they were.  Raised by ``snapshot()`` (and what takes
    one: ``fork()``, ``explore``, migration) and by ``restore()``/``fork(snapshot)`` before
    anything changed; the env keeps running.  Keep such files in the workspace, or declare
    them ``untracked_paths=[...]`` when their content need not come back (logs, caches)."""

    def __init__(self, message: str, paths: list[str] | None = None):
        super().__init__(message, [])
        self.paths = list(paths or [])


class SnapshotReleasedError(RestoreError):
    """The snapshot was released (explicitly, or because its env was closed)."""


class ForeignSnapshotError(RestoreError):
    """The snapshot belongs to another env (another lineage or another backend)."""


class SnapshotCorruptedError(RestoreError):
    """The snapshot's images are missing or fail their integrity check."""


class EnvClosedError(GymForkError):
    """The ForkableEnv was closed; create a new one."""


class ForeignWorkspaceError(GymForkError, PermissionError):
    """Raised *inside the env*, by the operation itself: a copy of an env (a ``fork()`` child, an
    env restored into another env) used a path in the workspace of the env it was copied from,
    derived before it was copied.  Nothing was read or written there; derive workspace paths
    from ``self.workspace`` where they are used.  In the learner it arrives as a
    :class:`WorkerError` from a worker."""


class ConcurrentUseError(GymForkError, RuntimeError):
    """A second thread called an env (a step, a reset, any request) while another thread's call
    to it was in flight. An env, like any Gymnasium env, takes one call at a time; its worker's
    channel carries one request and its reply, so two at once would swap replies or hang. Nothing
    was sent for the refused call; the other thread's call and the env go on."""


class IncompleteStepError(GymForkError, RuntimeError):
    """A call was interrupted (Ctrl-C) in the middle, and what it left cannot be gone on from:
    a vector env's step (some sub-envs stepped, and reset at an episode's end, and the caller
    holds none of their results: the batch is out of step), or an in-process env's
    (``backend="pickle"``) own code cut wherever it was (its state may be half-updated).
    ``reset()`` first (an in-process env: or ``restore()`` a snapshot)."""


class WorkerDiedError(GymForkError):
    """The worker process running the env died; the message says how (exit code or signal)."""


class WorkerError(GymForkError):
    """The env raised inside the worker. ``remote_type`` and ``remote_traceback`` say what."""

    def __init__(self, message: str, remote_type: str = "", remote_traceback: str = ""):
        super().__init__(message)
        self.remote_type = remote_type
        self.remote_traceback = remote_traceback


class PolicyError(GymForkError):
    """A policy run inside the env's worker (``rollout(policy=...)``,
    ``explore(..., policy_in_worker=True)``) raised. It arrives as a :class:`WorkerError` that is
    also a PolicyError; the message names the step and the policy's exception, and
    ``remote_traceback`` holds both tracebacks. The steps taken before it stand: the env's step
    count and action log account for them."""


class CriuError(GymForkError):
    """CRIU itself failed; the message quotes the end of its log."""


_remote_classes: dict[str, type] = {}


def _qualified_name(type_name: str, message: str, traceback_text: str) -> str | None:
    """The module-qualified name of the exception a worker's traceback ends with
    (``redis.exceptions.ConnectionError``): :func:`traceback.format_exc` writes it, with the
    message, as the traceback's last exception line; None for builtins (written bare)."""
    import re

    tail = f": {re.escape(message)}" if message else ""
    found = re.findall(rf"(?m)^((?:[A-Za-z_]\w*\.)+){re.escape(type_name)}{tail}$", traceback_text)
    return found[-1] + type_name if found else None


def _imported_class(qualified: str) -> type | None:
    """The class ``qualified`` names, looked up only in modules this process has imported already
    (a worker's reply never makes us import anything)."""
    import sys

    parts = qualified.split(".")
    for i in range(len(parts) - 1, 0, -1):
        obj: Any = sys.modules.get(".".join(parts[:i]))
        if obj is not None:
            for name in parts[i:]:
                obj = getattr(obj, name, None)
            return obj if isinstance(obj, type) else None
    return None


def remote_exception(type_name: str, message: str, traceback_text: str) -> WorkerError:
    """A WorkerError that is *also* an instance of the env's own exception type when that type
    is a builtin, a ``gymnasium.error`` class, or a class of a module imported here too (such as
    ``redis.ConnectionError``), so ``except AssertionError`` or ``except redis.ConnectionError``
    keeps working.  ``OSError`` and its subclasses stay plain WorkerErrors: gym_fork reads an
    ``OSError`` as a failure of its own channel."""
    qualified = _qualified_name(type_name, message, traceback_text)
    base = _imported_class(qualified) if qualified else None
    key = qualified if base is not None else type_name
    cls = _remote_classes.get(key)
    if cls is None:
        import builtins

        import gymnasium.error

        if base is None:
            base = getattr(builtins, type_name, None) or getattr(gymnasium.error, type_name, None)
        if isinstance(base, type) and issubclass(base, Exception) and not issubclass(base, OSError):
            try:
                cls = type(f"WorkerError[{type_name}]", (WorkerError, base), {})
            except TypeError:  # incompatible layouts: fall back to the plain class
                cls = WorkerError
        else:
            cls = WorkerError
        _remote_classes[key] = cls
    err = cls.__new__(cls)
    try:
        WorkerError.__init__(err, f"{type_name} in the env worker: {message}", type_name, traceback_text)
    except TypeError:  # the env's class wants other constructor arguments: the plain class
        _remote_classes[key] = WorkerError
        return WorkerError(f"{type_name} in the env worker: {message}", type_name, traceback_text)
    return err


# --- snapshots: bundles and the store -------------------------------------------------------
class BundleError(GymForkError):
    """A bundle cannot be loaded here; the message says exactly why."""


class BundleDamagedError(BundleError, SnapshotCorruptedError):
    """A bundle's or store entry's ``bundle.json`` is unreadable, not JSON, or has a field of the
    wrong type: damaged (or altered), not merely foreign.  Nothing in it was used."""


class StoreError(GymForkError):
    """The snapshot store cannot do what was asked (unknown id, not a store, ...)."""


class NoSpaceError(GymForkError):
    """Not enough free disk space for what was asked (a checkpoint, a bundle, a store entry).
    What the failed write had written is removed; the env keeps running.  ``path``,
    ``free_bytes`` and ``needed_bytes`` say where and how much (None where unknown)."""

    path: str | None = None
    free_bytes: int | None = None
    needed_bytes: int | None = None


class CapacityError(GymForkError, ValueError):
    """A request for more copies of an env than this machine can hold (processes, threads or
    memory); the message has the numbers, the limit, and how to override it."""

    def __init__(self, message: str, requested: int = 0, limit: int = 0):
        super().__init__(message)
        self.requested = requested
        self.limit = limit


# --- migration: on every one of these the source (env or job) keeps running unchanged ---------

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


class DivergedError(MigrationError):
    """The target's replay answered differently from the source: the env depends on something
    outside its process. Nothing was switched; the env runs locally, unchanged."""


# --- Ray plugin ---------------------------------------------------------------------------
class BranchesFailedError(GymForkError):
    """Some branches of :meth:`RayBranchPool.explore` failed (their node or actor died, or the
    env raised); ``.result`` holds the branches that completed and ``.result.failed`` the others."""

    def __init__(self, message: str, result: Any):
        super().__init__(message)
        self.result = result

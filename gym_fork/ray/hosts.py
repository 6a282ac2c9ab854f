"""Getting at the migration host actors from a driver or a job supervisor.

Env moves use one :class:`~gym_fork.ray.migration_host.MigrationHost` per node and Ray job
(:func:`host_for`: it lives as long as the driver's job). Whole jobs use a node's *job host*
(:func:`job_host_for`): detached, in namespace :data:`JOB_NAMESPACE`, so that it outlives the
``gym-fork run`` supervisor that created it; it stops itself after holding nothing for
``$GYM_FORK_RAY_JOB_HOST_IDLE_S`` seconds (read where it is created; default 60).
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from gym_fork.errors import MigrationError
from gym_fork.ray.errors import cause
from gym_fork.ray.migration_host import MigrationHost

HOST_NAME = "gym_fork-mhost-{}"
JOB_NAMESPACE = "gym_fork"  # job hosts (detached) live here, whoever created them
JOB_HOST_IDLE_ENV = "GYM_FORK_RAY_JOB_HOST_IDLE_S"

_host_cls: Any = None
_lock = threading.Lock()
_hosts: dict[tuple[str, str], Any] = {}  # (Ray job id, node id) -> handle


def _actor_class() -> Any:
    global _host_cls
    if _host_cls is None:
        _host_cls = ray.remote(MigrationHost)
    return _host_cls


def host_for(node_id: str) -> Any:
    """The migration host actor of ``node_id`` for this Ray job (created on first use).

    Handles are cached: a named get-or-create goes through the GCS, and a call on a handle got
    that way waits for it, which made every hop slower.
    """
    key = (ray.get_runtime_context().get_job_id(), node_id)
    with _lock:
        if key not in _hosts:
            _hosts[key] = _actor_class().options(
                name=HOST_NAME.format(node_id), get_if_exists=True, num_cpus=0, max_concurrency=16,
                max_restarts=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote()
        return _hosts[key]


def forget_host(node_id: str) -> None:
    """Drop the cached handle of ``node_id``'s host (it died, or was closed)."""
    with _lock:
        for k in [k for k in _hosts if k[1] == node_id]:
            del _hosts[k]


def job_host_for(node_id: str, idle_exit_s: float | None = None) -> Any:
    """The *job* host of ``node_id`` (created on first use).

    Args:
        idle_exit_s: it stops itself after holding nothing that long (when it is created here);
            default ``$GYM_FORK_RAY_JOB_HOST_IDLE_S`` or 60.
    """
    if idle_exit_s is None:
        idle_exit_s = job_host_idle_s()
    with _lock:
        cls = _actor_class()
    return cls.options(
        name=HOST_NAME.format(node_id), namespace=JOB_NAMESPACE, lifetime="detached", get_if_exists=True,
        num_cpus=0, max_concurrency=16, max_restarts=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote(idle_exit_s)


def job_host_idle_s() -> float:
    """How long a job host created from here waits idle before it stops."""
    return float(os.environ.get(JOB_HOST_IDLE_ENV, "60"))


def connect_ray(address: str | None = None) -> None:
    """Connect this process (a job supervisor) to the Ray cluster, unless it is already:
    ``address``, else ``$RAY_ADDRESS``, else ``"auto"`` (never a new local cluster).

    Raises:
        MigrationError: no cluster there.
    """
    if ray.is_initialized():
        return
    addr = address or os.environ.get("RAY_ADDRESS") or "auto"
    try:
        ray.init(address=addr, namespace=JOB_NAMESPACE, log_to_driver=False, configure_logging=False)
    except Exception as e:  # noqa: BLE001 - ConnectionError, ValueError, ...
        raise MigrationError(f"cannot connect to the Ray cluster at {addr!r} (--ray-address / $RAY_ADDRESS): "
                             f"{type(e).__name__}: {e}") from e
    # Ray's subreaper mode sets SIGCHLD to SIG_IGN; criu (the next dump) would fail returning 0
    ctypes.CDLL(None).signal(signal.SIGCHLD, ctypes.c_void_p(0))


def alive_nodes() -> set[str]:
    return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}


def job_host_address(node_id: str, ray_address: str | None = None, timeout: float = 60.0) -> str:
    """Where to stream a job checkpoint for Ray node ``node_id``: its job host's bridge
    (``ip:port``). Connects to Ray first if needed (:func:`connect_ray`).

    Raises:
        MigrationError: no such alive node, or its job host did not answer.
    """
    connect_ray(ray_address)
    if node_id not in alive_nodes():
        raise MigrationError(f"Ray node {node_id} is not an alive node of this cluster")
    last = None
    for _attempt in range(2):  # a job host that just stopped itself (idle) is replaced once
        try:
            return ray.get(job_host_for(node_id).job_address.remote(), timeout=timeout)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
            last = e
            time.sleep(0.5)
        except ray.exceptions.RayError as e:
            raise MigrationError(f"the job host on Ray node {node_id} did not answer: {cause(e)}") from e
    raise MigrationError(f"the job host on Ray node {node_id} is gone: {cause(last)}")


def close_hosts(jobs: bool = False) -> None:
    """Stop every migration host of this Ray job (their workers end, their directories go); with
    ``jobs=True`` the detached job hosts and the jobs they run instead."""
    if not jobs:
        with _lock:
            _hosts.clear()
    for n in ray.nodes():
        if not n.get("Alive"):
            continue
        try:
            if jobs:
                h = ray.get_actor(HOST_NAME.format(n["NodeID"]), namespace=JOB_NAMESPACE)
            else:
                h = ray.get_actor(HOST_NAME.format(n["NodeID"]))
        except ValueError:
            continue
        try:
            ray.get(h.close.remote(), timeout=30)
        except Exception:  # noqa: BLE001
            pass
        ray.kill(h, no_restart=True)

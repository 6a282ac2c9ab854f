"""``env.migrate(RayNode(node_id))``: the driver's side of moving an env worker to a Ray node.

A hop: **export** the worker as a signed bundle into the object store on the source node (the
driver, for a local worker: a copy-on-write snapshot, so the worker runs on; the source host,
for a worker already on a node); **receive** on the target node's host (verify, restore);
**attach** the driver to the restored worker through that host's TCP bridge; **switch**: only
now is the source stopped. Any failure before the switch resumes the source unchanged, and
because the worker keeps its unix channel hops chain (A -> B -> C -> A).
"""

from __future__ import annotations

import os
import shutil
import socket
import time
from typing import Any

import ray

from gym_fork.errors import MigratedEnvError, MigrationError, RemoteRestoreError
from gym_fork.migration.client import (MigratedBackend, NetworkHandle, check_movable, switch_to_remote,
                                       write_transient_bundle)
from gym_fork.migration.live import check_live, start_live
from gym_fork.migration.wire.auth import bundle_key
from gym_fork.migration.wire.connect import connect
from gym_fork.migration.wire.messages import recv_msg, send_msg
from gym_fork.ray.auth import resolve_token
from gym_fork.ray.errors import cause, cause_type
from gym_fork.ray.host import pack_dir
from gym_fork.ray.hosts import alive_nodes, forget_host, host_for
from gym_fork.snapshots import sessiondir

# ``node`` below is a gym_fork.ray.RayNode, which imports this module when an env migrates to one:
# it is not imported here (no cycle), only its ``node_id`` and ``str()`` are used.


class RayNetworkHandle(NetworkHandle):
    """A worker hosted by the migration host of a Ray node, reached through its TCP bridge."""

    def __init__(self, sock: socket.socket, pid: int, node_id: str, host: Any, wid: str):
        super().__init__(sock, pid, node_id[:12], f"ray:{node_id}")
        self.node_id, self.host, self.wid = node_id, host, wid

    def exit_status(self) -> str:
        try:
            ray.get(self.host.info.remote(), timeout=2)
            why = "its host actor is alive but the worker or the bridge ended"
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
            why = "its host actor is gone (killed, crashed, or its node died)"
        except Exception as e:  # noqa: BLE001
            why = f"its host actor did not answer ({type(e).__name__})"
        return f"the connection to Ray node {self.node_id} closed: {why}"

    def detach(self) -> None:
        """Let go of the worker without waiting: its host stops it (it moved on)."""
        self.closed = True
        self.chan.close()
        self.host.release.remote(self.wid)  # no wait: the worker is paused there, not in our way


class RayMigratedBackend(MigratedBackend):
    """Stands in for the backend of an env migrated to a Ray node."""

    def __init__(self, node_id: str):
        super().__init__(node_id[:12], f"ray:{node_id}")
        self.node_id = node_id

    def _refuse(self, what: str):
        raise MigratedEnvError(
            f"{what} is not supported on an env whose worker was migrated to Ray node {self.node_id}; "
            "step/reset/render/attributes/close and migrate(RayNode(...)) work")


def _check_alive(node: Any) -> None:
    """Raises MigrationError (before anything is done) unless ``node`` is an alive node."""
    if node.node_id not in alive_nodes():
        raise MigrationError(f"Ray node {node.node_id} is not an alive node of this cluster")


def _export_snapshot(snap: Any, tok: bytes, host_timings: dict) -> tuple[Any, int]:
    """CRIU images of ``snap`` (a dump of its frozen copy), as a signed bundle in this node's object
    store; returns ``(ref, bytes)``. Does not touch the env: its worker may go on meanwhile."""
    tmp = os.path.join(sessiondir.session_dir(), f"rmig-{os.urandom(4).hex()}")
    try:
        sessiondir.private_mkdir(tmp)  # (inside the try: removed by its path whatever fails after)
        t1 = time.perf_counter()
        snap.persist()
        t2 = time.perf_counter()
        write_transient_bundle(snap, os.path.join(tmp, "bundle"), bundle_key(tok))
        t3 = time.perf_counter()
        files = pack_dir(os.path.join(tmp, "bundle"))
        nbytes = int(sum(a.nbytes for a in files.values()))
        t4 = time.perf_counter()
        ref = ray.put(files)
        del files
        host_timings.update({"export_dump_s": t2 - t1, "export_bundle_s": t3 - t2, "export_pack_s": t4 - t3,
                             "export_put_s": time.perf_counter() - t4})
        return ref, nbytes
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _receive_and_attach(target: Any, node: Any, ref: Any, steps: int, tok: bytes, timeout: float,
                        timings: dict, host_timings: dict) -> tuple[socket.socket, dict]:
    """The target host pulls, verifies and restores the bundle ``ref``; then the driver attaches to
    the restored worker through the host's bridge. Returns ``(sock, rep)``; on failure the
    target's copy is released and a MigrationError raised."""
    t0 = time.perf_counter()
    w0 = time.time()
    try:
        rep = ray.get(target.receive.remote([ref], steps), timeout=timeout)
    except ray.exceptions.RayError as e:
        if isinstance(e, ray.exceptions.RayActorError):
            forget_host(node.node_id)  # a new one is made on the next try
        raise RemoteRestoreError(f"Ray node {node.node_id} did not restore the env: {cause(e)}",
                                 cause_type(e)) from e
    timings["receive_s"] = time.perf_counter() - t0
    rt = rep["timings"]
    # Ray's share: from the call to the method starting, and from its return to ours
    rt["call_to_start_s"], rt["return_s"] = rt.pop("t_enter") - w0, time.time() - rt.pop("t_exit")
    host_timings.update({f"receive_{k}": v for k, v in rt.items()})
    t0 = time.perf_counter()
    try:
        sock, _hello = connect(rep["address"], tok, timeout=min(timeout, 30.0))
        send_msg(sock, {"op": "attach", "id": rep["wid"]})
        reply = recv_msg(sock)
    except (OSError, EOFError, ValueError) as e:
        target.release.remote(rep["wid"])
        raise MigrationError(f"could not attach to the worker on Ray node {node.node_id}: {e}") from e
    except BaseException:
        target.release.remote(rep["wid"])
        raise
    if not reply.get("ok"):
        sock.close()
        target.release.remote(rep["wid"])
        raise RemoteRestoreError(f"Ray node {node.node_id} refused the attach: {reply.get('message')}",
                                 reply.get("error", ""))
    timings["attach_s"] = time.perf_counter() - t0
    sock.settimeout(None)
    return sock, rep


def migrate_env_to_node_live(env: Any, node: Any, *, token: str | bytes | None = None,
                             timeout: float = 60.0) -> Any:
    """``env.migrate(RayNode(id), live=True)``: pre-copy (:mod:`gym_fork.migration.live`) to a Ray
    node's host: the learner keeps stepping its local worker while the copy-on-write snapshot is
    exported, restored on the node and catches up by replay; then a later step switches.

    Returns:
        The :class:`~gym_fork.migration.live.LiveMigration`.

    Raises:
        MigrationError: the env cannot move live (nothing was changed).
    """
    check_movable(env)
    if isinstance(env._handle, NetworkHandle):
        raise MigrationError("live=True moves a worker that runs here; this env's worker runs on "
                             f"{env._handle.node} already: use live=False to move it on")
    _check_alive(node)
    check_live(env)
    tok = resolve_token(token)
    target = host_for(node.node_id)

    def ship(snap: Any, timings: dict, _mig: Any) -> tuple[RayNetworkHandle, dict]:
        host_timings: dict[str, float] = {}
        t0 = time.perf_counter()
        ref, nbytes = _export_snapshot(snap, tok, host_timings)
        timings["export_s"] = time.perf_counter() - t0
        sock, rep = _receive_and_attach(target, node, ref, snap.steps, tok, timeout, timings, host_timings)
        del ref
        remote = RayNetworkHandle(sock, rep["pid"], node.node_id, target, rep["wid"])
        return remote, {"pid": rep["pid"], "bytes": nbytes, "remote_timings": host_timings}

    def switch(env: Any, remote: RayNetworkHandle, local: Any) -> str:
        switch_to_remote(env, remote, RayMigratedBackend(node.node_id), local=local)
        return node.node_id

    return start_live(env, str(node), ship, switch)


def migrate_env_to_node(env: Any, node: Any, *, token: str | bytes | None = None,
                        timeout: float = 60.0) -> dict:
    """Move ``env``'s worker to ``node``'s migration host (see the module doc).

    Returns:
        A report: ``node_id``, ``source``, ``pid``, ``bytes``, driver- and host-side timings (s).

    Raises:
        MigrationError: (a subclass of) on failure; the env keeps running where it was, unchanged.
    """
    check_movable(env)  # an env on a node has a stand-in backend named "criu": it passes
    cur = env._handle
    if isinstance(cur, NetworkHandle) and not isinstance(cur, RayNetworkHandle):
        raise MigratedEnvError(f"this env runs on agent node {cur.node}; it cannot move on to a Ray node")
    _check_alive(node)
    on_node = isinstance(cur, RayNetworkHandle)
    source = cur.node_id if on_node else ray.get_runtime_context().get_node_id()
    if on_node and cur.node_id == node.node_id:
        return {"node_id": node.node_id, "source": source, "pid": cur.pid, "bytes": 0, "timings": {},
                "noop": True}
    tok = resolve_token(token)
    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    host_timings: dict[str, float] = {}
    target = host_for(node.node_id)
    sock = None
    exported = False
    try:
        # 1. export
        t0 = time.perf_counter()
        if on_node:
            try:
                out = ray.get(cur.host.export.remote(cur.wid, env.steps), timeout=timeout)
            except ray.exceptions.RayError as e:
                raise MigrationError(f"the host on Ray node {cur.node_id} could not export the worker: "
                                     f"{cause(e)}") from e
            exported = True
            ref, nbytes = out["refs"][0], out["bytes"]
            host_timings.update({f"export_{k}": v for k, v in out["timings"].items()})
        else:
            snap = env._side_snapshot()
            try:
                host_timings["export_snapshot_s"] = time.perf_counter() - t0
                ref, nbytes = _export_snapshot(snap, tok, host_timings)
            finally:
                snap.release()
        timings["export_s"] = time.perf_counter() - t0
        # 2. receive (verify + restore) on the target, 3. attach through the bridge
        sock, rep = _receive_and_attach(target, node, ref, env.steps, tok, timeout, timings, host_timings)
        del ref
    except BaseException:
        if sock is not None:
            sock.close()
        if exported:  # the source host keeps serving the env
            try:
                ray.get(cur.host.resume.remote(cur.wid), timeout=30)
            except Exception:  # noqa: BLE001
                pass
        raise
    # 4. switch: the source stops only now
    t0 = time.perf_counter()
    sock.settimeout(None)
    new = RayNetworkHandle(sock, rep["pid"], node.node_id, target, rep["wid"])
    switch_to_remote(env, new, RayMigratedBackend(node.node_id))  # a source host releases its paused copy
    timings["switch_s"] = time.perf_counter() - t0
    timings["total_s"] = time.perf_counter() - t_start
    return {"node_id": node.node_id, "source": source, "pid": rep["pid"], "bytes": nbytes,
            "timings": timings, "host_timings": host_timings}

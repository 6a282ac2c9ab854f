"""``ForkableEnv.migrate("host:port")``: move one env worker to an agent, stop-and-copy.

The worker is snapshotted (copy-on-write where it can be: it is not stopped), CRIU dumps that
copy while the images are streamed to the agent, which verifies and restores it; only after the
agent's answer is the local worker stopped and the env switched to a :class:`NetworkHandle` over
the same connection. Any failure before that leaves the env as it was.
"""

from __future__ import annotations

import os
import shutil
import socket
import threading
import time
from typing import Any

from gym_fork.snapshots import sessiondir
from gym_fork.backends.base import Backend, RemoteHandle
from gym_fork.criu.status import dump_size_bound
from gym_fork.migration.wire.auth import bundle_key, load_token
from gym_fork.migration.wire.connect import connect_in_background, parse_host_port
from gym_fork.migration.wire.streams import send_images
from gym_fork.errors import MigratedEnvError, MigrationError, RemoteRestoreError
from gym_fork.worker.channel import Channel


class NetworkHandle(RemoteHandle):
    """A worker on another node, reached through its agent's relay (same protocol as locally)."""

    def __init__(self, sock: socket.socket, remote_pid: int, node: str, target: str):
        super().__init__(Channel(sock), remote_pid, 0)
        self.node = node
        self.target = target

    def request_with_fd(self, cmd: str, fd: int, *args: Any) -> Any:
        raise MigratedEnvError(f"{cmd!r} needs a local worker; this env's worker runs on node {self.node} ({self.target})")

    def exit_status(self) -> str:
        return f"the connection to agent {self.node} ({self.target}) closed"

    def kill(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.chan.close()  # the agent stops the worker when the connection ends


class MigratedBackend(Backend):
    """Stands in for the backend of a migrated env: snapshots are refused with a clear error."""

    name = "criu"

    def __init__(self, node: str, target: str):
        self.node, self.target = node, target

    def _refuse(self, what: str):
        raise MigratedEnvError(
            f"{what} is not supported on an env whose worker was migrated to node {self.node} "
            f"({self.target}); step/reset/render/attributes/close work")

    def start(self, source):  # pragma: no cover - never called
        self._refuse("start")

    def snapshot(self, handle, snap_id):
        self._refuse("snapshot()")

    def restore(self, payload):
        self._refuse("restore()")

    def restore_many(self, payload, n):
        self._refuse("restore()/fork()")

    def release(self, payload) -> None:
        pass


def _bundle_meta(snap: Any, image: Any) -> dict[str, Any]:
    """bundle.json of a snapshot whose images are at ``image`` (a CriuPayload), minus ``images``
    (their sizes and sha256) and ``hmac``."""
    import platform
    import sys

    from gym_fork.criu.images import mapped_files
    from gym_fork.criu.status import criu_status
    from gym_fork.snapshots import bundle as B

    return {
        "format": B.FORMAT, "backend": snap.backend, "id": snap.id, "steps": snap.steps,
        "parent_id": snap.parent_id, "created": snap.created, "saved": time.time(),
        "env_id": snap.env_id, "actions": B._json_actions(snap.actions),
        "python": sys.executable, "python_version": platform.python_version(),
        "kernel": platform.release(), "machine": platform.machine(),
        "criu_version": criu_status().version, "ino": image.ino, "fork_tier": image.fork_tier,
        "files": mapped_files(image.path),
    }


def write_transient_bundle(snap: Any, path: str, key: bytes) -> None:
    """The bundle :func:`gym_fork.snapshots.bundle.save_snapshot` writes (same bundle.json, read back by
    ``load_snapshot`` on the agent), minus what only a *kept* bundle needs: the images are
    hard-linked, not re-hashed (their manifest was written when CRIU dumped them, a moment ago,
    in our private dir) and nothing is fsynced (the bundle only lives until it is sent)."""
    from gym_fork import keys
    from gym_fork.snapshots import bundle as B
    from gym_fork.snapshots.files import link_tree

    payload = snap._backend.persist(snap.payload())
    image = getattr(payload, "image", None) or payload
    man = sessiondir.read_manifest(image.path)
    meta = dict(_bundle_meta(snap, image), images=man["files"])
    meta["hmac"] = keys.sign(B.canonical_meta(meta), key)
    os.makedirs(path, mode=0o700)
    link_tree(image.path, os.path.join(path, "images"))
    import json

    with open(os.path.join(path, "bundle.json"), "w") as f:
        json.dump(meta, f)


def migrate_env(env: Any, target: str, *, token: str | bytes | None = None, token_file: str | None = None,
                tls: bool | str = False, timeout: float = 30.0, netns: str | None = None,
                insecure: bool = False) -> dict:
    """Move ``env``'s worker to the agent at ``target`` ("host:port"); returns a report dict
    (node, pid, bytes, timings in seconds). Raises a MigrationError subclass on failure, with the
    env unchanged. The learner waits for the whole move (stop-and-copy); see
    :mod:`gym_fork.migration.live` for the pre-copy variant. The checkpoint and then every step
    travel over TLS (``tls``, ``insecure``: :func:`gym_fork.migration.wire.connect.connect`)."""
    check_migratable(env, target)
    tok = load_token(token, token_file)
    t_start = time.monotonic()
    timings: dict[str, float] = {}
    saved_state = (env._parent_id, None if env._actions is None else list(env._actions))
    # Connect + authenticate while the snapshot is dumped (off the critical path).
    conn = connect_in_background(target, tok, tls=tls, insecure=insecure, timeout=timeout, netns=netns)
    snap = None
    try:
        t0 = time.monotonic()
        try:
            snap = env.snapshot()  # the freeze: the learner's next step runs on the target
        except BaseException:
            conn.discard()
            raise
        timings["snapshot_s"] = time.monotonic() - t0
        sock, hello, reply, nbytes = ship_snapshot(snap, target, tok, conn, timings,
                                                   dump_size_bound(env._handle.pid))
    finally:
        env._parent_id, env._actions = saved_state
        if snap is not None:
            snap.release()
    node = switch_to_remote(env, NetworkHandle(sock, reply["pid"], hello.get("node", target), target))
    timings["total_s"] = time.monotonic() - t_start
    return {"node": node, "target": target, "pid": reply["pid"], "bytes": nbytes,
            "timings": timings, "remote_timings": reply.get("timings", {})}


def check_migratable(env: Any, target: str) -> None:
    """Everything checked before anything is done (raises; the env is untouched)."""
    parse_host_port(target)  # a malformed address fails here, not in a background thread
    env._check_open()
    if isinstance(env._handle, NetworkHandle):
        raise MigratedEnvError(f"this env already runs on node {env._handle.node}; migrating it again is not supported")
    if env._backend.name != "criu":
        raise MigrationError(f"only the criu backend can migrate (this env uses {env._backend.name!r})")
    ws = getattr(env, "_workspace", None)
    if ws is not None:
        raise MigrationError(
            f"this env has a workspace ({ws.path}): migration does not carry workspace files yet, and the "
            "moved worker would use that path on the target; save a snapshot bundle (it carries the "
            "workspace) and load it there instead")


def ship_snapshot(snap: Any, target: str, tok: bytes, conn: Any, timings: dict,
                  limit: int) -> tuple[socket.socket, dict, dict, int]:
    """Dump ``snap`` (a copy of it, when it is a copy-on-write snapshot), stream it to the agent
    over ``conn`` (a :func:`~gym_fork.migration.wire.connect.connect_in_background`, consumed) and wait until the
    agent has verified and restored it. Returns ``(sock, hello, reply, bytes)``: the restored
    worker waits at the other end of ``sock``. ``limit``: the most bytes the images may take
    (:func:`gym_fork.criu.status.dump_size_bound`). Raises a MigrationError (``sock`` closed, so the
    agent stops what it restored) on failure. Touches neither the env nor ``snap``: the worker
    may go on stepping meanwhile."""
    key = bundle_key(tok)
    tmp = sessiondir.private_mkdir(os.path.join(sessiondir.session_dir(), f"mig-{os.urandom(4).hex()}"))
    into = os.path.join(tmp, "images")
    sock = None
    # CRIU dumps a copy of the snapshot into a private dir in this thread while the images are
    # streamed (and hashed) as CRIU writes them: dump and transfer overlap.
    done, failed = threading.Event(), threading.Event()
    dumped: dict[str, Any] = {}
    t_dump = time.monotonic()

    def dump() -> None:
        try:
            dumped["image"] = snap._backend.dump_transient(snap.payload(), into)
        except BaseException as e:  # noqa: BLE001 - re-raised below, in the caller's thread
            dumped["error"] = e
            failed.set()
        finally:
            timings["save_s"] = time.monotonic() - t_dump
            done.set()

    dumper = threading.Thread(target=dump, daemon=True, name="gym_fork-migration-dump")
    dumper.start()
    try:
        t0 = time.monotonic()
        sock, hello = conn.result()
        timings["connect_wait_s"] = time.monotonic() - t0
        timings["connect_s"] = conn.elapsed

        def trailer(digests: dict) -> dict:
            from gym_fork.snapshots import bundle as B
            from gym_fork import keys

            image = dumped["image"]
            known = os.path.join(image.path, sessiondir.MANIFEST)  # images dumped earlier: must still match
            if os.path.exists(known) and sessiondir.read_manifest(image.path)["files"] != digests:
                raise ValueError("the snapshot's images changed on disk since they were dumped")
            meta = dict(_bundle_meta(snap, image), images=digests, session=hello["nonce"])  # no replay elsewhere
            meta["hmac"] = keys.sign(B.canonical_meta(meta), key)
            return meta

        t0 = time.monotonic()
        # images that exist already (persisted) are checked against their sha256 manifest
        payload = snap.payload()
        persisted = getattr(payload, "image", payload) is not None
        try:
            reply, nbytes = send_images(
                sock, {"op": "env", "env_id": snap.env_id, "steps": snap.steps}, into, target, trailer,
                done, failed, limit, "sha256" if persisted else None)
        except ValueError:
            if "error" in dumped:
                raise dumped["error"] from None
            raise
        timings["transfer_restore_s"] = time.monotonic() - t0
        if not reply.get("ok"):
            raise RemoteRestoreError(
                f"agent {hello.get('node')!r} at {target} did not restore the env: "
                f"{reply.get('error')}: {reply.get('message')}", reply.get("error", ""))
    except BaseException:
        if sock is not None:
            sock.close()
        else:
            conn.discard()
        raise
    finally:
        dumper.join()
        shutil.rmtree(tmp, ignore_errors=True)
    sock.settimeout(None)
    return sock, hello, reply, nbytes


def switch_to_remote(env: Any, new: NetworkHandle, local: Any = None) -> str:
    """The target runs the env: point ``env`` at it and only now stop the local worker
    (``local``: the handle to stop, default ``env._handle``). Returns the node's name."""
    node, target = new.node, new.target
    old = local if local is not None else env._handle
    env._handle = new
    env._box[0] = new
    old.kill()
    env._backend = MigratedBackend(node, target)
    return node

"""``ForkableEnv.migrate("host:port")``: move one env worker to an agent, stop-and-copy.

The worker is snapshotted (copy-on-write where it can be: it is not stopped), CRIU dumps that
copy while the images are streamed to the agent, which verifies and restores it; only after the
agent's answer is the local worker stopped and the env switched to a :class:`NetworkHandle` over
the same connection. Any failure before that leaves the env as it was.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from typing import Any

from gym_fork.backends.base import Backend, RemoteHandle
from gym_fork.backends.criu import image_meta
from gym_fork.criu.status import dump_size_bound
from gym_fork.errors import MigratedEnvError, MigrationError, RemoteRestoreError
from gym_fork.migration.wire.auth import bundle_key, load_token
from gym_fork.migration.wire.connect import connect_in_background, parse_host_port
from gym_fork.migration.wire.streams import DumpThread, send_images
from gym_fork.snapshots import sessiondir
from gym_fork.snapshots.bundle import META, bundle_meta, sign_meta
from gym_fork.snapshots.files import link_tree
from gym_fork.worker.channel import Channel


class NetworkHandle(RemoteHandle):
    """A worker on another node, reached through its agent's relay (same protocol as locally)."""

    POLLS = False  # a TLS socket takes no MSG_DONTWAIT; and a network round trip is no wake-up's cost

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

    def detach(self) -> None:
        """Let go of the worker after it moved on to another node (default: :meth:`kill`)."""
        self.kill()


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

    def snapshot(self, handle, snap_id, *, ready_copy=True):
        self._refuse("snapshot()")

    def restore(self, payload, *args, **kwargs):
        self._refuse("restore()")

    def restore_many(self, payload, n, *args, **kwargs):
        self._refuse("restore()/fork()")

    def release(self, payload) -> None:
        pass


def write_transient_bundle(snap: Any, path: str, key: bytes) -> None:
    """The bundle :func:`gym_fork.snapshots.bundle.save_snapshot` writes (the same bundle.json,
    read back by ``load_snapshot``), minus what only a *kept* bundle needs: the images are
    hard-linked and listed from the manifest written when CRIU dumped them into our private dir,
    hashed only if never before, and nothing is fsynced (the bundle lives only until it is sent)."""
    snap.persist()
    images, fields = snap.payload_backend.store_images(snap.payload())
    listed = sessiondir.verify(images, digests=True)["files"]  # sha256 computed here if not yet
    meta = sign_meta(bundle_meta(snap, **fields, images=listed), key)
    os.makedirs(path, mode=0o700)
    link_tree(images, os.path.join(path, "images"), names=listed)  # a bundle holds only its signed files
    with open(os.path.join(path, META), "w") as f:
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
    # Connect + authenticate while the snapshot is dumped (off the critical path).
    conn = connect_in_background(target, tok, tls=tls, insecure=insecure, timeout=timeout, netns=netns)
    snap = None
    try:
        t0 = time.monotonic()
        try:
            snap = env._side_snapshot()  # the freeze: the learner's next step runs on the target
        except BaseException:
            conn.discard()
            raise
        timings["snapshot_s"] = time.monotonic() - t0
        sock, hello, reply, nbytes = ship_snapshot(snap, target, tok, conn, timings,
                                                   dump_size_bound(env.worker_pid))
    finally:
        if snap is not None:
            snap.release()
    remote = NetworkHandle(sock, reply["pid"], hello.get("node", target), target)
    switch_to_remote(env, remote, MigratedBackend(remote.node, target))
    timings["total_s"] = time.monotonic() - t_start
    return {"node": remote.node, "target": target, "pid": reply["pid"], "bytes": nbytes,
            "timings": timings, "remote_timings": reply.get("timings", {})}


def check_movable(env: Any) -> None:
    """What a move of ``env``'s worker anywhere needs (raises; the env is untouched).

    Raises:
        EnvClosedError: the env was closed.
        MigrationError: not the criu backend, a criu backend without CRIU (fork-only mode: inside
            a ``gym-fork run`` job, or where CRIU is unavailable), or the env has a workspace.
    """
    env._check_open()
    if env.backend != "criu":
        raise MigrationError(f"only the criu backend can migrate (this env uses {env.backend!r})")
    be = getattr(env, "_backend", None)
    if getattr(be, "mode", None) == "fork":  # (a migrated env's stand-in backend has no mode)
        from gym_fork.migration.control import is_managed_job

        if is_managed_job():
            raise MigrationError(
                "env.migrate() is not available inside a managed job (`gym-fork run`): its env workers run "
                "without CRIU checkpoints of their own (CRIU cannot dump the nested PID namespaces they would "
                "need), so one cannot move alone. Move the whole job instead -- workers and snapshots move "
                "with it: gym_fork.sb3.LiveMigrationCallback(target) in SB3 training, or "
                "gym_fork.migration.control.request_migration(target) at a step boundary. "
                "The env keeps running here, unchanged")
        raise MigrationError(
            "migration needs CRIU, and this env's criu backend runs in fork-only mode "
            f"({getattr(be, 'unavailable', None) or 'CRIU is unavailable'}); the env keeps running here, unchanged")
    ws = getattr(env, "_workspace", None)
    if ws is not None:
        raise MigrationError(
            f"this env has a workspace ({ws.path}): migration does not carry workspace files yet, and the "
            "moved worker would use that path on the target; save a snapshot bundle (it carries the "
            "workspace) and load it there instead")


def check_migratable(env: Any, target: str) -> None:
    """Everything a move to the agent at ``target`` needs, checked before anything is done."""
    parse_host_port(target)  # a malformed address fails here, not in a background thread
    env._check_open()
    if isinstance(env._handle, NetworkHandle):
        raise MigratedEnvError(f"this env already runs on node {env._handle.node}; migrating it again is not supported")
    check_movable(env)


def ship_snapshot(snap: Any, target: str, tok: bytes, conn: Any, timings: dict,
                  limit: int) -> tuple[socket.socket, dict, dict, int]:
    """Dump ``snap`` (a copy of it, when it is a copy-on-write snapshot), stream it to the agent
    over ``conn`` (a :func:`~gym_fork.migration.wire.connect.connect_in_background`, consumed)
    and wait until the agent has verified and restored it. Returns ``(sock, hello, reply, bytes)``: the restored
    worker waits at the other end of ``sock``. ``limit``: the most bytes the images may take
    (:func:`gym_fork.criu.status.dump_size_bound`). Raises a MigrationError (``sock`` closed, so the
    agent stops what it restored) on failure. Touches neither the env nor ``snap``: the worker
    may go on stepping meanwhile."""
    key = bundle_key(tok)
    tmp = os.path.join(sessiondir.session_dir(), f"mig-{os.urandom(4).hex()}")
    into = os.path.join(tmp, "images")
    sock = None
    dumper = None
    t_dump = time.monotonic()

    def dumped() -> None:
        timings["save_s"] = time.monotonic() - t_dump

    try:
        # made inside the try, removed by its path: Ctrl-C right after it was made (still in
        # private_mkdir, or starting the dump's thread) left it behind in the session dir
        sessiondir.private_mkdir(tmp)
        # CRIU dumps a copy of the snapshot into a private dir in another thread while the images
        # are streamed (and hashed) as CRIU writes them: dump and transfer overlap.
        dumper = DumpThread(lambda: snap.payload_backend.dump_transient(snap.payload(), into), on_end=dumped,
                            name="gym_fork-migration-dump")
        t0 = time.monotonic()
        sock, hello = conn.result()
        timings["connect_wait_s"] = time.monotonic() - t0
        timings["connect_s"] = conn.elapsed

        def trailer(digests: dict) -> dict:
            image = dumper.result
            known = os.path.join(image.path, sessiondir.MANIFEST)  # images dumped earlier: must still match
            if os.path.exists(known) and not sessiondir.streamed_as_dumped(image.path, digests):
                raise ValueError("the snapshot's images changed on disk since they were dumped")
            # signed for this session only: no replay elsewhere
            return sign_meta(bundle_meta(snap, **image_meta(image), images=digests, session=hello["nonce"]), key)

        t0 = time.monotonic()
        # images that exist already (persisted) are checked against their manifest after streaming
        try:
            reply, nbytes = send_images(
                sock, {"op": "env", "env_id": snap.env_id, "steps": snap.steps}, into, target, trailer,
                dumper.done, dumper.failed, limit, "sha256" if snap.persisted else None)
        except ValueError:
            dumper.raise_error()
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
        if dumper is not None:
            dumper.join()
        shutil.rmtree(tmp, ignore_errors=True)
    sock.settimeout(None)
    return sock, hello, reply, nbytes


def switch_to_remote(env: Any, new: NetworkHandle, backend: Backend, local: Any = None) -> None:
    """The target runs the env: point ``env`` at ``new`` (``backend`` stands in for the env's
    backend from now on) and only now stop where it ran before: ``local``, default the env's
    current worker (a worker on another node is detached: its host stops it)."""
    old = env._swap_worker(new)
    old = local if local is not None else old
    new.worker_polls = old.worker_polls  # (the same worker's memory: it polls as it did)
    if isinstance(old, NetworkHandle):
        old.detach()
    else:
        old.kill()
    env._use_backend(backend)

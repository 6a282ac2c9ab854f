"""The receiving end of a migration, shared by the agent and by plugins' hosts: take a streamed
checkpoint into a private directory, verify it (HMAC, session, every image's digest,
compatibility) before anything is restored, restore it, and for a job supervise it here.

A place that receives jobs is a :class:`JobSite`; plugins subclass it for their hooks.
"""

from __future__ import annotations

import errno
import hmac
import json
import logging
import os
import shutil
import signal
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from gym_fork import keys
from gym_fork.backends.bundles import load_snapshot
from gym_fork.criu import client as criu_client
from gym_fork.criu.images import check_compatible
from gym_fork.criu.status import log_tail
from gym_fork.errors import MigrationError, NoSpaceError, TransferError
from gym_fork.migration.job import JobHost
from gym_fork.migration.targets import TargetContext
from gym_fork.migration.wire.auth import bundle_key
from gym_fork.migration.wire.messages import recv_msg, send_msg
from gym_fork.migration.wire.streams import STREAM, receive_images
from gym_fork.snapshots import sessiondir
from gym_fork.snapshots.bundle import canonical_meta
from gym_fork.worker.channel import Channel, socket_inode

RECEIVE_TIMEOUT_S = 60.0
#: how long a restored job waits, frozen, for its source to commit the move (the source stops
#: then); without a commit the restored copy is killed: one copy of a job runs, never two
COMMIT_TIMEOUT_S = 30.0


@dataclass
class Received:
    """A checkpoint that arrived, not verified yet.

    Attributes:
        dir: the private directory it is in (``dir/bundle/images``: the image files); the
            caller removes it.
        meta: the trailer: the signed metadata as sent (untrusted until verified).
        digests: the images' sizes and digests, computed as they were written.
        timings: ``receive_s`` and ``bytes``.
    """

    dir: str
    meta: dict
    digests: dict
    timings: dict

    @property
    def bundle(self) -> str:
        return os.path.join(self.dir, "bundle")


def receive_checkpoint(conn: socket.socket, req: dict, state_dir: str, node: str) -> Received:
    """Check the request (stream format, disk space), say go, and take the streamed images and
    their trailer into a new private directory under ``state_dir``.

    Raises:
        TransferError: an unknown stream format, or a malformed stream (nothing is kept).
        NoSpaceError: not enough space for the announced size (refused before the stream).
        EOFError: the stream was cut (the directory is removed).
        OSError: writing failed (the directory is removed).
    """
    if req.get("stream") != STREAM:
        raise TransferError(f"node {node} receives stream format {STREAM} only, not {req.get('stream')!r}: "
                            "the sender's gym_fork is of another version")
    size = int(req.get("size", -1))
    if size < 0:
        raise ValueError("request has no size")
    st = os.statvfs(state_dir)
    free = st.f_bavail * st.f_frsize
    if size + (1 << 20) > free:
        raise NoSpaceError(f"node {node}: {free} bytes free in {state_dir}, the checkpoint needs {size}")
    send_msg(conn, {"ok": True, "ready": True})  # the sender streams only after this
    d = os.path.join(state_dir, f"in-{os.urandom(6).hex()}")
    t0 = time.monotonic()
    try:
        sessiondir.private_mkdir(d)  # (inside the try: removed by its path whatever fails after)
        conn.settimeout(RECEIVE_TIMEOUT_S)
        images = sessiondir.private_mkdir(os.path.join(d, "bundle", "images"))
        digests, size = receive_images(conn, size, images, str(req.get("hash", "sha256")))
        try:
            meta = recv_msg(conn)
        except ValueError as e:
            raise TransferError(f"bad trailer after the images: {e}") from e
    except OSError as e:
        shutil.rmtree(d, ignore_errors=True)
        if e.errno == errno.ENOSPC:
            raise NoSpaceError(f"node {node}: no space left in {state_dir} while receiving {size} bytes") from e
        raise
    except BaseException:
        shutil.rmtree(d, ignore_errors=True)
        raise
    return Received(d, meta, digests, {"receive_s": time.monotonic() - t0, "bytes": size})


def receive_env(conn: socket.socket, req: dict, state_dir: str, node: str, key: bytes) -> tuple[Any, dict]:
    """Receive one env worker's checkpoint, verify it and restore the worker as our child.

    Returns:
        ``(handle, timings)``: the restored worker, pinged.

    Raises:
        EOFError: the stream was cut (nothing to answer: the sender is gone).
        Exception: refused or failed (the caller tells the sender); nothing is left behind.
    """
    rec = receive_checkpoint(conn, req, state_dir, node)
    try:
        t0 = time.monotonic()
        with open(os.path.join(rec.bundle, "bundle.json"), "w") as f:
            json.dump(rec.meta, f)
        # HMAC, session, compatibility, and the digests computed on receipt
        snap = load_snapshot(rec.bundle, key=key, received=rec.digests, session=req["_session"])
        rec.timings["verify_s"] = time.monotonic() - t0
        t0 = time.monotonic()
        handle = snap.payload_backend.restore_verified(snap.payload())
        rec.timings["restore_s"] = time.monotonic() - t0
        return handle, rec.timings
    finally:
        shutil.rmtree(rec.dir, ignore_errors=True)  # restored (or refused): the images are not needed


class JobSite:
    """A place where received jobs run: an agent, or a plugin's host.

    Args:
        node: this node's name.
        token: the shared token (its :func:`~gym_fork.migration.wire.auth.bundle_key` verifies
            checkpoints; it is also the token for the jobs' onward moves).
        state_dir: where checkpoints land.
        log: the logger (default ``gym_fork.agent``).
        targets: how the jobs received here reach their next targets.
    """

    def __init__(self, node: str, token: bytes, state_dir: str, *, log: logging.Logger | None = None,
                 targets: TargetContext | None = None):
        self.node, self.token, self.key = node, token, bundle_key(token)
        self.state_dir = state_dir
        self.log = log or logging.getLogger("gym_fork.agent")
        self.targets = targets or TargetContext(token=token)
        self.lock = threading.Lock()
        self.jobs: dict[int, JobHost] = {}  # pid -> its supervisor, while the job runs here

    def job_restored(self, pid: int) -> None:
        """Called right after a job was restored, before it runs on; raising refuses the
        checkpoint (the restored job is killed)."""

    def job_ended(self, host: JobHost, how: str) -> None:
        """Called when a job received here ended: ``how`` is ``"exited"``, ``"migrated"`` or
        ``"refused"``."""

    def kill_all(self) -> None:
        """Stop every job running here."""
        with self.lock:
            jobs = list(self.jobs.values())
        for j in jobs:
            try:
                j.kill()
            except Exception:  # noqa: BLE001 - best effort, at shutdown
                pass


def _verify_job(site: JobSite, rec: Received, session: str) -> dict:
    meta = rec.meta
    if not keys.verify(canonical_meta(meta), meta.get("hmac", ""), site.key):
        raise MigrationError(f"the job checkpoint's HMAC does not verify with the token of {site.node}; "
                             "nothing restored")
    check_compatible(meta, rec.bundle)
    if not hmac.compare_digest(str(meta.get("session", "")), session):
        raise MigrationError("the job checkpoint was signed for another session (replayed?); nothing restored")
    sessiondir.verify_received(rec.digests, meta["images"], "the job checkpoint")
    return meta


def _restore_tree(images: str, ino: int, fd: int, fd_ino: int) -> int:
    """CRIU restore of a job tree as our child, ``fd`` (socket inode ``fd_ino``) in place of its
    control socket ``ino``. Returns the job's pid. Raises MigrationError."""
    try:
        return criu_client.restore(images, inherit_fd={f"socket:[{ino}]": fd}, rst_sibling=True, kill_ino=fd_ino)
    except Exception as e:  # noqa: BLE001 - pycriu's errors, TimeoutError
        raise MigrationError(f"CRIU restore of the job failed ({e}): "
                             f"{log_tail(os.path.join(images, 'restore.log'))}") from e


def _kill_and_reap(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)  # PID 1 of its namespace: the whole tree ends
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


def receive_job(site: JobSite, conn: socket.socket, req: dict, who: str) -> None:
    """Receive, verify and restore the job checkpoint streamed on ``conn``, tell the *restored*
    job it arrived, confirm to the source, then supervise the job in a thread (it can move on).

    ``req`` is the request, with ``_session``: this connection's nonce. Every outcome is answered
    on ``conn`` (or logged, when the source is gone); nothing is raised.
    """
    rec = None
    try:
        try:
            rec = receive_checkpoint(conn, req, site.state_dir, site.node)
        except EOFError as e:
            site.log.warning("%s: %s; nothing restored", who, e)
            return
        t0 = time.time()
        meta = _verify_job(site, rec, req["_session"])
        rec.timings["verify_s"] = time.time() - t0
        t0 = time.time()
        ours, theirs = socket.socketpair()
        new_ino = socket_inode(theirs.fileno())
        os.set_inheritable(theirs.fileno(), True)
        try:
            pid = _restore_tree(os.path.join(rec.bundle, "images"), meta["ino"], theirs.fileno(), new_ino)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        try:
            site.job_restored(pid)
        except BaseException:
            ours.close()
            _kill_and_reap(pid)
            raise
        rec.timings["restore_s"] = time.time() - t0
    except Exception as e:  # noqa: BLE001 - the source is told why
        site.log.warning("%s: job checkpoint refused/failed: %s: %s", who, type(e).__name__, e)
        try:
            send_msg(conn, {"ok": False, "error": type(e).__name__, "message": str(e)})
        except OSError:
            pass
        return
    finally:
        if rec is not None:
            shutil.rmtree(rec.dir, ignore_errors=True)
    timings = rec.timings
    chan = Channel(ours)
    host = JobHost(chan, pid, new_ino, token=site.token, node=site.node, targets=site.targets)
    arrived = {"status": "arrived", "node": site.node, "source": meta.get("source"), "t_freeze": meta["t_freeze"],
               "t_resume": time.time(), "bytes": timings["bytes"],
               "timeline": {**req.get("timeline", {}), **meta.get("timeline", {}), **timings}}
    # Two phases: the restored job waits (blocked on its migration request) until the source,
    # told that it is ready here, commits -- and stops. Before, the job ran on here as soon as it
    # was restored; a source that gave up waiting for the verdict (a slow restore, a lost reply)
    # trained on too: two copies of one job, silently.
    try:
        send_msg(conn, {"ok": True, "node": site.node, "pid": pid, "timings": timings, "commit": "wanted"})
        conn.settimeout(COMMIT_TIMEOUT_S)
        commit = recv_msg(conn)
        if not (isinstance(commit, dict) and commit.get("commit") is True):
            raise MigrationError(f"the source answered {commit!r}, not a commit")
    except Exception as e:  # noqa: BLE001 - no commit: the source runs the job on; not here too
        host.kill()
        site.job_ended(host, "refused")
        site.log.warning("%s: job restored as pid %d, but its source did not commit the move (%s: %s): the "
                         "restored copy was stopped; the job runs on at its source", who, pid, type(e).__name__, e)
        return
    try:
        chan.send(arrived)  # the restored job continues now
    except OSError as e:
        host.kill()
        site.job_ended(host, "refused")
        site.log.error("%s: the restored job (pid %d) did not take its reply after the source committed (%s): "
                       "the job is lost; its source stopped", who, pid, e)
        try:
            send_msg(conn, {"committed": False, "message": f"the restored job did not take its reply: {e}"})
        except OSError:
            pass
        return
    with site.lock:
        site.jobs[pid] = host
    try:
        send_msg(conn, {"committed": True})
    except OSError:
        pass  # the source committed (it stops whatever it hears now); the job runs here
    site.log.info("%s: job restored as pid %d from %s", who, pid, meta.get("source"))

    def supervise() -> None:
        how = host.serve()
        with site.lock:
            site.jobs.pop(pid, None)
        site.log.info("job %d %s (code %s)", pid, how, host.returncode)
        site.job_ended(host, how)

    threading.Thread(target=supervise, daemon=True, name=f"job-{pid}").start()

"""The migration host: one actor per Ray node that runs env workers and whole jobs moved there.

An env worker arrives as a bundle in the object store (:meth:`MigrationHost.receive`), is
verified and restored as the host's child, and is then reached through the host's TCP bridge:
the driver authenticates like to an agent, attaches to the worker by its one-shot id, and the
bridge relays bytes between that connection and the worker's unix channel. For the next hop the
host pauses the relay and exports the worker the same way (:meth:`MigrationHost.export`). Jobs
arrive on the same bridge as on an agent (``op="job"``) and run in :class:`RayJobSite`.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import socket
import threading
import time
import uuid
from typing import Any

import ray

from gym_fork.errors import AuthenticationError
from gym_fork.migration.client import write_transient_bundle
from gym_fork.migration.receive import receive_job
from gym_fork.migration.wire.accept import HANDSHAKE_TIMEOUT_S, accept
from gym_fork.migration.wire.auth import bundle_key
from gym_fork.migration.wire.messages import recv_msg, send_msg
from gym_fork.migration.wire.relay import relay
from gym_fork.migration.wire.tls import ServerTLS, server_tls
from gym_fork.ray.auth import resolve_token
from gym_fork.ray.host import BranchHost, pack_dir, unpack_dir
from gym_fork.ray.job_site import RayJobSite

log = logging.getLogger("gym_fork.ray.migration")

ATTACH_TIMEOUT_S = 60.0  # a received worker nobody attaches to within this is stopped


def _unnice_thread() -> None:
    """Ray runs worker processes at nice 15; a migration hop blocks the learner, so the threads
    that dump, restore and relay (and the criu processes they start, which inherit it) run at 0.
    Linux: PRIO_PROCESS with a thread id sets that thread only. Needs root (or CAP_SYS_NICE)."""
    try:
        if os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) > 0:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 0)
    except OSError:
        pass


class _Hosted:
    """One env worker held here: its env, the driver's connection once attached, and the pipe
    that pauses its relay."""

    def __init__(self, wid: str, env: Any, handle: Any):
        self.wid, self.env, self.handle = wid, env, handle
        self.conn: socket.socket | None = None
        self.attached = threading.Event()
        self.paused = threading.Event()
        self.ctl_r, self.ctl_w = os.pipe()
        self.thread: threading.Thread | None = None
        self.created = time.monotonic()
        self.gone = False


class MigrationHost(BranchHost):
    """The per-node host of migrated env workers and whole jobs (also a :class:`BranchHost`).

    Not used directly: ``env.migrate(RayNode(id))`` creates and drives these
    (:func:`gym_fork.ray.hosts.host_for`), and a ``gym-fork run`` supervisor streams jobs to its
    bridge (:func:`gym_fork.ray.hosts.job_host_for`).

    Args:
        idle_exit_s: stop after holding nothing that long (job hosts; None: never).
    """

    def __init__(self, idle_exit_s: float | None = None) -> None:
        super().__init__()
        self._token = resolve_token()
        self._key = bundle_key(self._token)
        self._hosted: dict[str, _Hosted] = {}
        self._mlock = threading.Lock()
        self._server: socket.socket | None = None
        self._address: str | None = None
        self._tls: ServerTLS | None = None
        self._jobs = RayJobSite(self.node_id, self._token, self.session)
        self._idle_exit_s = idle_exit_s
        threading.Thread(target=self._watchdog, daemon=True, name="gym_fork-mhost-watchdog").start()

    # --- introspection -------------------------------------------------------------------------
    def info(self) -> dict:
        out = super().info()
        with self._mlock:
            out["hosted"] = {w: h.handle.pid for w, h in self._hosted.items()}
        out.update(self._jobs.info())
        out["bridge"] = self._address
        return out

    def job_address(self) -> str:
        """The bridge address a job supervisor streams a job checkpoint to (``op="job"``)."""
        if not self._jobs.touch():
            raise RuntimeError(f"the migration host of node {self.node_id} is shutting down")
        return self._bridge()

    # --- bridge ---------------------------------------------------------------------------------
    def _bridge(self) -> str:
        with self._mlock:
            if self._address is None:
                ip = ray.util.get_node_ip_address()
                self._tls = server_tls(name=f"gym_fork ray host {self.node_id}")  # TLS as on an agent
                self._server = socket.create_server((ip, 0))
                self._address = f"{ip}:{self._server.getsockname()[1]}"
                threading.Thread(target=self._accept_loop, daemon=True, name="gym_fork-mhost-accept").start()
            return self._address

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, peer = self._server.accept()
            except OSError as e:
                if e.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    return  # closed
                log.warning("bridge: cannot accept a connection (%s); retrying", e)
                time.sleep(0.1)  # out of fds or memory: shed load, keep serving what runs here
                continue
            try:
                threading.Thread(target=self._connection, args=(conn, peer), daemon=True,
                                 name=f"gym_fork-bridge-{peer[1]}").start()
            except RuntimeError as e:  # out of threads
                conn.close()
                log.warning("bridge: cannot start a thread for a connection (%s)", e)
                time.sleep(0.1)

    def _connection(self, conn: socket.socket, peer: tuple) -> None:
        try:
            deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
            conn, nonce = accept(conn, self._token, self.node_id, self._tls, deadline=deadline)
            req = recv_msg(conn, deadline=deadline)
            conn.settimeout(HANDSHAKE_TIMEOUT_S)
            if req.get("op") == "job":  # a whole job from a `gym-fork run` supervisor (or another host)
                self._job_op(conn, dict(req, _session=nonce), f"{peer[0]}:{peer[1]}")
                return
            wid = str(req.get("id", ""))
            with self._mlock:
                h = self._hosted.get(wid)
                ok = req.get("op") == "attach" and h is not None and h.conn is None and not h.gone
                if ok:
                    h.conn = conn
            if not ok:
                send_msg(conn, {"ok": False, "error": "KeyError",
                                "message": f"no unattached worker {wid!r} on node {self.node_id}"})
                conn.close()
                return
            send_msg(conn, {"ok": True, "node": self.node_id, "pid": h.handle.pid})
            conn.settimeout(None)
        except (AuthenticationError, OSError, EOFError, ValueError) as e:
            log.warning("REFUSED %s:%s: %s: %s", peer[0], peer[1], type(e).__name__, e)
            conn.close()
            return
        h.attached.set()
        self._start_relay(h)

    def _job_op(self, conn: socket.socket, req: dict, who: str) -> None:
        _unnice_thread()
        try:
            if not self._jobs.begin():
                send_msg(conn, {"ok": False, "error": "RuntimeError",
                                "message": f"the migration host of node {self.node_id} is shutting down"})
                return
            try:
                log.info("%s: job checkpoint (%s bytes)", who, req.get("size"))
                receive_job(self._jobs, conn, req, who)
            finally:
                self._jobs.end()
        except Exception as e:  # noqa: BLE001 - log, keep serving
            log.exception("%s: job op failed: %s", who, e)
        finally:
            try:
                conn.close()
            except OSError:
                pass

    def _start_relay(self, h: _Hosted) -> None:
        h.paused.clear()
        h.thread = threading.Thread(target=self._relay, args=(h,), daemon=True, name=f"gym_fork-relay-{h.wid}")
        h.thread.start()

    def _relay(self, h: _Hosted) -> None:
        """The driver's connection to the worker's channel until either closes (then the worker
        is stopped) or a pause is requested (export)."""
        _unnice_thread()
        if relay(h.conn, h.handle.chan.sock, pause_fd=h.ctl_r):
            h.paused.set()
            return
        self._drop(h.wid)

    def _pause(self, h: _Hosted, timeout: float = 10.0) -> None:
        if h.thread is None or not h.thread.is_alive():
            if h.gone:
                raise RuntimeError(f"worker {h.wid} on node {self.node_id} is gone")
            return
        os.write(h.ctl_w, b"p")
        if not h.paused.wait(timeout):
            raise TimeoutError(f"the bridge of worker {h.wid} did not pause")
        h.thread.join(timeout)

    def _drop(self, wid: str) -> None:
        with self._mlock:
            h = self._hosted.pop(wid, None)
        if h is None:
            return
        h.gone = True
        if h.conn is not None:
            try:
                h.conn.close()
            except OSError:
                pass
        try:
            h.handle.kill()  # SIGKILL of the namespace init (or retire: fork tier)
        except Exception:  # noqa: BLE001
            pass
        for fd in (h.ctl_r, h.ctl_w):
            try:
                os.close(fd)
            except OSError:
                pass

    def _watchdog(self) -> None:
        while True:
            time.sleep(2.0)
            now = time.monotonic()
            with self._mlock:
                stale = [w for w, h in self._hosted.items()
                         if not h.attached.is_set() and now - h.created > ATTACH_TIMEOUT_S]
            for w in stale:
                log.warning("worker %s was never attached; stopping it", w)
                self._drop(w)
            self._jobs.reap_guards()
            if self._idle_exit_s is not None and self._idle():
                log.info("job host of node %s idle for %.0f s; stopping", self.node_id, self._idle_exit_s)
                self.close()
                ray.get_runtime_context().current_actor.__ray_terminate__.remote()
                return

    def _idle(self) -> bool:
        """Held nothing for ``idle_exit_s`` (since it started, was last asked for its address, or
        its last job ended); then it takes nothing new."""
        with self._mlock:
            if self._hosted or self.branches_busy():
                return False
            return self._jobs.idle_for(self._idle_exit_s)

    # --- env workers ----------------------------------------------------------------------------
    def receive(self, refs: list, steps: int) -> dict:
        """Pull the bundle ``refs[0]``, verify it, restore its worker here; returns where to attach."""
        t_enter = time.time()
        from gym_fork.env import ForkableEnv
        from gym_fork.backends.bundles import load_snapshot

        _unnice_thread()
        t0 = time.perf_counter()
        files = ray.get(refs[0])
        t1 = time.perf_counter()
        wid = uuid.uuid4().hex
        path = os.path.join(self.session, f"in-{wid}")
        unpack_dir(files, path)
        del files
        t2 = time.perf_counter()
        try:
            snap = load_snapshot(path, key=self._key)  # HMAC, compatibility, sha256 of every image
            t3 = time.perf_counter()
            handle = snap.payload_backend.restore_verified(snap.payload())  # CRIU restore + ping
            t4 = time.perf_counter()
            try:
                env = ForkableEnv._from_handle(snap.payload_backend, handle, steps=steps, record_actions=False)
            except BaseException:
                handle.kill()
                raise
            snap.release()
        finally:
            shutil.rmtree(path, ignore_errors=True)
        with self._mlock:
            self._hosted[wid] = _Hosted(wid, env, handle)
        address = self._bridge()
        return {"wid": wid, "pid": handle.pid, "node_id": self.node_id, "address": address,
                "timings": {"get_s": t1 - t0, "write_s": t2 - t1, "verify_s": t3 - t2, "restore_s": t4 - t3,
                            "in_actor_s": time.perf_counter() - t0, "t_enter": t_enter, "t_exit": time.time()}}

    def export(self, wid: str, steps: int) -> dict:
        """Pause the bridge of ``wid``, snapshot its worker (it keeps running, paused) and put the
        signed bundle into this node's object store. :meth:`resume` or :meth:`release` follow."""
        with self._mlock:
            h = self._hosted.get(wid)
        if h is None:
            raise KeyError(f"no worker {wid!r} on node {self.node_id} (its host was restarted or it was stopped)")
        _unnice_thread()
        t0 = time.perf_counter()
        self._pause(h)
        t1 = time.perf_counter()
        tmp = os.path.join(self.session, f"out-{uuid.uuid4().hex}")
        snap = None
        try:
            h.env._set_steps(steps)  # the driver stepped it meanwhile: the bundle says how far
            snap = h.env.snapshot()
            t2 = time.perf_counter()
            snap.persist()  # CRIU dump of the frozen copy (+ sha256 manifest)
            t2b = time.perf_counter()
            write_transient_bundle(snap, tmp, self._key)
            t3 = time.perf_counter()
            files = pack_dir(tmp)
            nbytes = int(sum(a.nbytes for a in files.values()))
            t4 = time.perf_counter()
            ref = ray.put(files)
            t5 = time.perf_counter()
        except BaseException:
            self._start_relay(h)
            raise
        finally:
            if snap is not None:
                snap.release()
            shutil.rmtree(tmp, ignore_errors=True)
        return {"refs": [ref], "bytes": nbytes,
                "timings": {"pause_s": t1 - t0, "snapshot_s": t2 - t1, "dump_s": t2b - t2, "bundle_s": t3 - t2b,
                            "pack_s": t4 - t3, "put_s": t5 - t4, "in_actor_s": time.perf_counter() - t0}}

    def resume(self, wid: str) -> bool:
        """Restart the relay of a worker whose export was not used."""
        with self._mlock:
            h = self._hosted.get(wid)
        if h is None or (h.thread is not None and h.thread.is_alive()):
            return False
        self._start_relay(h)
        return True

    def release(self, wid: str) -> bool:
        """Stop worker ``wid`` (it moved on)."""
        with self._mlock:
            h = self._hosted.get(wid)
        if h is None:
            return False
        if h.thread is not None and h.thread.is_alive():
            self._pause(h)
        self._drop(wid)
        return True

    def close(self) -> None:
        """Stop every hosted worker and job, the bridge, and delete this host's directory."""
        self._jobs.closing = True
        with self._mlock:
            wids = list(self._hosted)
        for w in wids:
            self._drop(w)
        self._jobs.kill_all()
        if self._server is not None:
            self._server.close()
        super().close()

"""Migration targets named by Ray node: ``env.migrate(RayNode(node_id))``.

One :class:`MigrationHost` actor per node (named ``gym_fork-mhost-<node id>``, pinned with
``NodeAffinitySchedulingStrategy(soft=False)``, created on first use by the driver that migrates,
so it lives as long as that driver's job). A hop:

1. **Export** the worker as a signed bundle and put it into Ray's object store *on the source
   node*: the driver does it for a local env (``env.snapshot()`` -- copy-on-write fork tier, the
   worker keeps running -- then :func:`~gym_fork.migration.client.write_transient_bundle`); for an
   env that already runs on a host, that host pauses its TCP bridge (nothing is in flight: the
   protocol is strictly request/reply and the driver is inside ``migrate``), snapshots its own
   worker the same way and puts the bundle (:meth:`MigrationHost.export`).
2. **Receive** on the target host: ``ray.get`` (object store to object store, never through the
   driver when the source is another host), write-out, ``load_snapshot`` (HMAC with the
   token-derived bundle key, CRIU/arch/mapped-file compatibility, every image's sha256), CRIU
   restore as the host's child (the host is a child subreaper), ping.
3. **Attach**: the driver connects to the target host's TCP bridge, passes the agent's mutual
   challenge-response (:mod:`gym_fork.migration.wire`) and names the one-shot worker id; from
   then on the bridge relays bytes between that TCP connection and the worker's unix channel,
   and the driver steps it through a :class:`RayNetworkHandle` (the ordinary worker protocol).
4. **Switch**: only now is the source stopped (local worker killed, or the source host told to
   release its paused worker). Any failure before that resumes the source unchanged.

Because the worker keeps its unix channel (external ``unix[INO]`` for CRIU) and the TCP side
lives in the host, a migrated worker can be exported again: hops chain (A -> B -> C -> A).

**Whole jobs** (``LiveMigrationCallback(RayNode(id))`` in a ``gym-fork run`` job): the job sends
its supervisor ``"ray:<node id>"``; the supervisor (not dumped, so it may talk to Ray) connects
to the cluster, gets that node's *job host* (:func:`job_host_for`: the same :class:`MigrationHost`
class, but detached, in namespace ``gym_fork``, so it outlives the supervisor that created it),
asks it for its bridge address (:func:`job_host_address`) and streams the job checkpoint to the
bridge exactly as to a ``gym-fork agent`` (same handshake, ``op="job"``, same verification and
restore: :func:`gym_fork.migration.job.receive_job`). The job becomes the host's child (the
host is a child subreaper) and is supervised there by a ``JobHost``, so it can move on. A small
guard process per job (own session) holds a pidfd of the job and the read end of a pipe only
the host holds: when the host process ends in any way (``ray.kill``, a crash, its node dying)
the guard SIGKILLs the job's PID namespace, so no restored job outlives its host. A job host
that has held nothing for ``idle_exit_s`` (``$GYM_FORK_RAY_JOB_HOST_IDLE_S`` in the supervisor
that created it, default 60) stops itself.

Token: ``token=`` / ``$GYM_FORK_TOKEN`` / ``$GYM_FORK_TOKEN_FILE`` where set, else a token derived
from the gym_fork HMAC key (``gym_fork.keys``), which every node must share anyway to verify
bundles. Hosts resolve theirs on their own node the same way (an explicit ``token=`` on the
driver must therefore also be in the hosts' environment, e.g. ``runtime_env={"env_vars": ...}``).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import select
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

from gym_fork.migration.client import MigratedBackend, NetworkHandle
from gym_fork.errors import MigratedEnvError, MigrationError, RemoteRestoreError
from gym_fork.ray.host import BranchHost, pack_dir, unpack_dir
from gym_fork.ray.node import RayNode

log = logging.getLogger("gym_fork.ray.migration")

ATTACH_TIMEOUT_S = 60.0  # a received worker nobody attaches to within this is stopped
HOST_NAME = "gym_fork-mhost-{}"
JOB_NAMESPACE = "gym_fork"  # job hosts (detached) live here, whoever created them
JOB_HOST_IDLE_ENV = "GYM_FORK_RAY_JOB_HOST_IDLE_S"

# Run by the guard of one job on a host: exits when the job exits (its pidfd is readable); when the
# pipe's write end -- held by the host process only -- closes first, the host is gone: kill the job.
_GUARD = """
import os, select, signal, sys
life, pfd = int(sys.argv[1]), int(sys.argv[2])
p = select.poll()
p.register(life, select.POLLIN)
p.register(pfd, select.POLLIN)
while True:
    try:
        ev = dict(p.poll())
        break
    except InterruptedError:
        pass
if life in ev:
    try:
        signal.pidfd_send_signal(pfd, signal.SIGKILL)
    except ProcessLookupError:
        pass
"""


def resolve_token(token: str | bytes | None = None) -> bytes:
    """The bridge token (see module doc)."""
    from gym_fork.migration import wire

    try:
        return wire.load_token(token)
    except (ValueError, OSError):
        from gym_fork import keys

        return hmac.new(keys.get_key(), b"gym_fork ray bridge token v1", hashlib.sha256).hexdigest().encode()


# --- the host actor ---------------------------------------------------------------------------------
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
    def __init__(self, wid: str, env: Any):
        self.wid, self.env = wid, env
        self.conn: socket.socket | None = None
        self.attached = threading.Event()
        self.paused = threading.Event()
        self.ctl_r, self.ctl_w = os.pipe()
        self.thread: threading.Thread | None = None
        self.created = time.monotonic()
        self.gone = False

    @property
    def pid(self) -> int:
        return self.env._handle.pid



class MigrationHost(BranchHost):
    """The per-node host of migrated env workers and whole jobs (also a :class:`BranchHost`). Not
    used directly: ``env.migrate(RayNode(id))`` creates and drives these (:func:`host_for`), and
    a ``gym-fork run`` supervisor streams jobs to its bridge (:func:`job_host_for`, ``op="job"``).
    ``idle_exit_s``: stop after holding nothing that long (job hosts; ``None``: never)."""

    def __init__(self, idle_exit_s: float | None = None) -> None:
        super().__init__()
        from gym_fork.migration import wire

        self._token = resolve_token()
        self._key = wire.bundle_key(self._token)
        self._hosted: dict[str, _Hosted] = {}
        self._mlock = threading.Lock()
        self._server: socket.socket | None = None
        self._address: str | None = None
        self._jobs = _JobSite(self)
        self._idle_exit_s = idle_exit_s
        self._closing = False
        threading.Thread(target=self._watchdog, daemon=True, name="gym_fork-mhost-watchdog").start()

    # --- introspection -------------------------------------------------------------------------
    def info(self) -> dict:
        out = super().info()
        with self._mlock:
            out["hosted"] = {w: h.pid for w, h in self._hosted.items()}
        with self._jobs._lock:
            out["jobs"] = {pid: {"guard": self._jobs.guards[pid].pid if pid in self._jobs.guards else None}
                           for pid in self._jobs.hosted}
        out["bridge"] = self._address
        out["jobs_received"] = self._jobs.received
        return out

    def job_address(self) -> str:
        """The bridge address a job supervisor streams a job checkpoint to (``op="job"``)."""
        with self._jobs._lock:
            if self._closing:
                raise RuntimeError(f"the migration host of node {self.node_id} is shutting down")
            self._jobs.last_active = time.monotonic()
        return self._bridge()

    # --- bridge ---------------------------------------------------------------------------------
    def _bridge(self) -> str:
        with self._mlock:
            if self._address is None:
                import ray

                ip = ray.util.get_node_ip_address()
                self._server = socket.create_server((ip, 0))
                self._address = f"{ip}:{self._server.getsockname()[1]}"
                threading.Thread(target=self._accept_loop, daemon=True, name="gym_fork-mhost-accept").start()
            return self._address

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, peer = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._connection, args=(conn, peer), daemon=True,
                             name=f"gym_fork-bridge-{peer[1]}").start()

    def _connection(self, conn: socket.socket, peer: tuple) -> None:
        from gym_fork.migration import wire
        from gym_fork.errors import AuthenticationError

        try:
            conn.settimeout(10.0)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            nonce = wire.server_handshake(conn, self._token, self.node_id)
            req = wire.recv_msg(conn)
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
                wire.send_msg(conn, {"ok": False, "error": "KeyError",
                                     "message": f"no unattached worker {wid!r} on node {self.node_id}"})
                conn.close()
                return
            wire.send_msg(conn, {"ok": True, "node": self.node_id, "pid": h.pid})
            conn.settimeout(None)
        except (AuthenticationError, OSError, EOFError, ValueError) as e:
            log.warning("REFUSED %s:%s: %s: %s", peer[0], peer[1], type(e).__name__, e)
            conn.close()
            return
        h.attached.set()
        self._start_relay(h)

    def _job_op(self, conn: socket.socket, req: dict, who: str) -> None:
        from gym_fork.migration import wire
        from gym_fork.migration.job import receive_job

        _unnice_thread()
        try:
            with self._jobs._lock:
                refuse = self._closing
                if not refuse:
                    self._jobs.busy += 1
            if refuse:
                wire.send_msg(conn, {"ok": False, "error": "RuntimeError",
                                     "message": f"the migration host of node {self.node_id} is shutting down"})
                return
            try:
                log.info("%s: job checkpoint (%s bytes)", who, req.get("size"))
                receive_job(self._jobs, conn, req, who)
            finally:
                with self._jobs._lock:
                    self._jobs.busy -= 1
                    self._jobs.last_active = time.monotonic()
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
        """Bytes both ways between the driver's TCP connection and the worker's unix channel, until
        either closes (then the worker is stopped) or a pause is requested (export)."""
        _unnice_thread()
        a, b = h.conn, h.env._handle.chan.sock
        pair = {a: b, b: a}
        try:
            while True:
                ready = select.select([a, b, h.ctl_r], [], [])[0]
                if h.ctl_r in ready:
                    os.read(h.ctl_r, 64)
                    h.paused.set()
                    return
                for s in ready:
                    data = s.recv(1 << 16)
                    if not data:
                        raise EOFError
                    pair[s].sendall(data)
        except (OSError, EOFError):
            pass
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
            h.env._handle.kill()  # SIGKILL of the namespace init (or retire: fork tier)
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
                import ray

                ray.get_runtime_context().current_actor.__ray_terminate__.remote()
                return

    def _idle(self) -> bool:
        """A job host that has held nothing for ``idle_exit_s`` (since it started, was last asked
        for its address, or its last job ended)."""
        j = self._jobs
        with self._mlock, j._lock:
            if self._hosted or self._roots or self._busy or j.hosted or j.busy:
                return False
            if time.monotonic() - j.last_active < self._idle_exit_s:
                return False
            self._closing = True  # no new job from here on
            return True

    # --- the migration steps --------------------------------------------------------------------
    def receive(self, refs: list, steps: int) -> dict:
        """Pull the bundle ``refs[0]``, verify it, restore its worker here; returns where to attach."""
        import ray

        t_enter = time.time()
        from gym_fork.snapshots.bundle import load_snapshot
        from gym_fork.env import ForkableEnv

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
            handle = snap._backend._restore_verified(snap.payload())  # CRIU restore + ping
            t4 = time.perf_counter()
            try:
                env = ForkableEnv.__new__(ForkableEnv)
                env._setup(snap._backend, handle, handle.request("meta"), lineage=uuid.uuid4().hex,
                           record_actions=False)
                env._steps = steps
            except BaseException:
                handle.kill()
                raise
            snap.release()
        finally:
            shutil.rmtree(path, ignore_errors=True)
        with self._mlock:
            self._hosted[wid] = _Hosted(wid, env)
        address = self._bridge()
        return {"wid": wid, "pid": handle.pid, "node_id": self.node_id, "address": address,
                "timings": {"get_s": t1 - t0, "write_s": t2 - t1, "verify_s": t3 - t2, "restore_s": t4 - t3,
                            "in_actor_s": time.perf_counter() - t0, "t_enter": t_enter, "t_exit": time.time()}}

    def export(self, wid: str, steps: int) -> dict:
        """Pause the bridge of ``wid``, snapshot its worker (it keeps running, paused) and put the
        signed bundle into this node's object store. :meth:`resume` or :meth:`release` follow."""
        import ray

        from gym_fork.migration.client import write_transient_bundle

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
            h.env._steps = steps
            snap = h.env.snapshot()
            t2 = time.perf_counter()
            snap._backend.persist(snap.payload())  # CRIU dump of the frozen copy (+ sha256 manifest)
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
        self._closing = True
        with self._mlock:
            wids = list(self._hosted)
        for w in wids:
            self._drop(w)
        self._jobs.kill_all()
        if self._server is not None:
            self._server.close()
        super().close()


class _JobSite:
    """A migration host as the place received jobs run (what :func:`~gym_fork.migration.job.receive_job`
    needs: the agent's attributes), plus one guard process per job (see module doc)."""

    def __init__(self, host: MigrationHost):
        self.host = host
        self.token, self.key, self.node = host._token, host._key, host.node_id
        self.state_dir = host.session
        self.log = log
        self.ray_address = None  # onward `ray:` hops use this process's Ray connection
        self._lock = threading.Lock()
        self.hosted: dict[int, Any] = {}  # job pid -> JobHost
        self.guards: dict[int, subprocess.Popen] = {}
        self.busy = 0
        self.received = 0
        self.last_active = time.monotonic()
        self._life_r, self._life_w = os.pipe()  # the write end lives (only) as long as this process

    def receive_bundle(self, conn: socket.socket, req: dict, who: str) -> tuple[str, dict, dict | None]:
        from gym_fork.migration.agent import receive_checkpoint

        return receive_checkpoint(conn, req, self.state_dir, self.node)

    def job_restored(self, pid: int) -> None:
        pfd = os.pidfd_open(pid)
        try:
            g = subprocess.Popen([sys.executable, "-S", "-c", _GUARD, str(self._life_r), str(pfd)],
                                 pass_fds=(self._life_r, pfd), stdin=subprocess.DEVNULL,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        finally:
            os.close(pfd)
        with self._lock:
            self.guards[pid] = g
            self.received += 1
            self.last_active = time.monotonic()

    def job_ended(self, job: Any, how: str) -> None:
        with self._lock:
            self.last_active = time.monotonic()
        self.reap_guards()

    def reap_guards(self) -> None:
        with self._lock:
            done = [p for p, g in self.guards.items() if g.poll() is not None]
            for p in done:
                self.guards.pop(p)

    def kill_all(self) -> None:
        with self._lock:
            jobs = list(self.hosted.values())
        for j in jobs:
            try:
                j.kill()
            except Exception:  # noqa: BLE001
                pass
        deadline = time.monotonic() + 5
        while self.guards and time.monotonic() < deadline:
            self.reap_guards()
            time.sleep(0.02)


# --- driver side ----------------------------------------------------------------------------------
_host_cls = None
_host_lock = threading.Lock()


_hosts: dict[tuple[str, str], Any] = {}  # (Ray job id, node id) -> handle


def host_for(node_id: str) -> Any:
    """The migration host actor of ``node_id`` (created on first use, one per node and job).
    Handles are cached: a named get-or-create goes through the GCS, and a call on a handle made
    that way waited ~0.9 s for it (measured per hop on this loaded 2-core machine)."""
    global _host_cls
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    key = (ray.get_runtime_context().get_job_id(), node_id)
    with _host_lock:
        if key in _hosts:
            return _hosts[key]
        if _host_cls is None:
            _host_cls = ray.remote(MigrationHost)
        h = _hosts[key] = _host_cls.options(
            name=HOST_NAME.format(node_id), get_if_exists=True, num_cpus=0, max_concurrency=16, max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote()
        return h


def forget_host(node_id: str) -> None:
    """Drop the cached handle of ``node_id``'s host (it died, or was closed)."""
    with _host_lock:
        for k in [k for k in _hosts if k[1] == node_id]:
            del _hosts[k]


def job_host_for(node_id: str, idle_exit_s: float | None = None) -> Any:
    """The *job* host of ``node_id``: a detached :class:`MigrationHost` in namespace
    ``gym_fork`` (created on first use; it must outlive the ``gym-fork run`` supervisor that
    moved a job there). ``idle_exit_s`` (default ``$GYM_FORK_RAY_JOB_HOST_IDLE_S`` or 60): it stops
    itself after holding nothing that long (applies when it is created)."""
    global _host_cls
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if idle_exit_s is None:
        idle_exit_s = float(os.environ.get(JOB_HOST_IDLE_ENV, "60"))
    with _host_lock:
        if _host_cls is None:
            _host_cls = ray.remote(MigrationHost)
    return _host_cls.options(
        name=HOST_NAME.format(node_id), namespace=JOB_NAMESPACE, lifetime="detached", get_if_exists=True,
        num_cpus=0, max_concurrency=16, max_restarts=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote(idle_exit_s)


def connect_ray(address: str | None = None) -> None:
    """Connect this process (a job supervisor) to the Ray cluster, unless it is already:
    ``address``, else ``$RAY_ADDRESS``, else ``"auto"`` (never a new local cluster)."""
    import ray

    if ray.is_initialized():
        return
    addr = address or os.environ.get("RAY_ADDRESS") or "auto"
    try:
        ray.init(address=addr, namespace=JOB_NAMESPACE, log_to_driver=False, configure_logging=False)
    except Exception as e:  # noqa: BLE001 - ConnectionError, ValueError, ...
        raise MigrationError(f"cannot connect to the Ray cluster at {addr!r} (--ray-address / $RAY_ADDRESS): "
                             f"{type(e).__name__}: {e}") from e
    # Ray's subreaper mode sets SIGCHLD to SIG_IGN; criu (the next dump) would fail returning 0
    import ctypes
    import signal

    ctypes.CDLL(None).signal(signal.SIGCHLD, ctypes.c_void_p(0))


def job_host_address(node_id: str, ray_address: str | None = None, timeout: float = 60.0) -> str:
    """Where to stream a job checkpoint for Ray node ``node_id``: its job host's bridge
    (``ip:port``). Connects to Ray first if needed (:func:`connect_ray`). Raises MigrationError."""
    import ray

    connect_ray(ray_address)
    alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    if node_id not in alive:
        raise MigrationError(f"Ray node {node_id} is not an alive node of this cluster")
    last = None
    for _attempt in range(2):  # a job host that just stopped itself (idle) is replaced once
        try:
            return ray.get(job_host_for(node_id).job_address.remote(), timeout=timeout)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
            last = e
            time.sleep(0.5)
        except ray.exceptions.RayError as e:
            raise MigrationError(f"the job host on Ray node {node_id} did not answer: {_cause(e)}") from e
    raise MigrationError(f"the job host on Ray node {node_id} is gone: {_cause(last)}")


def close_hosts(jobs: bool = False) -> None:
    """Stop every migration host of this job (their workers end, their directories go); with
    ``jobs=True`` the detached job hosts (namespace ``gym_fork``) and the jobs they run instead."""
    import ray

    if not jobs:
        with _host_lock:
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


class RayNetworkHandle(NetworkHandle):
    """A worker hosted by the migration host of a Ray node, reached through its TCP bridge."""

    def __init__(self, sock: socket.socket, pid: int, node_id: str, host: Any, wid: str):
        super().__init__(sock, pid, node_id[:12], f"ray:{node_id}")
        self.node_id, self.host, self.wid = node_id, host, wid

    def exit_status(self) -> str:
        import ray

        try:
            ray.get(self.host.info.remote(), timeout=2)
            why = "its host actor is alive but the worker or the bridge ended"
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
            why = "its host actor is gone (killed, crashed, or its node died)"
        except Exception as e:  # noqa: BLE001
            why = f"its host actor did not answer ({type(e).__name__})"
        return f"the connection to Ray node {self.node_id} closed: {why}"


class RayMigratedBackend(MigratedBackend):
    """Stands in for the backend of an env migrated to a Ray node."""

    def __init__(self, node_id: str):
        super().__init__(node_id[:12], f"ray:{node_id}")
        self.node_id = node_id

    def _refuse(self, what: str):
        raise MigratedEnvError(
            f"{what} is not supported on an env whose worker was migrated to Ray node {self.node_id}; "
            "step/reset/render/attributes/close and migrate(RayNode(...)) work")


def _check_movable(env: Any, node: RayNode) -> None:
    """What any move to ``node`` needs (raises MigrationError, before anything is done)."""
    import ray

    if not isinstance(env._handle, NetworkHandle) and env._backend.name != "criu":
        raise MigrationError(f"only the criu backend can migrate (this env uses {env._backend.name!r})")
    if getattr(env, "_workspace", None) is not None:
        raise MigrationError(f"this env has a workspace ({env._workspace.path}): migration does not carry "
                             "workspace files yet; save a snapshot bundle (it carries the workspace) instead")
    if node.node_id not in {n["NodeID"] for n in ray.nodes() if n.get("Alive")}:
        raise MigrationError(f"Ray node {node.node_id} is not an alive node of this cluster")


def _export_snapshot(snap: Any, tok: bytes, host_timings: dict) -> tuple[Any, int]:
    """CRIU images of ``snap`` (a dump of its frozen copy), as a signed bundle in this node's object
    store; returns ``(ref, bytes)``. Does not touch the env: its worker may go on meanwhile."""
    import ray

    from gym_fork.snapshots import sessiondir
    from gym_fork.migration import wire
    from gym_fork.migration.client import write_transient_bundle

    tmp = sessiondir.private_mkdir(os.path.join(sessiondir.session_dir(), f"rmig-{os.urandom(4).hex()}"))
    try:
        t1 = time.perf_counter()
        snap._backend.persist(snap.payload())
        t2 = time.perf_counter()
        write_transient_bundle(snap, os.path.join(tmp, "bundle"), wire.bundle_key(tok))
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


def _receive_and_attach(target: Any, node: RayNode, ref: Any, steps: int, tok: bytes, timeout: float,
                        timings: dict, host_timings: dict) -> tuple[socket.socket, dict]:
    """The target host pulls, verifies and restores the bundle ``ref``; then the driver attaches to
    the restored worker through the host's bridge. Returns ``(sock, rep)``; on failure the
    target's copy is released and a MigrationError raised."""
    import ray

    from gym_fork.migration import wire

    t0 = time.perf_counter()
    w0 = time.time()
    try:
        rep = ray.get(target.receive.remote([ref], steps), timeout=timeout)
    except ray.exceptions.RayError as e:
        if isinstance(e, ray.exceptions.RayActorError):
            forget_host(node.node_id)  # a new one is made on the next try
        raise RemoteRestoreError(f"Ray node {node.node_id} did not restore the env: {_cause(e)}",
                                 _cause_type(e)) from e
    timings["receive_s"] = time.perf_counter() - t0
    rt = rep["timings"]
    # Ray's share: from the call to the method starting, and from its return to ours
    rt["call_to_start_s"], rt["return_s"] = rt.pop("t_enter") - w0, time.time() - rt.pop("t_exit")
    host_timings.update({f"receive_{k}": v for k, v in rt.items()})
    t0 = time.perf_counter()
    try:
        sock, hello = wire.connect(rep["address"], tok, timeout=min(timeout, 30.0))
        wire.send_msg(sock, {"op": "attach", "id": rep["wid"]})
        reply = wire.recv_msg(sock)
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


def migrate_env_to_node_live(env: Any, node: RayNode, *, token: str | bytes | None = None,
                             timeout: float = 60.0) -> Any:
    """``env.migrate(RayNode(id), live=True)``: pre-copy (:mod:`gym_fork.migration.live`) to a Ray
    node's host: the learner keeps stepping its local worker while the fork-tier snapshot is
    exported, restored on the node and catches up by replay; then a later step switches."""
    from gym_fork.migration.live import check_live, start_live

    env._check_open()
    if isinstance(env._handle, NetworkHandle):
        raise MigrationError("live=True moves a worker that runs here; this env's worker runs on "
                             f"{env._handle.node} already: use live=False to move it on")
    _check_movable(env, node)
    check_live(env)
    tok = resolve_token(token)
    target = host_for(node.node_id)

    def ship(mig: Any) -> tuple[RayNetworkHandle, dict]:
        host_timings: dict[str, float] = {}
        t0 = time.perf_counter()
        ref, nbytes = _export_snapshot(mig._snap, tok, host_timings)
        mig._timings["export_s"] = time.perf_counter() - t0
        sock, rep = _receive_and_attach(target, node, ref, mig._snap.steps, tok, timeout, mig._timings,
                                        host_timings)
        del ref
        remote = RayNetworkHandle(sock, rep["pid"], node.node_id, target, rep["wid"])
        return remote, {"pid": rep["pid"], "bytes": nbytes, "remote_timings": host_timings}

    def switch(env: Any, remote: RayNetworkHandle, local: Any) -> str:
        env._handle = remote
        env._box[0] = remote
        local.kill()
        env._backend = RayMigratedBackend(node.node_id)
        return node.node_id

    return start_live(env, str(node), ship, switch)


def migrate_env_to_node(env: Any, node: RayNode, *, token: str | bytes | None = None,
                        timeout: float = 60.0) -> dict:
    """Move ``env``'s worker to ``node``'s migration host (see module doc). Returns a report
    (node ids, pid, bytes, driver- and host-side timings in seconds). On failure raises a
    :mod:`gym_fork.migration.errors` error and the env keeps running where it was, unchanged."""
    import ray

    env._check_open()
    cur = env._handle
    if isinstance(cur, NetworkHandle) and not hasattr(cur, "wid"):
        raise MigratedEnvError(f"this env runs on agent node {cur.node}; it cannot move on to a Ray node")
    _check_movable(env, node)
    source = getattr(cur, "node_id", None) or ray.get_runtime_context().get_node_id()
    if getattr(cur, "node_id", None) == node.node_id:
        return {"node_id": node.node_id, "source": source, "pid": cur.pid, "bytes": 0, "timings": {},
                "noop": True}
    tok = resolve_token(token)
    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    host_timings: dict[str, float] = {}
    saved_state = (env._parent_id, None if env._actions is None else list(env._actions))
    target = host_for(node.node_id)
    sock = None
    exported = False
    try:
        # 1. export
        t0 = time.perf_counter()
        if isinstance(cur, RayNetworkHandle):
            try:
                out = ray.get(cur.host.export.remote(cur.wid, env._steps), timeout=timeout)
            except ray.exceptions.RayError as e:
                raise MigrationError(f"the host on Ray node {cur.node_id} could not export the worker: "
                                     f"{_cause(e)}") from e
            exported = True
            ref, nbytes = out["refs"][0], out["bytes"]
            host_timings.update({f"export_{k}": v for k, v in out["timings"].items()})
        else:
            snap = env.snapshot()
            try:
                host_timings["export_snapshot_s"] = time.perf_counter() - t0
                ref, nbytes = _export_snapshot(snap, tok, host_timings)
            finally:
                snap.release()
        timings["export_s"] = time.perf_counter() - t0
        # 2. receive (verify + restore) on the target, 3. attach through the bridge
        sock, rep = _receive_and_attach(target, node, ref, env._steps, tok, timeout, timings, host_timings)
        del ref
    except BaseException:
        if sock is not None:
            sock.close()
        if exported:  # the source host keeps serving the env
            try:
                ray.get(cur.host.resume.remote(cur.wid), timeout=30)
            except Exception:  # noqa: BLE001
                pass
        env._parent_id, env._actions = saved_state
        raise
    # 4. switch: the source stops only now
    t0 = time.perf_counter()
    sock.settimeout(None)
    new = RayNetworkHandle(sock, rep["pid"], node.node_id, target, rep["wid"])
    old, env._handle = env._handle, new
    env._box[0] = new
    if isinstance(old, RayNetworkHandle):
        old.closed = True
        old.chan.close()
        old.host.release.remote(old.wid)  # no wait: the worker is paused there, not in our way
    else:
        old.kill()
    env._backend = RayMigratedBackend(node.node_id)
    env._parent_id, env._actions = saved_state
    timings["switch_s"] = time.perf_counter() - t0
    timings["total_s"] = time.perf_counter() - t_start
    return {"node_id": node.node_id, "source": source, "pid": rep["pid"], "bytes": nbytes,
            "timings": timings, "host_timings": host_timings}


def _cause(e: BaseException) -> str:
    cause = getattr(e, "cause", None)
    if cause is not None:
        return f"{type(cause).__name__}: {cause}"
    s = str(e).strip().splitlines()
    return s[0] if s else type(e).__name__


def _cause_type(e: BaseException) -> str:
    cause = getattr(e, "cause", None)
    return type(cause).__name__ if cause is not None else type(e).__name__

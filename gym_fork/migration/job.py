"""Managed jobs (``gym-fork run -- python train.py``) and whole-job live migration.

Processes::

    gym-fork run (supervisor, node A)          gym-fork agent (node B)
     └─ launcher: unshare(CLONE_NEWPID), fork   └─ J' restored job tree (rst_sibling: agent's child)
         └─ J  python train.py: PID 1 of its namespace, setsid(), stdin /dev/null,
               stdout/stderr O_APPEND log files; its ForkableEnv workers / threads are its tree

The job talks to whoever supervises it through one unix socket (fd ``$GYM_FORK_CONTROL_FD``),
strictly request/reply, like env workers.  ``LiveMigrationCallback`` sends ``("migrate", {...})``
at a step boundary and blocks in ``recv``; the supervisor then

1. dumps J's whole tree with CRIU (``leave_running``: J stays blocked in recv; the control socket
   is external ``unix[INO]``) while it streams the image files to the target as CRIU writes them
   (:func:`wire.send_images_while_dumping`: BLAKE3 of every byte, hashed as sent),
2. then sends ``job.json`` (the digests, the session nonce, the files J maps; HMAC with the
   token-derived key); the target verifies everything, restores the tree with a fresh socket in
   place of the control socket (``inherit_fd``), answers the *restored* job
   ``{"status": "arrived", ...}`` and only then confirms to us;
3. on the confirmation kills J (its PID namespace) and exits 0.  On any failure J gets
   ``{"status": "failed", "error": ...}`` and simply continues.

The agent then supervises J' with the same loop (:class:`JobHost`), so it can move again.

A target ``"ray:<node id>"`` (what ``LiveMigrationCallback(RayNode(id))`` sends) is resolved by
the *supervisor*, never by the job (a tree holding Ray's TCP connections cannot be dumped): it
connects to the Ray cluster (``--ray-address`` / ``$RAY_ADDRESS``), gets that node's migration
host actor (:func:`gym_fork.ray.migration.job_host_address`) and streams to the host's bridge
exactly as to an agent; the host runs the same receive path (:func:`receive_job`).
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

from gym_fork import keys
from gym_fork.snapshots import sessiondir
from gym_fork.migration import wire
from gym_fork.errors import MigrationError, RemoteRestoreError
from gym_fork.worker.channel import Channel, ChannelClosed, socket_inode

log = logging.getLogger("gym_fork.job")
CONTROL_ENV = "GYM_FORK_CONTROL_FD"

_LAUNCHER = """
import ctypes, os, signal, sys
if ctypes.CDLL(None, use_errno=True).unshare(0x20000000) != 0:
    sys.stderr.write("gym-fork run: unshare(CLONE_NEWPID) failed: %s\\n" % os.strerror(ctypes.get_errno()))
    os._exit(125)
pid = os.fork()
if pid == 0:
    os.setsid()
    os.execvp(sys.argv[1], sys.argv[1:])
for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(s, signal.SIG_IGN)
_, st = os.waitpid(pid, 0)
os._exit(os.waitstatus_to_exitcode(st) & 0xFF)
"""


# --- job side ---------------------------------------------------------------------------------------
def _ask_supervisor(cmd: str, args: dict) -> dict:
    """One request/reply on the job's control channel (``$GYM_FORK_CONTROL_FD``)."""
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
    """Ask this job's supervisor to move the whole job to ``target``; blocks until the job runs
    on the target (returns ``{"status": "arrived", ...}`` *there*) or the move failed (returns
    ``{"status": "failed", "error": ...}`` here)."""
    return _ask_supervisor("migrate", dict(info, target=target))


def prepare_migration(targets: list[str]) -> dict:
    """Tell this job's supervisor where it may move (at training start): for ``"ray:<node id>"``
    targets it connects to Ray, starts those nodes' job hosts and keeps them warm in the
    background, so that a later move does not wait for any of that. Answered at once."""
    return _ask_supervisor("prepare", {"targets": list(targets)})


# --- supervisor side (both `gym-fork run` and the agent) -------------------------------------------
def _job_files(images: str) -> list[list]:
    """Regular files the job maps or holds open, except O_APPEND ones (its logs grow)."""
    import pycriu

    try:
        with open(os.path.join(images, "files.img"), "rb") as f:
            entries = pycriu.images.load(f)["entries"]
    except Exception:  # noqa: BLE001
        return []
    import stat

    out = []
    for e in entries:
        r = e.get("reg") or {}
        if e.get("type") != "REG" or not r.get("name", "").startswith("/") or not stat.S_ISREG(r.get("mode", 0)):
            continue
        flags = r.get("flags", 0)
        if isinstance(flags, str):
            flags = int(flags, 0)
        if flags & os.O_APPEND:
            continue
        out.append([r["name"], r.get("size", 0)])
    return sorted(out)


class JobHost:
    """Supervises one job process (PID 1 of its namespace) over its control channel."""

    def __init__(self, chan: Channel, pid: int, ino: int, *, token: bytes | None, node: str,
                 popen: subprocess.Popen | None = None, tls: bool | str = False, netns: str | None = None,
                 ray_address: str | None = None):
        self.chan, self.pid, self.ino = chan, pid, ino
        self.token, self.node, self.popen, self.tls, self.netns = token, node, popen, tls, netns
        self.ray_address = ray_address  # for "ray:<node id>" targets (else $RAY_ADDRESS / "auto")
        self.returncode: int | None = None
        self.moved_to: str | None = None  # the target, once the job runs there
        self._warm: dict[str, str] = {}  # Ray node id -> its job host's bridge, kept fresh (prepare)
        self.prewarmed = False  # the last move used a warm job host
        self._warm_ready: dict[str, threading.Event] = {}  # per node: its first warm-up is over
        self._stop_warm = threading.Event()

    def _exited(self) -> bool:
        if self.returncode is not None:
            return True
        if self.popen is not None:
            rc = self.popen.poll()
            if rc is not None:
                self.returncode = rc
        else:
            try:
                wpid, st = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                self.returncode = -1
                return True
            if wpid:
                self.returncode = os.waitstatus_to_exitcode(st)
        return self.returncode is not None

    def serve(self) -> str:
        """Until the job exits ("exited") or moved away ("migrated")."""
        chan_open = True
        while True:
            if self._exited():
                self.chan.close()
                return "exited"
            if not chan_open:
                time.sleep(0.1)
                continue
            r, _, _ = select.select([self.chan.sock], [], [], 0.1)
            if not r:
                continue
            try:
                msg = self.chan.recv()
            except (ChannelClosed, OSError):
                chan_open = False
                continue
            if msg[0] == "migrate":
                ok = self.migrate_out(msg[1])
                if ok:
                    self.moved_to = str(msg[1].get("target", ""))
                    self._stop_warm.set()
                    self.kill()
                    return "migrated"
            elif msg[0] == "prepare":
                self.chan.send({"status": "ok"})
                self.prepare(list(msg[1].get("targets", [])))
            else:
                self.chan.send({"status": "failed", "error": f"unknown request {msg[0]!r}"})

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)  # PID 1 of its namespace: the whole tree ends
        except ProcessLookupError:
            pass
        if self.popen is not None:
            self.popen.wait()
        else:
            try:
                os.waitpid(self.pid, 0)
            except ChildProcessError:
                pass
        self.returncode = self.returncode if self.returncode is not None else -9
        self.chan.close()

    def migrate_out(self, req: dict) -> bool:
        from gym_fork.criu.status import criu_status, dump_size_bound, log_tail, new_client

        target = req.get("target", "")
        t_freeze = time.time()
        tl: dict[str, float] = {}
        tmp = sessiondir.private_mkdir(os.path.join(sessiondir.session_dir(), f"job-{os.urandom(4).hex()}"))
        images = sessiondir.private_mkdir(os.path.join(tmp, "images"))
        # resolve (Ray targets), connect + authenticate while CRIU dumps (off the critical path)
        conn = wire.in_background(self._connect, target)
        sock = None
        # CRIU dumps the tree in a thread while the images are streamed as CRIU writes them
        # (wire.send_images_while_dumping): dump and transfer overlap.
        st = criu_status()
        done, failed = threading.Event(), threading.Event()
        dump_error: list[BaseException] = []
        limit = dump_size_bound(self.pid, tree=True)

        def dump() -> None:
            dfd = os.open(images, os.O_DIRECTORY)
            try:
                c = new_client(st.binary)
                c.opts.images_dir_fd = dfd
                c.opts.log_file = "dump.log"
                c.opts.log_level = 2
                c.opts.pid = self.pid
                c.opts.leave_running = True
                c.opts.external.append(f"unix[{self.ino}]")
                c.dump()
            except Exception as e:  # noqa: BLE001 - reported by the streaming side
                dump_error.append(MigrationError(
                    f"CRIU dump of the job failed ({e}): {log_tail(os.path.join(images, 'dump.log'))}"))
                failed.set()
            finally:
                os.close(dfd)
                tl["dump_s"] = time.time() - t_freeze
                done.set()

        dumper = threading.Thread(target=dump, daemon=True, name="gym_fork-job-dump")
        dumper.start()
        try:
            t0 = time.time()
            sock, hello, token = conn.result()
            tl["connect_wait_s"] = time.time() - t0
            tl["prewarmed"] = float(self.prewarmed)
            tl.update(getattr(self, "connect_timing", {}))
            key = wire.bundle_key(token)
            import platform

            def trailer(digests: dict) -> dict:
                t1 = time.time()
                base = {"format": 1, "kind": "job", "ino": self.ino, "source": self.node, "t_freeze": t_freeze,
                        "criu_version": st.version, "machine": platform.machine(), "files": _job_files(images),
                        "info": {k: v for k, v in req.items() if isinstance(v, (int, float, str))}}
                tl["pack_s"] = time.time() - t1
                meta = dict(base, images=digests, session=hello["nonce"], timeline=tl)  # dump_s is known now
                meta["hmac"] = keys.sign(_canonical(meta), key)
                return meta

            t0 = time.time()
            try:
                reply, nbytes = wire.send_images_while_dumping(
                    sock, {"op": "job", "t_freeze": t_freeze, "timeline": tl}, images, target, trailer,
                    done, failed, limit)
            except ValueError:
                if dump_error:
                    raise dump_error[0] from None
                raise
            finally:
                sock.close()
            tl["transfer_restore_s"] = time.time() - t0
            if not reply.get("ok"):
                raise RemoteRestoreError(f"{hello.get('node')!r} at {target} did not restore the job: "
                                         f"{reply.get('error')}: {reply.get('message')}", reply.get("error", ""))
            log.info("job %d moved to %s (%s): %d bytes, dump %.3fs (streamed meanwhile), transfer+restore %.3fs",
                     self.pid, hello.get("node"), target, nbytes, tl["dump_s"], tl["transfer_restore_s"])
            return True
        except Exception as e:  # noqa: BLE001 - the job continues; tell it why
            if sock is None:
                conn.discard()
            log.warning("migration of job %d to %s failed: %s: %s", self.pid, target, type(e).__name__, e)
            try:
                self.chan.send({"status": "failed", "error": f"{type(e).__name__}: {e}", "target": target})
            except OSError:
                pass
            return False
        finally:
            dumper.join()
            shutil.rmtree(tmp, ignore_errors=True)

    def prepare(self, targets: list[str]) -> None:
        """Keep the job hosts of the ``ray:`` targets warm (a thread: connect to Ray once, start
        each host, refresh its address -- which also keeps it from idling out -- every third of
        its idle limit) until the job moves or ends."""
        from gym_fork.ray.node import parse_job_target

        nids = []
        for t in targets:
            try:
                nid = parse_job_target(t)
            except ValueError:
                continue
            if nid is not None and nid not in nids:
                nids.append(nid)
        if nids and not self._warm_ready:
            self._warm_ready.update({nid: threading.Event() for nid in nids})
            threading.Thread(target=self._keep_warm, args=(nids,), daemon=True, name="gym_fork-warm").start()

    def _keep_warm(self, nids: list[str]) -> None:
        from gym_fork.ray.migration import JOB_HOST_IDLE_ENV, connect_ray, job_host_for

        period = max(0.5, float(os.environ.get(JOB_HOST_IDLE_ENV, "60")) / 3)
        try:
            connect_ray(self.ray_address)
        except Exception as e:  # noqa: BLE001 - a move there reports it
            log.info("keeping Ray job hosts warm: %s", e)
            for nid in nids:
                self._warm_ready[nid].set()
            return
        import ray

        while not self._stop_warm.is_set() and not self._exited():
            # all hosts start at once; each node is ready as soon as its own host answers
            refs = {}
            for nid in nids:
                try:
                    refs[nid] = job_host_for(nid).job_address.remote()
                except Exception as e:  # noqa: BLE001
                    log.info("keeping Ray node %s's job host warm: %s", nid, e)
            for nid in nids:
                try:
                    if nid in refs:
                        self._warm[nid] = ray.get(refs[nid], timeout=60)
                except Exception as e:  # noqa: BLE001 - a move there resolves (and reports) it again
                    self._warm.pop(nid, None)
                    log.info("keeping Ray node %s's job host warm: %s", nid, e)
                self._warm_ready[nid].set()
            self._stop_warm.wait(period)

    def _connect(self, target: str) -> tuple[socket.socket, dict, bytes]:
        """Connect and authenticate to ``target``: an agent's ``host:port``, or ``ray:<node id>``
        (that node's migration host, found through Ray from here: the supervisor; already known
        when the job prepared its route)."""
        from gym_fork.ray.node import parse_job_target

        nid = parse_job_target(target)
        if nid is not None:
            from gym_fork.ray.migration import job_host_address, resolve_token

            token = resolve_token(self.token)  # the hosts' rule: explicit/env token, else the HMAC key's
            t0 = time.time()
            if nid in self._warm_ready:  # being warmed right now: that is the same work, wait for it
                self._warm_ready[nid].wait(60.0)
            warm = self._warm.get(nid)
            if warm is not None:
                try:
                    t1 = time.time()
                    sock, hello = wire.connect(warm, token)
                    self.prewarmed = True
                    self.connect_timing = {"warm_wait_s": t1 - t0, "handshake_s": time.time() - t1}
                    return sock, hello, token
                except MigrationError:
                    pass  # the host went away meanwhile: ask Ray again
            address = job_host_address(nid, self.ray_address)
            sock, hello = wire.connect(address, token)
            return sock, hello, token
        if not self.token:
            raise MigrationError(f"no token to authenticate to the agent at {target}: start `gym-fork run` "
                                 "with --token-file or $GYM_FORK_TOKEN")
        sock, hello = wire.connect(target, self.token, tls=self.tls, netns=self.netns)
        return sock, hello, self.token


def _canonical(meta: dict) -> bytes:
    return json.dumps({k: v for k, v in meta.items() if k != "hmac"}, sort_keys=True).encode()


# --- receiving side: an agent, or a Ray node's migration host ----------------------------------------
def receive_job(site: Any, conn: socket.socket, req: dict, who: str) -> None:
    """Receive, verify and restore the job checkpoint streamed on ``conn`` (after the handshake;
    ``req["_session"]`` is this connection's nonce), tell the *restored* job it arrived, confirm
    to the source, then supervise the job with a :class:`JobHost` in a thread (it can move on).

    ``site`` is where the job will run: a :class:`~gym_fork.migration.agent.Agent`, or the job
    site of a Ray node's :class:`~gym_fork.ray.migration.MigrationHost`. It provides ``token``,
    ``key`` (:func:`wire.bundle_key` of the token), ``node``, ``receive_bundle(conn, req, who)``,
    ``_lock`` and ``hosted`` (pid -> JobHost while the job runs here), and optionally ``log`` (a
    logger), ``ray_address`` (for onward ``ray:`` hops), ``job_restored(pid)`` (right after the
    restore, before the job runs on; raising refuses the checkpoint and kills the restored job)
    and ``job_ended(host, how)``.
    """
    import threading

    from gym_fork.snapshots.bundle import check_compatible
    from gym_fork.criu.status import criu_status, log_tail, new_client

    site_log = getattr(site, "log", None) or logging.getLogger("gym_fork.agent")
    d = None
    try:
        try:
            d, timings, streamed = site.receive_bundle(conn, req, who)
        except EOFError as e:
            site_log.warning("%s: %s; nothing restored", who, e)
            return
        t0 = time.time()
        path = os.path.join(d, "bundle")
        if streamed is not None:
            meta = streamed["meta"]
        else:
            try:
                with open(os.path.join(path, "job.json")) as f:
                    meta = json.load(f)
            except (OSError, ValueError) as e:
                raise MigrationError(f"the job checkpoint has no readable job.json: {e}") from e
        if not keys.verify(_canonical(meta), meta.get("hmac", ""), site.key):
            raise MigrationError(f"the job checkpoint's HMAC does not verify with the token of {site.node}; "
                                 "nothing restored")
        check_compatible(meta, path)
        images = os.path.join(path, "images")
        if streamed is not None:  # hashed on receipt; signed for this connection only
            if not hmac.compare_digest(str(meta.get("session", "")), req["_session"]):
                raise MigrationError("the job checkpoint was signed for another session (replayed?); nothing restored")
            sessiondir.verify_received(streamed["digests"], meta["images"], "the job checkpoint")
        elif sessiondir.verify(images, full=True)["files"] != meta["images"]:
            raise MigrationError("the job's image manifest does not match job.json")
        timings["verify_s"] = time.time() - t0
        t0 = time.time()
        ours, theirs = socket.socketpair()
        new_ino = socket_inode(theirs.fileno())
        os.set_inheritable(theirs.fileno(), True)
        dfd = os.open(images, os.O_DIRECTORY)
        try:
            c = new_client(criu_status().binary)
            c.opts.images_dir_fd = dfd
            c.opts.log_file = "restore.log"
            c.opts.log_level = 2
            c.opts.rst_sibling = True
            x = c.opts.inherit_fd.add()
            x.key = f"socket:[{meta['ino']}]"
            x.fd = theirs.fileno()
            try:
                pid = c.restore().pid
            except Exception as e:  # noqa: BLE001
                ours.close()
                raise MigrationError(f"CRIU restore of the job failed ({e}): {log_tail(os.path.join(images, 'restore.log'))}") from e
        finally:
            theirs.close()
            os.close(dfd)
        restored = getattr(site, "job_restored", None)
        if restored is not None:
            try:
                restored(pid)
            except BaseException:
                ours.close()
                _kill_and_reap(pid)
                raise
        timings["restore_s"] = time.time() - t0
    except Exception as e:  # noqa: BLE001
        site_log.warning("%s: job checkpoint refused/failed: %s: %s", who, type(e).__name__, e)
        try:
            wire.send_msg(conn, {"ok": False, "error": type(e).__name__, "message": str(e)})
        except OSError:
            pass
        return
    finally:
        if d:
            shutil.rmtree(d, ignore_errors=True)
    chan = Channel(ours)
    host = JobHost(chan, pid, new_ino, token=site.token, node=site.node, ray_address=getattr(site, "ray_address", None))
    ended = getattr(site, "job_ended", None)
    arrived = {"status": "arrived", "node": site.node, "source": meta.get("source"), "t_freeze": meta["t_freeze"],
               "t_resume": time.time(), "bytes": timings["bytes"], "timeline": {**req.get("timeline", {}), **meta.get("timeline", {}), **timings}}
    try:
        chan.send(arrived)  # the restored job continues now
    except OSError as e:
        host.kill()
        if ended is not None:
            ended(host, "refused")
        wire.send_msg(conn, {"ok": False, "error": "RestoreError", "message": f"the restored job did not take its reply: {e}"})
        return
    with site._lock:
        site.hosted[pid] = host
    try:
        wire.send_msg(conn, {"ok": True, "node": site.node, "pid": pid, "timings": timings})
    except OSError:
        pass  # the source is gone; the job runs here anyway (it was told it arrived)
    site_log.info("%s: job restored as pid %d from %s", who, pid, meta.get("source"))

    def supervise() -> None:
        how = host.serve()
        with site._lock:
            site.hosted.pop(pid, None)
        site_log.info("job %d %s (code %s)", pid, how, host.returncode)
        if ended is not None:
            ended(host, how)

    threading.Thread(target=supervise, daemon=True, name=f"job-{pid}").start()


agent_receive_job = receive_job  # the agent's name for it (``op="job"``)


def _kill_and_reap(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)  # PID 1 of its namespace: the whole tree ends
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


# --- `gym-fork run` ---------------------------------------------------------------------------------
def supervise(cmd: list[str], *, node: str, log_dir: str, token: bytes | None, tls_ca: str | None = None,
              ray_address: str | None = None) -> int:
    """Run ``cmd`` as a managed job (``gym-fork run``): its own session, stdio in O_APPEND logs,
    a control channel for migration requests. Returns the job's exit status (0 once it moved)."""
    os.makedirs(log_dir, exist_ok=True)
    out = open(os.path.join(os.path.abspath(log_dir), "stdout.log"), "ab")  # O_APPEND: pitfall 14
    err = open(os.path.join(os.path.abspath(log_dir), "stderr.log"), "ab")
    ours, theirs = socket.socketpair()
    ino = socket_inode(theirs.fileno())
    env = dict(os.environ, **{CONTROL_ENV: str(theirs.fileno()), "GYM_FORK_NODE": node})
    popen = subprocess.Popen([sys.executable, "-S", "-c", _LAUNCHER, *cmd], pass_fds=[theirs.fileno()],
                             stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True, env=env)
    theirs.close()
    out.close()
    err.close()
    pid = None
    deadline = time.monotonic() + 10
    while pid is None and time.monotonic() < deadline:
        try:
            with open(f"/proc/{popen.pid}/task/{popen.pid}/children") as f:
                kids = f.read().split()
            pid = int(kids[0]) if kids else None
        except OSError:
            break
        if pid is None:
            time.sleep(0.005)
    if pid is None:
        rc = popen.wait()
        print(f"gym-fork run: the job did not start (launcher exit {rc})", file=sys.stderr)
        return 1
    print(f"gym-fork run: job pid {pid} on node {node}", flush=True)

    def forward(sig, _f):  # SIGUSR1 to the supervisor = SIGUSR1 to the job (a migration trigger)
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass

    signal.signal(signal.SIGUSR1, forward)
    host = JobHost(Channel(ours), pid, ino, token=token, node=node, popen=popen, tls=tls_ca or False,
                   ray_address=ray_address)
    how = host.serve()
    if how == "migrated":
        where = host.moved_to or ""
        what = f"Ray node {where[4:]}" if where.startswith("ray:") else f"the target agent ({where})"
        print(f"gym-fork run: the job now runs on {what}; this supervisor exits", flush=True)
        return 0
    return host.returncode if host.returncode is not None else 1

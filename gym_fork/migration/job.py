"""Supervising a managed job: ``gym-fork run`` starts it, a :class:`JobHost` serves its control
channel and, when asked, moves the whole job tree to a target while the job waits.

A move: CRIU dumps the job's tree (``leave_running``; the job stays blocked in ``recv`` on its
control channel, an external ``unix[INO]``) while the images are streamed to the target as CRIU
writes them; then the signed job metadata follows. The target verifies everything, restores the
tree with a fresh control socket, tells the *restored* job it arrived and only then confirms to
us; we then kill the source job. On any failure the source job is told why and trains on.
"""

from __future__ import annotations

import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time

from gym_fork.criu import client as criu_client
from gym_fork.criu.images import mapped_files
from gym_fork.criu.status import criu_status, dump_size_bound, log_tail
from gym_fork.errors import MigrationError, RemoteRestoreError
from gym_fork.migration.control import CONTROL_ENV
from gym_fork.migration.targets import TargetContext, Targets
from gym_fork.migration.wire.auth import bundle_key
from gym_fork.migration.wire.connect import Background
from gym_fork.migration.wire.streams import DumpThread, send_images
from gym_fork.snapshots import sessiondir
from gym_fork.snapshots.bundle import bundle_meta, sign_meta
from gym_fork.worker.channel import Channel, ChannelClosed, socket_inode

log = logging.getLogger("gym_fork.job")

# The launcher: a new PID namespace whose init is the job (so one SIGKILL ends the whole tree and
# CRIU dumps it as one tree), in its own session.
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


def _dump_tree(images: str, pid: int, ino: int) -> None:
    """CRIU dump of the job's whole tree into ``images``, leaving it running (the control socket
    ``ino`` is external: its peer stays with us). Raises MigrationError."""
    try:
        # (streamed while CRIU writes: one try, see criu_client.dump)
        criu_client.dump(pid, images, leave_running=True, external=[f"unix[{ino}]"], retry=False)
    except Exception as e:  # noqa: BLE001 - pycriu's errors, TimeoutError
        raise MigrationError(f"CRIU dump of the job failed ({e}): {log_tail(os.path.join(images, 'dump.log'))}") from e


class JobHost:
    """Supervises one job process (PID 1 of its namespace) over its control channel.

    Args:
        chan: the supervisor's end of the job's control channel.
        pid: the job's pid (here).
        ino: the inode of the job's end of the channel (an external socket for CRIU).
        token: the agents' shared token (None: agents cannot be targets).
        node: this node's name (the job's ``source`` when it moves on).
        popen: the launcher, when this process started the job.
        targets: how to reach targets (default: a :class:`TargetContext` with ``token``).
    """

    def __init__(self, chan: Channel, pid: int, ino: int, *, token: bytes | None, node: str,
                 popen: subprocess.Popen | None = None, targets: TargetContext | None = None):
        self.chan, self.pid, self.ino = chan, pid, ino
        self.token, self.node, self.popen = token, node, popen
        self.targets = Targets(targets or TargetContext(token=token))
        self.returncode: int | None = None
        self.moved_to: str | None = None  # the target, once the job runs there

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
        """Answer the job's requests until it exits (returns ``"exited"``) or moved away
        (``"migrated"``)."""
        try:
            return self._serve()
        finally:
            self.targets.close()

    def _serve(self) -> str:
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
                if self.migrate_out(msg[1]):
                    self.moved_to = str(msg[1].get("target", ""))
                    self.kill()
                    return "migrated"
            elif msg[0] == "prepare":
                self.chan.send({"status": "ok"})
                self.targets.prepare(list(msg[1].get("targets", [])))
            else:
                self.chan.send({"status": "failed", "error": f"unknown request {msg[0]!r}"})

    def kill(self) -> None:
        """SIGKILL the job (PID 1 of its namespace: the whole tree ends) and reap it."""
        try:
            os.kill(self.pid, signal.SIGKILL)
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
        """Move the job to ``req["target"]``. Returns True once the target confirmed (the caller
        then kills the source); False after telling the job why not (it trains on)."""
        target = req.get("target", "")
        t_freeze = time.time()
        tl: dict[str, float] = {}
        tmp = sessiondir.private_mkdir(os.path.join(sessiondir.session_dir(), f"job-{os.urandom(4).hex()}"))
        images = sessiondir.private_mkdir(os.path.join(tmp, "images"))
        # resolve the target, connect and authenticate while CRIU dumps (off the critical path)
        conn = Background(lambda: self.targets.connect(target), close=lambda c: c.sock.close())
        sock = None
        # CRIU dumps the tree in a thread while the images are streamed as it writes them
        st = criu_status()
        limit = dump_size_bound(self.pid, tree=True)

        def dumped() -> None:
            tl["dump_s"] = time.time() - t_freeze

        dumper = DumpThread(lambda: _dump_tree(images, self.pid, self.ino), on_end=dumped, name="gym_fork-job-dump")
        try:
            t0 = time.time()
            c = conn.result()
            sock = c.sock
            tl["connect_wait_s"] = time.time() - t0
            tl["prewarmed"] = float(c.prewarmed)
            tl.update(c.timings)
            key = bundle_key(c.token)

            def trailer(digests: dict) -> dict:
                t1 = time.time()
                files = mapped_files(images, skip_append=True)  # its logs grow: not compared
                tl["pack_s"] = time.time() - t1
                info = {k: v for k, v in req.items() if isinstance(v, (int, float, str))}
                return sign_meta(bundle_meta(None, kind="job", ino=self.ino, source=self.node, t_freeze=t_freeze,
                                             criu_version=st.version, files=files, info=info, images=digests,
                                             session=c.hello["nonce"], timeline=tl), key)  # dump_s is known now

            t0 = time.time()
            try:
                reply, nbytes = send_images(sock, {"op": "job", "t_freeze": t_freeze, "timeline": tl}, images,
                                            target, trailer, dumper.done, dumper.failed, limit)
            except ValueError:
                dumper.raise_error()
                raise
            finally:
                sock.close()
            tl["transfer_restore_s"] = time.time() - t0
            if not reply.get("ok"):
                raise RemoteRestoreError(f"{c.hello.get('node')!r} at {target} did not restore the job: "
                                         f"{reply.get('error')}: {reply.get('message')}", reply.get("error", ""))
            log.info("job %d moved to %s (%s): %d bytes, dump %.3fs (streamed meanwhile), transfer+restore %.3fs",
                     self.pid, c.hello.get("node"), target, nbytes, tl["dump_s"], tl["transfer_restore_s"])
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


def supervise(cmd: list[str], *, node: str, log_dir: str, token: bytes | None,
              targets: TargetContext | None = None) -> int:
    """Run ``cmd`` as a managed job (``gym-fork run``): in a new PID namespace and session, stdio
    in O_APPEND logs (the supervisor owns the files, so the job's tree holds nothing CRIU could
    not move), with a control channel for migration requests.

    Returns:
        The job's exit status; 0 once it moved away.
    """
    os.makedirs(log_dir, exist_ok=True)
    out = open(os.path.join(os.path.abspath(log_dir), "stdout.log"), "ab")  # O_APPEND: a moved job appends
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
    host = JobHost(Channel(ours), pid, ino, token=token, node=node, popen=popen, targets=targets)
    how = host.serve()
    if how == "migrated":
        print(f"gym-fork run: the job now runs on {host.targets.describe(host.moved_to or '')}; "
              "this supervisor exits", flush=True)
        return 0
    rc = host.returncode if host.returncode is not None else 1
    if rc != 0:  # its stderr is in a log file: say so, with the lines that tell why
        err_log = os.path.join(os.path.abspath(log_dir), "stderr.log")
        print(f"gym-fork run: the job exited with code {rc}; the end of {err_log}:\n"
              f"{_last_lines(err_log, 8)}", file=sys.stderr, flush=True)
    return rc


def _last_lines(path: str, n: int) -> str:
    """The last ``n`` lines of a log that may be large (a long training's): its last 16 KiB."""
    try:
        with open(path, "rb") as f:
            f.seek(max(f.seek(0, os.SEEK_END) - (16 << 10), 0))
            text = f.read().decode(errors="replace")
    except OSError:
        return f"(no log at {path})"
    return "\n".join(text.rstrip("\n").splitlines()[-n:]) or "(empty)"

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
from gym_fork.migration.wire.messages import recv_msg, send_msg
from gym_fork.migration.wire.streams import DumpThread, send_images
from gym_fork.snapshots import sessiondir
from gym_fork.snapshots.bundle import bundle_meta, sign_meta
from gym_fork.worker.channel import Channel, ChannelClosed, socket_inode

log = logging.getLogger("gym_fork.job")

# The launcher: a new PID namespace whose init is the job (so one SIGKILL ends the whole tree and
# CRIU dumps it as one tree), in its own session.  As PID 1 of its namespace the job gets only the
# signals it has a handler for (the kernel drops the others, even SIGTERM from outside), so the
# launcher relays SIGTERM/SIGINT/SIGHUP: to the job when it catches the signal, by ending it
# (SIGKILL) when it would have had the default action (terminate), not at all when it ignores it.
# It exits the way the job did: a signal death is re-raised (as the relayed signal when it ended
# the job for one), so the supervisor's Popen.returncode says e.g. -9 or -15.
_LAUNCHER = """
import ctypes, os, resource, signal, sys
if ctypes.CDLL(None, use_errno=True).unshare(0x20000000) != 0:
    sys.stderr.write("gym-fork run: unshare(CLONE_NEWPID) failed: %s\\n" % os.strerror(ctypes.get_errno()))
    os._exit(125)
pid = 0
ended_for = []
def relay(sig, _frame):
    if pid <= 0:
        return
    try:
        with open("/proc/%d/status" % pid) as f:
            masks = dict(line.split(":", 1) for line in f if line.startswith(("SigIgn", "SigCgt")))
        caught, ignored = (int(masks[k], 16) >> (sig - 1) & 1 for k in ("SigCgt", "SigIgn"))
    except (OSError, KeyError, ValueError):
        caught, ignored = 1, 0
    try:
        if caught:
            os.kill(pid, sig)
        elif not ignored:
            ended_for.append(sig)
            os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(s, relay)
pid = os.fork()
if pid == 0:
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, signal.SIG_DFL)
    os.setsid()
    os.execvp(sys.argv[1], sys.argv[1:])
_, st = os.waitpid(pid, 0)
for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(s, signal.SIG_IGN)
if os.WIFSIGNALED(st):
    sig = os.WTERMSIG(st)
    if sig == signal.SIGKILL and ended_for:
        sig = ended_for[0]
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # the job's core (if any) is its own, not ours
    if sig not in (signal.SIGKILL, signal.SIGSTOP):
        signal.signal(sig, signal.SIG_DFL)
    os.kill(os.getpid(), sig)
os._exit(os.waitstatus_to_exitcode(st) & 0xFF)
"""

#: how long the source waits for the target's verdict once the images are sent (its restore of
#: a large job takes long); the job is paused meanwhile, and a target that never answers is given
#: up (the target then gets no commit, and stops its restored copy)
VERDICT_TIMEOUT_S = 300.0

# The signals that make `gym-fork run` stop its job, and how long the job then has before SIGKILL.
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
STOP_TIMEOUT_S = 10.0


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
        self.stops: list[int] = []  # signals asking to stop the job (`gym-fork run`'s handlers add them)

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
        """Answer the job's requests until it exits (returns ``"exited"``), moved away
        (``"migrated"``) or a signal in ``stops`` asks to stop it (``"stopped"``; see :func:`stop_job`)."""
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
            if self.stops:
                return "stopped"
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

    def _commit(self, sock: socket.socket, target: str) -> None:
        """Tell the target, whose restored copy of the job waits, that the move is committed: from
        here on this source stops, whatever it hears back (one copy runs, never two: a copy the
        commit did not reach is stopped there). A missing acknowledgement is logged loudly."""
        try:
            send_msg(sock, {"commit": True})
        except OSError as e:  # not sent: the target stops its copy, and so do we: said loudly
            log.error("job %d: the commit to %s could not be sent (%s); the target stops its restored copy when "
                      "it hears none, and this source stops too: check %s for the job", self.pid, target, e, target)
            return
        try:
            ack = recv_msg(sock)
        except (OSError, EOFError) as e:
            ack = {"committed": None, "message": f"{type(e).__name__}: {e}"}
        if not (isinstance(ack, dict) and ack.get("committed") is True):
            log.error("job %d: %s did not acknowledge the commit (%s); the job runs there if the commit arrived, "
                      "else nowhere: check %s", self.pid, target, ack, target)

    def migrate_out(self, req: dict) -> bool:
        """Move the job to ``req["target"]``. Returns True once the target confirmed (the caller
        then kills the source); False after telling the job why not (it trains on)."""
        target = req.get("target", "")
        t_freeze = time.time()
        tl: dict[str, float] = {}
        tmp = os.path.join(sessiondir.session_dir(), f"job-{os.urandom(4).hex()}")
        images = os.path.join(tmp, "images")
        # resolve the target, connect and authenticate while CRIU dumps (off the critical path)
        conn = Background(lambda: self.targets.connect(target), close=lambda c: c.sock.close())
        sock = None
        dumper = None

        def dumped() -> None:
            tl["dump_s"] = time.time() - t_freeze

        try:
            # inside the try: the directories are removed whatever fails after they were made,
            # and a failure to size the dump is the job's "failed" answer (it trains on), not
            # the supervisor's exception
            sessiondir.private_mkdir(tmp)
            sessiondir.private_mkdir(images)
            st = criu_status()
            limit = dump_size_bound(self.pid, tree=True)
            # CRIU dumps the tree in a thread while the images are streamed as it writes them
            dumper = DumpThread(lambda: _dump_tree(images, self.pid, self.ino), on_end=dumped,
                                name="gym_fork-job-dump")
            t0 = time.time()
            c = conn.result()
            sock = c.sock
            sock.settimeout(VERDICT_TIMEOUT_S)  # (the connect timeout was for the handshake)
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
                tl["transfer_restore_s"] = time.time() - t0
                if not reply.get("ok"):
                    raise RemoteRestoreError(f"{c.hello.get('node')!r} at {target} did not restore the job: "
                                             f"{reply.get('error')}: {reply.get('message')}", reply.get("error", ""))
                if reply.get("commit") == "wanted":
                    self._commit(sock, target)
            except ValueError:
                dumper.raise_error()
                raise
            finally:
                sock.close()
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
            if dumper is not None:
                dumper.join()
            shutil.rmtree(tmp, ignore_errors=True)


def supervise(cmd: list[str], *, node: str, log_dir: str, token: bytes | None,
              targets: TargetContext | None = None, stop_timeout: float = STOP_TIMEOUT_S) -> int:
    """Run ``cmd`` as a managed job (``gym-fork run``): in a new PID namespace and session, stdio
    in O_APPEND logs (the supervisor owns the files, so the job's tree holds nothing CRIU could
    not move), with a control channel for migration requests.  SIGTERM, SIGINT or SIGHUP to this
    process stops the job (:func:`stop_job`, ``stop_timeout`` seconds before SIGKILL).

    Returns:
        The job's exit status (128 + the signal's number when a signal ended it, or when one
        asked this supervisor to stop it); 0 once it moved away; 1 when it could not start.
    """
    log_dir = os.path.abspath(log_dir)
    try:
        os.makedirs(log_dir, exist_ok=True)
        out = open(os.path.join(log_dir, "stdout.log"), "ab")  # O_APPEND: a moved job appends
        err = open(os.path.join(log_dir, "stderr.log"), "ab")
    except OSError as e:
        print(f"gym-fork run: cannot write the job's logs in {log_dir}: {e.strerror or e}; give --log-dir a "
              "directory you can create and write to", file=sys.stderr)
        return 1
    err_start = os.fstat(err.fileno()).st_size  # the log is appended to: this job's part starts here
    # Ask, don't raise: a signal is served between the job's requests (never in a migration's middle).
    stops: list[int] = []
    previous = {s: signal.signal(s, lambda sig, _f: stops.append(sig)) for s in _STOP_SIGNALS}
    try:
        return _supervise(cmd, node, log_dir, token, targets, stop_timeout, out, err, err_start, stops)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _supervise(cmd: list[str], node: str, log_dir: str, token: bytes | None, targets: TargetContext | None,
               stop_timeout: float, out, err, err_start: int, stops: list[int]) -> int:
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
    host.stops = stops
    how = host.serve()
    if how == "migrated":
        print(f"gym-fork run: the job now runs on {host.targets.describe(host.moved_to or '')}; "
              "this supervisor exits", flush=True)
        return 0
    if how == "stopped":
        return stop_job(host, stops, stop_timeout)
    rc = host.returncode if host.returncode is not None else 1
    if rc != 0:  # its stderr is in a log file: say so, with the lines that tell why
        err_log = os.path.join(log_dir, "stderr.log")
        print(f"gym-fork run: the job {_ended(rc)}; the end of {err_log}:\n"
              f"{_last_lines(err_log, 8, err_start)}", file=sys.stderr, flush=True)
    return 128 - rc if rc < 0 else rc  # a signal's death as the shell says it: 128 + its number


def _ended(rc: int) -> str:
    """How the job ended, from its Popen-style return code (-N: signal N)."""
    if rc >= 0:
        return f"exited with code {rc}"
    try:
        name = signal.Signals(-rc).name
    except ValueError:
        name = f"signal {-rc}"
    return f"was killed by {name} (exit status {128 - rc})"


def stop_job(host: JobHost, stops: list[int], timeout: float) -> int:
    """Stop the job because ``stops[0]`` (SIGTERM, SIGINT or SIGHUP) came to the supervisor: send
    it to the launcher, which relays it to the job (see ``_LAUNCHER``); SIGKILL the job when it
    still runs after ``timeout`` seconds or when another such signal comes.  Returns 128 + the
    signal's number, the shell's status for a command ended by that signal."""
    sig = stops[0]
    name = signal.Signals(sig).name
    popen = host.popen
    assert popen is not None
    print(f"gym-fork run: got {name}: stopping the job (pid {host.pid}): {name} sent to it, SIGKILL if it still "
          f"runs in {timeout:g} s", file=sys.stderr, flush=True)
    try:
        os.kill(popen.pid, sig)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + timeout
    while popen.poll() is None and time.monotonic() < deadline and len(stops) == 1:
        time.sleep(0.02)
    if popen.poll() is None:
        why = "another signal came" if len(stops) > 1 else f"it did not stop within {timeout:g} s"
        print(f"gym-fork run: {why}: killed the job (SIGKILL)", file=sys.stderr, flush=True)
        host.kill()
    host.chan.close()
    return 128 + sig


def _last_lines(path: str, n: int, start: int = 0) -> str:
    """The last ``n`` lines of a log that may be large (a long training's): its last 16 KiB,
    from offset ``start`` on (what this job wrote: the log is appended to, run after run)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(f.seek(0, os.SEEK_END) - (16 << 10), start))
            text = f.read().decode(errors="replace")
    except OSError:
        return f"(no log at {path})"
    return "\n".join(text.rstrip("\n").splitlines()[-n:]) or "(empty)"

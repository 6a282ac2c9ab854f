"""The CRIU backend: the env runs in a worker process; a snapshot is a CRIU checkpoint of it.

Invariants (see ARCHITECTURE.md):
* every worker is PID 1 of its own PID namespace (spawned through a small launcher that calls
  ``unshare(CLONE_NEWPID)``, or restored by CRIU, which creates a fresh namespace for a namespace init).  So one image can be
  restored any number of times, also while the original runs, with no PID clash;
* the worker's only link to us is one unix stream socket, dumped as external ``unix[INO]``
  and replaced with a fresh socketpair end on every restore (``inherit_fd``);
* a snapshot is taken only between requests (the worker is blocked in ``recv``), so no bytes
  are in flight in the channel; ``leave_running`` keeps the original going;
* the images are written aside and renamed into place with a checksum manifest; a restore
  verifies the manifest first.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from gym_fork import store
from gym_fork.backends.base import Backend, Handle, RemoteHandle
from gym_fork.criu_support import criu_status, log_tail, new_client
from gym_fork.errors import (
    BackendUnavailableError,
    CriuError,
    RestoreError,
    SnapshotCorruptedError,
    SnapshotError,
    WorkerDiedError,
    WorkerError,
)
from gym_fork.protocol import ERR, Channel, socket_inode
from gym_fork.server import EnvSource

RESTORE_TIMEOUT_S = 60.0


class CriuPayload:
    """Where a CRIU snapshot's images are, and the channel inode they expect."""

    __slots__ = ("path", "ino", "__weakref__")

    def __init__(self, path: str, ino: int):
        self.path = path
        self.ino = ino


class CriuBackend(Backend):
    name = "criu"

    def __init__(self, *, verify: str = "full", worker_log: str | None = None):
        st = criu_status()
        if not st.usable:
            raise BackendUnavailableError(
                "CRIU cannot be used here: " + "; ".join(st.reasons)
                + (". To fix: " + "; ".join(st.advice) if st.advice else "")
                + ". Run `gym-fork doctor` for details."
            )
        if verify not in ("full", "size"):
            raise ValueError(f"verify must be 'full' or 'size', not {verify!r}")
        self.binary: str = st.binary  # type: ignore[assignment]
        self.verify = verify
        self.worker_log = worker_log

    # --- start -----------------------------------------------------------------------------
    def start(self, source: EnvSource) -> tuple[Handle, dict]:
        ours, theirs = socket.socketpair()
        ino = socket_inode(theirs.fileno())
        out = open(self.worker_log, "ab") if self.worker_log else subprocess.DEVNULL  # O_APPEND: see pitfall 14
        try:
            popen = subprocess.Popen(
                [sys.executable, "-S", "-c", _PIDNS_LAUNCHER, str(theirs.fileno())],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                start_new_session=True, env=_worker_environ(),
            )
        finally:
            theirs.close()
            if out is not subprocess.DEVNULL:
                out.close()
        chan = Channel(ours)
        handle = RemoteHandle(chan, popen.pid, ino, popen=popen)
        try:
            meta = handle.request("init", source)
        except WorkerDiedError as e:
            raise WorkerDiedError(f"the env worker failed to start: {e}") from None
        except WorkerError:
            handle.kill()
            raise
        handle.pid = meta["pid"]  # the python inside the namespace, not `unshare`
        return handle, meta

    # --- snapshot --------------------------------------------------------------------------
    def snapshot(self, handle: Handle, snap_id: str) -> tuple[CriuPayload, int]:
        assert isinstance(handle, RemoteHandle)
        root = store.session_dir()
        tmp = store.private_mkdir(os.path.join(root, f".{snap_id}.tmp"))
        final = os.path.join(root, f"snap-{snap_id}")
        dfd = os.open(tmp, os.O_DIRECTORY)
        try:
            c = new_client(self.binary)
            c.opts.images_dir_fd = dfd
            c.opts.log_file = "dump.log"
            c.opts.log_level = 2
            c.opts.pid = handle.pid
            c.opts.leave_running = True
            c.opts.external.append(f"unix[{handle.ino}]")
            c.dump()
        except Exception as e:  # noqa: BLE001 - pycriu raises its own types; we wrap them all
            tail = log_tail(os.path.join(tmp, "dump.log"))
            shutil.rmtree(tmp, ignore_errors=True)
            raise SnapshotError(f"CRIU dump of worker {handle.pid} failed ({e}); the env keeps running.\n{tail}") from e
        finally:
            os.close(dfd)
        try:
            size = store.write_manifest(tmp, {"backend": "criu", "ino": handle.ino, "id": snap_id})
            store.commit(tmp, final)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise SnapshotError(f"could not store the snapshot images: {e}") from e
        return CriuPayload(final, handle.ino), size

    # --- restore ---------------------------------------------------------------------------
    def restore(self, payload: CriuPayload) -> Handle:
        self._verify(payload)
        return self._restore_verified(payload)

    def restore_many(self, payload: CriuPayload, n: int) -> list[Handle]:
        self._verify(payload)
        if n == 1:
            return [self._restore_verified(payload)]
        # Each restore is its own criu process and PID namespace; threads just wait on them.
        with ThreadPoolExecutor(max_workers=min(n, 16)) as pool:
            futs = [pool.submit(self._restore_verified, payload) for _ in range(n)]
            handles, errors = [], []
            for f in futs:
                try:
                    handles.append(f.result())
                except Exception as e:  # noqa: BLE001
                    errors.append(e)
        if errors:
            for h in handles:
                h.kill()
            raise errors[0]
        return handles

    def _verify(self, payload: CriuPayload) -> None:
        if not os.path.isdir(payload.path):
            raise SnapshotCorruptedError(f"snapshot images at {payload.path} are missing")
        store.verify(payload.path, full=self.verify == "full")

    def _restore_verified(self, payload: CriuPayload) -> Handle:
        ours, theirs = socket.socketpair()
        new_ino = socket_inode(theirs.fileno())
        os.set_inheritable(theirs.fileno(), True)  # criu swrk is fork+exec'd and must inherit it
        workdir = tempfile.mkdtemp(prefix="restore-", dir=store.session_dir())
        dfd = os.open(payload.path, os.O_DIRECTORY)
        wfd = os.open(workdir, os.O_DIRECTORY)
        try:
            c = new_client(self.binary)
            c.opts.images_dir_fd = dfd
            c.opts.work_dir_fd = wfd  # per restore: logs and stats of concurrent restores must not collide
            c.opts.log_file = "restore.log"
            c.opts.log_level = 2
            c.opts.rst_sibling = True  # the restored worker becomes our child: waitpid works
            fd = c.opts.inherit_fd.add()
            fd.key = f"socket:[{payload.ino}]"
            fd.fd = theirs.fileno()
            pid = c.restore().pid
        except Exception as e:  # noqa: BLE001
            ours.close()
            tail = log_tail(os.path.join(workdir, "restore.log"))
            raise RestoreError(f"CRIU restore from {payload.path} failed ({e}); the running env is unchanged.\n{tail}") from e
        finally:
            theirs.close()
            os.close(dfd)
            os.close(wfd)
            shutil.rmtree(workdir, ignore_errors=True)
        handle = RemoteHandle(Channel(ours), pid, new_ino, child=True)
        try:
            handle.request("ping")
        except WorkerDiedError as e:
            handle.kill()
            raise RestoreError(f"the restored worker did not answer: {e}") from e
        return handle

    def release(self, payload: CriuPayload) -> None:
        shutil.rmtree(payload.path, ignore_errors=True)


# Runs the worker as PID 1 of a new PID namespace and exits the way the worker did (a signal
# death is re-raised, so Popen.returncode says e.g. -9).  util-linux 2.38's `unshare --fork`
# cannot do that (its sigprocmask call fails), hence this.  `-S`: no site import, tiny process.
_PIDNS_LAUNCHER = """
import ctypes, os, signal, sys
if ctypes.CDLL(None, use_errno=True).unshare(0x20000000) != 0:  # CLONE_NEWPID
    sys.stderr.write("gym_fork: unshare(CLONE_NEWPID) failed: %s\\n" % os.strerror(ctypes.get_errno()))
    os._exit(125)
pid = os.fork()
if pid == 0:
    os.execv(sys.executable, [sys.executable, "-m", "gym_fork.worker"] + sys.argv[1:])
for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(s, signal.SIG_IGN)  # the worker decides; we only mirror its end
_, st = os.waitpid(pid, 0)
if os.WIFSIGNALED(st):
    sig = os.WTERMSIG(st)
    if sig not in (signal.SIGKILL, signal.SIGSTOP):
        signal.signal(sig, signal.SIG_DFL)
    os.kill(os.getpid(), sig)
os._exit(os.waitstatus_to_exitcode(st))
"""


def _worker_environ() -> dict[str, str]:
    env = dict(os.environ)
    # The worker must import modules exactly as we do (gym_fork even when not installed, and the
    # modules that define user env classes, e.g. a test file): hand it our sys.path.
    pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    paths = [pkg_root] + [p for p in sys.path if p and os.path.isdir(p)]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(var, "1")
    return env

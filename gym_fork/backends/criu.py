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

import errno
import functools
import os
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
import logging
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Sequence
from typing import Any

from gym_fork.backends.base import Backend, Handle, RemoteHandle
from gym_fork.criu import client
from gym_fork.criu.images import check_compatible, is_page_image, mapped_files, page_chunk_lengths
from gym_fork.criu.status import criu_status, log_tail
from gym_fork.interrupts import held
from gym_fork.errors import (
    BackendUnavailableError,
    BundleDamagedError,
    RestoreError,
    SnapshotCorruptedError,
    SnapshotError,
    WorkerDiedError,
    WorkerError,
    remote_exception,
)
from gym_fork.snapshots import sessiondir
from gym_fork.snapshots.bundle import check_field, check_images
from gym_fork.snapshots.files import is_no_space, no_space
from gym_fork.worker import cpus, exits
from gym_fork.worker.channel import OK, READY, Channel, ChannelClosed, recv_fds, send_fds, socket_inode
from gym_fork.worker.commands import EnvSource, pickled_modules
from gym_fork.worker.resources import Scan
from gym_fork.backends import netns, treecapture

RESTORE_TIMEOUT_S = 60.0
#: the time the copies left would spend (unpickling the policy all branches share, or importing
#: what their policies' pickles name) above which explore(policy_in_worker=True) clones its
#: branches from a copy that did it once (CriuBackend._clone_preloaded): a fork-tier snapshot of
#: that copy costs ~2-4 ms here; a policy whose module imports torch ~1.5 s a copy
PRELOAD_MIN_SAVING_S = 0.01
log = logging.getLogger("gym_fork")


def _is_ns_init(pid: int) -> bool:
    """Whether host pid ``pid`` is PID 1 of its namespace (a copy of an env that starts processes:
    see ``gym_fork.worker.loop._fork_copy_process``): stopping it must not kill its namespace."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"NSpid:"):
                    ids = line.split()
                    return len(ids) > 2 and ids[-1] == b"1"
    except OSError:
        pass
    return False


class CriuPayload:
    """Where a CRIU snapshot's images are, and the channel inode they expect."""

    __slots__ = ("path", "ino", "fork_tier", "owned", "netns", "__weakref__")

    def __init__(self, path: str, ino: int, fork_tier: bool = False, owned: bool = True, netns: bool = False):
        self.path = path
        self.ino = ino
        self.owned = owned  # False for a loaded bundle: release() must not delete the user's files
        self.fork_tier = fork_tier  # restored workers may take fork() snapshots (single-threaded)
        self.netns = netns  # the tree had a network namespace of its own: each restore gets a fresh one


def _runs(pid: int) -> bool:
    """Whether ``pid`` is a running process (not gone, not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


# why a copy-on-write snapshot can be lost, and how to keep one that is not
_FROZEN_GONE = ("A copy-on-write snapshot is a frozen process in its env worker's PID namespace: it ends when "
                "that namespace's first process does -- the env's original worker, until its first restore or "
                "fork -- e.g. when the env crashed or was killed, and when it is killed itself (the OOM killer). "
                "This snapshot was never persisted, so nothing of it is left; the env is unchanged. A snapshot that must outlive a crash of its env: snap.persist() (CRIU "
                "images on disk, restored from there once the frozen process is gone) or a SnapshotStore")


class ForkPayload:
    """A copy-on-write snapshot: a frozen process holding the state, and optionally its image.

    The frozen process offers a *ready* copy of itself unasked, between requests (see
    :func:`gym_fork.worker.loop.frozen_loop`): its channel arrives on ``chan`` as a ``READY``
    message with the fd, and is kept in ``ready`` until a restore takes it.
    """

    __slots__ = ("chan", "_pid", "image", "lock", "ready", "ready_pids", "spawned", "__weakref__")

    def __init__(self, chan: Channel, pid: int | None = None):
        self.chan: Channel | None = chan
        self._pid = pid
        self.image: CriuPayload | None = None  # set once persisted
        self.lock = threading.RLock()  # one request at a time on the frozen process's channel
        self.ready: list[Channel] = []  # channels of ready copies offered by the frozen process
        self.ready_pids: list[int | None] = []  # their host pids (their memory is the snapshot's)
        self.spawned = False  # the env had started processes: its copies are namespace inits

    @property
    def pid(self) -> int:
        """Host pid of the frozen process (asked for lazily: snapshot() need not wait for it)."""
        if self._pid is None:
            with self.lock:
                self._pid = self._request("ping")
        return self._pid

    def request_with_fd(self, cmd: str, fd: int) -> Any:
        with self.lock:
            return self._request(cmd, fd)

    def _request(self, cmd: str, fd: int | None = None) -> Any:
        if self.chan is None:
            raise WorkerDiedError("the snapshot's frozen process is gone")
        try:
            with held():  # (Ctrl-C between a request and its fd, or inside its reply, lost the snapshot)
                self.chan.send((cmd, ()))
                if fd is not None:
                    send_fds(self.chan.sock, b"F", [fd])
                reply = self._reply()
        except (ChannelClosed, OSError) as e:
            raise WorkerDiedError(f"the snapshot's frozen process{f' ({self._pid})' if self._pid else ''} died "
                                  f"during {cmd!r}") from e
        if reply[0] == OK:
            return reply[1]
        _, type_name, message, tb = reply
        raise remote_exception(type_name, message, tb)

    def clone_many(self, fds: Sequence[int], restoring: bool = True, reseed: bool = False) -> list[Any]:
        """One ``clone`` per descriptor, sent back to back (the frozen process forks them one after
        another while the copies made so far start on other CPUs), then every reply read in
        order: a result or the exception of each, so that the channel stays in step.
        ``restoring``: copies for a restore (the frozen process then keeps ready copies from now
        on), not a batch for ``fork()``. ``reseed``: each copy will be reseeded first (the frozen
        process then finds the env's generators once, for all its copies: ``EnvServer.generators``)."""
        with self.lock:
            if self.chan is None:
                raise WorkerDiedError("the snapshot's frozen process is gone")
            out: list[Any] = []
            try:
                with held():  # every request with its fd, every reply read: the channel stays in step
                    for fd in fds:
                        self.chan.send(("clone", (restoring, reseed)))
                        send_fds(self.chan.sock, b"F", [fd])
                    for _fd in fds:
                        reply = self._reply()
                        out.append(reply[1] if reply[0] == OK else remote_exception(*reply[1:]))
            except (ChannelClosed, OSError) as e:
                raise WorkerDiedError(f"the snapshot's frozen process{f' ({self._pid})' if self._pid else ''} died "
                                      "during 'clone'") from e
            return out

    def _reply(self) -> tuple:
        """The reply to the oldest request in flight; ready copies offered meanwhile are kept."""
        reply = self.chan.recv()
        while reply[0] == READY:
            self._keep_offer(reply[1])
            reply = self.chan.recv()
        return reply

    def _keep_offer(self, pid: int | None) -> None:
        _msg, fds = recv_fds(self.chan.sock, 1)
        for fd in fds[1:]:
            os.close(fd)
        if fds:
            self.ready.append(Channel.from_fd(fds[0]))
            self.ready_pids.append(pid)

    def collect(self) -> None:
        """Pick up the ready copies the frozen process has offered (never waits)."""
        with held():  # (an offer cut between its message and its fd: the next read hung)
            while self.chan is not None and select.select([self.chan.sock], [], [], 0)[0]:
                reply = self.chan.recv()
                if reply[0] != READY:
                    raise ChannelClosed("a frozen snapshot answered a request nobody made")
                self._keep_offer(reply[1])

    def take_ready(self) -> Channel | None:
        """The channel of a ready copy, if the frozen process has offered one (never waits).
        Tell the frozen process with :meth:`taken`, so it forks the next."""
        with self.lock:
            if self.chan is None:
                return None
            try:
                self.collect()
                if not self.ready:
                    return None
                self.ready_pids.pop()
                return self.ready.pop()
            except (ChannelClosed, OSError):
                return None  # the caller's clone request reports the frozen process's end

    def taken(self, pid: int | None) -> None:
        """Tell the frozen process its ready copy is in use (host ``pid``: the next ready copy
        faults in what that one touches), so it forks the next. A notice: no reply."""
        with self.lock, held():
            if self.chan is not None:
                try:
                    self.chan.send(("taken", (pid,) if pid else ()))
                except OSError:
                    pass  # gone: the next clone request says so

    def close(self) -> None:
        """End the frozen process and its ready copies (each exits on EOF)."""
        with self.lock:
            if self.chan is not None:
                self.chan.close()
                self.chan = None
            for ch in self.ready:
                ch.close()
            self.ready.clear()
            self.ready_pids.clear()


# What losing the fork tier costs, for the warnings that say so.
DUMP_COST = (" (each snapshot and restore then takes a CRIU dump or restore of the process: tens to hundreds "
             "of milliseconds and images the size of its memory, instead of a copy-on-write fork() in about a "
             "millisecond)")


class CriuBackend(Backend):
    """CRIU process snapshots, with a copy-on-write fork tier for in-memory snapshots.

    ``fork_tier``: ``"auto"`` (default) takes in-memory snapshots by ``fork()`` when the worker
    is single-threaded (milliseconds, memory shared copy-on-write) and writes CRIU images only
    when a snapshot is persisted; ``False`` always dumps with CRIU; ``True`` requires the tier.
    """

    name = "criu"
    storable = True

    def __init__(self, *, verify: str = "full", worker_log: str | None = None,
                 fork_tier: bool | str = "auto", allow_fork_only: bool = False, private_network: bool = False):
        st = criu_status()
        why = ("CRIU cannot be used here: " + "; ".join(st.reasons)
               + (". To fix: " + "; ".join(st.advice) if st.advice else "")
               + ". Run `gym-fork doctor` for details.")
        # mode: "root" (workers are PID-namespace inits, criu in the host namespaces), "userns"
        # (non-root: workers and criu inside the holder's user namespace, --unprivileged) or "fork"
        # (no CRIU at all: plain worker processes, copy-on-write fork() snapshots only).
        self.unavailable: str | None = None
        if st.usable and os.environ.get("GYM_FORK_CONTROL_FD"):
            # Inside a `gym-fork run` job: the job's PID namespace is checkpointed as a whole, and
            # CRIU cannot dump nested PID namespaces, so workers are plain children here and
            # snapshots are copy-on-write forks (which move with the job).
            if fork_tier is False:
                raise BackendUnavailableError(
                    "inside a `gym-fork run` job, env workers cannot have CRIU snapshots of their own "
                    "(CRIU cannot dump a job holding nested PID namespaces); use fork_tier='auto'")
            self.mode, self.unavailable = "fork", (
                "inside a `gym-fork run` job, env workers run without a PID namespace of their own (CRIU "
                "cannot dump nested PID namespaces, and the whole job must stay movable): snapshots are "
                "copy-on-write forks; persisting or saving one needs a worker outside a managed job")
        elif st.usable:
            self.mode: str = st.mode or "root"
        elif allow_fork_only and fork_tier is not False and hasattr(os, "fork"):
            self.mode, self.unavailable = "fork", why
        else:
            raise BackendUnavailableError(why)
        if verify not in ("full", "sha256", "size"):
            raise ValueError(f"verify must be 'full', 'sha256' or 'size', not {verify!r}")
        self.binary: str = st.binary  # type: ignore[assignment]
        self.verify = verify
        self.worker_log = worker_log
        if fork_tier not in ("auto", True, False):
            raise ValueError(f"fork_tier must be 'auto', True or False, not {fork_tier!r}")
        self.fork_tier = fork_tier
        if private_network and self.mode != "root":
            raise BackendUnavailableError(
                "private_network=True needs root (a network namespace per env worker, dumped and restored by "
                f"CRIU); this backend runs in {self.mode!r} mode")
        self.private_network = bool(private_network)

    # --- start -----------------------------------------------------------------------------
    def start(self, source: EnvSource, binds: Binds | None = None) -> tuple[Handle, dict]:
        """Start a worker building ``source``; with ``binds`` (root), in a mount namespace of its
        own where each ``(host dir, path)`` pair is bound (private directories)."""
        if binds and self.mode != "root":
            raise BackendUnavailableError("private directories need CRIU as root (mount namespaces)")
        nsfd = -1
        if self.private_network:  # the channel must belong to the worker's namespace (CRIU looks it up there)
            nsfd, (ours, theirs) = netns.new_netns()
        else:
            ours, theirs = socket.socketpair()
        ino = socket_inode(theirs.fileno())
        # "ab": CRIU restores a file that grew since the dump only when it is open for appending
        out = open(self.worker_log, "ab") if self.worker_log else subprocess.DEVNULL
        holder = ""
        if self.mode == "userns":  # the launcher joins the holder's namespaces, opens stdio there
            from gym_fork.criu.userns import get_holder

            holder = str(get_holder().pid)
        try:
            popen = subprocess.Popen(
                [sys.executable, "-S", "-c", _PIDNS_LAUNCHER, str(theirs.fileno()), self.mode, holder,
                 os.path.abspath(self.worker_log) if self.worker_log else "", sessiondir.session_dir(), str(nsfd),
                 *[p for pair in (binds or ()) for p in pair]],
                pass_fds=[theirs.fileno()] + ([nsfd] if nsfd >= 0 else []), stdin=subprocess.DEVNULL,
                stdout=out, stderr=out, start_new_session=True, env=_worker_environ(),
            )
        finally:
            theirs.close()
            if nsfd >= 0:
                os.close(nsfd)
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
        handle.pid = meta["pid"]  # the python inside the namespace, not the launcher
        handle.ns_root = self.mode != "fork"
        handle.fork_tier = self._use_fork_tier(meta)
        return handle, meta

    def _use_fork_tier(self, meta: dict) -> bool:
        if self.fork_tier is False:
            return False
        # fork() copies only the calling thread: other threads make it unsafe (torch's pools once
        # they run), not torch being imported.  A worker with torch imported but idle forks like any
        # other, and every fork first checks for threads (a CRIU dump of the whole tree instead
        # when there are some).  In fork-only mode there is no dump to fall back on, so torch counts.
        unsafe = meta.get("threads", 1) > 1 or bool(meta.get("torch_loaded") and self.mode == "fork")
        if unsafe and self.mode == "fork":
            # backends.start_env() hands such an env to the pickle backend where that is exact,
            # else refuses it at start-up; a direct start() gets the worker's own refusal later.
            return True
        if unsafe and self.fork_tier is True:
            raise BackendUnavailableError(
                f"fork_tier=True, but the env worker has {meta.get('threads')} threads"
                f"{' and torch loaded' if meta.get('torch_loaded') else ''}: fork() would deadlock "
                "their thread pools. Use fork_tier='auto' or False (CRIU dumps keep all threads)."
            )
        if unsafe:
            spec = meta.get("spec")
            log.warning("gym_fork: env %s: its worker has %s threads at start-up, so its snapshots are CRIU "
                        "dumps%s. To keep the fast path, keep the env single-threaded (OMP_NUM_THREADS=1, "
                        "torch.set_num_threads(1)); fork_tier=False chooses dumps without this warning",
                        getattr(spec, "id", None) or meta.get("unwrapped_type"), meta.get("threads"), DUMP_COST)
        return not unsafe

    def _private_net(self, pid: int) -> bool:
        """Whether worker ``pid`` runs in a network namespace of its own: started with
        ``private_network=True``, or restored from images of such a worker (a bundle loaded with
        ``load_snapshot``, a migrated env), whatever this backend object was created with."""
        return self.private_network or (self.mode == "root" and not netns.same_netns_as_us(pid))

    # --- snapshot --------------------------------------------------------------------------
    def snapshot(self, handle: Handle, snap_id: str, *,
                 ready_copy: bool = True) -> tuple[CriuPayload | ForkPayload, int]:
        """A fork-tier snapshot when ``fork()`` copies the worker exactly; else a CRIU dump of its
        whole process tree (one log line says why; later snapshots of this env are dumps too), or
        UncapturableStateError naming what nothing captures (see :mod:`.treecapture`).
        ``ready_copy``: whether a fork-tier snapshot forks a ready copy ahead of a restore."""
        assert isinstance(handle, RemoteHandle)
        if handle.fork_tier:
            found = self._fork_snapshot(handle, ready_copy)
            if isinstance(found, ForkPayload):
                treecapture.remember_frozen(handle, found)
                return found, 0
            moved = 0
            if found.ns_init and found.fork_processes and self.mode != "fork" and self.fork_tier is not True:
                found, moved = self._move_out_frozen(handle, found)
            treecapture.check_tree(found, criu_ok=self.mode != "fork", private_network=self._private_net(handle.pid),
                                   unavailable=self.unavailable, fork_tier_required=self.fork_tier is True,
                                   root=self.mode == "root")
            log.warning(treecapture.describe_switch(found, moved) + DUMP_COST)
            handle.fork_tier = False  # its tree holds no fork-tier process: the dumps from now on stay exact
            return self._dump(handle, snap_id, leave_running=True, scan=found)
        scan = Scan.from_wire(handle.request("resources"))
        treecapture.check_tree(scan, criu_ok=self.mode != "fork", private_network=self._private_net(handle.pid),
                               unavailable=self.unavailable, root=self.mode == "root")
        return self._dump(handle, snap_id, leave_running=True, scan=scan)

    def _move_out_frozen(self, handle: RemoteHandle, scan: Scan) -> tuple[Scan, int]:
        """The worker's tree must hold only the env's processes for a whole-tree dump: write its
        earlier in-memory snapshots as CRIU images and end their frozen processes (they restore
        from the images from now on), then scan again.  Only when that is all that stands in the
        way (the check passes without them); live clones (branches) in the tree stay and are
        refused by the check.  Returns the new scan and how many snapshots were moved."""
        treecapture.check_tree(Scan(scan.pid, scan.ns_init, scan.resources, [], scan.tree), criu_ok=True,
                               private_network=self._private_net(handle.pid))
        frozen = treecapture.frozen_of(handle)
        pids = {payload.pid for payload in frozen}
        for payload in frozen:
            self.persist(payload)
            self.evict(payload)
        deadline, last, same = time.monotonic() + 5.0, None, 0
        while True:  # the frozen processes and their spares exit on EOF; the worker reaps them
            scan = Scan.from_wire(handle.request("resources"))
            left = set(scan.fork_processes)
            same = same + 1 if left == last else 0
            # done: none left; or only others (live branches: the check refuses) and no change lately
            if not left or (not left & pids and same >= 3) or time.monotonic() > deadline:
                return scan, len(frozen)
            last = left
            time.sleep(0.02)

    def _fork_snapshot(self, handle: RemoteHandle, ready_copy: bool = True) -> ForkPayload | Scan:
        """A copy-on-write snapshot, or (no fork happened) what the worker found that ``fork()``
        cannot copy. ``ready_copy`` false: its frozen process forks no copy ahead of a restore
        until it is restored once (see :func:`gym_fork.worker.loop.frozen_loop`)."""
        ours, theirs = socket.socketpair()
        try:
            # (a local worker is told this process's CPU: it moves off it for the scan and the fork)
            cpu = cpus.current_cpu() if type(handle) is RemoteHandle else None
            found = handle.request_with_fd("fork_snapshot", theirs.fileno(), ready_copy, cpu)
        except WorkerError as e:
            ours.close()
            raise SnapshotError(f"fork snapshot failed: {e}; the env keeps running") from e
        finally:
            theirs.close()
        if found is not None:
            ours.close()
            return Scan.from_wire(found)
        payload = ForkPayload(Channel(ours))
        payload.spawned = bool(getattr(handle.chan, "spawned", False))  # told ahead of the reply
        handle._last_fork = weakref.ref(payload)  # (the worker forks it after its answer: see kill())
        return payload

    def _require_criu(self, what: str) -> None:
        if self.mode == "fork":
            raise BackendUnavailableError(
                f"{what} needs CRIU images, and CRIU is unavailable for this user (only copy-on-write "
                f"in-memory snapshots work): {self.unavailable}")

    def _dump(self, handle: RemoteHandle, snap_id: str, *, leave_running: bool,
              into: str | None = None, scan: Scan | None = None) -> tuple[CriuPayload, int]:
        """Dump into the session dir, checksummed and committed; or, with ``into`` (a new private
        dir), plain images only: no manifest, no fsync, no rename (transient images that are
        hashed while they are streamed, see :meth:`dump_transient`)."""
        self._require_criu("this snapshot" if leave_running else "persist()")
        root = sessiondir.session_dir()
        tmp = into or os.path.join(root, f".{snap_id}.tmp")
        final = os.path.join(root, f"snap-{snap_id}")
        try:
            # made inside the try, and removed by its path: Ctrl-C right after the directory was
            # made (still in private_mkdir, or in _private_net) left it behind in the session dir
            sessiondir.private_mkdir(tmp)
            private_net = self._private_net(handle.pid)
            external = [f"unix[{handle.ino}]"]
            if private_net:
                external.append(f"net[{netns.netns_inode(handle.pid)}]:{treecapture.NETNS_KEY}")
            with _dump_binary(self, handle.pid) as binary:
                client.dump(handle.pid, tmp, leave_running=leave_running, external=external, mode=self.mode,
                            binary=binary, options=treecapture.dump_options(scan, private_net),
                            retry=into is None,  # (images dumped into= are read as they are written)
                            held_paths=scan.workspace if scan is not None else ())
            treecapture.mark_images(tmp, scan)
        except Exception as e:  # noqa: BLE001 - pycriu raises its own types; we wrap them all
            tail = log_tail(os.path.join(tmp, "dump.log"))
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(e, OSError) and is_no_space(e):  # (making the directory)
                raise no_space(e, root, f"the CRIU images of worker {handle.pid}") from e
            if "No space left on device" in tail:
                raise no_space(OSError(errno.ENOSPC, "No space left on device"), root,
                               f"the CRIU images of worker {handle.pid}") from e
            if not _runs(handle.pid):  # killed or crashed meanwhile: "keeps running" would be false
                raise SnapshotError(f"CRIU dump of worker {handle.pid} failed ({e}): the process died during the "
                                    f"dump (killed, or crashed), so nothing of it was dumped.\n{tail}") from e
            raise SnapshotError(f"CRIU dump of worker {handle.pid} failed ({e}); the env keeps running.\n{tail}") from e
        except BaseException:  # Ctrl-C: criu finished or was stopped (the client waits); no images kept
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if into is not None:
            return CriuPayload(tmp, handle.ino, fork_tier=handle.fork_tier, netns=private_net), 0
        try:
            size = sessiondir.write_manifest(tmp, {"backend": "criu", "ino": handle.ino, "id": snap_id},
                                             hashed=self.verify == "sha256")
            sessiondir.commit(tmp, final)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if is_no_space(e):
                raise no_space(e, root, f"the CRIU images of worker {handle.pid}") from e
            raise SnapshotError(f"could not store the snapshot images: {e}") from e
        except BaseException:  # Ctrl-C: no snapshot will hold them
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(final, ignore_errors=True)
            raise
        return CriuPayload(final, handle.ino, fork_tier=handle.fork_tier, netns=private_net), size

    # --- restore ---------------------------------------------------------------------------
    def restore(self, payload: CriuPayload | ForkPayload, binds: Binds | None = None, *,
                hold_tree: bool = False) -> Handle:
        return self.restore_many(payload, 1, None if binds is None else [binds], hold_tree=hold_tree)[0]

    def restore_many(self, payload: CriuPayload | ForkPayload, n: int,
                     binds: Sequence[Binds] | None = None, policies: Sequence[bytes] | None = None,
                     restoring: bool = True, *, hold_tree: bool = False, reseed: bool = False) -> list[Handle]:
        """``n`` new workers from ``payload``.  ``binds[i]``: ``(host dir, path)`` pairs the i-th
        worker sees in a mount namespace of its own (private directories, see
        :mod:`gym_fork.worker.mounts`).  ``policies``: pickled policies the new workers will run
        (``policy_rollout``), unpickled ahead where that saves work (see :meth:`_clone_preloaded`):
        a handle's ``preloaded`` says how many of them its worker holds, by index (the first ones).
        ``restoring`` false: copies for ``fork()``, not restores (see :meth:`ForkPayload.clone_many`).
        ``reseed``: the copies will be reseeded first (ditto). ``hold_tree``: a restored tree's other processes stay stopped until the handle's
        :meth:`~gym_fork.backends.base.Handle.release_held` (see :meth:`restore_verified`); a
        fork-tier copy holds no other process."""
        per = list(binds) if binds is not None else [None] * n
        if len(per) != n:
            raise ValueError(f"{len(per)} bind lists for {n} copies")
        if isinstance(payload, ForkPayload):
            # Copies that need binds come from CRIU images when CRIU is here (_clones): a forked copy that
            # entered a mount namespace of its own would hold files (its executable, libraries,
            # fds) on the mounts of the namespace it was forked in, and files it opens later on
            # those of its own -- a process CRIU can no longer dump ("Can't lookup mount"), so
            # such a copy could never be persisted, bundled or migrated. A restored tree is born
            # in its namespace (see _restore_wrapper). The images are kept with the snapshot.
            if self._clones(payload, per):
                try:
                    if policies and n > 1 and not any(per) and not payload.spawned:
                        return self._clone_preloaded(payload, n, list(policies), reseed)
                    return self._clone_many(payload, n, per, restoring, reseed)
                except RestoreError as e:
                    if not isinstance(e.__cause__, WorkerDiedError):
                        raise
                    # The frozen process is gone -- it lives in its env worker's PID namespace,
                    # which ends with the env's first worker (a crash, a kill) -- so restores come
                    # from the snapshot's images from now on, where it has them
                    payload.close()  # (its ready copies went with it)
                    if payload.image is None:
                        raise RestoreError(f"{e}. {_FROZEN_GONE}") from e
            if payload.image is None:
                if payload.chan is None:
                    raise SnapshotCorruptedError(f"the snapshot's frozen process is gone. {_FROZEN_GONE}")
                self.persist(payload)
            payload = payload.image
        self._require_criu("restoring a persisted snapshot")
        self._verify(payload)
        if n == 1:
            return [self.restore_verified(payload, per[0], hold_tree=hold_tree)]
        if any(per):
            _wrapper()  # written before the threads fork criu (see _criu_via)
        # Each restore is its own criu process and PID namespace; threads just wait on them.
        futs = []
        try:
            with ThreadPoolExecutor(max_workers=min(n, 16)) as pool:
                futs = [pool.submit(self.restore_verified, payload, b, hold_tree=hold_tree) for b in per]
                handles, errors = [], []
                for f in futs:
                    try:
                        handles.append(f.result())
                    except Exception as e:  # noqa: BLE001
                        errors.append(e)
        except BaseException:  # Ctrl-C: the pool's threads finish their restores; none is kept
            for f in futs:
                if f.done() and not f.cancelled() and f.exception() is None:
                    f.result().kill()
            raise
        if errors:
            for h in handles:
                h.kill()
            raise errors[0]
        return handles

    def _clones(self, payload: ForkPayload, binds: Sequence[Binds | None]) -> bool:
        """Whether copies of the fork-tier ``payload`` with ``binds`` are forked from its frozen
        process (else restored from its images, see :meth:`restore_many`)."""
        return payload.chan is not None and not (any(binds) and self.mode != "fork")

    def reopens_paths(self, payload: CriuPayload | ForkPayload, binds: Binds | None = None) -> bool:
        return not isinstance(payload, ForkPayload) or not self._clones(payload, [binds])

    def _clone_many(self, payload: ForkPayload, n: int, binds: Sequence[Binds | None],
                    restoring: bool = True, reseed: bool = False) -> list[Handle]:
        """``n`` copies of a frozen snapshot: its ready copy if it offered one, the rest cloned
        in one pipelined batch (:meth:`ForkPayload.clone_many`: 16 LunarLander copies in about
        half the time of one round trip each)."""
        handles: list[Handle] = []
        fresh: list[RemoteHandle] = []
        try:
            while len(handles) < n:
                ready = self._take_ready(payload, tell_later=restoring and n == 1)
                if ready is None:
                    break
                _enter_private(ready, binds[len(handles)])
                handles.append(ready)
            pairs = [socket.socketpair() for _ in range(n - len(handles))]
            for ours, theirs in pairs:
                h = RemoteHandle(Channel(ours), 0, socket_inode(theirs.fileno()), fork_tier=True)
                # waits in the socket until the clone serves it: one round trip less; a copy for
                # fork() leaves out the snapshot's observation and info (nothing reads them: pickling
                # them cost each copy ~50 copy-on-write faults)
                h.send("hello", restoring)
                fresh.append(h)
            try:
                results = (payload.clone_many([theirs.fileno() for _ours, theirs in pairs], restoring, reseed)
                           if pairs else [])
            except WorkerDiedError as e:
                raise RestoreError(f"cloning the frozen snapshot failed: {e}") from e
            finally:
                for _ours, theirs in pairs:
                    theirs.close()
            failed = [r for r in results if isinstance(r, BaseException)]
            if failed:
                raise RestoreError(f"cloning the frozen snapshot (pid {payload.pid}) failed: {failed[0]}") from failed[0]
            for h in fresh:
                h.pid, *initial = h.receive()
                h.initial = initial if restoring else None
                h.ns_root = payload.spawned and _is_ns_init(h.pid)
                _enter_private(h, binds[len(handles)])
                handles.append(h)
        except BaseException:
            for h in [*handles, *[f for f in fresh if f not in handles]]:
                if h.pid:
                    h.kill()
                else:
                    h.chan.close()
            raise
        return handles

    def _clone_preloaded(self, payload: ForkPayload, n: int, policies: list[bytes],
                         reseed: bool = False) -> list[Handle]:
        """``n`` copies of a frozen snapshot for branches that run ``policies`` in their workers.

        Unpickling a policy imports what it refers to by name (its module; torch for a torch
        model: seconds), and every copy forked from the snapshot would pay that again. So the
        first copy does it first: with one policy for all branches, it unpickles that policy
        (``load_policy``), which every branch then uses as it would its own unpickled copy; with
        one each, it imports the modules their pickles name (``import_modules``; the names read
        from the pickles here, no object made), and each branch unpickles its own. Either way every branch's process ends up as it would
        have on its own -- the snapshot's state plus that same unpickling. When the others would
        together have spent at least :data:`PRELOAD_MIN_SAVING_S` on it, that copy is
        snapshotted in turn (a fork, as for any fork-tier snapshot) and the rest are cloned from
        there; where it fails, saves little, or leaves the copy unforkable (a thread the import
        started), the rest are cloned from ``payload`` as without this."""
        first = self._clone_many(payload, 1, [None], restoring=False)[0]
        rest: list[Handle] = []
        try:
            try:
                if len(policies) == 1:
                    took = first.request("load_policy", policies[0])
                    first.preloaded = 1
                else:  # (module names only: the pickles, weights and all, need not travel twice)
                    names = list(dict.fromkeys(m for blob in policies for m in pickled_modules(blob)))
                    took = first.request("import_modules", names)
                if took * (n - 1) >= PRELOAD_MIN_SAVING_S:
                    found = self._fork_snapshot(first, ready_copy=False)
                    if isinstance(found, ForkPayload):
                        try:
                            rest = self._clone_many(found, n - 1, [None] * (n - 1), False, reseed)
                        finally:
                            self.release(found)
                        for h in rest:
                            h.preloaded = first.preloaded
                        return [first, *rest]
            except (WorkerError, SnapshotError) as e:
                # a policy that does not unpickle there (each branch then says why, as without
                # preloading), an older worker without these commands, a failed fork
                log.debug("gym_fork: policies not preloaded: %s", e)
            rest = self._clone_many(payload, n - 1, [None] * (n - 1), False, reseed)
            return [first, *rest]
        except BaseException:  # (Ctrl-C too: no copy made here may live on unreturned)
            for h in [first, *rest]:
                h.kill()
            raise

    @staticmethod
    def _take_ready(payload: ForkPayload, tell_later: bool = False) -> RemoteHandle | None:
        """A handle on a ready copy of the frozen snapshot (its ``hello`` already answered), or
        None when none was offered yet or it does not answer. ``tell_later``: the frozen process
        is told the copy is taken once the copy's first request is sent (:meth:`RemoteHandle.defer`:
        a restore, whose next call is that copy's first step), not before this returns."""
        with held():  # (a copy taken and not told: the frozen process would keep no other ready)
            chan = payload.take_ready()
            if chan is None:
                return None
            try:
                reply = chan.recv_reply()  # one read: a copy sends nothing after its hello (no fd)
            except (ChannelClosed, OSError):
                reply = None
            if reply is None or reply[0] != OK:  # the copy died or failed: clone on request instead
                chan.close()
                payload.taken(None)
                return None
            hello, ino = reply[1]
            h = RemoteHandle(chan, hello[0], ino, fork_tier=True, ns_root=payload.spawned and _is_ns_init(hello[0]))
            if tell_later:
                h.defer(functools.partial(payload.taken, hello[0]))
            else:
                payload.taken(hello[0])
        h.initial = list(hello[1:4])
        h.learn_packed(hello[4])
        return h

    def persist(self, payload: CriuPayload | ForkPayload) -> CriuPayload | ForkPayload:
        """Write CRIU images of a copy-on-write snapshot (nothing else stops meanwhile)."""
        if isinstance(payload, CriuPayload) or payload.image is not None:
            return payload
        payload.image = self._dump_copy(payload, None)
        return payload

    def dump_transient(self, payload: CriuPayload | ForkPayload, into: str) -> CriuPayload:
        """CRIU images of a copy-on-write snapshot in the new private dir ``into``, for shipping
        right away (live migration): no manifest, no fsync, and ``payload`` is not changed (the
        caller releases it). Whoever reads them must hash them (``wire.send_images`` does, in
        the same pass that sends them). A snapshot that already has images is dumped from
        neither: its images are hard-linked (they are immutable)."""
        image = payload if isinstance(payload, CriuPayload) else payload.image
        if image is not None:
            os.makedirs(into, mode=0o700)
            for name in os.listdir(image.path):  # with MANIFEST.json: the sender checks against it
                if os.path.isfile(os.path.join(image.path, name)):
                    os.link(os.path.join(image.path, name), os.path.join(into, name))
            return CriuPayload(into, image.ino, fork_tier=image.fork_tier, netns=image.netns)
        return self._dump_copy(payload, into)

    def _dump_copy(self, payload: ForkPayload, into: str | None) -> CriuPayload:
        self._require_criu("persist()")
        if payload.chan is None:
            raise SnapshotCorruptedError(f"the snapshot's frozen process is gone. {_FROZEN_GONE}")
        try:
            frozen = payload.pid
        except WorkerDiedError as e:  # (gone with its worker's namespace, or killed)
            payload.close()
            raise SnapshotCorruptedError(f"{e}. {_FROZEN_GONE}") from e
        ours, theirs = netns.socketpair_in(frozen) if self._private_net(frozen) else socket.socketpair()
        ino = socket_inode(theirs.fileno())
        try:
            pid = payload.request_with_fd("promote", theirs.fileno())
        except WorkerDiedError as e:
            ours.close()
            payload.close()
            raise SnapshotCorruptedError(f"{e}. {_FROZEN_GONE}") from e
        except WorkerError as e:
            ours.close()
            raise SnapshotError(f"could not make a dumpable copy of the snapshot: {e}") from e
        finally:
            theirs.close()
        copy = RemoteHandle(Channel(ours), pid, ino, fork_tier=True)
        try:
            image, _size = self._dump(copy, f"p{pid}-{os.urandom(4).hex()}", leave_running=False, into=into)
        finally:
            copy.chan.close()
            try:
                os.kill(pid, 9)  # normally CRIU killed it already
            except ProcessLookupError:
                pass
        return image

    def evict(self, payload: CriuPayload | ForkPayload) -> None:
        if isinstance(payload, ForkPayload) and payload.image is not None and payload.chan is not None:
            payload.close()  # the frozen process and its ready copy exit on EOF

    def memory_bytes(self, payload: CriuPayload | ForkPayload) -> int | None:
        if isinstance(payload, ForkPayload) and payload.chan is not None:
            total = private_dirty_bytes(payload.pid)
            with payload.lock:  # and its ready copy's (tens of KB to a few MB: see worker/prefault.py)
                try:
                    payload.collect()
                except (ChannelClosed, OSError):
                    pass
                pids = list(payload.ready_pids)
            for pid in pids:
                if pid and total is not None:
                    total += private_dirty_bytes(pid) or 0
            return total
        return None

    def _verify(self, payload: CriuPayload) -> None:
        if not os.path.isdir(payload.path):
            raise SnapshotCorruptedError(f"snapshot images at {payload.path} are missing")
        sessiondir.verify(payload.path, full=self.verify != "size", rehash=self.verify == "sha256")

    def restore_verified(self, payload: CriuPayload, binds: Binds | None = None, *,
                         hold_tree: bool = False) -> Handle:
        """A new worker from the images of ``payload``, which the caller has just verified (their
        sha256 manifest, or the digests of a transfer); with ``binds``, criu runs (and the tree
        is restored) in a new mount namespace with those binds. Raises RestoreError (the images
        are untouched) or TimeoutError.

        ``hold_tree``: the tree's other processes (a tool server, a file watcher) do not run yet:
        criu leaves the tree stopped, the worker alone is let go on (it only answers requests),
        and the others wait for the handle's ``release_held()`` -- after the caller has put back
        the files they work on (``restore()`` puts the workspace back after the restore: run at
        once, a watcher saw the later trajectory's files and went on from them)."""
        nsfd = -1
        if payload.netns:  # a fresh namespace per copy; its channel is created inside it
            nsfd, (ours, theirs) = netns.new_netns()
            os.set_inheritable(nsfd, True)
        else:
            ours, theirs = socket.socketpair()
        new_ino = socket_inode(theirs.fileno())
        os.set_inheritable(theirs.fileno(), True)  # criu swrk is fork+exec'd and must inherit it
        try:
            pid = self._criu_restore(payload, binds, ours, theirs, new_ino, nsfd, hold_tree)
        except BaseException as e:
            if not isinstance(e, Exception):  # Ctrl-C, also in the cleanup after criu: what it
                client.kill_socket_holders(new_ino)  # restored goes, and is reaped (our child);
                ours.close()  # before ours closes: on that EOF it would exit into a zombie
            raise
        handle = None
        try:
            handle = RemoteHandle(Channel(ours), pid, new_ino, child=True, ns_root=True,
                                  fork_tier=payload.fork_tier and self.fork_tier is not False)
            if hold_tree:
                handle.held = _let_worker_go(pid, payload.path)
            _pid, *handle.initial = handle.request("hello")
            _tell_exit_log(handle)
        except WorkerDiedError as e:
            handle.kill()
            raise RestoreError(f"the restored worker did not answer: {e}") from e
        except BaseException:  # Ctrl-C: the new worker is nobody's
            if handle is not None:
                handle.kill()
            else:
                client.kill_socket_holders(new_ino)
                ours.close()
            raise
        return handle

    def _criu_restore(self, payload: CriuPayload, binds: Binds | None, ours: socket.socket, theirs: socket.socket,
                      new_ino: int, nsfd: int, hold_tree: bool = False) -> int:
        """:meth:`restore_verified`'s call to criu; returns the restored root's pid."""
        # per restore work dir: logs and stats of concurrent restores must not collide. Made
        # inside the try and removed by its path: Ctrl-C right after it was made leaves nothing
        workdir = os.path.join(sessiondir.session_dir(), f"restore-{os.urandom(6).hex()}")
        try:
            os.mkdir(workdir, 0o700)
            inherit = {f"socket:[{payload.ino}]": theirs.fileno()}
            if nsfd >= 0:
                inherit[treecapture.NETNS_KEY] = nsfd
            # a tree with ptys of its own gets a devpts of its own, where each pty keeps its number
            # (the original's, still open, holds that number in ours)
            devpts = treecapture.needs_devpts(payload.path)
            if (binds or devpts) and self.mode != "root":
                raise RestoreError("private directories need CRIU as root" if binds else
                                   "restoring a tree with ptys of its own needs CRIU as root")
            binary = (_restore_wrapper(workdir, self.binary or criu_status().binary, binds or [], devpts=devpts)
                      if binds or devpts else self.binary)
            with treecapture.image_lock(payload.path):
                pid = client.restore(payload.path, inherit_fd=inherit,
                                     rst_sibling=True,  # the restored worker becomes our child: waitpid works
                                     work_dir=workdir, mode=self.mode, binary=binary, kill_ino=new_ino,
                                     options=dict(treecapture.dump_options(None, payload.netns),
                                                  **({"leave_stopped": True} if hold_tree else {})))
        except Exception as e:  # noqa: BLE001
            ours.close()
            tail = log_tail(os.path.join(workdir, "restore.log"))
            raise RestoreError(f"CRIU restore from {payload.path} failed ({e}); the running env is unchanged.\n{tail}") from e
        finally:
            theirs.close()
            if nsfd >= 0:
                os.close(nsfd)
            shutil.rmtree(workdir, ignore_errors=True)
        return pid

    def release(self, payload: CriuPayload | ForkPayload) -> None:
        if isinstance(payload, ForkPayload):
            payload.close()  # the frozen process and its ready copy exit on EOF
            if payload.image is not None:
                shutil.rmtree(payload.image.path, ignore_errors=True)
            return
        if payload.owned:
            shutil.rmtree(payload.path, ignore_errors=True)

    def dies_with(self, payload: CriuPayload | ForkPayload, handle: Handle) -> bool:
        # a frozen process is a child in its worker's PID namespace, its copies too
        return (isinstance(payload, ForkPayload) and payload.chan is not None and isinstance(handle, RemoteHandle)
                and handle.ns_root and handle.fork_tier and not handle.closed)

    def is_persisted(self, payload: CriuPayload | ForkPayload) -> bool:
        return isinstance(payload, CriuPayload) or payload.image is not None

    def persisted_bytes(self, payload: CriuPayload | ForkPayload) -> int | None:
        """The size of a persisted snapshot's images (from their manifest), or None."""
        image = payload if isinstance(payload, CriuPayload) else payload.image
        if image is None:
            return None
        try:
            return sum(f["size"] for f in sessiondir.read_manifest(image.path)["files"].values())
        except SnapshotCorruptedError:
            return None

    # --- bundles and stores: the images, plus what a restore elsewhere depends on ------------------
    def bundle_write(self, payload: CriuPayload | ForkPayload, dest_dir: str) -> dict:
        """``images/``: the image files only (dumped first if the snapshot is in memory only),
        checked in our private directory and then hard-linked (copied, and checked while copied,
        across file systems); the fields say what they are and what they need."""
        image = _image_of(self.persist(payload))
        man = sessiondir.verify(image.path, full=True, digests=True)  # intact; their sha256 signed below
        images = os.path.join(dest_dir, "images")
        sessiondir.export_images(image.path, man["files"], images)
        return dict(image_meta(image, images), images=man["files"])

    def bundle_read(self, bundle_dir: str, meta: dict, received: dict | None = None) -> tuple[CriuPayload, int]:
        """The images a bundle's signed list names, copied into a private directory and checked
        there (:func:`~gym_fork.snapshots.sessiondir.copy_verified`): restores read that copy, so
        nothing done to the bundle after the check changes what is restored.  ``received``
        (streamed into our own private directory, hashed on arrival): used in place."""
        images = os.path.join(bundle_dir, "images")
        if received is not None:
            sessiondir.verify_received(received, meta["images"], bundle_dir)
            return self.payload_at(images, meta), sum(f["size"] for f in meta["images"].values())
        dest = os.path.join(sessiondir.session_dir(), f"load-{meta['id']}-{os.urandom(4).hex()}")
        os.mkdir(dest, 0o700)
        try:
            size = sessiondir.copy_verified(images, meta["images"], dest, bundle_dir)
            sessiondir.write_signed_manifest(dest, meta["images"], {"backend": "criu", "ino": meta["ino"], "id": meta["id"]})
        except BaseException:
            shutil.rmtree(dest, ignore_errors=True)
            raise
        payload = self.payload_at(dest, meta)
        payload.owned = True  # the private copy goes with the snapshot; the bundle stays
        return payload, size

    def check_compatible(self, meta: dict, path: str) -> None:
        """The CRIU fields' types (BundleDamagedError), then whether this machine can restore
        the images (BundleError)."""
        check_field(meta, "ino", (int,), path)
        check_field(meta, "criu_version", (str, int), path)
        for name in ("fork_tier", "netns"):
            check_field(meta, name, (bool,), path, optional=True)
        files = check_field(meta, "files", (list,), path)
        if not all(isinstance(f, list) and len(f) == 2 and isinstance(f[0], str) and isinstance(f[1], int)
                   for f in files):
            raise BundleDamagedError(f"{path}: bundle.json field 'files' is not a list of [path, size]; nothing "
                                     "was loaded")
        check_images(check_field(meta, "images", (dict,), path), path)
        check_compatible(meta, path)

    def store_images(self, payload: CriuPayload | ForkPayload) -> tuple[str, dict]:
        image = _image_of(payload)
        return image.path, image_meta(image)

    def payload_at(self, path: str, meta: dict) -> CriuPayload:
        return CriuPayload(path, meta["ino"], fork_tier=meta.get("fork_tier", False), owned=False,
                           netns=meta.get("netns", False))

    def chunk_lengths(self, images_dir: str, name: str, chunk_size: int) -> list[int] | None:
        if not is_page_image(name):
            return None
        return page_chunk_lengths(os.path.join(images_dir, name), chunk_size)


# --- private directories (gym_fork.worker.mounts): which mount namespace criu runs in ---------

#: ``(host directory, path the worker sees it at)`` pairs for one worker
Binds = Sequence[tuple[str, str]]


def _let_worker_go(pid: int, images_dir: str) -> list[int]:
    """A tree criu restored and left stopped, rooted at the worker ``pid``: continue the worker
    (and its threads); returns the other processes that must be continued later -- all but those
    that were stopped when the tree was dumped, which stay stopped as they were."""
    from gym_fork.criu.images import stopped_at_dump
    from gym_fork.worker.resources import descendants_of, innermost_pid

    # The worker first: stopped, it would never see its channel's EOF, and a controller killed
    # meanwhile (the image reading below takes milliseconds) left the tree stopped for good.
    # Going on, it waits for its first request; only a thread of its env could start a process
    # meanwhile, as it could once the worker went on after this scan before (that one would
    # run, like the worker, before the workspace is back: not new here).
    os.kill(pid, signal.SIGCONT)
    others = descendants_of(pid)  # (the tree's processes, stopped by criu)
    keep_stopped = stopped_at_dump(images_dir) if others else frozenset()
    return [p for p in others if innermost_pid(p) not in keep_stopped]


def _enter_private(handle: RemoteHandle, binds: Binds | None) -> None:
    """Without CRIU (mode ``fork``, root): a fork-tier copy moves into a mount namespace of its
    own with ``binds`` before it runs any env code (its first request); nothing ever dumps such a
    copy, which CRIU could not (see :meth:`CriuBackend.restore_many`).  Which of them are private directories the copy knows
    already (its frozen parent's memory); the others show its workspace at the paths the
    snapshot's processes knew it by (:func:`gym_fork.snapshots.workspace.binds_for`)."""
    if binds:
        handle.request("private_dirs", None, [list(b) for b in binds])


_WRAPPER = "#!/bin/sh\n# gym_fork: criu in another mount namespace; how: \"$0.conf\" (see criu.py)\n. \"$0.conf\"\n"
_wrapper_lock = threading.Lock()


def _criu_via(path: str, conf: str) -> str:
    """An executable at the new ``path`` that runs the shell lines ``conf`` with criu's arguments.

    Not a script written here and now: exec'ing a file fails (ETXTBSY) while any process holds
    it open for writing, and a fork in another thread (concurrent restores each fork criu)
    inherits the descriptor of a file being written -- pycriu's child then never runs criu and
    its parent waits for the timeout.  So ``path`` is a symlink to one wrapper written once per
    session (:func:`_wrapper`), which *reads* ``path + ".conf"``."""
    with open(os.open(path + ".conf", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600), "w") as f:
        f.write(conf)
    os.symlink(_wrapper(), path)
    return path


def _wrapper() -> str:
    path = os.path.join(sessiondir.session_dir(), "criu-wrap")
    with _wrapper_lock:
        if not os.path.exists(path):
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o700), "w") as f:
                f.write(_WRAPPER)
            os.rename(tmp, path)
    return path


class _dump_binary:
    """The criu to dump worker ``pid`` with: criu itself, or -- for a worker in a mount namespace
    of its own (private directories) -- a script that runs criu inside that namespace, where the
    worker's mounts are criu's own: CRIU then dumps open files by their paths there and no mount
    namespace (a restore recreates the binds, :func:`_restore_wrapper`)."""

    def __init__(self, backend: "CriuBackend", pid: int):
        self.binary, self.script = backend.binary, None
        if backend.mode != "root":
            return  # a userns worker lives in the holder's mount namespace: criu joins it there
        try:
            other = os.stat(f"/proc/{pid}/ns/mnt").st_ino != os.stat("/proc/self/ns/mnt").st_ino
        except OSError:
            return
        if other:
            criu = backend.binary or criu_status().binary
            nsenter = shutil.which("nsenter") or "/usr/bin/nsenter"
            self.script = _criu_via(
                os.path.join(sessiondir.session_dir(), f"criu-mnt-{pid}-{os.urandom(4).hex()}"),
                f"exec {nsenter} --mount=/proc/{pid}/ns/mnt -- {shlex.quote(criu)} \"$@\"\n")
            self.binary = self.script

    def __enter__(self) -> str | None:
        return self.binary

    def __exit__(self, *exc: object) -> None:
        if self.script is not None:
            for p in (self.script, self.script + ".conf"):
                try:
                    os.unlink(p)
                except OSError:
                    pass


def _restore_wrapper(workdir: str, criu: str, binds: Binds, devpts: bool = False) -> str:
    """A script in ``workdir`` that runs criu in a new mount namespace where each ``(source,
    target)`` of ``binds`` is bound: the restored tree is born there and opens its files there.
    ``devpts``: that namespace also gets a new devpts instance (its own pty numbers, all free), so
    that CRIU can give each of the tree's ptys its old number while the original holds it here."""
    unshare = shutil.which("unshare") or "/usr/bin/unshare"
    mounts = "; ".join([f"mount --bind -- {shlex.quote(src)} {shlex.quote(dst)}" for src, dst in binds] +
                       (["mount -t devpts -o newinstance,ptmxmode=0666,mode=620 devpts /dev/pts",
                         "mount --bind /dev/pts/ptmx /dev/ptmx"] if devpts else []))
    inner = f"set -e; {mounts}; exec {shlex.quote(criu)} \"$@\""
    return _criu_via(os.path.join(workdir, "criu-private"),
                     f"exec {unshare} --mount --propagation private -- /bin/sh -c {shlex.quote(inner)} criu \"$@\"\n")


def _image_of(payload: CriuPayload | ForkPayload) -> CriuPayload:
    """The images of a persisted payload (raises SnapshotError for an in-memory-only one)."""
    image = payload if isinstance(payload, CriuPayload) else payload.image
    if image is None:
        raise SnapshotError("the snapshot has no CRIU images yet; persist() it first")
    return image


def image_meta(image: CriuPayload, images_dir: str | None = None) -> dict[str, Any]:
    """The signed fields a set of env-worker images carries in ``bundle.json`` (besides their
    digests): the CRIU version, the channel inode they expect, whether the restored worker may
    take fork-tier snapshots, and the files the worker maps (read from ``images_dir``, default
    ``image.path``).  :meth:`CriuBackend.check_compatible` checks them before a restore."""
    return {"criu_version": criu_status().version, "ino": image.ino, "fork_tier": image.fork_tier,
            "netns": image.netns, "files": mapped_files(images_dir or image.path)}


def private_dirty_bytes(pid: int) -> int | None:
    """Private_Dirty of a process: the memory only it holds (pages its siblings have rewritten)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Private_Dirty:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


# Starts the worker and exits the way it did (a signal death is re-raised, so Popen.returncode
# says e.g. -9).  util-linux 2.38's `unshare --fork` cannot do that (its sigprocmask call fails),
# hence this.  `-S`: no site import, tiny process.  argv: FD MODE HOLDER_PID LOG WORKDIR NETNS_FD.
#   root:   the worker is PID 1 of a new PID namespace;
#   userns: first join the holder's user + mount namespaces (gym_fork.criu.userns), open stdio and
#           chdir there (CRIU's parasite needs a writable cwd in that mount namespace), then as root;
#   fork:   no namespaces at all (non-root without user namespaces: the fork tier needs none).
_PIDNS_LAUNCHER = """
import ctypes, os, signal, sys
fd, mode, holder, logpath, workdir, netns = sys.argv[1:7]
binds = sys.argv[7:]  # SOURCE TARGET ...: private directories (gym_fork.worker.mounts), root only
worker = [sys.executable, "-m", "gym_fork.worker", fd]
if mode == "fork":
    os.execv(sys.executable, worker)
libc = ctypes.CDLL(None, use_errno=True)
def die(what):
    why = "gym_fork's worker launcher: %s failed: %s" % (what, os.strerror(ctypes.get_errno()))
    sys.stderr.write(why + "\\n")
    # stderr may be /dev/null: the controller's init request gets the reason as its answer
    # (gym_fork.worker.__main__ does the same; PYTHONPATH finds gym_fork even under -S)
    try:
        from gym_fork.worker.__main__ import answer_init_with_error
        answer_init_with_error(int(fd), "OSError", "it could not start: " + why, "")
    except Exception:
        pass
    os._exit(125)
if mode == "userns":
    for ns, flag in (("user", 0x10000000), ("mnt", 0x00020000)):
        nsfd = os.open("/proc/%s/ns/%s" % (holder, ns), os.O_RDONLY)
        if libc.setns(nsfd, flag) != 0:
            die("setns(%s namespace of the holder %s)" % (ns, holder))
        os.close(nsfd)
    os.chdir(workdir)
    out = os.open(logpath, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600) if logpath else os.open(os.devnull, os.O_WRONLY)
    inp = os.open(os.devnull, os.O_RDONLY)
    os.dup2(inp, 0); os.dup2(out, 1); os.dup2(out, 2); os.close(inp); os.close(out)
if netns != "-1" and libc.setns(int(netns), 0x40000000) != 0:  # CLONE_NEWNET: the worker's own network
    die("setns(network namespace)")
if netns != "-1":
    os.close(int(netns))
if binds:  # a mount namespace of the worker's own, where each TARGET shows SOURCE
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]
    if libc.unshare(0x00020000) != 0:  # CLONE_NEWNS
        die("unshare(CLONE_NEWNS)")
    if libc.mount(b"none", b"/", None, 0x4000 | 0x40000, None) != 0:  # MS_REC | MS_PRIVATE
        die("making / private")
    for i in range(0, len(binds), 2):
        if libc.mount(os.fsencode(binds[i]), os.fsencode(binds[i + 1]), None, 0x1000 | 0x4000, None) != 0:
            die("binding %s on %s" % (binds[i], binds[i + 1]))
    # stdio opened out there points at the old namespace's mounts (CRIU could not dump it): reopen
    out = os.open(logpath, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600) if logpath else os.open(os.devnull, os.O_WRONLY)
    inp = os.open(os.devnull, os.O_RDONLY)
    os.dup2(inp, 0); os.dup2(out, 1); os.dup2(out, 2); os.close(inp); os.close(out)
if libc.unshare(0x20000000) != 0:  # CLONE_NEWPID
    die("unshare(CLONE_NEWPID)")
pid = os.fork()
if pid == 0:
    os.execv(sys.executable, worker)
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


def _tell_exit_log(handle: RemoteHandle) -> None:
    """Tell a CRIU-restored worker this process's record of how copies end (gym_fork.worker.exits):
    its environment still names the file of the process that started it (another one after a
    ``load_snapshot``, a store or a migration, or gone). One round trip, on a restore of ~40 ms."""
    try:
        handle.request("exit_log", sessiondir.exit_log())
    except WorkerError:
        pass  # an older gym_fork's worker: its copies' ends are not written down here


def _worker_environ() -> dict[str, str]:
    env = dict(os.environ)
    # The worker must import modules exactly as we do (gym_fork even when not installed, and the
    # modules that define user env classes, e.g. a test file): hand it our sys.path.
    pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    paths = [pkg_root] + [p for p in sys.path if p and os.path.isdir(p)]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env[exits.PATH_ENV] = sessiondir.exit_log()  # how its copies end, for exit_status()
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(var, "1")
    return env

"""Files changed by the env's child processes and native code: seen by the kernel, not by Python.

:mod:`gym_fork.worker.files` records what the env changes through Python (an audit hook).  A
C library's own ``fopen``/``write``, a shell the env runs, a server it starts: their writes
raise no audit event.  Here the worker asks the kernel instead: one ``fanotify`` group per active
worker process, with a filesystem mark on every writable local filesystem, reporting each
file closed after writing, created, removed, moved or whose attributes changed
(``FAN_CLOSE_WRITE | FAN_CREATE | FAN_DELETE | FAN_MOVED_FROM | FAN_MOVED_TO | FAN_ATTRIB``),
with the directory handle and name of the entry and the pid of the process that did it
(``FAN_REPORT_DFID_NAME``).

Whose change it was: the kernel reports the pid as seen from the *reader's* PID namespace, and a
worker is in a namespace of its own (the launcher's ``unshare(CLONE_NEWPID)``; a CRIU-restored
worker gets a fresh one).  A process outside it is reported as pid 0 and ignored: the learner,
other workers, CRIU, the rest of the machine.  Inside it live, besides this worker and the env's
children, gym_fork's fork-tier copies of the worker (their siblings).  So a change is the env's
when its pid is this process or one of its living descendants; a pid that has already exited
counts as the env's when this worker has started processes of its own since it was built (its
Python spawned one, or a scan found one alive: :func:`built`), else as a sibling's -- except inside a branch's workspace of this env's lineage
(``ROOT``, ``ROOT.branch-<id>``...): branches that each run a shell in their own workspace do not
refuse each other.  A sibling's exited child writing elsewhere can thus be counted here too: a
refusal that names the path, never a write missed.  (A copy of an env that had started processes
is itself PID 1 of a namespace of its own -- ``gym_fork.worker.loop._fork_copy_process`` -- so
there its siblings are pid 0 and the attribution is exact.)

The changes go into the worker's :class:`~gym_fork.worker.files.Record`, with the same filters
(workspace, ``/dev``, ``/proc``, ``/sys``, ``__pycache__``, unix socket names), so the controller
refuses a snapshot, restore or fork that would diverge, by path, exactly as for the env's Python
writes.  The queue is drained (:func:`drain`) before every reply; when the env has started
processes, which write at any time, the controller asks for one more drain before a restore or
fork (:data:`spawned`).

A group belongs to one process: a forked copy closes the inherited descriptor at once
(:func:`forget`; it would otherwise read, or keep alive, its parent's queue), and a copy that
starts serving opens its own (:func:`start`, from ``hello``; a ready copy, forked ahead, once it
has answered ``hello``, and closes it again when no request came for half a second -- it may wait
for hours -- to open it with its first request: :func:`defer`, :func:`resume`).  A CRIU image may hold a group, but
CRIU 4.1 restores it without its filesystem marks (deaf): a restored copy's ``hello`` replaces
it with a new one, reading the mount table again (it may run on another machine).

``GYM_FORK_FSWATCH=0`` (in the learner's environment, inherited by its workers) turns it off, to
measure what it costs; writes below Python are then not seen.

Needs ``CAP_SYS_ADMIN`` (root): without it there is no group (:func:`available` is False), and
only the Python-level record remains; ``gym-fork doctor`` says so.  Filesystems that cannot
report directory handles (some overlayfs setups, FUSE) are not watched; :func:`unwatched` names
them.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import select
import stat
import struct

from gym_fork import atfork
from gym_fork.worker import files

# <linux/fanotify.h>
FAN_CLASS_NOTIF = 0x0
FAN_CLOEXEC = 0x1
FAN_NONBLOCK = 0x2
FAN_UNLIMITED_QUEUE = 0x10
FAN_REPORT_DIR_FID = 0x400
FAN_REPORT_NAME = 0x800
FAN_REPORT_DFID_NAME = FAN_REPORT_DIR_FID | FAN_REPORT_NAME
FAN_MARK_ADD = 0x1
FAN_MARK_FILESYSTEM = 0x100
FAN_ATTRIB = 0x4
FAN_CLOSE_WRITE = 0x8
FAN_MOVED_FROM = 0x40
FAN_MOVED_TO = 0x80
FAN_CREATE = 0x100
FAN_DELETE = 0x200
FAN_Q_OVERFLOW = 0x4000
FAN_ONDIR = 0x40000000
FAN_EVENT_INFO_TYPE_DFID_NAME = 2
AT_FDCWD = -100

MASK = FAN_CLOSE_WRITE | FAN_CREATE | FAN_DELETE | FAN_MOVED_FROM | FAN_MOVED_TO | FAN_ATTRIB | FAN_ONDIR
_UNNAMED = re.compile(r"#[0-9]+")
_META = struct.Struct("=IBBHQii")  # struct fanotify_event_metadata: 24 bytes
_INFO = struct.Struct("=BBH2iIi")  # info header, __kernel_fsid_t, struct file_handle's two ints

# Filesystems whose changes are the world's, not a file's content on a disk we share.
_SKIP_TYPES = frozenset({
    "proc", "sysfs", "devtmpfs", "devpts", "cgroup", "cgroup2", "mqueue", "debugfs", "tracefs",
    "securityfs", "pstore", "bpf", "configfs", "fusectl", "hugetlbfs", "binfmt_misc", "autofs",
    "nsfs", "efivarfs", "rpc_pipefs", "selinuxfs",
})

_fd: int | None = None  # this process's group
_owner: int | None = None  # the pid that opened it (a forked copy must not read it)
_mounts: dict[tuple[int, int], str] = {}  # fsid -> the mount point of that filesystem
_unwatched: list[str] = []  # mount points that could not be marked, with why
_overflowed = False
spawned = False  # the env started a process of its own (its Python did, or a scan found a child)
spawn_told = False  # ... and this process's channel was told so
_libc: ctypes.CDLL | None = None


def _lib() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.fanotify_init.argtypes = [ctypes.c_uint, ctypes.c_uint]
        _libc.fanotify_mark.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint64, ctypes.c_int, ctypes.c_char_p]
        _libc.open_by_handle_at.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
    return _libc


def available() -> bool:
    """A group is open in this process (root, and a kernel with ``FAN_REPORT_DFID_NAME``)."""
    return _fd is not None and _owner == os.getpid()


def warn_if_blind() -> None:
    """As root, say once per worker what the watch cannot see (a filesystem without directory
    handles, a kernel without ``FAN_REPORT_DFID_NAME``): writes there by the env's children or
    native code would go unnoticed.  Without root that is the documented default: no warning."""
    if os.geteuid() != 0 or os.environ.get("GYM_FORK_FSWATCH") == "0":
        return
    import warnings

    if not available():
        warnings.warn("gym_fork: this kernel does not report file changes with directory handles "
                      "(fanotify FAN_REPORT_DFID_NAME, Linux >= 5.9): files the env's child processes or "
                      "native code write outside its workspace are not seen, so not refused; keep them in "
                      "the workspace", RuntimeWarning, stacklevel=2)
    elif _unwatched:
        warnings.warn("gym_fork: file changes on " + ", ".join(_unwatched) + " are not seen (no directory "
                      "handles there): files the env's child processes or native code write there are not "
                      "refused; keep them in the env's workspace", RuntimeWarning, stacklevel=2)


def own_fds() -> tuple[int, ...]:
    """This process's group descriptor, if any: gym_fork's, not the env's (the resources scan
    skips it; a fork never shares it, a CRIU restore replaces it)."""
    return (_fd,) if _fd is not None and _owner == os.getpid() else ()


def unwatched() -> list[str]:
    """Mounted filesystems whose changes are not seen (``"PATH (why)"``)."""
    return list(_unwatched)


def _writable_mounts() -> list[tuple[str, str]]:
    """(mount point, type) of every read-write mount, one per filesystem, outside /proc, /sys, /dev."""
    seen: set[str] = set()
    out = []
    try:
        with open("/proc/self/mountinfo", "rb") as f:
            lines = f.read().decode("utf-8", "surrogateescape").splitlines()
    except OSError:
        return []
    for line in lines:
        left, _, right = line.partition(" - ")
        parts, rparts = left.split(), right.split()
        if len(parts) < 6 or len(rparts) < 1:
            continue
        dev, point, opts, fstype = parts[2], _unescape(parts[4]), parts[5].split(","), rparts[0]
        if fstype in _SKIP_TYPES or "ro" in opts or dev in seen:
            continue
        if point.startswith(("/proc", "/sys", "/dev")) and point not in ("/", "/dev/shm"):
            continue  # the audit hook ignores these too: device nodes, kernel state (not /dev/shm's files)
        seen.add(dev)
        out.append((point, fstype))
    return out


def _unescape(s: str) -> str:
    return s.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def start(*, refresh: bool = False) -> bool:
    """Open this process's group and mark every writable filesystem (idempotent). False where the
    kernel or our privileges do not allow it; the Python-level record still works.

    The mount table is read once per worker (``refresh``: again, e.g. in a CRIU-restored copy,
    perhaps on another machine); forked copies reuse their parent's, so a copy's group costs one
    system call per filesystem and one to open."""
    global _fd, _owner, _overflowed, spawn_told, _poller
    if _fd is not None and _owner == os.getpid() and not refresh:
        return True
    forget()
    if os.environ.get("GYM_FORK_FSWATCH") == "0":
        return False  # measuring its cost only: writes below Python go unseen
    if refresh or not _points:
        _load_points()
    if not _points:
        return False
    libc = _lib()
    fd = libc.fanotify_init(FAN_CLASS_NOTIF | FAN_CLOEXEC | FAN_NONBLOCK | FAN_UNLIMITED_QUEUE | FAN_REPORT_DFID_NAME,
                            os.O_RDONLY | os.O_LARGEFILE)
    if fd < 0:
        return False  # EPERM without CAP_SYS_ADMIN; EINVAL on kernels older than 5.9
    marked = 0
    for point, fstype in list(_points):
        if libc.fanotify_mark(fd, FAN_MARK_ADD | FAN_MARK_FILESYSTEM, MASK, AT_FDCWD, os.fsencode(point)) == 0:
            marked += 1
            continue
        _unwatched.append(f"{point} ({fstype}: {os.strerror(ctypes.get_errno())})")
        _points.remove((point, fstype))  # not tried again by copies
        for key, where in list(_mounts.items()):
            if where == point:
                del _mounts[key]
    if not marked:
        os.close(fd)
        return False
    _fd, _owner, _overflowed = fd, os.getpid(), False
    _poller = select.poll()
    _poller.register(fd, select.POLLIN)
    spawn_told = False  # a new copy, a new channel: say it again
    return True


_points: list[tuple[str, str]] = []  # (mount point, type) to mark


def _load_points() -> None:
    """Read the mount table: the mount point of each filesystem, keyed by the fsid fanotify
    reports (``open_by_handle_at`` needs a descriptor there; opened only when a change is ours,
    so no mount is kept busy)."""
    _points.clear()
    _mounts.clear()
    _unwatched.clear()
    files.socket_names.update(_bound_socket_names())
    for point, fstype in _writable_mounts():
        try:
            _mounts[_fsid(point)] = point
        except OSError as exc:
            _unwatched.append(f"{point} ({fstype}: {exc.strerror})")
            continue
        _points.append((point, fstype))


def _bound_socket_names() -> list[str]:
    """The paths of the unix sockets bound now in this network namespace (``/proc/net/unix``):
    their removal later is a name going away, not content changing."""
    try:
        with open("/proc/net/unix", "rb") as f:
            lines = f.read().splitlines()[1:]
    except OSError:
        return []
    out = []
    for line in lines:
        parts = line.split(None, 7)
        if len(parts) == 8 and parts[7].startswith(b"/"):
            out.append(os.fsdecode(parts[7]))
    return out


def _fsid(point: str) -> tuple[int, int]:
    """The ``__kernel_fsid_t`` fanotify reports for the filesystem at ``point``. glibc's
    ``statvfs().f_fsid`` packs its two 32-bit halves into one integer."""
    v = os.statvfs(point).f_fsid
    lo, hi = v & 0xFFFFFFFF, (v >> 32) & 0xFFFFFFFF
    return (struct.unpack("=i", struct.pack("=I", lo))[0], struct.unpack("=i", struct.pack("=I", hi))[0])


def forget() -> None:
    """Drop this process's reference to the group without reading it: right after a fork, in the
    child (the parent keeps reading it).  The descriptors on the mount points stay."""
    global _fd, _owner
    if _fd is not None:
        try:
            os.close(_fd)  # the last reference: the kernel waits a grace period (~15 ms) here
        except OSError:
            pass
    _fd = _owner = None


deferred = False  # a ready copy: its group is opened when its first request arrives (resume())


def defer() -> None:
    """A ready copy waits, maybe for hours, before it serves: it opens no group until then (an
    idle group would queue every file change on the machine).  Nothing of the env's runs in it
    before its first request, so nothing is missed."""
    global deferred
    forget()
    deferred = True


def resume() -> None:
    """The deferred group, opened now (the copy's first request)."""
    global deferred
    deferred = False
    start()


def built() -> None:
    """The env is built: record what construction changed, then forget the processes it started
    and that are gone (glfw, imported by MuJoCo envs, runs a Python child to read a library's
    version).  Only processes started later, or alive at a scan, make the env's copies namespace
    inits and its exited pids the env's."""
    global spawned
    drain()
    spawned = False


def note_spawn() -> None:
    """The env started a process (an audit event of its Python, or a scan that found a child);
    the controller learns it with the next reply (:func:`gym_fork.worker.output.flush`)."""
    global spawned
    spawned = True


def drain(record: files.Record | None = None) -> None:
    """Read the queued changes and record the env's own into ``record`` (the worker's)."""
    global _overflowed
    fd = _fd
    if fd is None:  # (a forked process has none: the at-fork hook dropped it)
        return
    if not _poller.poll(0):  # 0.6 µs here; a failing read() costs 1.9, FIONREAD 1.0 (an audit event)
        return
    rec = record if record is not None else files._worker
    me = _owner
    while True:
        try:
            buf = os.read(fd, 65536)
        except BlockingIOError:
            return
        except OSError as exc:
            if exc.errno == errno.EINTR:
                continue
            return
        if not buf:
            return
        pos, end = 0, len(buf)
        while pos + _META.size <= end:
            length, _vers, _res, mlen, mask, efd, pid = _META.unpack_from(buf, pos)
            if length < _META.size:
                break
            if efd >= 0:
                os.close(efd)  # not in FID mode; be safe
            if mask & FAN_Q_OVERFLOW:
                _overflowed = True
                rec.paths.setdefault("(changes lost: the kernel's event queue overflowed)", files.MODIFIED)
                rec.version += 1
            elif pid != 0:
                if pid == me:
                    _record(rec, buf, pos + mlen, pos + length, mask)
                else:  # decided below, once per batch: one look at this process's descendants
                    _pending_others.append((pid, mask, bytes(buf[pos + mlen:pos + length])))
            pos += length
        if _pending_others:
            _settle_others(rec)


_pending_others: list[tuple[int, int, bytes]] = []
_poller = select.poll()  # watches this process's group (start())


def _settle_others(rec: files.Record) -> None:
    """Changes by other processes of this namespace: the env's when made by a living descendant,
    or by an exited process once the env has started processes of its own."""
    items = _pending_others[:]
    _pending_others.clear()
    mine = _descendants()
    if mine:
        note_spawn()
    for pid, mask, info in items:
        if pid in mine:
            _record(rec, info, 0, len(info), mask)
        elif spawned:  # an exited process: ours, or a sibling copy's
            _record(rec, info, 0, len(info), mask, siblings=_lineage_root(rec))


_BRANCH_SUFFIX = re.compile(r"(\.branch-[A-Za-z0-9_-]+)+$")


def _lineage_root(rec: files.Record) -> str | None:
    """The workspace every branch of this env's lineage derives its own from (a fork's is
    ``ROOT.branch-<id>``, a fork of a fork ``ROOT.branch-<id>.branch-<id>``)."""
    return _BRANCH_SUFFIX.sub("", rec.workspace) if rec.workspace else None


forked: set[int] = set()  # the worker's frozen snapshots (gym_fork.worker.loop keeps it): not the env's


def _descendants() -> set[int]:
    """The namespace pids of this process's living descendants, gym_fork's own fork-tier
    processes and their trees left out."""
    from gym_fork.worker import resources  # only when another pid of the namespace wrote something

    try:
        return set(resources.env_descendants_local(forked))
    except Exception:  # noqa: BLE001 - on doubt, count nothing as a descendant (spawned decides)
        return set()


files.on_spawn = note_spawn
atfork.in_child(forget)  # every fork: the env's own, gym_fork's fork tier


def _record(rec: files.Record, buf: bytes, pos: int, end: int, mask: int, siblings: str | None = None) -> None:
    """Record the entry the info records in ``buf[pos:end]`` name.  ``siblings``: the lineage's
    workspace root, for a change by an exited process that may be a sibling copy's: one inside a
    branch's workspace is that branch's (a copy's shell writing its own workspace), not ours."""
    while pos + _INFO.size <= end:
        itype, _pad, ilen, f0, f1, hbytes, htype = _INFO.unpack_from(buf, pos)
        if ilen <= 0:
            return
        if itype == FAN_EVENT_INFO_TYPE_DFID_NAME:
            hstart = pos + 4 + 8  # after the header and the fsid: struct file_handle
            handle = bytes(buf[hstart:hstart + 8 + hbytes])
            name_at = hstart + 8 + hbytes
            raw = bytes(buf[name_at:pos + ilen])
            name = os.fsdecode(raw.split(b"\0", 1)[0])
            directory = _resolve((f0, f1), handle)
            if directory is not None:
                path = directory if name in ("", ".") else os.path.join(directory, name)
                if siblings and (path == siblings or path.startswith((siblings + "/", siblings + ".branch-"))):
                    return
                _note(rec, path, mask)
        pos += ilen


def _resolve(fsid: tuple[int, int], handle: bytes) -> str | None:
    """The path of the directory ``handle`` names, via ``open_by_handle_at`` (needs
    ``CAP_DAC_READ_SEARCH``), or None when it is gone or its filesystem is not ours."""
    point = _mounts.get(fsid)
    if point is None:
        return None
    try:  # not O_PATH: open_by_handle_at refuses one
        mfd = os.open(point, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        dfd = _lib().open_by_handle_at(mfd, handle, os.O_PATH | os.O_CLOEXEC)
    finally:
        os.close(mfd)
    if dfd < 0:
        return None  # ESTALE: the directory was removed since
    try:
        path = os.readlink(f"/proc/self/fd/{dfd}")
    finally:
        os.close(dfd)
    if path.endswith(" (deleted)"):
        return None
    return path


def _note(rec: files.Record, path: str, mask: int) -> None:
    p = files._path(path, None, rec)
    if p is None or p in rec.paths:
        return
    st = files._lstat(p)
    if st is not None and stat.S_ISSOCK(st.st_mode):
        files.socket_names.add(p)
        return  # a unix socket's name holds no content (listening sockets: the resources scan)
    if st is None and p in files.socket_names:
        return  # a socket's name, removed (the type of a removed entry is not reported)
    if st is None and _UNNAMED.fullmatch(os.path.basename(p)) and not mask & (FAN_DELETE | FAN_MOVED_FROM):
        return  # an unnamed O_TMPFILE file (the kernel calls it "#INODE"): in no directory
    if mask & FAN_CREATE:  # it did not exist: gone again by the next look, it left no trace
        kind = files.MADE_DIR if mask & FAN_ONDIR else files.CREATED
    else:  # written, removed, renamed (over what may have existed), chmod-ed: sticky
        kind = files.MODIFIED
    rec.paths[p] = kind
    rec.version += 1


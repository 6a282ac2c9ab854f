"""The files an env writes outside its workspace: recorded where the env runs, checked by the controller.

A snapshot holds the worker's process, not the files on disk.  What the env keeps in its
declared ``workspace=`` is captured separately (:mod:`gym_fork.snapshots.workspace`); a file it
writes anywhere else and closes again before the step ends is in no snapshot, and the
:mod:`~gym_fork.worker.resources` scan cannot see it (it looks only at files *open* between steps).
Restoring a snapshot taken before such a write would give the env its memory of that moment
back but leave the file as it is now; branches would all write the one file.  So gym_fork
records those writes and refuses the snapshot, restore or fork that would diverge.

Recording (worker side, :func:`install`): a Python audit hook (:func:`sys.addaudithook`) sees
every ``open()`` for writing (``O_WRONLY``, ``O_RDWR``, ``O_CREAT``, ``O_TRUNC``, ``O_APPEND``),
``os.remove``/``unlink``, ``os.rename``/``replace`` (both paths), ``os.truncate``, ``os.mkdir``,
``os.rmdir``, ``shutil.rmtree``, ``os.chmod``/``chown``/``utime``, links, extended attributes,
and ``sqlite3.connect`` of a database file (SQLite writes below Python: its connect event is the
only trace).  The first change to a path decides whether the env *created* it (it did not exist)
or *modified* it.  A path the env created and removed again left no trace and is forgotten; a
removal of a path that does not exist changes nothing and is not recorded.  A directory the env
makes is not reported by itself (what it writes into it is; removing a directory it did not make
is), and unix socket names (no content; a listening socket is the resources scan's) are ignored.  Ignored: the declared workspace (:func:`set_workspace`,
from the same ``workspace`` attribute the env reads), ``__pycache__`` (the import system),
``/dev``, ``/proc``, ``/sys``, unnamed ``O_TMPFILE`` files, and paths given as a descriptor
(``open(fd, "w")``, ``os.ftruncate``: the file was recorded when it was opened by name) or
relative to a directory descriptor (the standard library's only such writer, ``shutil.rmtree``,
names its tree in its own event).  The record is sticky for the process's life and, being
plain memory, is copied into every fork and CRIU image: a copy of a snapshot inherits the
record as of that snapshot.

The hook itself only classifies the event and, for a write, normalises the path and looks it up
in a dict; it reads no ``/proc`` file and logs nothing.  (A path's first write costs one
``lstat``.)

Reporting (:func:`pending`, called by :func:`gym_fork.worker.output.flush`): when the record
changed since it was last sent, the whole record ``{path: "created" | "modified"}`` rides in the
output frame that precedes the next reply; no extra round trip.  A new copy's ``hello``
(:func:`resend`) sends it again on its new channel.  The controller keeps the latest one per
channel and filters it (:func:`outside`) by the env's workspace and ``untracked_paths``.

In-process envs (the pickle backend): :class:`Record` per env and :func:`tracking` around each
call into the env, in the calling thread only: what the learner itself writes is not the env's.

Not seen here: writes that bypass Python's audit events (a C library's own ``fopen``/``write``;
``mmap`` writes) and writes by other processes (the env's child processes, servers).  In a worker
run as root, :mod:`gym_fork.worker.fswatch` asks the kernel for those (``fanotify``) and records
them into the same record; the audit hook tells it when the env starts a process.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import stat
import sys
import threading
from typing import Any, Callable, Iterable, Iterator

from gym_fork.errors import ForeignWorkspaceError
from gym_fork.worker import exits

CREATED = "created"  # the path did not exist before the env's first change to it
MODIFIED = "modified"  # it existed: written, truncated, renamed, removed, chmod-ed, ...
MADE_DIR = "made-dir"  # a directory the env made: not reported (its files are), but its removal is the env's own

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_TMPFILE = getattr(os, "O_TMPFILE", 0)
_WRITE_MODE = frozenset("wax+")
_SYSTEM = ("/dev/", "/proc/", "/sys/")
# ... except POSIX shared memory: /dev/shm is a tmpfs of files like any other (an env's tool keeps
# state there, and a copy would share it), not device nodes; gym_fork's ring slots are its own
_SHARED_MEMORY, _OWN_SHARED = "/dev/shm/", "/dev/shm/gym_fork-"
# gym_fork's record of how copies ended (gym_fork.worker.exits): written by a copy's parent (a
# frozen snapshot, this worker as a namespace init), never by the env
_EXIT_LOG = os.path.normpath(os.environ[exits.PATH_ENV]) if os.environ.get(exits.PATH_ENV) else None


class Record:
    """The paths one env changed: ``paths`` maps each to :data:`CREATED` or :data:`MODIFIED`.

    ``version`` counts changes; ``sent``/``sent_version`` remember what :func:`pending` last
    reported.  ``workspace``: the env's declared workspace (ignored), absolute, or None."""

    __slots__ = ("paths", "version", "sent", "sent_version", "workspace", "foreign", "aliases")

    def __init__(self) -> None:
        self.paths: dict[str, str] = {}
        self.version = 0
        self.sent: dict[str, str] | None = {}
        self.sent_version = 0
        self.workspace: str | None = None
        # the workspace of the env this one was copied from (a fork() child's parent's): off limits
        self.foreign: str | None = None
        # other paths showing the workspace itself (binds in a copy's mount namespace): the workspace
        self.aliases: tuple[str, ...] = ()

    def current(self) -> dict[str, str]:
        """The record now: paths the env created and removed again are dropped (no trace left),
        directories it made are left out (what it writes in them is recorded)."""
        gone = [p for p, kind in self.paths.items() if kind is not MODIFIED and not os.path.lexists(p)]
        for p in gone:
            del self.paths[p]
        return {p: kind for p, kind in self.paths.items() if kind is not MADE_DIR}


socket_names: set[str] = set()  # paths seen holding a unix socket: a name, no content
_worker = Record()  # the worker process's record (the env owns the whole process)
_active: Record | None = None  # where the hook records now
_thread: int | None = None  # only this thread's events count (in-process envs); None: all
_installed = False


# --- installing and switching ---------------------------------------------------------------------
def install(*, in_process: bool = False) -> None:
    """Add the audit hook (once per process; Python cannot remove one).

    Args:
        in_process: False in a worker (every event of the process is the env's, recorded in the
            worker's record from now on); True where the env runs inside the learner (nothing is
            recorded except inside :func:`tracking`).
    """
    global _installed, _active
    if not in_process:
        _active = _worker
    if not _installed:
        _installed = True
        sys.addaudithook(_hook)


@contextlib.contextmanager
def tracking(record: Record) -> Iterator[None]:
    """Record into ``record`` what this thread changes inside the block (an in-process env's call).

    Example:
        >>> import os, tempfile
        >>> from gym_fork.worker import files
        >>> files.install(in_process=True)
        >>> rec, d = files.Record(), tempfile.mkdtemp()
        >>> with files.tracking(rec):
        ...     with open(os.path.join(d, "log.txt"), "a") as f:
        ...         _ = f.write("step\\n")
        >>> list(rec.current().values())
        ['created']
    """
    previous = track(record)
    try:
        yield
    finally:
        untrack(previous)


def track(record: Record) -> tuple:
    """Start recording this thread's changes into ``record``; returns what :func:`untrack`
    puts back (the context manager :func:`tracking`, without its cost, for every env call)."""
    global _active, _thread
    previous = _active, _thread
    _active, _thread = record, threading.get_ident()
    return previous


def untrack(previous: tuple) -> None:
    global _active, _thread
    _active, _thread = previous


def set_workspace(path: str | None, previous: Any = None) -> None:
    """The env's declared workspace is ``path``: changes inside it are captured with each
    snapshot, not recorded here (entries already under it are dropped). ``previous``: the
    env's ``workspace`` attribute until now (a copy's: the directory of the env it was copied
    from, which the copy must not touch any more)."""
    rec = _active
    if rec is None:
        return
    old = rec.workspace  # None in an env's first worker: what the env chose itself is not a copy's
    if old is not None and isinstance(previous, str) and previous:
        old = os.path.normpath(os.path.abspath(previous))
    rec.workspace = os.path.normpath(os.path.abspath(path)) if path else None
    if old and rec.workspace and old != rec.workspace:
        # a copy moved to a directory of its own (a fork() child's DIR.branch-<id>): what it
        # inherited still names the directory it was copied from -- unless the copy's mount
        # namespace shows its own directory there (as root: gym_fork.snapshots.workspace.binds_for),
        # where that path is simply another name of its workspace
        known = [a for a in (*rec.aliases, old) if a != rec.workspace]
        rec.aliases = tuple(a for a in known if _same_dir(a, rec.workspace))
        rec.foreign = None if old in rec.aliases else old
        if rec is _worker:  # (an in-process env shares the learner's working directory)
            _follow_cwd(old, rec.workspace)
    if rec.workspace:
        inside = [p for p in rec.paths if is_under(p, rec.workspace)]
        for p in inside:
            del rec.paths[p]
        if inside:
            rec.version += 1


def _same_dir(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _follow_cwd(old: str, new: str) -> None:
    """An env that ``chdir``ed into its workspace goes on in its own copy of it."""
    try:
        cwd = os.getcwd()
        if is_under(cwd, old):
            os.chdir(os.path.join(new, os.path.relpath(cwd, old)))
    except OSError:
        pass


def _refuse_foreign(rec: Record, event: str, args: tuple) -> None:
    """Raise :class:`ForeignWorkspaceError` when ``event`` names a path in ``rec.foreign``: the
    operation is aborted (an audit hook's exception is the operation's), so no other env's files
    are read or changed, and the env's step fails saying why -- where its writes would otherwise
    have mixed into another env's directory, silently."""
    if event == "subprocess.Popen":
        names = args[2:3]  # its working directory (a tool run in the project directory)
    elif event in _PATHLESS:
        return
    else:
        names = args[:2] if event in _TWO_PATHS else args[:1]
    for raw in names:
        if raw.__class__ is int or raw is None:
            continue
        try:
            p = os.fspath(raw)
            p = os.fsdecode(p) if p.__class__ is bytes else p
        except TypeError:
            continue
        if p.startswith("file:"):  # sqlite3.connect(uri=True)
            p = p[5:].partition("?")[0]
        if not p:
            continue
        p = os.path.normpath(p if p[0] == "/" else os.path.join(os.getcwd(), p))
        if is_under(p, rec.foreign):  # type: ignore[arg-type]
            raise ForeignWorkspaceError(
                f"gym_fork: {event} of {p} refused: this env is a copy (a fork() child, or restored into "
                f"another env) working in its own copy of the workspace, {rec.workspace}; {p} is in "
                f"{rec.foreign}, the workspace of the env it was copied from. Derive paths from "
                "self.workspace where you use them, not once in __init__: gym_fork sets the workspace "
                "attribute of every copy to its own directory")


def pending() -> dict[str, str] | None:
    """The worker's whole record when it changed since it was last sent, else None (the usual
    case: one integer comparison)."""
    rec = _worker
    if rec.version == rec.sent_version:
        return None
    rec.sent_version = rec.version
    now = rec.current()
    if now == rec.sent or (not now and rec.sent is None):
        rec.sent = now
        return None
    rec.sent = now
    return now


def resend() -> None:
    """Send the whole record again with the next reply (a new copy talks on a new channel)."""
    _worker.sent = None
    _worker.sent_version = -1


#: Logs and caches that libraries write on their own, whose content no env's behaviour depends on:
#: never refused (as if declared in ``untracked_paths``). MuJoCo appends its warnings to
#: ``MUJOCO_LOG.TXT`` in the current directory (e.g. a deprecation notice each time
#: HalfCheetah-v5's model compiles); OpenGL drivers cache compiled shaders when an env renders.
KNOWN_LOGS: tuple[str, ...] = ("*/MUJOCO_LOG.TXT", "*/.cache/mesa_shader_cache*", "*/.nv/GLCache*",
                                "*.monitor.csv")  # SB3's Monitor(filename=...), make_vec_env(monitor_dir=...)

#: this worker's env's ``untracked_paths`` (:func:`set_untracked`): what the fork-tier scan lets a
#: worker hold open as a log (:func:`is_log`)
_untracked: tuple[str, ...] = ()


def set_exit_log(path: str) -> None:
    """Name the controller's record of how copies end (:mod:`gym_fork.worker.exits`): for this
    worker's copies' parents, which inherit the environment, and for the filters here (its
    parents' writes are never the env's)."""
    global _EXIT_LOG
    os.environ[exits.PATH_ENV] = path
    _EXIT_LOG = os.path.normpath(path)


def set_untracked(patterns: Iterable[str]) -> None:
    """Tell this worker its env's ``untracked_paths`` (normalised by :func:`untracked_patterns`)."""
    global _untracked
    _untracked = tuple(patterns)


def is_log(path: str) -> bool:
    """Whether ``path`` is a file whose content no snapshot restores: it matches this worker's
    ``untracked_paths`` or a log gym_fork knows (:data:`KNOWN_LOGS`).

    Example:
        >>> is_log("/tmp/run/0.monitor.csv"), is_log("/tmp/run/state.json")
        (True, False)
    """
    return any(_matches(path, pat) for pat in (*_untracked, *KNOWN_LOGS))


# --- the controller's view --------------------------------------------------------------------------
def outside(record: dict[str, str] | None, workspace: str | None = None,
            untracked: Iterable[str] = ()) -> list[str]:
    """The paths in ``record`` that no snapshot holds: outside ``workspace`` and matching none of
    the ``untracked`` patterns (:func:`untracked_patterns`), sorted.

    Example:
        >>> outside({"/tmp/x/log.txt": "created", "/work/ws/db.sqlite": "modified"},
        ...         "/work/ws", ["/var/cache"])
        ['/tmp/x/log.txt']
    """
    if not record:
        return []
    pats = [*untracked, *KNOWN_LOGS]
    return sorted(p for p in record
                  if not (workspace and is_under(p, workspace)) and not any(_matches(p, pat) for pat in pats))


def untracked_patterns(patterns: str | Iterable[str] | None) -> tuple[str, ...]:
    """Normalise ``untracked_paths``: absolute (``~`` expanded, relative to the current
    directory), ``fnmatch`` patterns.

    Raises:
        TypeError: not a string or an iterable of strings.
    """
    if patterns is None:
        return ()
    if isinstance(patterns, (str, os.PathLike)):
        patterns = [patterns]  # type: ignore[list-item]
    out = []
    try:
        items = list(patterns)
    except TypeError:
        raise TypeError(f"untracked_paths must be a path pattern or a list of them, not "
                        f"{type(patterns).__name__}") from None
    for pat in items:
        pat = os.fspath(pat) if isinstance(pat, (str, os.PathLike)) else pat
        if not isinstance(pat, str) or not pat:
            raise TypeError(f"untracked_paths must be non-empty path patterns (str), not {pat!r}")
        out.append(os.path.normpath(os.path.abspath(os.path.expanduser(pat))))
    return tuple(out)


def _matches(path: str, pattern: str) -> bool:
    """``pattern`` matches ``path`` or a directory above it (``/tmp/cache`` covers its files)."""
    if fnmatch.fnmatchcase(path, pattern):
        return True
    parent = os.path.dirname(path)
    while parent != path:
        if fnmatch.fnmatchcase(parent, pattern):
            return True
        path, parent = parent, os.path.dirname(parent)
    return False


def is_under(path: str, directory: str) -> bool:
    """Whether ``path`` is ``directory`` or lies in it (both normalised absolute paths)."""
    return path == directory or path.startswith(directory.rstrip("/") + "/")


# --- the hook -----------------------------------------------------------------------------------------
def _hook(event: str, args: tuple) -> None:
    handler = _HANDLERS.get(event)
    if handler is None:
        return
    rec = _active
    if rec is None or (_thread is not None and threading.get_ident() != _thread):
        return
    if rec.foreign is not None:
        _refuse_foreign(rec, event, args)  # raises: aborts the operation, on purpose
    try:
        handler(rec, args)
    except Exception:  # noqa: BLE001 - an exception here would abort the env's own operation
        pass


def _path(raw: Any, dir_fd: Any, rec: Record) -> str | None:
    """``raw`` as a normalised absolute path, or None when it is not recorded."""
    if raw.__class__ is int:
        return None  # a descriptor: recorded when it was opened by name
    p = os.fspath(raw)
    if p.__class__ is bytes:
        p = os.fsdecode(p)
    if not p:
        return None
    if p[0] != "/":
        if dir_fd is not None and dir_fd != -1:
            return None  # relative to a directory descriptor (shutil.rmtree's walk: its event names the tree)
        p = os.path.join(os.getcwd(), p)
    p = os.path.normpath(p)
    if p.startswith(_SYSTEM) and (not p.startswith(_SHARED_MEMORY) or p.startswith(_OWN_SHARED)) \
            or "/__pycache__" in p or p in ("/dev", "/proc", "/sys") or p == _EXIT_LOG:
        return None
    if rec.workspace and is_under(p, rec.workspace):
        return None
    if rec.aliases and any(is_under(p, a) for a in rec.aliases):
        return None  # the workspace, by another name (a copy's bind)
    return p


def _lstat(p: str) -> os.stat_result | None:
    try:
        return os.lstat(p)
    except (OSError, ValueError):
        return None


def _changed(rec: Record, raw: Any, dir_fd: Any = None) -> None:
    """A write to ``raw`` (it is created when it did not exist)."""
    p = _path(raw, dir_fd, rec)
    if p is None or p in rec.paths:
        return
    st = _lstat(p)
    if st is not None and stat.S_ISSOCK(st.st_mode):
        socket_names.add(p)
        return  # a unix socket's name holds no content (listening sockets: the resources scan)
    rec.paths[p] = MODIFIED if st is not None else CREATED
    rec.version += 1


def _created(rec: Record, raw: Any, dir_fd: Any = None, kind: str = CREATED) -> None:
    """``raw`` is made (a directory, a link): nothing changes when it exists already (the call fails)."""
    p = _path(raw, dir_fd, rec)
    if p is None or p in rec.paths or _lstat(p) is not None:
        return
    rec.paths[p] = kind
    rec.version += 1


def _removed(rec: Record, raw: Any, dir_fd: Any = None) -> None:
    """``raw`` is removed: nothing changes when it does not exist."""
    p = _path(raw, dir_fd, rec)
    if p is None or p in rec.paths:
        return
    st = _lstat(p)
    if st is None:
        return
    if stat.S_ISSOCK(st.st_mode):
        socket_names.add(p)  # its removal, seen later by gym_fork.worker.fswatch, is no change either
        return
    rec.paths[p] = MODIFIED
    rec.version += 1


def _on_open(rec: Record, args: tuple) -> None:
    path, mode, flags = args
    if flags:
        if not flags & _WRITE_FLAGS or (_TMPFILE and flags & _TMPFILE == _TMPFILE):
            return
    elif mode is None or mode.__class__ is not str or _WRITE_MODE.isdisjoint(mode):
        return
    p = _path(path, None, rec)
    if p is None or p in rec.paths:
        return
    st = _lstat(p)
    if st is not None and stat.S_ISDIR(st.st_mode):
        return  # a directory opened for writing: an unnamed O_TMPFILE file (tempfile.TemporaryFile)
    rec.paths[p] = MODIFIED if st is not None else CREATED
    rec.version += 1


def _on_sqlite(rec: Record, args: tuple) -> None:
    db = args[0]
    if db.__class__ is not str:
        db = os.fsdecode(os.fspath(db))
    if not db or db == ":memory:":
        return
    if db.startswith("file:"):  # a URI (uri=True): read-only and in-memory databases write nothing
        db, _, query = db[5:].partition("?")
        if db.startswith("//"):
            db = db[2:]
        if not db or db == ":memory:" or "mode=ro" in query or "mode=memory" in query:
            return
    _changed(rec, db)


def _on_rename(rec: Record, args: tuple) -> None:
    src, dst, src_dir_fd, dst_dir_fd = args[:4]
    _removed(rec, src, src_dir_fd)
    _changed(rec, dst, dst_dir_fd)


on_spawn: Callable[[], None] | None = None  # gym_fork.worker.fswatch: the env started a process
quiet_fork = False  # gym_fork's own fork-tier fork() is not the env's


#: the prefix of a record entry that is a process an in-process env started, not a path
PROCESS = "<process started by the env: "


def _spawned(rec: Record, what: Any) -> None:
    """The env started a process running ``what`` (a program path, or None for a fork)."""
    if quiet_fork:
        return
    if rec is _worker:
        if on_spawn is not None:
            on_spawn()
        return
    # An in-process env (the pickle backend): what its processes write is seen by nobody (the
    # learner's own process is no worker with a namespace of its own), so it is recorded as
    # such, and the snapshot refused, naming the program.
    try:
        name = os.path.basename(os.fsdecode(what)) if what is not None else "a fork"
    except TypeError:
        name = "a program"
    key = f"{PROCESS}{name}>"
    if key not in rec.paths:
        rec.paths[key] = MODIFIED
        rec.version += 1


_TWO_PATHS = frozenset({"os.rename", "os.link", "os.symlink"})
_PATHLESS = frozenset({"os.posix_spawn", "os.spawn", "os.system", "os.fork", "os.forkpty"})


def _nothing(rec: Record, args: tuple) -> None:
    """Reads record nothing; they are hooked only for a copy's :func:`_refuse_foreign`."""


_HANDLERS: dict[str, Callable[[Record, tuple], None]] = {
    "os.listdir": _nothing,
    "os.scandir": _nothing,
    "os.chdir": _nothing,
    # processes the env starts (their writes are seen by gym_fork.worker.fswatch)
    "subprocess.Popen": lambda rec, a: _spawned(rec, a[0] or (a[1][0] if isinstance(a[1], (list, tuple)) and a[1]
                                                            else str(a[1]).split()[0] if a[1] else None)),
    "os.posix_spawn": lambda rec, a: _spawned(rec, a[0]),
    "os.spawn": lambda rec, a: _spawned(rec, a[1]),
    "os.system": lambda rec, a: _spawned(rec, os.fsdecode(a[0]).split()[0] if a[0] else "sh"),
    "os.fork": lambda rec, a: _spawned(rec, None),
    "os.forkpty": lambda rec, a: _spawned(rec, None),
    "open": _on_open,
    "sqlite3.connect": _on_sqlite,
    "os.rename": _on_rename,  # also os.replace
    "os.remove": lambda rec, a: _removed(rec, a[0], a[1]),  # also os.unlink
    "os.rmdir": lambda rec, a: _removed(rec, a[0], a[1]),
    "shutil.rmtree": lambda rec, a: _removed(rec, a[0], a[1]),
    "os.truncate": lambda rec, a: _changed(rec, a[0]),
    "os.mkdir": lambda rec, a: _created(rec, a[0], a[2], MADE_DIR),
    "os.link": lambda rec, a: _created(rec, a[1], a[3]),
    "os.symlink": lambda rec, a: _created(rec, a[1], a[2]),
    "os.chmod": lambda rec, a: _changed(rec, a[0], a[2]),
    "os.chown": lambda rec, a: _changed(rec, a[0], a[3]),
    "os.utime": lambda rec, a: _changed(rec, a[0], a[3]),
    "os.setxattr": lambda rec, a: _changed(rec, a[0]),
    "os.removexattr": lambda rec, a: _changed(rec, a[0]),
}

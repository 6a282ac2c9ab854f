"""Machine-wide slots for step rings: at most ``cpus - 1`` rings spin at a time on a machine.

A ring (:mod:`gym_fork.worker.ring`) pays off while its two processes can spin on CPUs of their
own. One controller process keeps at most ``cpus - 1`` rings, but a machine often runs several:
SB3's ``SubprocVecEnv`` over ``ForkableEnv`` factories (one controller per env), two training
scripts side by side, Ray actors. Each of them, counting only its own rings, opened one, and on
2 CPUs their spinning took the CPUs their workers needed: ``SubprocVecEnv(4)`` of CartPole stepped
1.11-1.29x slower with rings than without, ``SubprocVecEnv(8)`` up to 1.5x.

So a controller claims a *slot* before it opens a ring: a file ``slot-I`` (``I < cpus - 1``)
created with ``O_EXCL`` in a directory private to the user (``/dev/shm/gym_fork-rings-UID``, mode
0700, or ``$GYM_FORK_RING_SLOTS_DIR``), holding the claimant's pid and start time. Claiming needs no lock and holds no descriptor
(a CRIU image of a job holds none of it); a slot whose process is gone -- or whose pid now
belongs to another process -- is stale and taken over. A process in another PID namespace may
find a live claimant's slot stale and take it: one ring too many, never a wrong step.

Example::

    >>> slot = claim()  # None where no CPU is free for another ring
    >>> slot is None or (slot.release() is None)
    True
"""

from __future__ import annotations

import os
import stat
import sys
import tempfile
import time
import warnings

# The slot directories already warned about (once each: a bad directory is asked at every env).
_warned: set[str] = set()


class Slot:
    """A claimed slot; :meth:`release` frees it (only in the process that claimed it: a child
    forked meanwhile inherits the object, not the claim)."""

    __slots__ = ("path", "pid", "identity")

    def __init__(self, path: str | None, identity: bytes = b""):
        self.path = path  # None: a slot that stands for none (tests that force rings)
        self.pid = os.getpid()
        self.identity = identity

    def release(self) -> None:
        path, self.path = self.path, None
        if path is None or os.getpid() != self.pid:
            return
        if _read(path) == self.identity:  # still ours (not taken over as stale meanwhile)
            try:
                os.unlink(path)
            except OSError:
                pass


def directory() -> str:
    """Where this user's slots live: ``$GYM_FORK_RING_SLOTS_DIR`` (processes given the same one
    share the slots), else on tmpfs (``/dev/shm``) where there is one."""
    chosen = os.environ.get("GYM_FORK_RING_SLOTS_DIR")
    if chosen:
        return chosen
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    return os.path.join(base, f"gym_fork-rings-{os.getuid()}")


def count() -> int:
    """How many slots the machine has: one per CPU but one (the learner's)."""
    return max(0, (os.cpu_count() or 1) - 1)


def held() -> list[int]:
    """The pids (as ``/proc`` shows them) of the live processes holding a slot now."""
    d = directory()
    out = []
    for i in range(count()):
        content = _read(os.path.join(d, f"slot-{i}"))
        if content and _identity(int(content.split()[0])) == content:
            out.append(int(content.split()[0]))
    return out


def claim() -> Slot | None:
    """A free slot, or None when every slot is held by a live process. A slot directory that
    cannot hold slots, or is not this user's alone, gives None too (no ring, rather than trust
    it) and a :class:`RuntimeWarning` naming it, once per directory."""
    d = directory()
    why = problem(d, create=True)
    if why is not None:
        return _refuse(d, why)
    me = _identity("self")
    if me is None:
        return _refuse(d, "/proc/self/stat cannot be read (is /proc mounted?)")
    for i in range(count()):
        path = os.path.join(d, f"slot-{i}")
        for _attempt in range(2):  # the second after taking over a stale slot
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            except FileExistsError:
                if not _stale(path):
                    break
                try:
                    os.unlink(path)
                except OSError:
                    break
                continue
            except OSError as e:
                return _refuse(d, f"a slot cannot be written there ({e.strerror})")
            try:
                os.write(fd, me)
            finally:
                os.close(fd)
            return Slot(path, me)
    return None


def problem(d: str | None = None, *, create: bool = False) -> str | None:
    """Why slot directory ``d`` (default: :func:`directory`) cannot hold slots, or None where it
    can. With ``create``, a missing directory is made (mode 0700); without, a missing one is
    fine where its parent lets this user make it."""
    d = d or directory()
    if create:
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass
        except OSError as e:
            return f"it cannot be created ({e.strerror})"
    try:
        st = os.lstat(d)
    except FileNotFoundError:
        parent = os.path.dirname(os.path.abspath(d))
        if not create and os.path.isdir(parent) and os.access(parent, os.W_OK | os.X_OK):
            return None
        return "it does not exist and cannot be created there"
    except OSError as e:
        return f"it cannot be read ({e.strerror})"
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a directory"
    if st.st_uid != os.getuid():
        return f"user {st.st_uid} owns it, not this user ({os.getuid()})"
    if st.st_mode & 0o077:
        return f"others may use it (mode {stat.S_IMODE(st.st_mode):o}; it must be 700)"
    return None


def _refuse(d: str, why: str) -> None:
    """No slot from directory ``d``; say so once, with what to do (the env still steps, through
    its socket: correct, only slower)."""
    if d not in _warned:
        _warned.add(d)
        warnings.warn(f"no step ring: the ring slot directory {d} cannot be used: {why}. Envs step "
                      "through their sockets instead (slower). Set GYM_FORK_RING_SLOTS_DIR to a "
                      "directory only you can write (mode 700), or GYM_FORK_RING=0 to turn rings "
                      "off and silence this.", RuntimeWarning, stacklevel=_outside_gym_fork())
    return None


def _outside_gym_fork() -> int:
    """The ``stacklevel`` (for a ``warnings.warn`` in the caller) of the first frame outside the
    gym_fork package: the user's line that led here (a ``step()``), not the ring's opening."""
    frame, level = sys._getframe(2), 2
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] == "gym_fork":
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 1


def _identity(pid: int | str) -> bytes | None:
    """``b"PID STARTTIME"`` of a process (``"self"``: this one), told apart from a later one
    with the same pid. The pid is as ``/proc`` shows it (this process may be in a PID namespace
    of its own, where ``os.getpid()`` means another process to everyone else)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            head, tail = f.read().rsplit(b")", 1)
        return b"%s %s" % (head.split(b" ", 1)[0], tail.split()[19])  # field 22: start time (ticks since boot)
    except (OSError, ValueError, IndexError):
        return None


def _read(path: str) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return os.read(fd, 64)
    finally:
        os.close(fd)


def _stale(path: str) -> bool:
    """Whether the process that claimed ``path`` is gone (or its pid is another's now). A slot
    not written yet (its claimant is between create and write) is stale only once it is old."""
    content = _read(path)
    if content is None:
        return False  # gone already: the next create will say
    if not content:
        try:
            return time.time() - os.stat(path).st_mtime > 5.0
        except OSError:
            return False
    try:
        pid = int(content.split()[0])
    except (ValueError, IndexError):
        return True
    return _identity(pid) != content

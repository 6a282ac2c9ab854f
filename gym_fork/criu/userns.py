"""CRIU without root: a long-lived *holder* process owning an unprivileged user + mount namespace.

Stock CRIU 4.x needs no privilege when it runs inside a user namespace in which the user is
root, with a mount namespace owned by that user namespace, and ``--unprivileged``.  The
controller itself stays in the host namespaces (a multi-threaded trainer cannot ``unshare(CLONE_NEWUSER)``):

* the holder is ``python -S`` that ``unshare(CLONE_NEWUSER | CLONE_NEWNS)``s, maps uid/gid 0 to
  the user, reports ``ok`` and blocks on its stdin; it exits when the controller goes away
  (EOF), and the namespaces live as long as any process in them;
* every env worker is started *through* it: the launcher ``setns()``es into the holder's user
  and mount namespaces, opens its stdio there, ``chdir``s to a writable directory (CRIU's
  parasite mounts a proc there) and becomes PID 1 of a new PID namespace;
* criu runs through a wrapper script ``nsenter --preserve-credentials -U -m --wd -t HOLDER criu``
  (pycriu execs a binary path); dumps and restores pass ``--unprivileged``.

:func:`get_holder` starts the holder on first use, per process; :func:`userns_support` says
whether unprivileged user namespaces can be created here and, if not, what an administrator
can change.
"""

from __future__ import annotations

import atexit
import errno
import functools
import os
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass, field

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000

# The holder: unshare user+mount namespaces, map root to us, say "ok", wait for EOF on stdin.
_HOLDER = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
uid, gid = os.geteuid(), os.getegid()
def fail(step):
    e = ctypes.get_errno()
    sys.stdout.write("E %d %s %s\n" % (e, step, os.strerror(e))); sys.stdout.flush(); os._exit(3)
if libc.unshare(0x10000000) != 0:  # CLONE_NEWUSER
    fail("unshare(CLONE_NEWUSER)")
try:
    with open("/proc/self/setgroups", "w") as f: f.write("deny")
    with open("/proc/self/uid_map", "w") as f: f.write("0 %d 1" % uid)
    with open("/proc/self/gid_map", "w") as f: f.write("0 %d 1" % gid)
except OSError as e:
    sys.stdout.write("E %d uid_map %s\n" % (e.errno, e.strerror)); sys.stdout.flush(); os._exit(3)
if libc.unshare(0x00020000) != 0:  # CLONE_NEWNS
    fail("unshare(CLONE_NEWNS)")
os.chdir(sys.argv[1])
sys.stdout.write("ok %d\n" % os.getpid()); sys.stdout.flush()
sys.stdin.buffer.read()  # until the controller goes away
"""


@dataclass
class UsernsSupport:
    """Whether this user can create the holder's namespaces, and what blocks it if not."""

    ok: bool
    error: str | None = None
    blockers: list[str] = field(default_factory=list)  # sysctls / LSMs found in the way
    admin_fix: list[str] = field(default_factory=list)  # what an administrator can change


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def userns_blockers() -> tuple[list[str], list[str]]:
    """Known switches that disable unprivileged user namespaces: (what is set, how to change it)."""
    found, fix = [], []
    v = _read("/proc/sys/user/max_user_namespaces")
    if v == "0":
        found.append("user.max_user_namespaces = 0")
        fix.append("sysctl -w user.max_user_namespaces=15000 (persist it in /etc/sysctl.d/)")
    v = _read("/proc/sys/kernel/unprivileged_userns_clone")
    if v == "0":
        found.append("kernel.unprivileged_userns_clone = 0 (Debian/older Ubuntu kernels)")
        fix.append("sysctl -w kernel.unprivileged_userns_clone=1 (persist it in /etc/sysctl.d/)")
    v = _read("/proc/sys/kernel/apparmor_restrict_unprivileged_userns")
    if v == "1":
        found.append("kernel.apparmor_restrict_unprivileged_userns = 1 (Ubuntu >= 23.10 AppArmor)")
        fix.append("sysctl -w kernel.apparmor_restrict_unprivileged_userns=0, or an AppArmor profile "
                   "granting 'userns,' to this Python interpreter (see Ubuntu's 'unprivileged_userns' docs)")
    return found, fix


def _explain(errno_: int, step: str, text: str) -> UsernsSupport:
    found, fix = userns_blockers()
    err = f"{step} failed: {text} (errno {errno_})"
    if not found:
        if errno_ == errno.ENOSPC:  # a user.max_user_namespaces limit of 0 here or in a parent namespace
            found.append("user.max_user_namespaces is 0 in this or a parent user namespace (ENOSPC)")
            fix.append("raise user.max_user_namespaces (sysctl) where it is 0; inside a container, on the host")
        elif errno_ == errno.EPERM:
            found.append("creating a user namespace is not permitted (seccomp, e.g. Docker's default "
                         "profile, an LSM, or a sysctl)")
            fix.append("allow unshare(CLONE_NEWUSER): e.g. docker run --security-opt seccomp=unconfined, "
                       "or the sysctls kernel.unprivileged_userns_clone=1 / "
                       "kernel.apparmor_restrict_unprivileged_userns=0")
    return UsernsSupport(False, err, found, fix)


class UsernsUnavailable(OSError):
    def __init__(self, support: UsernsSupport):
        super().__init__(support.error)
        self.support = support


class Holder:
    """The long-lived process owning this session's user + mount namespace."""

    def __init__(self, workdir: str):
        self.workdir = workdir
        self.proc = subprocess.Popen(
            [sys.executable, "-S", "-c", _HOLDER, workdir], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True,
        )
        line = self.proc.stdout.readline().decode(errors="replace").strip().split(maxsplit=3)
        if not line or line[0] != "ok":
            self.proc.stdin.close()
            self.proc.wait()
            if line and line[0] == "E":
                self.support = _explain(int(line[1]), line[2], line[3] if len(line) > 3 else "")
            else:
                self.support = UsernsSupport(False, f"the namespace holder failed (exit {self.proc.returncode})")
            raise UsernsUnavailable(self.support)
        self.pid = self.proc.pid
        self.support = UsernsSupport(True)
        self._wrapper: dict[str, str] = {}

    def alive(self) -> bool:
        return self.proc.poll() is None

    def criu_wrapper(self, criu: str) -> str:
        """An executable that runs ``criu`` inside the holder's namespaces (pycriu execs a path)."""
        if criu not in self._wrapper:
            nsenter = shutil.which("nsenter") or "/usr/bin/nsenter"
            path = os.path.join(self.workdir, f"criu-userns-{self.pid}")
            tmp = path + ".tmp"
            with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o700), "w") as f:
                # bare --wd: the holder's cwd, *inside* its mount namespace (the parasite mounts there)
                f.write(f"#!/bin/sh\nexec {nsenter} --preserve-credentials -U -m --wd -t {self.pid} {criu} \"$@\"\n")
            os.replace(tmp, path)
            self._wrapper[criu] = path
        return self._wrapper[criu]

    def close(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()


_lock = threading.Lock()
_holder: Holder | None = None


def get_holder() -> Holder:
    """This process's holder, started on first use (and again if it died). Raises OSError with the
    reason when user namespaces cannot be created."""
    global _holder
    with _lock:
        if _holder is None or not _holder.alive():
            from gym_fork.snapshots import sessiondir

            _holder = Holder(sessiondir.session_dir())
            atexit.register(_holder.close)
        return _holder


@functools.lru_cache(maxsize=1)
def userns_support() -> UsernsSupport:
    """Can this process create an unprivileged user + mount namespace? (starts the holder)"""
    try:
        return get_holder().support
    except UsernsUnavailable as e:
        return e.support
    except OSError as e:
        return UsernsSupport(False, f"the namespace holder could not start: {e}")

"""Finding CRIU and checking that it works here.

``criu_status()`` answers "can gym_fork use CRIU here, and if not, why not?" once per process;
``backend="auto"`` and ``gym-fork doctor`` both ask it.  Also the small facts every CRIU call
needs: its timeout, a pycriu client for a binary, the tail of its log, a bound on image sizes.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

MIN_MAJOR = 4
_CANDIDATES = ("/usr/local/sbin/criu", "/usr/sbin/criu", "/usr/local/bin/criu", "/usr/bin/criu")


@dataclass
class CriuStatus:
    usable: bool
    binary: str | None = None
    version: str | None = None
    check_output: str = ""
    pycriu: str | None = None  # pycriu version, or None when it does not import
    is_root: bool = False
    reasons: list[str] = field(default_factory=list)  # why it is not usable
    advice: list[str] = field(default_factory=list)  # what to do about it
    rejected: list[str] = field(default_factory=list)  # criu binaries passed over, and why
    # How CRIU runs: "root" (host namespaces), "userns" (non-root: inside the holder's user +
    # mount namespace with --unprivileged, see gym_fork.criu.userns) or None when it cannot run.
    mode: str | None = None
    userns: object | None = None  # gym_fork.criu.userns.UsernsSupport, for non-root users


def binary_version(path: str) -> str | None:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"Version:\s*([0-9][0-9.]*)", out)
    return m.group(1) if m else None


def _candidate_paths() -> list[str]:
    """Existing criu files in search order: ``$GYM_FORK_CRIU``, PATH, then the usual places."""
    out: list[str] = []
    for c in (os.environ.get("GYM_FORK_CRIU"), shutil.which("criu"), *_CANDIDATES):
        if c and c not in out and os.path.isfile(c):
            out.append(c)
    return out


def _judge(path: str) -> tuple[str | None, str | None]:
    """(version, why it is rejected or None when it is acceptable)."""
    ver = binary_version(os.path.realpath(path))
    if ver is None:
        return None, "does not run"
    if int(ver.split(".")[0]) < MIN_MAJOR:
        return ver, f"version {ver} is too old (need >= {MIN_MAJOR}.0; 3.x fails on recent kernels)"
    return ver, None


def find_criu() -> tuple[str | None, str | None, list[str]]:
    """The first criu >= 4 found: ``$GYM_FORK_CRIU``, then PATH, then the usual places.

    Returns (path, version, notes about rejected candidates).
    """
    notes: list[str] = []
    for c in _candidate_paths():
        ver, why = _judge(c)
        if why is not None:
            notes.append(f"{c}: {why}")
            continue
        return os.path.abspath(c), ver, notes
    return None, None, notes


def criu_candidates() -> list[dict]:
    """Every criu binary in the search order, each ``{"path", "version", "rejected"}``.

    Unlike :func:`find_criu` this does not stop at the first usable one, so ``gym-fork doctor``
    can also mention binaries that are present but ignored (e.g. Debian's criu 3.17).
    ``rejected`` is ``None`` for an acceptable binary, else why it is passed over.
    """
    return [dict(zip(("path", "version", "rejected"), (c, *_judge(c)))) for c in _candidate_paths()]


KDAT_DIR = "/run/gym_fork-criu"  # `gym-fork install-criu` builds CRIU with RUNDIR=KDAT_DIR


def ensure_kdat_cache(binary: str) -> bool:
    """Mount the small root-only tmpfs where our CRIU build caches its kernel probe (criu.kdat).

    CRIU keeps that cache only on a tmpfs; without it every dump and restore re-probes the kernel
    first.  A mount does not survive a reboot, so gym_fork re-creates it on first use.
    Returns True when the cache directory is usable."""
    try:
        with open(binary, "rb") as f:
            if (KDAT_DIR + "/criu.kdat").encode() not in f.read():
                return False  # not our build: its cache lives wherever its builder chose
        if os.path.ismount(KDAT_DIR):
            return True
        if os.geteuid() != 0:
            return False
        os.makedirs(KDAT_DIR, mode=0o700, exist_ok=True)
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "gym_fork-criu-kdat", KDAT_DIR],
                           capture_output=True, timeout=10)
        return r.returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@functools.lru_cache(maxsize=1)
def criu_status() -> CriuStatus:
    st = CriuStatus(usable=False, is_root=os.geteuid() == 0)
    st.binary, st.version, notes = find_criu()
    if st.binary and st.is_root:
        ensure_kdat_cache(st.binary)
    st.rejected.extend(notes)
    if st.binary is None:  # a rejected binary only matters when no acceptable one was found
        st.reasons.extend(notes)
    try:
        import pycriu  # noqa: F401
        from pycriu import rpc_pb2  # noqa: F401

        st.pycriu = getattr(getattr(pycriu, "version", None), "__version__", None) or "installed"
    except Exception as e:  # noqa: BLE001
        st.reasons.append(f"pycriu does not import ({type(e).__name__}: {e})")
        st.advice.append("run `gym-fork install-criu` (it installs pycriu into the Python gym_fork runs in)")
    if st.binary is None:
        st.reasons.append("no criu >= 4.0 found (looked at $GYM_FORK_CRIU, PATH, /usr/local/sbin, /usr/sbin)")
        st.advice.append("run `sudo $(which gym-fork) install-criu` to build CRIU 4.1.1")
    if not st.is_root and st.binary and not st.reasons:
        # Non-root: CRIU works inside an unprivileged user + mount namespace (--unprivileged).
        # `criu check` does not predict that; doctor probes it with a real dump/restore.
        from gym_fork.criu.userns import userns_support

        st.userns = us = userns_support()
        if us.ok:
            st.mode = "userns"
        else:
            st.reasons.append(f"not root, and unprivileged user namespaces are unavailable ({us.error}"
                              + (": " + "; ".join(us.blockers) if us.blockers else "") + ")")
            st.advice.append("an administrator can: " + "; ".join(us.admin_fix) if us.admin_fix
                             else "run as root, or allow unprivileged user namespaces")
    if st.binary and st.is_root:
        try:
            p = subprocess.run([st.binary, "check"], capture_output=True, text=True, timeout=60)
            st.check_output = (p.stdout + p.stderr).strip()
            if p.returncode != 0:
                st.reasons.append(f"`criu check` failed: {st.check_output.splitlines()[-1:]}")
                st.advice.append("see `criu check` output; a too-old kernel or missing features cannot be fixed here")
        except (OSError, subprocess.TimeoutExpired) as e:
            st.reasons.append(f"`criu check` did not run: {e}")
    st.usable = not st.reasons
    if st.usable and st.mode is None:
        st.mode = "root"
    return st


def criu_timeout() -> float:
    """Seconds any one CRIU dump/restore may take before it is killed ($GYM_FORK_CRIU_TIMEOUT, 60)."""
    try:
        return float(os.environ.get("GYM_FORK_CRIU_TIMEOUT", "60"))
    except ValueError:
        return 60.0


def new_client(binary: str):
    """A pycriu client bound to ``binary`` (absolute: pycriu execs it without a PATH lookup)."""
    import pycriu

    c = _client_class(pycriu.criu)()
    c.use_binary(binary)
    c._comm = _safe_comm(type(c._comm))(binary)
    return c


_CLIENT: Any = None


def _client_class(base: type) -> type:
    """pycriu's client, made to wait for its criu when a request fails: pycriu waits for criu
    only after a complete exchange, so a criu that exited before our request was sent (the send
    fails) stayed a zombie, and its socket open, for as long as the learner ran."""
    global _CLIENT
    if _CLIENT is not None:
        return _CLIENT

    class Client(base):  # type: ignore[misc, valid-type]
        def _send_req_and_recv_resp(self, req: Any) -> Any:
            try:
                return super()._send_req_and_recv_resp(req)
            except BaseException:
                if not getattr(req, "keep_open", False):
                    abandon = getattr(self._comm, "abandon", None)
                    if abandon is not None:
                        abandon()
                raise

    _CLIENT = Client
    return Client


_SAFE_COMM: Any = None


def _safe_comm(base: type) -> type:
    """pycriu's ``swrk`` launcher, made safe in a threaded process: its forked child runs Python
    until it execs criu, and if that exec fails (e.g. ETXTBSY) the exception would carry the
    child -- a copy of this whole process, restore threads and all -- back into our code, while
    the parent waits for a criu that never comes.  Here the child always ends in exec or
    ``_exit(127)`` (the parent then reads EOF at once)."""
    global _SAFE_COMM
    if _SAFE_COMM is not None:
        return _SAFE_COMM
    import socket as _socket
    import struct

    class SafeBinComm(base):  # type: ignore[misc, valid-type]
        _proc: Any = None

        def connect(self, daemon: bool) -> Any:
            if not daemon:
                return self._spawn()
            css = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_SEQPACKET)
            os.set_inheritable(css[0].fileno(), True)
            self.daemon = daemon
            pid = os.fork()
            if pid == 0:
                try:
                    if daemon:
                        if os.fork() != 0:
                            os._exit(0)
                        os.setsid()
                    for fd in (0, 1, 2):
                        os.close(fd)
                    css[0].send(struct.pack("i", os.getpid()))
                    os.execv(self.comm, [self.comm, "swrk", "%d" % css[0].fileno()])
                finally:
                    os._exit(127)
            if daemon:
                os.waitpid(pid, 0)
            css[0].close()
            self.swrk = struct.unpack("i", css[1].recv(4))[0]
            self.sk = css[1]
            return self.sk

        def _spawn(self) -> Any:
            # vfork + exec (subprocess), not fork: a fork copies the page tables of the whole
            # learner (torch and all), several ms on a virtual machine, on every dump and restore
            import subprocess

            ours, theirs = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_SEQPACKET)
            os.set_inheritable(theirs.fileno(), True)
            theirs_ino = os.fstat(theirs.fileno()).st_ino
            try:
                # close_fds=False: criu gets what the caller made inheritable (the images dir, the
                # channels named in inherit_fd), as a fork + exec would give it. A process group of
                # its own: the tasks of a restore, clones of criu, are in it until they restore
                # theirs, so that a criu cut short at its timeout takes them along (client._kill_criu)
                self._proc = subprocess.Popen(
                    [self.comm, "swrk", str(theirs.fileno())], close_fds=False, process_group=0,
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            except BaseException as e:
                if not isinstance(e, Exception):
                    # Ctrl-C inside Popen, after the fork and before its pid came back: that criu
                    # holds the socket's other end (killed and waited for; else a zombie for good)
                    kill_socket_holders(theirs_ino)
                ours.close()
                raise
            finally:
                theirs.close()
            self.swrk = self._proc.pid
            self.sk = ours
            return ours

        def disconnect(self) -> None:
            if self._proc is None:
                return super().disconnect()
            self.sk.close()
            self._proc.wait()

        def abandon(self) -> None:
            """After a failed exchange: close our end (a criu still reading gets EOF and exits)
            and wait for criu; one still running after a few seconds is killed with its process
            group (its helpers, and the tasks of a restore, share it: see client._kill_criu)."""
            proc, self._proc = self._proc, None
            if proc is None:
                return
            sk = getattr(self, "sk", None)
            if sk is not None:
                sk.close()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, 9)  # started with process_group=0: it leads its group
                except ProcessLookupError:
                    pass
                proc.wait()

    _SAFE_COMM = SafeBinComm
    return SafeBinComm


def log_tail(path: str, lines: int = 8) -> str:
    """The last error-ish lines of a CRIU log, for exception messages."""
    try:
        with open(path, errors="replace") as f:
            text = f.read().splitlines()
    except OSError:
        return f"(no log at {path})"
    noise = "RLIMIT_NOFILE"  # harmless in sandboxes without CAP_SYS_RESOURCE
    errs = [ln for ln in text if ("Error" in ln or "rror (" in ln) and noise not in ln]
    return "\n".join((errs or text)[-lines:])


def children_by_parent() -> dict[int, list[int]]:
    """Every process's children, by their parent's pid (``/proc/*/stat``; one pass).

    Not the per-thread ``/proc/PID/task/TID/children`` files: a child is listed under the thread
    that made it and moves to another thread of its parent when that one ends, so reading those
    files one by one across such a move can miss it (a test saw a worker "gone" that was still
    exiting). The parent's pid in ``stat`` is the process's, whichever of its threads holds it."""
    out: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # (gone meanwhile)
            continue
        out.setdefault(ppid, []).append(int(name))
    return out


def dump_size_bound(pid: int, *, tree: bool = False) -> int:
    """An upper bound on the CRIU images of ``pid`` (``tree``: and all its descendants): resident
    memory (CRIU dumps at most the resident private pages; no swap here) plus 32 MiB of
    metadata. Announced to a receiving agent before images are streamed while they are dumped."""
    total, todo, seen = 0, [pid], set()
    kids = children_by_parent() if tree else {}
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            with open(f"/proc/{p}/status") as f:
                total += next((int(x.split()[1]) * 1024 for x in f if x.startswith("VmRSS:")), 0)
        except OSError:
            continue
        todo.extend(kids.get(p, ()))
    return total + (32 << 20)


def reap(pids: list[int], timeout: float = 2.0) -> None:
    """Wait for the SIGKILLed ``pids`` that are this process's children (a half-restored task is:
    criu clones it as its caller's child), so none stays a zombie; others are not ours to wait for."""
    deadline = time.monotonic() + timeout
    for pid in pids:
        while True:
            try:
                if os.waitpid(pid, os.WNOHANG)[0] or time.monotonic() > deadline:
                    break
            except ChildProcessError:
                break
            time.sleep(0.001)


def kill_socket_holders(ino: int) -> list[int]:
    """SIGKILL every process of ours holding ``socket:[ino]`` (a restore that was cut short);
    returns their pids."""
    target, killed = f"socket:[{ino}]", []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            fds = os.listdir(f"/proc/{name}/fd")
            if any(os.readlink(f"/proc/{name}/fd/{fd}") == target for fd in fds):
                os.kill(int(name), signal.SIGKILL)
                killed.append(int(name))
        except OSError:
            continue
    reap(killed)
    return killed

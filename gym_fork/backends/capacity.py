"""How many copies of an env this machine can hold: ``fork(snap, n)`` and ``explore(n_branches=n)``
check ``n`` before starting anything.

Each copy costs processes and threads (a worker, or a whole restored tree) and memory: a CRIU
restore holds every page of the images privately; a copy-on-write clone starts sharing its
pages and privately holds what it rewrites (a fraction of the snapshot's anonymous memory, a
quarter is assumed); a pickle copy lives in this process (a few times its pickle).  The request
is refused, with the numbers, when it exceeds

* pids: ``/proc/sys/kernel/pid_max`` and ``threads-max`` minus the threads that exist now
  (``/proc/loadavg``), ``RLIMIT_NPROC`` for non-root users, and a ``pids`` cgroup limit;
* memory: ``MemAvailable`` and a memory cgroup limit (90% of what is free).

The memory check is an estimate: ``max_copies=N`` (or ``$GYM_FORK_MAX_COPIES``) replaces it by
"at most N"; the process limits are the kernel's and always apply.
"""

from __future__ import annotations

import dataclasses
import operator
import os
import resource
from typing import Any

from gym_fork.errors import CapacityError

ENV_VAR = "GYM_FORK_MAX_COPIES"
_RESERVE_PIDS = 64  # left for everything else on the machine
_MEMORY_SHARE = 0.9
_CLONE_SHARE = 4  # a copy-on-write clone privately holds about 1/4 of its anonymous memory
_PROCESS_OVERHEAD = 1 << 20  # page tables, kernel stacks, ... per process


@dataclasses.dataclass
class CopyCost:
    """What one more copy of a snapshot costs: processes, threads, bytes, and how it is made."""

    processes: int
    threads: int
    memory: int
    how: str


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None  # "max": no limit


_PAGE = os.sysconf("SC_PAGE_SIZE")


def _anonymous_bytes(pid: int) -> int | None:
    """``pid``'s resident anonymous memory (its ``RssAnon``), from ``/proc/PID/statm``: resident
    minus shared pages (file and shmem).  Read on every ``fork()``: ``smaps_rollup`` gives the
    same number by walking every page table, 0.4-1 ms for a 50 MB worker, ~30x this."""
    fields = (_read(f"/proc/{pid}/statm") or "").split()
    if len(fields) < 3 or not (fields[1].isdigit() and fields[2].isdigit()):
        return None
    return max(int(fields[1]) - int(fields[2]), 0) * _PAGE


def copy_cost(payload: Any) -> CopyCost:
    """The cost of one restored copy of ``payload`` (a payload of any backend)."""
    from gym_fork.backends.criu import CriuPayload, ForkPayload
    from gym_fork.backends.pickle import PickleFile

    if isinstance(payload, (bytes, bytearray, PickleFile)):
        size = payload.size if isinstance(payload, PickleFile) else len(payload)
        return CopyCost(0, 0, max(3 * size, 64 << 10), "an unpickled copy in this process")
    if isinstance(payload, ForkPayload) and payload.chan is not None:
        anon = _anonymous_bytes(payload.pid)
        anon = 64 << 20 if anon is None else anon
        return CopyCost(1, 1, anon // _CLONE_SHARE + _PROCESS_OVERHEAD, "a copy-on-write clone")
    image = payload.image if isinstance(payload, ForkPayload) else payload
    if isinstance(image, CriuPayload):
        try:
            names = os.listdir(image.path)
        except OSError:
            names = []
        pages = sum(_size(os.path.join(image.path, n)) for n in names if n.startswith("pages-"))
        procs = sum(n.startswith("mm-") for n in names) or 1
        threads = sum(n.startswith("core-") for n in names) or procs
        return CopyCost(procs, threads, pages + procs * _PROCESS_OVERHEAD, "a CRIU restore of its images")
    return CopyCost(1, 1, 64 << 20, "a new worker")


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _cgroup_paths(controller: str) -> list[str]:
    """This process's cgroup directories for ``controller`` (v2 unified, then v1)."""
    out = []
    for line in (_read("/proc/self/cgroup") or "").splitlines():
        hid, ctrls, path = (line.split(":", 2) + ["", ""])[:3]
        if hid == "0" and ctrls == "":
            out.append(os.path.join("/sys/fs/cgroup", path.lstrip("/")))
        elif controller in ctrls.split(","):
            out.append(os.path.join("/sys/fs/cgroup", controller, path.lstrip("/")))
    return out


def _cgroup_free(controller: str, limit_files: tuple[str, str], use_files: tuple[str, str]) -> int | None:
    best = None
    for d in _cgroup_paths(controller):
        for limit_f, use_f in zip(limit_files, use_files):
            limit, used = _int(_read(os.path.join(d, limit_f))), _int(_read(os.path.join(d, use_f)))
            if limit is not None and used is not None and limit < (1 << 60):
                free = max(limit - used, 0)
                best = free if best is None else min(best, free)
    return best


def limits() -> dict[str, tuple[int, str]]:
    """What is free now: ``{"pids"|"threads"|"memory": (amount, where the limit comes from)}``."""
    out: dict[str, tuple[int, str]] = {}
    loadavg = (_read("/proc/loadavg") or "0 0 0 0/0").split()
    threads_now = _int(loadavg[3].split("/")[1]) if len(loadavg) > 3 else 0
    pid_max = _int(_read("/proc/sys/kernel/pid_max"))
    if pid_max:
        out["pids"] = (pid_max - (threads_now or 0), f"pid_max {pid_max}, {threads_now} in use")
    threads_max = _int(_read("/proc/sys/kernel/threads-max"))
    if threads_max:
        out["threads"] = (threads_max - (threads_now or 0), f"threads-max {threads_max}, {threads_now} in use")
    soft, _hard = resource.getrlimit(resource.RLIMIT_NPROC)
    if os.geteuid() != 0 and soft != resource.RLIM_INFINITY:
        mine = _user_threads()
        free = soft - mine
        if "threads" not in out or free < out["threads"][0]:
            out["threads"] = (free, f"RLIMIT_NPROC {soft}, {mine} of this user's in use")
    pids_cg = _cgroup_free("pids", ("pids.max",), ("pids.current",))
    if pids_cg is not None and ("pids" not in out or pids_cg < out["pids"][0]):
        out["pids"] = (pids_cg, "the pids cgroup's pids.max")
    mem = None
    for line in (_read("/proc/meminfo") or "").splitlines():
        if line.startswith("MemAvailable:"):
            mem = int(line.split()[1]) * 1024
    if mem is not None:
        out["memory"] = (mem, "MemAvailable")
    mem_cg = _cgroup_free("memory", ("memory.max", "memory.limit_in_bytes"),
                          ("memory.current", "memory.usage_in_bytes"))
    if mem_cg is not None and ("memory" not in out or mem_cg < out["memory"][0]):
        out["memory"] = (mem_cg, "the memory cgroup's limit")
    return out


def _user_threads() -> int:
    uid, n = os.getuid(), 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                st = os.stat(f"/proc/{name}")
            except OSError:
                continue
            if st.st_uid == uid:
                n += len(os.listdir(f"/proc/{name}/task")) if os.path.isdir(f"/proc/{name}/task") else 1
    return n


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def count(value: Any, name: str) -> int:
    """``value`` as a count (>= 1): an ``int`` or anything with ``__index__`` (NumPy integers),
    never a bool, str or float.  Raises TypeError (naming the expected type) or ValueError."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int (how many), not a bool")
    try:
        n = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int (how many), not {type(value).__name__} {value!r}") from None
    if n < 1:
        raise ValueError(f"{name} must be >= 1, got {n}")
    return n


def check_copies(payload: Any, n: int, *, max_copies: int | None = None) -> None:
    """Refuse ``n`` copies of ``payload`` that this machine cannot hold.

    Args:
        payload: the snapshot's payload (any backend).
        n: how many copies are asked for.
        max_copies: replaces the memory estimate by "at most this many" (default:
            ``$GYM_FORK_MAX_COPIES``, else the estimate).

    Raises:
        CapacityError: with the numbers, the limit, and how to override the estimate.
    """
    if max_copies is None and os.environ.get(ENV_VAR):
        try:
            max_copies = int(os.environ[ENV_VAR])
        except ValueError:
            raise CapacityError(f"${ENV_VAR} must be an integer, not {os.environ[ENV_VAR]!r}") from None
    cost = copy_cost(payload)
    free = limits()
    override = (f" Pass max_copies=N to fork() or explore() (or set ${ENV_VAR}=N) to allow up to N copies "
                "whatever the memory estimate says; the kernel's process limits still apply.")
    for kind, per in (("pids", cost.threads), ("threads", cost.threads)):
        if per and kind in free:
            fit = max(free[kind][0] - _RESERVE_PIDS, 0) // per
            if n > fit:
                raise CapacityError(
                    f"{n} copies of this env refused: each copy ({cost.how}) needs {per} {kind[:-1]}(s), and "
                    f"only about {fit} more copies fit ({free[kind][1]}; {_RESERVE_PIDS} kept for the rest of the "
                    "machine). Ask for fewer copies, or run them in batches (close the copies of one batch first).",
                    requested=n, limit=fit)
    if max_copies is not None:
        if n > max_copies:
            raise CapacityError(f"{n} copies of this env refused: max_copies is {max_copies}.", requested=n,
                                limit=max_copies)
        return
    if "memory" in free and cost.memory:
        avail = int(free["memory"][0] * _MEMORY_SHARE)
        fit = avail // cost.memory
        if n > fit:
            raise CapacityError(
                f"{n} copies of this env refused: each copy ({cost.how}) is estimated to need {_human(cost.memory)} "
                f"of memory, {_human(n * cost.memory)} in all, and {_human(free['memory'][0])} is available "
                f"({free['memory'][1]}; {int(_MEMORY_SHARE * 100)}% of it is used): about {fit} copies fit. Ask "
                f"for fewer copies, or run them in batches.{override}", requested=n, limit=fit)

"""Give a fresh fork-tier copy the page tables it is about to need, before it is needed.

A copy made by ``fork()`` starts with none of the page-table entries of file mappings (the kernel
leaves them out: a fault can fill them from the page cache) and with every page of its private
memory shared, write-protected, with the process it was forked from.  Its first request --
usually the first step after a ``restore()`` -- then takes a minor fault on each page of code it
runs (libpython, NumPy, the simulator's library) and a copy-on-write fault on each page it writes:
hundreds of faults, a millisecond or more on a virtual machine, on the learner's critical path.

A ready copy (see :func:`gym_fork.worker.loop.frozen_loop`) has time before it is used, and a
good guess of what it will touch: what a *sibling* touched -- the worker the snapshot was taken
from, or the copy that was used before it; they run the same code on nearly the same data.
:func:`learn` reads that process's page map (``/proc/PID/pagemap``): its file pages that are
mapped, and its private pages that are its own (written since the fork).  :func:`apply` then
faults exactly those in, in this process, with ``madvise(MADV_POPULATE_READ / _WRITE)``
(Linux 5.14 or later): reading maps code pages (no memory: they are the page cache's), writing
breaks copy-on-write of the heap pages the sibling wrote (memory: those pages only, typically a
few MB).  No byte changes value, so a copy computes exactly what it would have.  Where the kernel
lacks the advice or the page map cannot be read, nothing happens; ``GYM_FORK_PREFAULT=0`` (in
the controller's environment) turns it off, to measure what it buys.

Example:
    >>> import os
    >>> plan = learn(os.getpid())
    >>> apply(plan) >= 0
    True
"""

from __future__ import annotations

import ctypes
import errno
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

MADV_POPULATE_READ = 22  # Linux >= 5.14: fault in page tables, readable, like a read of every page
MADV_POPULATE_WRITE = 23  # ... writable: breaks copy-on-write, like a write of every page
PAGE = os.sysconf("SC_PAGE_SIZE")
_PRESENT = 1 << 63
_EXCLUSIVE = 1 << 56  # the page is mapped by this process only (written since the fork, or new)
#: private writable areas larger than this are not learned (reserved arenas: reading their page
#: map would cost more than it saves)
MAX_AREA = 256 << 20
#: at most this much private memory is faulted in for writing per copy
MAX_WRITE_BYTES = 64 << 20
#: pages per madvise() call when :func:`apply` may be stopped: a call that breaks copy-on-write
#: costs ~10 µs a page on a virtual machine, so a request waits at most ~0.3 ms for the call in hand
STEP_PAGES = {"read": 128, "write": 32}
#: how often :func:`apply` asks whether to stop (seconds)
STOP_CHECK_S = 100e-6

_ok = True
_libc: ctypes.CDLL | None = None


@dataclass
class Plan:
    """Address ranges ``(start, end)`` to fault in: ``read`` for code, ``write`` for heap."""

    read: list[tuple[int, int]] = field(default_factory=list)
    write: list[tuple[int, int]] = field(default_factory=list)


def _areas(pid: int | str) -> list[tuple[int, int, bytes, bytes]]:
    """(start, end, perms, name) of a process's mappings."""
    out = []
    with open(f"/proc/{pid}/maps", "rb") as f:
        for line in f:
            parts = line.split(None, 5)
            start, end = parts[0].split(b"-")
            out.append((int(start, 16), int(end, 16), parts[1], parts[5].strip() if len(parts) > 5 else b""))
    return out


def _kind(perms: bytes, name: bytes) -> str | None:
    """"read" for a readable, not writable file mapping (code, read-only data); "write" for
    private writable memory; None for what is left alone (the kernel's own areas, shared or
    inaccessible mappings)."""
    if perms[0:1] != b"r" or perms[3:4] != b"p" or name.startswith(b"[v"):
        return None
    if perms[1:2] == b"w":
        return "write"
    return "read" if name.startswith(b"/") else None


def learn(pid: int) -> Plan:
    """What process ``pid`` has touched: its mapped file pages and the private pages it wrote.

    Returns:
        A :class:`Plan` (empty when the process is gone or its page map cannot be read).
    """
    plan = Plan()
    try:
        areas = [(a, b, k) for a, b, p, n in _areas(pid)
                 if (k := _kind(p, n)) is not None and not (k == "write" and b - a > MAX_AREA)]
        fd = os.open(f"/proc/{pid}/pagemap", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return plan
    chunks, addrs, wants = [], [], []
    try:
        i = 0
        while i < len(areas):  # one read per run of adjacent areas (a library's segments)
            j = i + 1
            while j < len(areas) and areas[j][0] == areas[j - 1][1]:
                j += 1
            lo, hi = areas[i][0], areas[j - 1][1]
            try:
                data = os.pread(fd, (hi - lo) // PAGE * 8, lo // PAGE * 8)
            except OSError:
                i = j
                continue
            chunks.append(data)
            n = len(data) // 8
            addrs.append(lo + PAGE * np.arange(n, dtype=np.uint64))
            want = np.empty(n, dtype=np.uint64)
            for a, b, kind in areas[i:j]:
                want[(a - lo) // PAGE:(b - lo) // PAGE] = _PRESENT if kind == "read" else _PRESENT | _EXCLUSIVE
            wants.append(want)
            i = j
    finally:
        os.close(fd)
    if not chunks:
        return plan
    entries = np.frombuffer(b"".join(chunks), dtype=np.uint64)[: sum(len(a) for a in addrs)]
    addr, want = np.concatenate(addrs), np.concatenate(wants)
    hit = (entries & want) == want
    # a run of touched pages: consecutive addresses of one kind
    cont = np.zeros(len(hit), dtype=bool)
    cont[1:] = hit[1:] & hit[:-1] & (addr[1:] == addr[:-1] + np.uint64(PAGE)) & (want[1:] == want[:-1])
    firsts = np.flatnonzero(hit & ~cont)
    lasts = np.flatnonzero(hit & ~np.append(cont[1:], False))
    budget = MAX_WRITE_BYTES  # a copy must not become a private copy of a huge heap
    for f, l in zip(firsts.tolist(), lasts.tolist()):
        run = (int(addr[f]), int(addr[l]) + PAGE)
        if want[f] == _PRESENT:
            plan.read.append(run)
        elif budget > 0:
            run = (run[0], min(run[1], run[0] + budget))
            plan.write.append(run)
            budget -= run[1] - run[0]
    return plan


def apply(plan: Plan, stop: Callable[[], bool] | None = None) -> int:
    """Fault in ``plan``'s ranges in this process, where they are still mapped the same way.

    Args:
        plan: what to fault in (:func:`learn`).
        stop: asked every :data:`STOP_CHECK_S` or so; when it returns True the rest is left
            out. A ready copy passes "a request is waiting": a copy taken before it finished
            (restores a few milliseconds apart) then serves at once instead of finishing first.

    Returns:
        The number of pages faulted in (0 where the kernel lacks ``MADV_POPULATE_*``).
    """
    if not _wanted(plan):
        return 0
    if stop is not None and stop():  # reading this process's mappings alone takes ~1 ms
        return 0
    return drive(installments(plan, chunked=stop is not None), stop)[0]


def _wanted(plan: Plan) -> bool:
    return _ok and bool(plan.read or plan.write) and os.environ.get("GYM_FORK_PREFAULT") != "0"


def installments(plan: Plan, chunked: bool = True) -> Iterator[int]:
    """:func:`apply` one ``madvise`` call at a time (:data:`STEP_PAGES` pages where ``chunked``):
    yields the pages each call faulted in, so that the caller can stop between calls and go on
    later where it stopped (:func:`drive`). Reads this process's mappings at the first call."""
    global _ok, _libc
    if not _wanted(plan):
        return
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc.madvise.restype = ctypes.c_int
    try:
        mine = sorted((s, e, _kind(p, n)) for s, e, p, n in _areas("self"))
    except OSError:
        return
    tried = invalid = 0
    for ranges, kind, advice in ((plan.read, "read", MADV_POPULATE_READ), (plan.write, "write", MADV_POPULATE_WRITE)):
        step = STEP_PAGES[kind] * PAGE if chunked else None
        for start, end in _clip(ranges, [(s, e) for s, e, k in mine if k == kind]):
            tried += 1
            while start < end:
                step_end = end if step is None else min(end, start + step)
                if _libc.madvise(start, step_end - start, advice) == 0:
                    yield (step_end - start) // PAGE
                elif ctypes.get_errno() == errno.EINVAL:
                    invalid += 1  # a special mapping, or (all of them) a kernel without the advice
                    break
                else:
                    break  # EFAULT/ENOMEM: unmapped meanwhile, or a file truncated under it: skip it
                start = step_end
    if tried and invalid == tried:
        _ok = False  # an older kernel: do not try again


def drive(steps: Iterator[int], stop: Callable[[], bool] | None = None) -> tuple[int, bool]:
    """Run :func:`installments` until they are all done or ``stop()`` (asked every
    :data:`STOP_CHECK_S` or so) says to stop. Returns the pages faulted in and whether all is
    done; stopped, ``steps`` goes on from there when driven again."""
    pages = 0
    next_check = time.perf_counter() + STOP_CHECK_S
    for n in steps:
        pages += n
        if stop is not None and time.perf_counter() >= next_check:
            if stop():
                return pages, False
            next_check = time.perf_counter() + STOP_CHECK_S
    return pages, True


class CpuWatch:
    """Whether a CPU is free right now: the kernel's count of runnable tasks, machine-wide and
    this process included (``/proc/loadavg``'s fourth field, read with one ``pread``: ~1.4 µs),
    against the machine's CPUs.

    Faulting in ahead is work a ready copy does *instead of* its first request's page faults, and
    dearer per page (``MADV_POPULATE_WRITE`` ~10 µs a page here, a fault 3-5 µs): it pays only
    where it runs on a CPU nobody else wants -- a learner that paused, not a search loop whose
    learner and copy in use keep every CPU busy (there it took CPU from them). Where the count
    cannot be read, every CPU counts as free (as before this check).

    Example:
        >>> with CpuWatch() as cpus:
        ...     isinstance(cpus.free(), bool)
        True
    """

    def __init__(self) -> None:
        self.cpus = os.cpu_count() or 1
        try:
            self._fd: int | None = os.open("/proc/loadavg", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self._fd = None

    def free(self) -> bool:
        if self._fd is None:
            return True
        try:
            runnable = int(os.pread(self._fd, 128, 0).split()[3].split(b"/")[0])
        except (OSError, ValueError, IndexError):
            return True
        return runnable <= self.cpus

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "CpuWatch":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _clip(ranges: list[tuple[int, int]], areas: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of ``ranges`` inside ``areas`` (both sorted by start, non-overlapping)."""
    out, j = [], 0
    for start, end in sorted(ranges):
        while j < len(areas) and areas[j][1] <= start:
            j += 1
        k = j
        while k < len(areas) and areas[k][0] < end:
            s, e = max(start, areas[k][0]), min(end, areas[k][1])
            if s < e:
                out.append((s, e))
            k += 1
    return out

"""Which CPU a process runs on, and moving the calling process off one.

On a machine with few CPUs a learner and its worker often end up on the *same* CPU: the
learner's request wakes a sleeping worker with a synchronous wake-up, which places it beside
its waker, and two processes that poll with ``sched_yield`` between steps are not pulled
apart by the load balancer for a while. Stepping steadily, they do run apart (measured: after
300 µs or 1 ms of learner work between steps, never on one CPU). A fork-tier snapshot right
after a pause meets it: the worker's scan and ``fork()`` (~1.5 ms here) then ran on the
learner's CPU, and the learner, its answer already in the socket, waited for them (snapshot()
1.6-2.3 ms instead of ~0.8). So the learner names its CPU in the request and a worker on the
same one steps aside first (:func:`step_aside`, ~0.15 ms here).
"""

from __future__ import annotations

import ctypes
import os

try:
    _getcpu = ctypes.CDLL(None, use_errno=True).sched_getcpu  # glibc: the vDSO's getcpu, ~1 µs
    _getcpu.restype = ctypes.c_int
    _getcpu.argtypes = []
except (OSError, AttributeError):  # another C library
    _getcpu = None


def current_cpu() -> int | None:
    """The CPU the calling thread runs on right now, or None where that cannot be told."""
    if _getcpu is None:
        return None
    cpu = _getcpu()
    return cpu if cpu >= 0 else None


def step_aside(cpu: int | None) -> bool:
    """If the calling process runs on ``cpu``, move it to another CPU it may use; its allowed
    CPUs are left as they were (the move is made by narrowing them for a moment). Returns
    whether it moved."""
    if cpu is None or current_cpu() != cpu:
        return False
    try:
        allowed = os.sched_getaffinity(0)
        others = allowed - {cpu}
        if not others:
            return False
        os.sched_setaffinity(0, others)  # the kernel moves this process before it returns
        os.sched_setaffinity(0, allowed)  # (widened again: it stays where it now runs)
    except OSError:
        return False
    return True

"""What the Ctrl-C campaigns (``scripts/ctrl_c_campaign.py``, ``scripts/ctrl_c_explore_campaign.py``)
and the tests drawn from them share: their seed lists, and the worker processes left running.

Example:
    >>> from gym_fork.testing.campaigns import parse_seeds
    >>> parse_seeds("3-5"), parse_seeds("1,7")
    ([3, 4, 5], [1, 7])
"""

from __future__ import annotations

import os

from gym_fork.worker.resources import descendants_of


def parse_seeds(text: str) -> list[int]:
    """``"A-B"`` (both included) or ``"A,B,C"``."""
    if "-" in text:
        lo, hi = map(int, text.split("-"))
        return list(range(lo, hi + 1))
    return [int(s) for s in text.split(",")]


def worker_processes(root: int | None = None) -> set[int]:
    """Live gym_fork worker processes below ``root`` (default: this process) -- workers, frozen
    snapshots, their copies -- by their command line (``python -m gym_fork.worker``); a process
    that ends while it is looked at is left out."""
    out = set()
    for p in descendants_of(os.getpid() if root is None else root):
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{p}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if b"-m\0gym_fork.worker\0" in cmd and state not in "ZX":
            out.add(p)
    return out

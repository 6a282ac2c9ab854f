"""What the campaigns (``scripts/ctrl_c_*campaign.py``, ``scripts/crash_campaign.py``) and the
tests drawn from them share: their command line, their seed lists, how each run is reported, and
the worker processes left running.

Example:
    >>> from gym_fork.testing.campaigns import parse_seeds, report
    >>> parse_seeds("3-5"), parse_seeds("1,7")
    ([3, 4, 5], [1, 7])
    >>> report([("seed 1", lambda: (False, "0 calls broken"))])
    seed 1: 0 calls broken
    0 of 1 runs broken
    0
"""

from __future__ import annotations

import argparse
import os
import traceback
from collections.abc import Callable, Iterable

from gym_fork.worker.resources import descendants_of


def parser(doc: str, *, seeds: str, count: str, per_seed: int) -> argparse.ArgumentParser:
    """A campaign's command line: its whole docstring as ``--help``, ``--seeds`` (default
    ``seeds``) and ``--<count>`` (how many calls or rounds per seed, default ``per_seed``)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default=seeds, help=f"seeds, as 'A-B' or 'A,B,C' (default: {seeds})")
    ap.add_argument(f"--{count}", type=int, default=per_seed, help=f"{count} per seed (default: {per_seed})")
    return ap


def report(runs: Iterable[tuple[str, Callable[[], tuple[bool, str]]]]) -> int:
    """Run each ``(name, run)`` of a campaign: ``run()`` returns whether it broke and a summary;
    an exception ends that run (said, with where it came from) and counts as broken. Prints a
    line per run and the count; returns the exit status (1 if any broke)."""
    broken = total = 0
    for name, run in runs:
        total += 1
        try:
            bad, summary = run()
            print(f"{name}: {summary}", flush=True)
        except Exception as e:  # noqa: BLE001 - reported: the run ended there
            where = traceback.extract_tb(e.__traceback__)[-4:]
            print(f"{name}: ended by {type(e).__name__}: {e}\n  at "
                  + " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(where)),
                  flush=True)
            bad = True
        broken += bool(bad)
    print(f"{broken} of {total} runs broken")
    return 1 if broken else 0


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

"""Storage cost of snapshots in a SnapshotStore, with and without page deduplication.

100 snapshots of one LunarLander-v3 run (one snapshot after every step, random actions with a
fixed seed; a reset if the episode ends first), each written into the store (CRIU dump of the
fork-tier snapshot + chunking).  Reports the worker's RSS, bytes on disk (allocated blocks, each
inode once), the median bytes each additional snapshot adds, and the median time per write.

    .venv/bin/python benchmarks/store.py [--n 100] [--modes dedup-16k,dedup-4k,dedup-64k,plain]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gym_fork  # noqa: E402
from gym_fork import SnapshotStore  # noqa: E402

MODES = {"plain": dict(dedup=False), "dedup-4k": dict(chunk_size=4096),
         "dedup-16k": dict(chunk_size=16384), "dedup-64k": dict(chunk_size=65536)}


def disk_usage(path: str) -> int:
    seen, total = set(), 0
    for root, _dirs, files in os.walk(path):
        for n in files:
            st = os.lstat(os.path.join(root, n))
            if st.st_ino not in seen:
                seen.add(st.st_ino)
                total += st.st_blocks * 512
    return total


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def run(mode: str, n: int, base: str) -> dict:
    d = os.path.join(base, mode)
    st = SnapshotStore(d, **MODES[mode])
    env = gym_fork.ForkableEnv("LunarLander-v3", store=st, fork_tier=True)
    env.reset(seed=0)
    env.action_space.seed(0)
    times, sizes, resets = [], [disk_usage(d)], 0
    worker_rss = 0
    for _ in range(n):
        _, _, term, trunc, _ = env.step(env.action_space.sample())
        if term or trunc:
            env.reset()
            resets += 1
        worker_rss = max(worker_rss, rss(env.worker_pid))
        s = env.snapshot()
        t = time.perf_counter()
        st.put(s)
        times.append(time.perf_counter() - t)
        sizes.append(disk_usage(d))
        s.release()
    env.close()
    incr = [b - a for a, b in zip(sizes[1:], sizes[2:])]
    return {"mode": mode, "rss": worker_rss, "first": sizes[1] - sizes[0], "total": sizes[-1],
            "incr_median": statistics.median(incr), "put_median": statistics.median(times),
            "put_p90": sorted(times)[int(0.9 * len(times))], "resets": resets,
            "logical": sum(e["logical_bytes"] for e in st.list().values())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--modes", default="plain,dedup-4k,dedup-16k,dedup-64k")
    args = ap.parse_args()
    base = tempfile.mkdtemp(prefix="gym_fork-store-bench-")
    try:
        rows = [run(m, args.n, base) for m in args.modes.split(",")]
    finally:
        shutil.rmtree(base, ignore_errors=True)
    mib = 1 << 20
    plain = next((r for r in rows if r["mode"] == "plain"), rows[0])
    print(f"\n{args.n} snapshots of LunarLander-v3 (one per step), each written to a SnapshotStore; "
          f"worker RSS {plain['rss'] / mib:.1f} MiB; episode resets: {plain['resets']}\n")
    print(f"| mode | images written (MiB) | on disk (MiB) | vs plain | first snapshot (MiB) | "
          f"each additional, median (MiB) | additional / RSS | write median (ms) | write p90 (ms) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['mode']} | {r['logical'] / mib:.0f} | {r['total'] / mib:.1f} | "
              f"{r['total'] / plain['total']:.3f} | {r['first'] / mib:.1f} | {r['incr_median'] / mib:.2f} | "
              f"{100 * r['incr_median'] / r['rss']:.1f} % | {1000 * r['put_median']:.0f} | {1000 * r['put_p90']:.0f} |")


if __name__ == "__main__":
    main()

"""The copy-on-write tier against CRIU dumps and cloudpickle: a 500 MB worker, and the memory
that 100 snapshots of one LunarLander episode cost.

    .venv/bin/python benchmarks/fork_tier.py [--reps 7] [--mb 500] [--snapshots 100]

Prints markdown tables (medians, ratios) and writes results/fork_tier.json (``--out DIR``: DIR/fork_tier.json).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import cloudpickle
import gymnasium as gym
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import add_out_option, busy_check, fmt, fmt_ratio, print_table, save_results, summarize, time_reps  # noqa: E402

import gym_fork  # noqa: E402


class BigStateEnv(gym.Env):
    """CartPole dynamics plus ``mb`` megabytes of live state (a replay memory, a map, ...)."""

    def __init__(self, mb: int = 500):
        self.inner = gym.make("CartPole-v1")
        self.observation_space = self.inner.observation_space
        self.action_space = self.inner.action_space
        self.memory = np.ones(mb * 1024 * 1024 // 8, dtype=np.float64)  # touched: really resident

    def reset(self, *, seed=None, options=None):
        return self.inner.reset(seed=seed, options=options)

    def step(self, action):
        out = self.inner.step(action)
        self.memory[np.random.randint(len(self.memory))] += 1.0  # some state keeps changing
        return out


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(f.read().split("VmRSS:")[1].split()[0]) * 1024


def bench_big(mb: int, reps: int) -> dict:
    out = {}
    for label, kw in (("fork tier", {"fork_tier": True}), ("CRIU dump", {"fork_tier": False})):
        env = gym_fork.ForkableEnv(lambda: BigStateEnv(mb), backend="criu", verify="size", **kw)
        env.reset(seed=0)
        for _ in range(10):
            env.step(0)
        snaps: list = []
        ts = time_reps(lambda: snaps.append(env.snapshot()), reps, 1)
        s = snaps[-1]
        tr = time_reps(lambda: env.restore(s), reps, 1)
        out[label] = {"snapshot_ms": summarize(ts), "restore_ms": summarize(tr), "rss": rss_bytes(env.worker_pid)}
        for x in snaps:
            x.release()
        env.close()
    local = BigStateEnv(mb)
    local.reset(seed=0)
    blobs: list = []
    tp = time_reps(lambda: blobs.append(cloudpickle.dumps(local)), reps, 1)
    tl = time_reps(lambda: cloudpickle.loads(blobs[-1]), reps, 1)
    td = time_reps(lambda: copy.deepcopy(local), reps, 1)
    out["cloudpickle"] = {"snapshot_ms": summarize(tp), "restore_ms": summarize(tl)}
    out["deepcopy"] = {"snapshot_ms": summarize(td), "restore_ms": None}
    return out


def bench_memory(n: int) -> dict:
    env = gym_fork.make("LunarLander-v3", backend="criu", fork_tier=True)
    env.reset(seed=0)
    env.action_space.seed(0)
    snaps = []
    while len(snaps) < n:
        _, _, term, trunc, _ = env.step(env.action_space.sample())
        if term or trunc:
            env.reset()
        snaps.append(env.snapshot())
    rss = rss_bytes(env.worker_pid)
    private = [s.memory_bytes() or 0 for s in snaps]
    # pages shared by everybody are counted once in the worker's RSS; what the snapshots add is
    # what each holds privately (pages the worker has rewritten since)
    res = {"n": n, "worker_rss": rss, "sum_private": sum(private), "median_private": float(np.median(private)),
           "max_private": max(private)}
    for s in snaps:
        s.release()
    env.close()
    return res


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--mb", type=int, default=500, help="size of the big worker's state (MB)")
    ap.add_argument("--snapshots", type=int, default=100)
    add_out_option(ap)
    args = ap.parse_args(argv)
    busy = busy_check()
    big = bench_big(args.mb, args.reps)
    ms = lambda d, k: d[k]["median"] if d.get(k) else None  # noqa: E731
    base = big["cloudpickle"]
    rows = [[k, fmt(ms(v, "snapshot_ms")), fmt(ms(v, "restore_ms")),
             fmt_ratio(ms(base, "snapshot_ms"), ms(v, "snapshot_ms")),
             fmt_ratio(ms(base, "restore_ms"), ms(v, "restore_ms"))] for k, v in big.items()]
    print_table(["method", "snapshot ms", "restore ms", "cloudpickle/this snapshot", "cloudpickle/this restore"], rows,
                title=f"{args.mb} MB worker (median of {args.reps}; criu with verify='size')")
    mem = bench_memory(args.snapshots)
    mb = 1 / 2**20
    print_table(["snapshots", "worker RSS MB", "sum private MB", "median private MB / snapshot",
                 "per snapshot % of RSS", "all snapshots % of RSS"],
                [[mem["n"], fmt(mem["worker_rss"] * mb), fmt(mem["sum_private"] * mb),
                  fmt(mem["median_private"] * mb), fmt(100 * mem["median_private"] / mem["worker_rss"]),
                  fmt(100 * mem["sum_private"] / mem["worker_rss"])]],
                title="memory of fork-tier snapshots taken at every step of one LunarLander episode")
    save_results("fork_tier", {"args": vars(args), "big": big, "memory": mem, "busy": busy})


if __name__ == "__main__":
    main()

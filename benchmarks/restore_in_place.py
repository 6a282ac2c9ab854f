"""Restore in place vs the fork tier's ready copy: what restoring a snapshot costs when the
worker's own pages are copied back, instead of switching to a forked copy.

    .venv/bin/python benchmarks/restore_in_place.py                  # LunarLander, 16 branches, 3 runs
    .venv/bin/python benchmarks/restore_in_place.py --env CartPole-v1 --runs 5

This measures a direction from issue #17 that gym_fork does **not** use. ``restore_in_place.c``
(compiled here with gcc against this Python) snapshots a single-threaded Python process by
write-protecting its private writable memory with userfaultfd (asynchronous mode: the kernel
just marks pages written) and cloning a holder process that keeps the memory; a restore reads
the layout, asks ``PAGEMAP_SCAN`` for the pages written since, copies their snapshot content
back from the holder and jumps into the snapshot call, which returns a second time. No new
process: the learner keeps stepping the same, warm process.

Each run: the env stepped ``--depth`` steps from ``reset(seed=0)``, a snapshot, then ``--branches``
branches of ``--horizon`` seeded random steps, each followed by a restore; every branch's
observations and rewards are hashed and compared with a replay from ``reset()`` (bit-exact or the
run fails). The same branches go through a ``ForkableEnv`` (fork tier): ``restore(snap)`` and the
branch. Printed: medians per run of restore + first step − a plain step (the learner-visible cost,
as ``hot_path.py`` measures it), the in-place restore's parts, the ratio, and restore + the whole
branch (in place the env also steps in process, so that column mixes both effects). Tests never run this.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import statistics
import struct
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import gymnasium as gym
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.append(str(HERE.parent))
from benchmarks.common import print_table  # noqa: E402

RESUMED = -1000


def build(out_dir: str) -> str:
    so = os.path.join(out_dir, "restore_in_place.so")
    cmd = ["gcc", "-O2", "-shared", "-fPIC", f"-I{sysconfig.get_paths()['include']}", "-o", so,
           str(HERE / "restore_in_place.c")]
    try:
        subprocess.run(cmd, check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        sys.exit(f"cannot build restore_in_place.c ({e}): it needs gcc and this Python's headers "
                 f"({sysconfig.get_paths()['include']})")
    return so


def prefix_actions(space: gym.Space, depth: int) -> list:
    rng = np.random.default_rng(123)
    return [_draw(space, rng) for _ in range(depth)]


def branch_actions(space: gym.Space, k: int, horizon: int) -> list:
    rng = np.random.default_rng(1000 + k)
    return [_draw(space, rng) for _ in range(horizon)]


def _draw(space: gym.Space, rng: np.random.Generator):
    if isinstance(space, gym.spaces.Discrete):
        return int(rng.integers(0, space.n))
    return rng.uniform(space.low, space.high).astype(space.dtype)


def run_branch(step, actions: list) -> tuple[bytes, float, float]:
    """Step a branch; returns its digest, the first step's time and the whole branch's (s)."""
    h = hashlib.sha256()
    first = 0.0
    t0 = time.perf_counter()
    for i, a in enumerate(actions):
        t = time.perf_counter()
        obs, rew, term, trunc, _ = step(a)
        if i == 0:
            first = time.perf_counter() - t
        h.update(np.asarray(obs).tobytes())
        h.update(struct.pack("d", float(rew)))
        if term or trunc:
            break
    return h.digest(), first, time.perf_counter() - t0


def plain_step_time(env: gym.Env, space: gym.Space, n: int = 300) -> float:
    acts = branch_actions(space, 99_999, n)
    t = time.perf_counter()
    for a in acts:
        _, _, term, trunc, _ = env.step(a)
        if term or trunc:
            env.reset()
    return (time.perf_counter() - t) / n


# --- the in-place side: a child process that restores itself ---------------------------------------
def child(args: argparse.Namespace) -> None:
    """Writes one JSON line per branch to fd ``args.out_fd``. Its Python state goes back to the
    snapshot at every restore, so everything that must outlive one is kept by the kernel: the
    branch counter is the output file's size, the restore's start time is written before it."""
    from gym_fork.worker import lean

    lean.install()  # as lean as a gym_fork worker (no pygame for Box2D envs): as many mappings
    lib = ctypes.PyDLL(args.lib)  # keeps the GIL: the snapshot is taken inside this call
    for name in ("ip_snapshot", "ip_restore", "ip_stat"):
        getattr(lib, name).restype = ctypes.c_long
    if (rc := lib.ip_init()) != 0:
        sys.exit(f"in-place restore unavailable here (init {rc}): needs Linux >= 6.7, userfaultfd")
    env = gym.make(args.env)
    env.reset(seed=0)
    for a in prefix_actions(env.action_space, args.depth):
        env.step(a)
    mappings = sum(1 for _ in open("/proc/self/maps"))
    other = gym.make(args.env)  # a separate copy: the same code, warm
    other.reset(seed=1)
    plain = plain_step_time(other, env.action_space)
    log = args.out_path
    rc = lib.ip_snapshot()
    resumed_at = time.perf_counter_ns()
    done = sum(1 for _ in open(log))
    if rc == RESUMED:
        started = int(open(log + ".t").read())
        parts = [lib.ip_stat(i) for i in range(6)]
        restore_ns = resumed_at - started
    elif rc < 0:
        sys.exit(f"snapshot failed ({rc})")
    else:
        parts, restore_ns = None, None
    if done < args.branches + 1:  # line 0: the branch right after the snapshot (no restore before it)
        digest, first, whole = run_branch(env.step, branch_actions(env.action_space, max(done - 1, 0), args.horizon))
        with open(log, "a") as f:
            f.write(json.dumps({"digest": digest.hex(), "first": first, "whole": whole, "restore_ns": restore_ns,
                                "parts": parts, "plain": plain, "mappings": mappings}) + "\n")
        with open(log + ".t", "w") as f:
            f.write(str(time.perf_counter_ns()))
        sys.exit(f"restore refused or failed ({lib.ip_restore()})")  # returns only then


def in_place_run(args: argparse.Namespace, lib: str, tmp: str) -> list[dict]:
    log = os.path.join(tmp, "branches.jsonl")
    open(log, "w").close()
    cmd = [sys.executable, __file__, "--child", "--lib", lib, "--out-path", log, "--env", args.env,
           "--depth", str(args.depth), "--branches", str(args.branches), "--horizon", str(args.horizon)]
    subprocess.run(cmd, check=True, timeout=300)
    return [json.loads(line) for line in open(log)][1:]


# --- the fork tier: the same branches through a ForkableEnv -----------------------------------------
def fork_tier_run(args: argparse.Namespace) -> list[dict]:
    import gym_fork

    env = gym_fork.ForkableEnv(args.env, fork_tier=True, record_actions=False)
    try:
        env.reset(seed=0)
        for a in prefix_actions(env.action_space, args.depth):
            env.step(a)
        snap = env.snapshot()
        plain = plain_step_time(env, env.action_space)
        env.restore(snap)
        out = []
        for k in range(args.branches):
            t = time.perf_counter()
            env.restore(snap)
            restore_s = time.perf_counter() - t
            digest, first, whole = run_branch(env.step, branch_actions(env.action_space, k, args.horizon))
            out.append({"digest": digest.hex(), "first": first, "whole": whole, "restore_s": restore_s,
                        "plain": plain})
        return out
    finally:
        env.close()


def replay_digests(args: argparse.Namespace) -> list[str]:
    out = []
    for k in range(args.branches):
        env = gym.make(args.env)
        env.reset(seed=0)
        for a in prefix_actions(env.action_space, args.depth):
            env.step(a)
        out.append(run_branch(env.step, branch_actions(env.action_space, k, args.horizon))[0].hex())
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--env", default="LunarLander-v3")
    p.add_argument("--runs", type=int, default=3, help="runs, in-place and fork tier alternating (default 3)")
    p.add_argument("--branches", type=int, default=16)
    p.add_argument("--horizon", type=int, default=50)
    p.add_argument("--depth", type=int, default=100)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--lib", help=argparse.SUPPRESS)
    p.add_argument("--out-path", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    med = statistics.median
    want = replay_digests(args)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        lib = build(tmp)
        for run in range(args.runs):
            ip = in_place_run(args, lib, tmp)
            ft = fork_tier_run(args)
            for name, got in (("in place", ip), ("fork tier", ft)):
                bad = [k for k, (g, w) in enumerate(zip(got, want)) if g["digest"] != w]
                if bad or len(got) != len(want):
                    sys.exit(f"run {run}: {name}: branches {bad} differ from the replay from reset()")
            plain_ip, plain_ft = ip[0]["plain"], ft[0]["plain"]
            rows.append({
                "in_place": med(b["restore_ns"] / 1e9 + b["first"] for b in ip) - plain_ip,
                "fork_tier": med(b["restore_s"] + b["first"] for b in ft) - plain_ft,
                "maps": med(b["parts"][0] for b in ip) / 1e9, "scan": med(b["parts"][1] for b in ip) / 1e9,
                "stage": med(b["parts"][2] for b in ip) / 1e9, "pages": med(b["parts"][4] for b in ip),
                "unmapped": max(b["parts"][5] for b in ip), "mappings": ip[0]["mappings"],
                "first_ip": med(b["first"] for b in ip), "first_ft": med(b["first"] for b in ft),
                "plain_ip": plain_ip, "plain_ft": plain_ft,
                "loop_ip": med(b["restore_ns"] / 1e9 + b["whole"] for b in ip),
                "loop_ft": med(b["restore_s"] + b["whole"] for b in ft),
            })
            print(f"[restore_in_place] run {run + 1}/{args.runs}: {2 * args.branches} branches bit-identical "
                  "to the replay", file=sys.stderr, flush=True)
    ms = lambda s: f"{s * 1e3:.2f} ms"  # noqa: E731
    us = lambda s: f"{s * 1e6:.0f} µs"  # noqa: E731
    headers = ["run", "in place", "fork tier `restore()`", "in place / fork tier",
               "in place: layout / written-page scan / staging", "pages copied",
               "first step after: in place / fork tier", "plain step: in process / ForkableEnv",
               "restore + whole branch: in place / fork tier"]
    table = [[i, ms(r["in_place"]), ms(r["fork_tier"]), f"{r['in_place'] / r['fork_tier']:.2f}x",
              f"{ms(r['maps'])} / {ms(r['scan'])} / {ms(r['stage'])}",
              f"{r['pages']:.0f} ({r['unmapped']} new mappings unmapped; {r['mappings']} mappings)",
              f"{us(r['first_ip'])} / {us(r['first_ft'])}", f"{us(r['plain_ip'])} / {us(r['plain_ft'])}",
              f"{ms(r['loop_ip'])} / {ms(r['loop_ft'])} ({r['loop_ip'] / r['loop_ft']:.2f}x)"]
             for i, r in enumerate(rows, 1)]
    print_table(headers, table, title=f"{args.env}: restore()+first step − plain step, medians over "
                f"{args.branches} branches of {args.horizon} steps from depth {args.depth}")

if __name__ == "__main__":
    main()

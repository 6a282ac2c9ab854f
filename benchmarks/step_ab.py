"""Step cost, A against B at fine grain: two gym_fork trees (or one tree run two ways) side by side.

Wall-clock numbers on a shared 2-core VM drift by tens of percent between runs, so a single run of
``hot_path.py`` per tree cannot show a 10 % change.  Here two driver processes -- tree A and tree B,
each with its own ForkableEnv (or ForkableVecEnv) and worker -- take turns running chunks of steps
(A, B, B, A, ...), so the machine's drift hits both alike.  Prints the median µs per step of each,
the ratio B/A, and CPU µs per step (controller + worker, from /proc/PID/schedstat).  An A/A control
(the same tree twice) reads 1.02-1.08 here.

    git worktree add --detach /tmp/base <commit>
    .venv/bin/python benchmarks/step_ab.py /tmp/base . [--env LunarLander-v3] [--vec 4]
    .venv/bin/python benchmarks/step_ab.py . . --envB GYM_FORK_FSWATCH=0     # one setting's share
    .venv/bin/python benchmarks/step_ab.py /tmp/base . --floor   # + a minimal raw-bytes worker

``--floor`` adds F: the same env stepped by a bare forked Python worker over a socketpair (raw
bytes, no gym_fork): the machine's floor for a cross-process step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.common import print_table  # noqa: E402

# Both drivers: warm up, then time one chunk per line on stdin (wall, own CPU, the worker's CPU).
MEASURE = r'''
run()
gc.collect()
gc.disable()
sys.stdout.write("ready\n"); sys.stdout.flush()
for line in sys.stdin:
    c0, w0 = cpu("self"), sum(cpu(p) for p in pids)
    t0 = time.perf_counter_ns()
    run()
    dt = time.perf_counter_ns() - t0
    c1, w1 = cpu("self"), sum(cpu(p) for p in pids)
    sys.stdout.write(json.dumps([dt / steps / 1000, (c1 - c0) / steps / 1000, (w1 - w0) / steps / 1000]) + "\n")
    sys.stdout.flush()
'''

CHILD = r'''
import gc, json, os, sys, time
import gymnasium as gym
import numpy as np
import gym_fork
env_id, steps, vec = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def cpu(pid):
    with open(f"/proc/{pid}/schedstat") as f:
        return int(f.read().split()[0])
if vec:
    venv = gym_fork.ForkableVecEnv([env_id] * vec)
    venv.reset()
    space = venv.action_space
    space.seed(0)
    batches = [np.array([space.sample() for _ in range(vec)]) for _ in range(steps)]
    wp = venv.worker_pids
    pids = [p for p in (wp() if callable(wp) else wp) if p]
    def run():
        for b in batches:
            venv.step(b)
else:
    env = gym_fork.ForkableEnv(env_id, backend="criu")
    space = env.action_space
    space.seed(0)
    acts = [space.sample() for _ in range(steps)]
    env.reset(seed=0)
    step, reset = env.step, env.reset
    pids = [env._handle.pid]
    def run():
        for a in acts:
            _, _, t, tr, _ = step(a)
            if t or tr:
                reset()
''' + MEASURE

FLOOR = r'''
import gc, json, os, pickle, socket, sys, time
import gymnasium as gym
env_id, steps = sys.argv[1], int(sys.argv[2])
def cpu(pid):
    with open(f"/proc/{pid}/schedstat") as f:
        return int(f.read().split()[0])
a, b = socket.socketpair()
pid = os.fork()
if pid == 0:  # the floor: a minimal Python worker (pickle in, env.step, pickle out)
    sys.stdin.close()
    a.close()
    env = gym.make(env_id)
    env.reset(seed=0)
    buf = bytearray(4096)
    while True:
        k = b.recv_into(buf)
        if not k:
            os._exit(0)
        out = env.step(int.from_bytes(buf[:k], "little"))
        if out[2] or out[3]:
            env.reset()
        b.sendall(out[0].tobytes())
b.close()
space = gym.make(env_id).action_space
space.seed(0)
acts = [space.sample() for _ in range(steps)]
buf = bytearray(4096)
def run():
    for x in acts:
        a.sendall(int(x).to_bytes(8, "little"))
        a.recv_into(buf)
pids = [pid]
''' + MEASURE



def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("tree_a", help="checkout of the baseline (its gym_fork is imported)")
    ap.add_argument("tree_b", help="checkout to compare (may be the same as tree_a, with --envB)")
    ap.add_argument("--chunks", type=int, default=20, help="chunks per driver (alternating)")
    ap.add_argument("--steps", type=int, default=500, help="steps (or batches) per chunk")
    ap.add_argument("--env", default="CartPole-v1")
    ap.add_argument("--vec", type=int, default=0, help="ForkableVecEnv with this many envs instead")
    ap.add_argument("--envB", action="append", default=[], help="K=V set for B only (e.g. GYM_FORK_FSWATCH=0)")
    ap.add_argument("--floor", action="store_true", help="also a minimal raw-bytes socketpair worker (F)")
    args = ap.parse_args(argv)
    procs = {}
    for name, tree in zip("AB", (args.tree_a, args.tree_b)):
        env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
        if name == "B":
            env.update(kv.split("=", 1) for kv in args.envB)
        procs[name] = subprocess.Popen([sys.executable, "-c", CHILD, args.env, str(args.steps), str(args.vec)],
                                       cwd="/tmp", stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    if args.floor:
        procs["F"] = subprocess.Popen([sys.executable, "-c", FLOOR, args.env, str(args.steps)], cwd="/tmp",
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    for name, p in procs.items():
        if p.stdout.readline().strip() != "ready":
            raise SystemExit(f"driver {name} failed to start")
    res: dict[str, list] = {k: [] for k in procs}
    order = "".join(procs)
    for i in range(args.chunks):
        for name in (order if i % 2 == 0 else order[::-1]):
            p = procs[name]
            p.stdin.write("go\n")
            p.stdin.flush()
            res[name].append(json.loads(p.stdout.readline()))
    for p in procs.values():
        p.stdin.close()
        p.wait()
    med = {k: [statistics.median(x[j] for x in v) for j in range(3)] for k, v in res.items()}
    what = f"{args.env}" + (f" ForkableVecEnv({args.vec}) batch" if args.vec else " step")
    rows = [[f"{k}: {dict(A=args.tree_a, B=args.tree_b + (' ' + ' '.join(args.envB) if args.envB else ''), F='floor (raw bytes, no gym_fork)')[k]}",
             f"{m[0]:.1f}", f"{m[1]:.1f}", f"{m[2]:.1f}",
             f"{m[0] / med['A'][0]:.3f}"] for k, m in med.items()]
    print_table(["driver", "µs per step (median)", "controller CPU µs", "worker CPU µs", "vs A"], rows,
                title=f"{what}: {args.chunks} alternating chunks of {args.steps}")
    return {"what": what, "medians": med}


if __name__ == "__main__":
    main()

"""What one branch of a closed-loop ``explore()`` costs in CPU, part by part, next to the
machine's floor for the same part: where the break-even depth of ``hot_path.py`` comes from.

    .venv/bin/python benchmarks/branch_costs.py                   # LunarLander, 16 x 100, 7 reps
    .venv/bin/python benchmarks/branch_costs.py --env CartPole-v1 --reps 5 --json out.json

On a machine whose CPUs are all busy during ``explore()`` (16 branches on 2 CPUs), what decides
the wall time is the CPU the branches take, not latency: so each part is measured as CPU time of
the process that spends it (``/proc/PID/schedstat``: nanoseconds on a CPU), per copy or per step:

* **the snapshot's own process** (the frozen snapshot), from its fork until it waits for its
  first request: once per ``explore()``, shared by its branches (not in the sums below); floor:
  the bare child's CPU at its first line of Python;
* **the frozen snapshot's fork** of one copy (its CPU over ``fork(snapshot, 16)``, / 16);
  floor: a bare ``os.fork()`` in a process as lean as a worker holding the same env after 100
  steps (no gym_fork code), the parent's CPU;
* **the copy, until it is ready** (its CPU when ``fork()`` returns: Python's after-fork hooks,
  gym_fork's setup, the ``hello`` answer, each page it writes a copy-on-write fault); floor: the
  bare child's CPU at its first line of Python; and the page faults of each (a fork-tier copy
  pays for every page it writes, and CPython writes the pages of every object it touches: its
  reference counts);
* **its reseed** with ``rng="reseed"`` (``explore()``'s default; the rows above and below are
  ``rng="same"``): a second batch, each copy's CPU when ``fork()`` returns minus the first
  batch's; no floor (a bare child keeps its parent's generators) and not in the sums below;
* **its first step, beyond a later one** (the copy-on-write faults of the pages a step writes),
  and its page faults; floor: the same in the bare child;
* **each later step**, worker and learner, in ``explore()``'s own closed loop (16 branches
  stepping at once, workers sleeping between requests), with the worker's page faults per step,
  and one copy's worker stepped alone (the others idle: what the 15 others taking turns on the
  CPUs and their caches add); floors: bare workers -- processes of the same lean kind that wait
  on a socket for an action byte, step, and send the observation's bytes back: the wake-ups and
  system calls any worker pays, no gym_fork code -- 16 stepped at once by a bare learner the
  same way, and one alone; and an in-process step's CPU (what a replay pays);
* **closing the copy** (the learner's ``close()``, the copy's ``env.close()`` and exit, the
  kernel tearing its memory down): the CPU the whole machine spent meanwhile, minus what it spent
  in as long a quiet time right after (``/proc/stat`` without steal time: 10 ms ticks, so per
  copy only over many; run it on an otherwise idle machine); floor: 16 bare children that
  stepped exiting at once, measured the same way.

The last rows add the parts up per branch of ``--horizon`` steps (the floor: the bare parts, each
step a bare worker's and a bare learner's, 16 at once), say how many in-process steps the fixed part (fork,
setup, first step, close) is worth, and what break-even depth against replaying from ``reset()``
follows when the branches keep every CPU busy and a replay runs on one: (CPU per branch / CPUs)
/ in-process step - horizon, as ``hot_path.py`` measures it in wall time. Tests never run this.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.append(str(Path(__file__).resolve().parent.parent))
from benchmarks.common import print_table  # noqa: E402

import gym_fork  # noqa: E402
from gym_fork import exploration  # noqa: E402

TICK_MS = 1e3 / os.sysconf("SC_CLK_TCK")

# A process as lean as a worker (numpy, gymnasium, the env after 100 steps; no gym_fork): a bare
# fork, the parent's and the child's CPU, the child's first two steps; and an in-process step.
_FLOOR = r"""
import json, os, resource, socket, statistics, sys, time
import gymnasium as gym
env_id, reps, branches, horizon = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
env = gym.make(env_id); env.reset(seed=0)
n = env.action_space.n
for i in range(100):
    if any(env.step(i % n)[2:4]): env.reset()
t0 = time.thread_time()
for i in range(2000):
    if any(env.step(i % n)[2:4]): env.reset()
step_ms = (time.thread_time() - t0) / 2000 * 1e3
def minflt():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
fork_ms, first_ms, extra_ms, first_flt, extra_flt = [], [], [], [], []
for _ in range(reps * 3):
    r, w = os.pipe()
    t0 = time.thread_time()
    pid = os.fork()
    if pid == 0:
        a, fa = time.thread_time(), minflt()
        env.step(0); b, fb = time.thread_time(), minflt()
        env.step(1); c, fc = time.thread_time(), minflt()
        os.write(w, json.dumps([a * 1e3, (b - a - (c - b)) * 1e3, fa, (fb - fa) - (fc - fb)]).encode()); os._exit(0)
    fork_ms.append((time.thread_time() - t0) * 1e3)
    os.waitpid(pid, 0)
    a, x, fa, fx = json.loads(os.read(r, 200)); os.close(r); os.close(w)
    first_ms.append(a); extra_ms.append(x); first_flt.append(fa); extra_flt.append(fx)
tick_ms = 1e3 / os.sysconf("SC_CLK_TCK")
def busy_ms():  # the whole machine's CPU so far: all but idle, iowait and steal (other guests' time)
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v[:8]) - v[3] - v[4] - v[7]) * tick_ms
exit_ms = []
for _ in range(reps):  # 16 children that stepped, then exit at once: the machine's CPU meanwhile,
    r, w = os.pipe()   # minus what it spends in as long a quiet time right after (its background)
    kids = []
    for _i in range(16):
        pid = os.fork()
        if pid == 0:
            os.close(w); env.step(0); env.step(1); os.read(r, 1); os._exit(0)
        kids.append(pid)
    os.close(r)
    time.sleep(0.1)
    b0, t0 = busy_ms(), time.perf_counter()
    os.close(w)
    for pid in kids:
        os.waitpid(pid, 0)
    time.sleep(0.1)
    b1, t1 = busy_ms(), time.perf_counter()
    time.sleep(t1 - t0)
    exit_ms.append((b1 - b0) - (busy_ms() - b1))
# 16 bare workers stepped at once in a closed loop, as explore() steps its branches: a child that
# waits on a socket for an action byte, steps, sends the observation's bytes back; each child's
# CPU and page faults per step, and the learner's CPU per step
def proc_cpu_flt(pid):
    with open(f"/proc/{pid}/schedstat") as f:
        ns = int(f.read().split()[0])
    with open(f"/proc/{pid}/stat") as f:
        flt = int(f.read().rsplit(")", 1)[1].split()[7])
    return ns / 1e6, flt
def at_once(n_kids, horizon):
    socks, pids = [], []
    for _i in range(n_kids):
        ours, theirs = socket.socketpair()
        pid = os.fork()
        if pid == 0:
            ours.close()
            while True:
                d = theirs.recv(8)
                if not d or d == b"q":
                    os._exit(0)
                obs, _r, term, trunc, _i = env.step(d[0] % n)
                if term or trunc:
                    obs, _i = env.reset()
                theirs.sendall(obs.tobytes())
        theirs.close(); socks.append(ours); pids.append(pid)
    def run(steps):
        for s in socks:
            s.sendall(bytes([0]))
        for t in range(steps):
            for s in socks:
                obs = s.recv(4096)
                if t + 1 < steps:
                    s.sendall(bytes([(obs[0] + t) % n]))
    run(10)  # (past the first steps' faults)
    before = [proc_cpu_flt(p) for p in pids]
    l0 = time.thread_time()
    run(horizon)
    learner_us = (time.thread_time() - l0) / (n_kids * horizon) * 1e6
    after = [proc_cpu_flt(p) for p in pids]
    for s, p in zip(socks, pids):
        s.sendall(b"q"); os.waitpid(p, 0); s.close()
    return (learner_us, statistics.median((a[0] - b[0]) * 1e3 / horizon for a, b in zip(after, before)),
            statistics.median((a[1] - b[1]) / horizon for a, b in zip(after, before)))
at_once_runs = [at_once(branches, horizon) for _ in range(reps)]
# one bare worker stepped alone (the same kind of child): its CPU per step, and the learner's
ours, theirs = socket.socketpair()
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    ours.close()
    t0, k = time.thread_time(), 0
    while True:
        d = theirs.recv(8)
        if not d or d == b"q":
            break
        obs, _r, term, trunc, _i = env.step(d[0] % n)
        if term or trunc:
            obs, _i = env.reset()
        theirs.sendall(obs.tobytes()); k += 1
    os.write(w, json.dumps((time.thread_time() - t0) / k * 1e6).encode()); os._exit(0)
theirs.close()
t0 = time.thread_time()
for i in range(2000):
    ours.sendall(bytes([i % n])); ours.recv(4096)
bare_learner_us = (time.thread_time() - t0) / 2000 * 1e6
ours.sendall(b"q"); os.waitpid(pid, 0)
bare_worker_us = json.loads(os.read(r, 100)); os.close(r); os.close(w)
med = statistics.median
print(json.dumps({"fork_ms": med(fork_ms), "child_ready_ms": med(first_ms), "first_step_extra_ms": med(extra_ms),
                  "child_ready_faults": med(first_flt), "first_step_extra_faults": med(extra_flt),
                  "step_ms": step_ms, "exit_ms": sum(exit_ms) / (16 * len(exit_ms)),
                  "bare_worker_step_us": bare_worker_us, "bare_learner_step_us": bare_learner_us,
                  "bare_learner_at_once_us": med(r[0] for r in at_once_runs),
                  "bare_worker_at_once_us": med(r[1] for r in at_once_runs),
                  "bare_worker_at_once_faults": med(r[2] for r in at_once_runs)}))
"""


def floor(env_id: str, reps: int, branches: int, horizon: int) -> dict:
    out = subprocess.run([sys.executable, "-c", _FLOOR, env_id, str(reps), str(branches), str(horizon)],
                         capture_output=True, text=True,
                         timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"the floor measurement failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def cpu_ms(pid: int) -> float:
    with open(f"/proc/{pid}/schedstat") as f:
        return int(f.read().split()[0]) / 1e6


def faults(pid: int) -> int:
    """A process's minor page faults so far (copy-on-write and first-touch faults)."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


def busy_ms() -> float:
    """The whole machine's CPU so far: all but idle, iowait and steal (the time the hypervisor gave
    other guests is not this machine's work; counting it put ~0.8 ms on each copy's close)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v[:8]) - v[3] - v[4] - v[7]) * TICK_MS


def net_busy_ms(work: Callable[[], None]) -> float:
    """The machine's CPU while ``work()`` runs, minus what it spends in as long a quiet time right
    after (its background: kernel threads, other processes), in 10 ms ticks."""
    b0, t0 = busy_ms(), time.perf_counter()
    work()
    b1, t1 = busy_ms(), time.perf_counter()
    time.sleep(t1 - t0)
    return (b1 - b0) - (busy_ms() - b1)


def one_rep(env: gym_fork.ForkableEnv, k: int, horizon: int, n_actions: int) -> dict:
    med = statistics.median
    # No ready copy ahead (it would be one of the k, forked and set up before the timed part):
    # every copy here is forked on demand, as 15 of explore()'s 16 are.
    snap = env._snapshot(ready_copy=False)
    frozen = snap._payload.pid  # (asked now: not inside the timed fork)
    time.sleep(0.03)  # (by then it waits for its first request)
    frozen_start_ms = cpu_ms(frozen)
    gc.disable()
    try:
        f0 = cpu_ms(frozen)
        kids = env.fork(snap, k, rng="same")
        frozen_ms = (cpu_ms(frozen) - f0) / k
        pids = [kid._handle.pid for kid in kids]
        exploration.share_cpus(kids)  # as explore() does: they sleep between requests, no polling
        ready, ready_flt = [cpu_ms(p) for p in pids], [faults(p) for p in pids]
        for kid in kids:
            kid.step_send(0)
        for kid in kids:
            kid.step_receive()
        first, first_flt = [cpu_ms(p) for p in pids], [faults(p) for p in pids]
        c0, l0 = [cpu_ms(p) for p in pids], time.thread_time()
        branches = [exploration.Branch(i, None) for i in range(k)]
        policy = exploration.as_policy(lambda obs, _n=n_actions: int(abs(float(obs[0])) * 1e3) % _n)
        exploration._run_closed_loop(kids, branches, policy, horizon, False, False)
        learner_us = (time.thread_time() - l0) / (k * horizon) * 1e6
        worker_us = med([(cpu_ms(p) - c) * 1e3 / horizon for p, c in zip(pids, c0)])
        step_flt = med([(faults(p) - f) / horizon for p, f in zip(pids, first_flt)])
        # one copy stepped alone (the others idle), sleeping between requests as above: what a
        # step costs its worker without 15 others taking turns on the CPUs (and their caches)
        alone, a0 = kids[0], cpu_ms(pids[0])
        for i in range(horizon):
            if any(alone.step(i % n_actions)[2:4]):
                alone.reset()
        alone_us = (cpu_ms(pids[0]) - a0) * 1e3 / horizon
        time.sleep(0.05)

        def close_all() -> None:
            for kid in kids:
                kid._begin_close()
            for kid in kids:
                kid.close()
            time.sleep(0.15)  # (the copies' exits run at low priority: let them finish)

        close_busy_ms = net_busy_ms(close_all)
        # explore()'s default, rng="reseed": the same batch again, each copy reseeded as it is made
        kids = env.fork(snap, k, rng="reseed", seeds=list(range(k)))
        reseeded = [cpu_ms(kid._handle.pid) for kid in kids]
        for kid in kids:
            kid._begin_close()
        for kid in kids:
            kid.close()
        time.sleep(0.15)
    finally:
        gc.enable()
        snap.release()
    return {"frozen_start_ms": frozen_start_ms, "frozen_fork_ms": frozen_ms, "copy_ready_ms": med(ready), "reseed_ms": med(reseeded) - med(ready),
            # the first step's CPU minus a later step's (measured in the loop after it)
            "first_step_extra_ms": med([f - r for f, r in zip(first, ready)]) - worker_us / 1e3,
            "worker_step_us": worker_us, "worker_alone_step_us": alone_us, "learner_step_us": learner_us,
            "copy_ready_faults": med(ready_flt),  # (a new process counts from 0)
            "first_step_extra_faults": med([f - r for f, r in zip(first_flt, ready_flt)]) - step_flt,
            "worker_step_faults": step_flt,
            "close_busy_ms": close_busy_ms, "closed": k}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--env", default="LunarLander-v3", help="a Gymnasium id with discrete actions (default LunarLander-v3)")
    ap.add_argument("--branches", type=int, default=16, help="copies forked at once (default 16)")
    ap.add_argument("--horizon", type=int, default=100, help="steps per branch (default 100)")
    ap.add_argument("--reps", type=int, default=7, help="repetitions; medians are shown (default 7)")
    ap.add_argument("--json", metavar="PATH", help="also write the numbers to this file")
    args = ap.parse_args()
    env = gym_fork.ForkableEnv(args.env, fork_tier=True)
    try:
        env.reset(seed=0)
        n = env.action_space.n
        for i in range(100):
            if any(env.step(i % n)[2:4]):
                env.reset()
        one_rep(env, args.branches, 10, n)  # warm-up
        reps = [one_rep(env, args.branches, args.horizon, n) for _ in range(args.reps)]
    finally:
        env.close()
    fl = floor(args.env, args.reps, args.branches, args.horizon)
    m = {key: statistics.median(r[key] for r in reps) for key in reps[0]}
    # whole-machine CPU comes in 10 ms ticks: summed over every rep, not a median of each
    m["close_ms"] = sum(r["close_busy_ms"] for r in reps) / sum(r["closed"] for r in reps)
    step_ms = fl["step_ms"]
    fixed = m["frozen_fork_ms"] + m["copy_ready_ms"] + m["first_step_extra_ms"] + m["close_ms"]
    fixed_floor = fl["fork_ms"] + fl["child_ready_ms"] + fl["first_step_extra_ms"] + fl["exit_ms"]
    per_step = (m["worker_step_us"] + m["learner_step_us"]) / 1e3
    # the floor per step: bare workers stepped the same way, all at once (not one alone)
    per_step_floor = (fl["bare_worker_at_once_us"] + fl["bare_learner_at_once_us"]) / 1e3
    branch, branch_floor = fixed + per_step * args.horizon, fixed_floor + per_step_floor * args.horizon
    cpus = len(os.sched_getaffinity(0))

    def depth(branch_ms: float) -> float:  # branches share every CPU; a replay runs on one
        return branch_ms / cpus / step_ms - args.horizon

    rows = [
        ["the snapshot's own process, until it waits (once per explore(); not below)",
         f"{m['frozen_start_ms']:.2f} ms", f"{fl['child_ready_ms']:.2f} ms (bare child, first line)"],
        ["the frozen snapshot forks one copy", f"{m['frozen_fork_ms']:.2f} ms", f"{fl['fork_ms']:.2f} ms (bare os.fork)"],
        ["the copy, until ready", f"{m['copy_ready_ms']:.2f} ms", f"{fl['child_ready_ms']:.2f} ms (bare child, first line)"],
        ["  ... its page faults", f"{m['copy_ready_faults']:.0f}", f"{fl['child_ready_faults']:.0f}"],
        ["its reseed (rng='reseed', explore()'s default; not below)", f"{m['reseed_ms']:.2f} ms", "—"],
        ["its first step, beyond a later one", f"{m['first_step_extra_ms']:.2f} ms", f"{fl['first_step_extra_ms']:.2f} ms"],
        ["  ... its page faults", f"{m['first_step_extra_faults']:.0f}", f"{fl['first_step_extra_faults']:.0f}"],
        ["closing it (learner, copy, exit; whole machine)", f"{m['close_ms']:.2f} ms", f"{fl['exit_ms']:.2f} ms (bare child's exit)"],
        ["each later step: the worker", f"{m['worker_step_us']:.0f} µs",
         f"{fl['bare_worker_at_once_us']:.0f} µs (bare workers, {args.branches} at once)"],
        ["  ... its page faults", f"{m['worker_step_faults']:.2f}", f"{fl['bare_worker_at_once_faults']:.2f}"],
        ["  ... the same copy stepped alone", f"{m['worker_alone_step_us']:.0f} µs",
         f"{fl['bare_worker_step_us']:.0f} µs (a bare worker alone)"],
        ["each later step: the learner", f"{m['learner_step_us']:.0f} µs",
         f"{fl['bare_learner_at_once_us']:.0f} µs (bare learner, {args.branches} at once)"],
        ["an in-process step (the replay's)", f"{step_ms * 1e3:.0f} µs", "—"],
        [f"one branch of {args.horizon} steps, all parts", f"{branch:.1f} ms", f"{branch_floor:.1f} ms (bare parts)"],
        ["its fixed part, in in-process steps", f"{fixed / step_ms:.0f} steps", f"{fixed_floor / step_ms:.0f} steps"],
        [f"break-even depth, CPU-bound on {cpus} CPUs", f"{depth(branch):.0f} steps", f"{depth(branch_floor):.0f} steps"],
    ]
    print_table(["CPU per copy / per step", "gym_fork", "floor"], rows,
                title=f"{args.env}: {args.branches} branches x {args.horizon} steps, medians of {args.reps}")
    if args.json:
        Path(args.json).write_text(json.dumps({"gym_fork": m, "floor": fl, "reps": reps,
                                               "branch_ms": branch, "branch_floor_ms": branch_floor,
                                               "break_even": depth(branch), "break_even_floor": depth(branch_floor)},
                                              indent=1))


if __name__ == "__main__":
    main()

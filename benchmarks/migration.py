"""Live-migration downtime, median over N moves (as root, CRIU >= 4; nodes = netns + veth).

    .venv/bin/python benchmarks/migration.py [--n 5] [--mb 50] [--jobs 5] [--json out.json]

(a) one env worker holding --mb MB of (random, so really dumped) memory: downtime is the whole
    ``env.migrate()`` call plus the first step on the target (the learner is blocked meanwhile);
(a') the same with ``live=True``: pre-copy, the learner keeps stepping; downtime = its pauses;
(b) a whole PPO job (examples/migration_train.py under ``gym-fork run``): downtime is from the
    freeze (CRIU dump start) on A to the first step after resume on B.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from gym_fork.testing.nodes import Nodes  # noqa: E402


def big_env(mb: int):
    def make():
        import gymnasium as gym
        import numpy as np

        env = gym.make("CartPole-v1")
        env.unwrapped.ballast = np.random.default_rng(0).integers(0, 255, size=mb << 20, dtype=np.uint8)
        return env

    return make


def bench_env(n: Nodes, reps: int, mb: int) -> list[dict]:
    import gym_fork

    out = []
    for i in range(reps):
        env = gym_fork.ForkableEnv(big_env(mb))
        try:
            env.reset(seed=i)
            for _ in range(10):
                env.step(0)
            t0 = time.perf_counter()
            rep = env.migrate(n.target["B"], token=n.token, netns=n.netns.get("A"))
            env.step(1)
            rep["downtime_s"] = time.perf_counter() - t0
            out.append(rep)
        finally:
            env.close()
    return out


def bench_env_live(n: Nodes, reps: int, mb: int) -> list[dict]:
    """Pre-copy: the learner keeps stepping (random actions) while the snapshot travels; downtime
    is the learner's pauses (fork-tier snapshot + the switch), and we also record how slow its
    steps got meanwhile (the dump, transfer and restore share the machine's cores)."""
    import numpy as np

    import gym_fork

    out = []
    for i in range(reps):
        env = gym_fork.ForkableEnv(big_env(mb))
        try:
            env.reset(seed=i)
            rng = np.random.default_rng(i)
            before = []
            for _ in range(200):
                t = time.perf_counter()
                if env.step(int(rng.integers(2)))[2]:
                    env.reset()
                before.append(time.perf_counter() - t)
            t0 = time.perf_counter()
            mig = env.migrate(n.target["B"], token=n.token, netns=n.netns.get("A"), live=True)
            t_call = time.perf_counter() - t0
            during = []
            while not mig.done():
                t = time.perf_counter()
                if env.step(int(rng.integers(2)))[2]:
                    env.reset()
                during.append(time.perf_counter() - t)
            rep = mig.result()
            t_total = time.perf_counter() - t0
            rep.update(call_s=t_call, until_switch_s=t_total, step_before_s=float(np.median(before)),
                       step_during_p50_s=float(np.median(during)), step_during_max_s=float(np.max(during)),
                       steps_during=len(during))
            out.append(rep)
        finally:
            env.close()
    return out


def bench_job(n: Nodes, reps: int) -> list[dict]:
    out = []
    for i in range(reps):
        logd = os.path.join(n.dir, f"bench-job-{i}")
        cmd = [sys.executable, "-m", "gym_fork.cli", "run", "--node", "A", "--log-dir", logd, "--token-file",
               n.token_file, "--", sys.executable, os.path.join(ROOT, "examples", "migration_train.py"),
               "--target", n.target["B"], "--at", "600", "--total", "1024", "--seed", str(i)]
        if n.netns.get("A"):
            cmd = ["nsenter", f"--net=/run/netns/{n.netns['A']}", *cmd]
        subprocess.run(cmd, capture_output=True, timeout=180, check=True)
        deadline = time.monotonic() + 120
        done = None
        while done is None and time.monotonic() < deadline:
            with open(os.path.join(logd, "stdout.log")) as f:
                done = next((json.loads(x) for x in f if '"done"' in x), None)
            time.sleep(0.2)
        m = done["migrations"][0]
        if m["status"] != "arrived":
            raise RuntimeError(m)
        out.append(m)
    return out


def summarize(name: str, rows: list[dict], parts: dict[str, callable]) -> dict:
    med = {"downtime_s": statistics.median(r["downtime_s"] for r in rows),
           "bytes": statistics.median(r["bytes"] for r in rows)}
    for k, f in parts.items():
        med[k] = statistics.median(f(r) for r in rows)
    print(f"\n{name}: median over {len(rows)} moves: downtime {med['downtime_s'] * 1e3:.0f} ms "
          f"(min {min(r['downtime_s'] for r in rows) * 1e3:.0f}, max {max(r['downtime_s'] for r in rows) * 1e3:.0f}), "
          f"{med['bytes'] / 1e6:.1f} MB moved")
    for k in parts:
        print(f"    {k:<42s} {med[k] * 1e3:8.2f} ms")
    return {"n": len(rows), "median": med, "all_downtimes_s": [r["downtime_s"] for r in rows]}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=5)
    p.add_argument("--mb", type=int, default=50)
    p.add_argument("--jobs", type=int, default=5)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    res = {}
    with Nodes(["A", "B"]) as n:
        print(f"nodes: {'netns+veth' if n.use_netns else 'loopback'} {n.target}")
        if a.n:
            rows = bench_env(n, a.n, a.mb)
            res["env_worker"] = summarize(f"(a) env worker with {a.mb} MB", rows, {
                "A: snapshot (fork tier)": lambda r: r["timings"]["snapshot_s"],
                "A: CRIU dump of the frozen copy": lambda r: r["timings"]["save_s"],
                "A->B: connect + handshake (overlaps dump)": lambda r: r["timings"]["connect_s"],
                "A: wait for the connection": lambda r: r["timings"].get("connect_wait_s", 0.0),
                "A->B: stream+hash / B: receive+hash": lambda r: r["remote_timings"]["receive_s"],
                "B: verify (HMAC, session, compat, digests)": lambda r: r["remote_timings"]["verify_s"],
                "B: CRIU restore + ping": lambda r: r["remote_timings"]["restore_s"],
            })
            rows = bench_env_live(n, a.n, a.mb)
            res["env_worker_live"] = summarize(f"(a') env worker with {a.mb} MB, live=True (pre-copy)", rows, {
                "pause 1: migrate() call (fork-tier snapshot)": lambda r: r["timings"]["start_s"],
                "pause 2: final replay + switch": lambda r: r["timings"]["switch_s"],
                "(learner step before, median)": lambda r: r["step_before_s"],
                "(learner step during pre-copy, median)": lambda r: r["step_during_p50_s"],
                "(learner step during pre-copy, max)": lambda r: r["step_during_max_s"],
                "(time until switched, learner running)": lambda r: r["until_switch_s"],
            })
            print(f"    steps the learner made meanwhile (median): "
                  f"{statistics.median(r['steps_during'] for r in rows):.0f}, replayed on the target in "
                  f"{statistics.median(len(r['rounds']) for r in rows):.0f} rounds")
        if a.jobs:
            rows = bench_job(n, a.jobs)
            res["ppo_job"] = summarize("(b) whole PPO job (trainer + torch, 1 process tree)", rows, {
                f"A: {k}": (lambda r, k=k: r["timeline"].get(k, 0.0)) for k in ("dump_s", "pack_s", "connect_wait_s")} | {
                f"B: {k}": (lambda r, k=k: r["timeline"][k]) for k in ("receive_s", "verify_s", "restore_s")})
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()

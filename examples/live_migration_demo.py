"""Live migration demo: PPO on LunarLander-v3 starts on node A, moves mid-episode to node B and
finishes there; then one env worker moves too.  One command (as root, CRIU >= 4):

    .venv/bin/python examples/live_migration_demo.py [--total 6144] [--out live_migration.png]

Nodes are network namespaces joined by a veth pair (each with its own address and
`gym-fork agent`); without root privileges for that, two agents on loopback ports.  Prints a
timeline (freeze, dump, transfer, restore, resume), saves a PNG of episode return and timesteps
across the migration, and removes everything it created.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from gym_fork.testing.nodes import Nodes  # noqa: E402


def _lines(path: str) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(x) for x in f if x.startswith("{")]
    except (OSError, ValueError):
        return []


def move_job(n: Nodes, total: int, trigger_after_episodes: int) -> dict:
    logd = os.path.join(n.dir, "job-logs")
    cmd = [sys.executable, "-m", "gym_fork.cli", "run", "--node", "A", "--log-dir", logd, "--token-file",
           n.token_file, "--", sys.executable, os.path.join(HERE, "migration_train.py"),
           "--target", n.target["B"], "--total", str(total)]
    if n.netns.get("A"):
        cmd = ["nsenter", f"--net=/run/netns/{n.netns['A']}", *cmd]
    sup = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out = os.path.join(logd, "stdout.log")
        deadline = time.monotonic() + 120
        while len([x for x in _lines(out) if "ret" in x]) < trigger_after_episodes:
            if time.monotonic() > deadline or sup.poll() is not None:
                raise RuntimeError(f"the job did not get going: {sup.communicate()}")
            time.sleep(0.05)
        print(f"node A: {trigger_after_episodes} episodes done; sending SIGUSR1 (migrate to B at the next step)")
        sup.send_signal(signal.SIGUSR1)  # forwarded to the job; the callback moves at a step boundary
        so, se = sup.communicate(timeout=120)
        while not any(x.get("done") for x in _lines(out)):
            if time.monotonic() > deadline:
                raise RuntimeError("the job did not finish on node B")
            time.sleep(0.2)
    finally:
        if sup.poll() is None:
            sup.kill()
            sup.wait()
    print("supervisor on A:", so.strip().replace("\n", " | "))
    return {"lines": _lines(out), "supervisor_rc": sup.returncode}


def timeline(m: dict) -> None:
    """Where the downtime went. The dump and the transfer overlap: images are streamed (and
    hashed on both ends) while CRIU writes them."""
    tl = m.get("timeline", {})
    print(f"\nmigration A -> B at timestep {m['timestep']} ({m['bytes'] / 1e6:.1f} MB moved)")
    dump, wait, recv = tl.get("dump_s", 0), tl.get("connect_wait_s", 0), tl.get("receive_s", 0)
    end_recv = wait + recv
    rows = [(0.0, dump, "freeze + CRIU dump (job frozen from here)"),
            (wait, end_recv, "stream A -> B, hashed on both ends (overlaps the dump)"),
            (dump, dump + tl.get("pack_s", 0), "sign job.json (after the dump)"),
            (end_recv, end_recv + tl.get("verify_s", 0), "verify on B: HMAC, session, compatibility, digests"),
            (end_recv + tl.get("verify_s", 0), end_recv + tl.get("verify_s", 0) + tl.get("restore_s", 0),
             "CRIU restore on B")]
    for a, b, name in rows:
        print(f"  {a * 1e3:6.0f} -> {b * 1e3:6.0f} ms  {name:<52s} {(b - a) * 1e3:6.0f} ms")
    last = rows[-1][1]
    print(f"  {m['downtime_s'] * 1e3:6.0f} ms            resume on B (first step after the move)")
    print(f"  downtime (freeze -> resume): {m['downtime_s'] * 1e3:.0f} ms; after the restore (reply, first step): "
          f"{(m['downtime_s'] - last) * 1e3:.0f} ms")


def plot(lines: list[dict], m: dict, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    eps = [x for x in lines if "ret" in x]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for node, color in (("A", "tab:blue"), ("B", "tab:orange")):
        pts = [x for x in eps if x["node"] == node]
        a1.scatter([x["t"] for x in pts], [x["ret"] for x in pts], s=12, color=color, label=f"node {node}")
    a1.axvline(m["timestep"], color="k", ls="--", lw=1, label=f"migration (t={m['timestep']})")
    a1.set_xlabel("timestep")
    a1.set_ylabel("episode return")
    a1.set_title("PPO LunarLander-v3: episode return")
    a1.legend()
    w0 = eps[0]["wall"]
    a2.step([x["wall"] - w0 for x in eps], [x["t"] for x in eps], where="post", color="tab:green")
    a2.axhline(m["timestep"], color="k", ls="--", lw=1)
    a2.set_xlabel("wall-clock seconds")
    a2.set_ylabel("timesteps (episode ends)")
    a2.set_title(f"timesteps continue; downtime {m['downtime_s'] * 1e3:.0f} ms")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def move_env(n: Nodes) -> dict:
    import numpy as np

    import gym_fork

    env, ref = gym_fork.make("LunarLander-v3"), gym_fork.make("LunarLander-v3")
    acts = [int(a) for a in np.random.default_rng(0).integers(0, 4, size=300)]
    try:
        for e in (env, ref):
            e.reset(seed=1)
            for a in acts[:100]:
                e.step(a)
        rep = env.migrate(n.target["B"], token=n.token, netns=n.netns.get("A"))
        same = True
        for a in acts[100:]:
            x, y = env.step(a), ref.step(a)
            same &= bool((x[0] == y[0]).all()) and x[1:4] == y[1:4]
            if x[2] or x[3]:
                env.reset(), ref.reset()
        t, r = rep["timings"], rep["remote_timings"]
        print(f"\nenv worker moved to {rep['node']} after 100 steps: {rep['bytes'] / 1e6:.1f} MB, "
              f"total {t['total_s'] * 1e3:.0f} ms (snapshot {t['snapshot_s'] * 1e3:.0f}, save+pack "
              f"{t['save_s'] * 1e3:.0f}, transfer+verify+restore {t['transfer_restore_s'] * 1e3:.0f}: receive "
              f"{r.get('receive_s', 0) * 1e3:.0f}, verify {r.get('verify_s', 0) * 1e3:.0f}, restore "
              f"{r.get('restore_s', 0) * 1e3:.0f})")
        print(f"200 more steps over the network, bit-identical to a local continuation: {same}")
        return {"report": rep, "identical": same}
    finally:
        env.close()
        ref.close()


def move_env_live(n: Nodes) -> dict:
    """The same move with ``live=True``: the learner keeps stepping while the snapshot travels;
    the target replays what it missed, then a later step() switches over."""
    import time

    import numpy as np

    import gym_fork

    env, ref = gym_fork.make("LunarLander-v3"), gym_fork.make("LunarLander-v3")
    rng = np.random.default_rng(1)
    try:
        for e in (env, ref):
            e.reset(seed=2)
        mig = env.migrate(n.target["B"], token=n.token, netns=n.netns.get("A"), live=True)
        same, steps, worst = True, 0, 0.0
        while not mig.done() or steps < 300:
            a = int(rng.integers(4))
            t0 = time.perf_counter()
            x = env.step(a)
            worst = max(worst, time.perf_counter() - t0)
            y = ref.step(a)
            same &= bool((x[0] == y[0]).all()) and x[1:4] == y[1:4]
            steps += 1
            if x[2] or x[3]:
                env.reset(), ref.reset()
        rep = mig.result()
        print(f"\nlive (pre-copy) move to {rep['node']}: the learner made {rep['replayed_ops']} requests while the "
              f"snapshot travelled ({rep['timings']['total_s'] * 1e3:.0f} ms), replayed on B in {len(rep['rounds'])} "
              f"rounds; learner paused {rep['timings']['start_s'] * 1e3:.1f} ms (snapshot) + "
              f"{rep['timings']['switch_s'] * 1e3:.1f} ms (switch) = downtime {rep['downtime_s'] * 1e3:.1f} ms; "
              f"slowest step meanwhile {worst * 1e3:.1f} ms")
        print(f"{steps} steps across the switch, bit-identical to a local run: {same}")
        return {"report": rep, "identical": same}
    finally:
        env.close()
        ref.close()


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--total", type=int, default=6144)
    p.add_argument("--episodes-before", type=int, default=12, help="migrate after this many episodes on A")
    p.add_argument("--out", default="live_migration.png")
    args = p.parse_args(argv)
    with Nodes(["A", "B"]) as n:
        how = f"network namespaces {n.netns['A']} / {n.netns['B']} (veth)" if n.use_netns else "loopback"
        print(f"nodes ({how}): A agent {n.target['A']}, B agent {n.target['B']}")
        job = move_job(n, args.total, args.episodes_before)
        done = [x for x in job["lines"] if x.get("done")][0]
        m = done["migrations"][0]
        if m["status"] != "arrived":
            raise SystemExit(f"the migration failed: {m.get('error')}")
        eps = [x for x in job["lines"] if "ret" in x]
        span = [x for x in eps if x["node"] == "B"][0]
        print(f"the episode in progress at the move started on A and ended on B at t={span['t']} "
              f"(return {span['ret']:.1f}); training finished on B at {done['timesteps']} timesteps")
        timeline(m)
        plot(job["lines"], m, args.out)
        print(f"\nsaved {os.path.abspath(args.out)}")
        env = move_env(n)
        live = move_env_live(n)
    print("cleaned up: agents stopped, namespaces and temporary files removed")
    return {"job": done, "env": env, "env_live": live, "png": os.path.abspath(args.out), "netns": n.use_netns}


if __name__ == "__main__":
    main()

"""Recompute vs fork: what exploring K futures of a deep state costs when you must replay the
prefix to get there, and when you can snapshot it.

    .venv/bin/python benchmarks/recompute.py              # full run, ~5 min on 2 cores
    .venv/bin/python benchmarks/recompute.py --quick      # smoke run, ~1 min
    .venv/bin/python -m benchmarks.recompute --envs LunarLander-v3 --depths 10,1000 --reps 5

The workload, per env and prefix depth D: reach the state after D prefix steps from
``reset(seed=0)``, then run K=16 branches of H=100 steps from it.

* **replay** (the baseline without snapshots): one in-process ``gymnasium`` env; for every
  branch, ``reset(seed=0)`` + the D prefix actions + the H branch actions.  Everything is timed:
  without a snapshot, reaching the state *is* the cost of every branch.
* **fork tier** (``gym_fork.make(id, backend="criu", fork_tier=True)``): the prefix is stepped
  once, untimed (it is the shared history).  Timed: ``env.snapshot()`` (a frozen ``fork()`` copy
  of the worker) + ``gym_fork.explore(env, snap, ..., n_branches=K, horizon=H, rng="same",
  stop_at_done=False)`` (K copy-on-write clones, run, then closed).
* **criu dumps** (``fork_tier=False``): the same, but the snapshot is a CRIU dump to disk and the
  K branches are K concurrent CRIU restores.

Each of the two runs its branches two ways (``--loop``): *closed-loop*, a policy callable that
explore() asks for every action (one IPC round trip per step and branch, branches in lockstep:
what an RL policy needs), and *open-loop*, ``explore(..., actions=...)`` (each branch's H
actions run inside its worker in one round trip: the fast path for planned or random actions).

Same work on both sides: the prefix actions and every branch's H actions are pre-drawn from a
seeded RNG and identical for all methods.  The rule for episode ends is "auto-reset": whenever an
episode ends (in the prefix or in a branch) the env is ``reset()`` *unseeded* (it draws from its
own RNG, which is part of the state) and stepping goes on; explore() does exactly this with
``stop_at_done=False``.  So a branch is always H steps, and the replayed and the forked branches
are the same trajectories: the script checks that every branch's rewards and final observation
agree bit for bit ("exact" column).  Note that D counts env steps since ``reset(seed=0)``,
including steps of earlier episodes (random LunarLander episodes last ~100 steps, Pong ~800).

Cost: replay's time is linear in D and runs on one core; fork/criu pay a constant per snapshot
and per branch (their K worker processes share the machine's cores).  A replay cell whose
estimated time exceeds ``--replay-budget-s`` is timed with fewer repetitions, or, when even one
pass does not fit, on a subset of its K branches and scaled to K (all branches cost the same
prefix; the table marks such cells).

Also measured: branches per second when forking n = 1, 2, 4, 8, 16 at once from one snapshot
(``env.fork(snap, n)`` + one step in each + close), for both tiers.

Tables go to stdout (markdown), progress to stderr, numbers to ``results/recompute.json`` and the
plot to ``results/recompute.png`` (``--out DIR`` puts them in DIR; ``--name`` changes both; ``--quick`` uses ``recompute_quick``).
"""

from __future__ import annotations

import argparse
import inspect
import math
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python benchmarks/x.py` too

import gymnasium as gym  # noqa: E402
import numpy as np  # noqa: E402

import gym_fork  # noqa: E402
from benchmarks.common import (  # noqa: E402
    REPO_ROOT,
    add_out_option,
    results_dir,
    Progress,
    fmt,
    fmt_ratio,
    print_table,
    save_results,
    summarize,
    time_reps,
)

DEFAULT_ENVS = "LunarLander-v3,ALE/Pong-v5"
DEFAULT_DEPTHS = "10,100,1000,10000"
DEFAULT_COUNTS = "1,2,4,8,16"
SEED = 0
TIERS = {"fork": True, "criu": False}  # snapshot tier -> ForkableEnv(fork_tier=...)
# branching method -> (tier, open-loop?): closed-loop = explore() with a policy callable, one IPC
# round trip per step per branch; open-loop = explore(actions=...), each branch's H actions run
# inside its worker in one round trip (gym_fork >= 970f22e).
BRANCH_METHODS = {"fork": ("fork", False), "criu": ("criu", False),
                  "fork_open": ("fork", True), "criu_open": ("criu", True)}
LABELS = {"replay": "replay", "fork": "fork tier", "criu": "criu dumps",
          "fork_open": "fork tier, open-loop", "criu_open": "criu dumps, open-loop"}
SHORT = {"fork": "fork", "criu": "criu", "fork_open": "fork-open", "criu_open": "criu-open"}
HAS_OPEN_LOOP = "actions" in inspect.signature(gym_fork.explore).parameters


# --- the workload ------------------------------------------------------------------------------


def make_plain(env_id: str) -> gym.Env:
    if env_id.startswith("ALE/"):
        import ale_py

        gym.register_envs(ale_py)
    return gym.make(env_id)


def action_plan(n_actions: int, max_depth: int, k: int, h: int, seed: int = 1) -> tuple[list, list]:
    """Prefix actions (the first D are the D-step prefix) and K lists of H branch actions."""
    rng = np.random.default_rng(seed)
    prefix = [int(a) for a in rng.integers(0, n_actions, max_depth)]
    branches = [[int(a) for a in rng.integers(0, n_actions, h)] for _ in range(k)]
    return prefix, branches


def step_through(env, actions) -> None:
    """Step ``actions``, resetting (unseeded) at every episode end."""
    for a in actions:
        _, _, term, trunc, _ = env.step(a)
        if term or trunc:
            env.reset()


def replay_branch(env: gym.Env, prefix: list, branch: list) -> tuple[list, np.ndarray]:
    """reset(seed) + prefix + branch, in process; returns the branch's rewards and final obs."""
    env.reset(seed=SEED)
    step_through(env, prefix)
    rewards, obs = [], None
    for a in branch:
        obs, r, term, trunc, _ = env.step(a)
        rewards.append(float(r))
        if term or trunc:
            env.reset()
    return rewards, obs


class PlannedActions:
    """An explore() policy that plays the pre-drawn branch actions.

    explore() asks for one action per live branch, in branch order, every step; with
    ``stop_at_done=False`` all K branches stay live, so call ``c`` is branch ``c % K``, step ``c // K``.
    """

    def __init__(self, branches: list):
        self.branches, self.k, self.calls = branches, len(branches), 0

    def __call__(self, _obs):
        i, t = self.calls % self.k, self.calls // self.k
        self.calls += 1
        return self.branches[i][t]


# --- measurements ------------------------------------------------------------------------------


def calibrate(env: gym.Env, prefix: list, n_steps: int) -> dict:
    """In-process cost model for replay: seeded reset time and time per step."""
    resets = time_reps(lambda: env.reset(seed=SEED), reps=3, warmup=1)
    env.reset(seed=SEED)
    steps = time_reps(lambda: step_through(env, prefix[:n_steps]), reps=1, warmup=1)
    return {"reset_s": statistics.median(resets), "step_s": steps[0] / n_steps}


def plan_replay(est_s: float, k: int, reps: int, budget_s: float) -> tuple[int, int]:
    """(repetitions, branches to time) so that the cell fits in ``budget_s``."""
    if budget_s <= 0 or est_s * reps <= budget_s:
        return reps, k
    if est_s <= budget_s:
        return max(1, int(budget_s // est_s)), k
    return 1, max(2, min(k, int(budget_s // (est_s / k))))


def replay_sample(env: gym.Env, prefix_d: list, branches: list, n_timed: int) -> tuple[float, list]:
    """One timed replay pass over the first ``n_timed`` branches; returns (seconds, results)."""
    out: list = []
    dt = time_reps(lambda: out.extend(replay_branch(env, prefix_d, b) for b in branches[:n_timed]),
                   reps=1, warmup=0)[0]
    return dt, out


def branching_sample(env: gym_fork.ForkableEnv, branches: list, h: int, open_loop: bool) -> tuple[float, dict]:
    """One timed snapshot() + explore(K branches x H steps) from the env's current state."""
    k = len(branches)
    info: dict = {}

    def fn():
        t0 = time.perf_counter()
        snap = env.snapshot()
        t1 = time.perf_counter()
        if open_loop:
            res = gym_fork.explore(env, snap, None, n_branches=k, horizon=h, rng="same", stop_at_done=False,
                                   progress=False, actions=branches)
        else:
            res = gym_fork.explore(env, snap, PlannedActions(branches), n_branches=k, horizon=h, rng="same",
                                   stop_at_done=False, progress=False)
        info["snapshot_s"], info["explore_s"] = t1 - t0, time.perf_counter() - t1
        info["size"], info["mem"] = snap.size_bytes, snap.memory_bytes()
        info["results"] = [(br.rewards, br.final_obs) for br in res.branches]
        assert res.steps == k * h, (res.steps, k * h)
        return snap

    dt = time_reps(fn, reps=1, warmup=0, teardown=lambda snap: snap.release())[0]
    return dt, info


def bench_depth(plain: gym.Env, envs: dict, methods: list[str], prefix_d: list, branches: list, h: int,
                reps: int, replay_plan: tuple[int, int], warmup: int) -> dict:
    """All methods at one depth, interleaved round by round (replay, fork, criu, ..., replay, ...),
    so that a change in machine load hits them alike."""
    k = len(branches)
    r_reps, n_timed = replay_plan
    samples: dict = {m: [] for m in ["replay"] + methods}
    extra: dict = {m: {"snapshot_s": [], "explore_s": []} for m in methods}
    last: dict = {}
    for i in range(warmup + max(reps, r_reps)):
        if i >= warmup and len(samples["replay"]) < r_reps:
            dt, last["replay"] = replay_sample(plain, prefix_d, branches, n_timed)
            samples["replay"].append(dt)
        for m in methods:
            if len(samples[m]) >= reps:
                continue
            tier, open_loop = BRANCH_METHODS[m]
            dt, info = branching_sample(envs[tier], branches, h, open_loop)
            if i < warmup:
                continue
            samples[m].append(dt)
            extra[m]["snapshot_s"].append(info["snapshot_s"])
            extra[m]["explore_s"].append(info["explore_s"])
            last[m] = info
    scale = k / n_timed
    cells = {"replay": {"s": summarize([x * scale for x in samples["replay"]], unit=1.0), "reps": r_reps,
                        "timed_branches": n_timed, "extrapolated": n_timed < k,
                        "measured_s": summarize(samples["replay"], unit=1.0)}}
    for m in methods:
        info = last[m]
        cells[m] = {"s": summarize(samples[m], unit=1.0), "reps": reps,
                    "snapshot_ms": summarize(extra[m]["snapshot_s"], unit=1e3),
                    "explore_s": summarize(extra[m]["explore_s"], unit=1.0),
                    "snapshot_bytes": info["size"], "snapshot_private_bytes": info["mem"],
                    "exact": same_results(last["replay"], info["results"][:n_timed]),
                    "exact_branches_compared": n_timed}
    return cells


def bench_fork_rate(env: gym_fork.ForkableEnv, counts: list[int], reps: int, action) -> dict:
    """Branches/s when forking n at once: fork(snap, n) + one step in each + close."""
    snap = env.snapshot()
    out = {}
    try:
        for n in counts:
            def fn(n=n):
                kids = env.fork(snap, n)
                for c in kids:
                    c.step_send(action)
                for c in kids:
                    c.step_receive()
                for c in kids:
                    c.close()

            samples = time_reps(fn, reps=reps, warmup=1)
            med = statistics.median(samples)
            out[n] = {"s": summarize(samples, unit=1.0), "branches_per_s": n / med}
    finally:
        snap.release()
    return out


def same_results(a: list, b: list) -> bool:
    for (ra, oa), (rb, ob) in zip(a, b):
        if ra != rb:
            return False
        oa, ob = np.asarray(oa), np.asarray(ob)
        if oa.shape != ob.shape or oa.tobytes() != ob.tobytes():
            return False
    return True


# --- analysis ----------------------------------------------------------------------------------


def _linfit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b x."""
    if len(xs) == 1:
        return ys[0], 0.0
    b, a = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    return float(a), float(b)


def break_even(depths: list[int], replay: list[float], method: list[float]) -> dict:
    """Depth where replay/method crosses 1: interpolated (log-log) between measured depths when
    bracketed, and a linear cost-model estimate (replay = a + bD, method = c + dD) always."""
    ratios = [r / m for r, m in zip(replay, method)]
    a, b = _linfit(depths, replay)
    c, d = _linfit(depths, method)
    model = (c - a) / (b - d) if b != d else None
    interp = None
    for i in range(len(depths) - 1):
        r0, r1 = ratios[i], ratios[i + 1]
        if r0 < 1 <= r1:
            l0, l1 = math.log(depths[i]), math.log(depths[i + 1])
            interp = math.exp(l0 + (l1 - l0) * (0 - math.log(r0)) / (math.log(r1) - math.log(r0)))
            break
    if interp is not None:
        text, how = f"≈ {interp:.0f}", "interpolated between measured depths"
    elif ratios and ratios[0] >= 1:
        how = "fork side already wins at the smallest depth"
        text = f"< {depths[0]}"
        if model is not None:
            text += " (model: " + ("wins even at D=0" if model <= 0 else f"≈ {model:.0f}") + ")"
    elif ratios:
        how = "replay wins at every measured depth"
        text = f"> {depths[-1]}" + (f" (model: ≈ {model:.0f})" if model and model > 0 else "")
    else:
        text, how = "—", "no data"
    return {"ratios": ratios, "interpolated": interp, "model": model, "text": text, "how": how,
            "replay_fit": {"a_s": a, "b_s_per_step": b}, "method_fit": {"c_s": c, "d_s_per_step": d}}


# --- main --------------------------------------------------------------------------------------


def run(args) -> dict:
    env_ids = [e for e in args.envs.split(",") if e]
    depths = sorted(int(d) for d in args.depths.split(","))
    counts = [int(n) for n in args.counts.split(",")] if args.counts else []
    k, h, reps = args.branches, args.horizon, args.reps
    loops = {"closed": [False], "open": [True], "both": [False, True]}[args.loop]
    if True in loops and not HAS_OPEN_LOOP:
        print("note: this gym_fork has no explore(actions=...): open-loop methods skipped", file=sys.stderr)
        loops = [x for x in loops if not x] or [False]
    methods = [m for m, (_tier, ol) in BRANCH_METHODS.items() if ol in loops]
    tiers = list(dict.fromkeys(BRANCH_METHODS[m][0] for m in methods))
    results: dict = {"args": {"envs": env_ids, "depths": depths, "branches": k, "horizon": h, "reps": reps,
                              "replay_budget_s": args.replay_budget_s, "counts": counts, "quick": args.quick,
                              "methods": methods, "seed": SEED,
                              "episode_ends": "auto-reset (unseeded reset, env's own RNG)"},
                     "calibration": {}, "cells": {}, "exact": {}, "break_even": {}, "fork_rate": {}}
    n_cells = len(env_ids) * (len(depths) + (len(tiers) if counts else 0))
    with Progress(n_cells, "recompute") as prog:
        for env_id in env_ids:
            plain = make_plain(env_id)
            n_act = plain.action_space.n
            prefix, branches = action_plan(n_act, depths[-1], k, h)
            cal = calibrate(plain, prefix, min(1000, max(200, depths[-1])))
            results["calibration"][env_id] = cal
            cells = results["cells"][env_id] = {m: {} for m in ["replay"] + methods}
            rates = results["fork_rate"].setdefault(env_id, {})
            # one ForkableEnv per snapshot tier; the prefix is stepped incrementally, untimed
            tier_envs = {t: gym_fork.make(env_id, backend="criu", fork_tier=TIERS[t]) for t in tiers}
            try:
                for env in tier_envs.values():
                    env.reset(seed=SEED)
                pos = 0
                for j, d in enumerate(depths):
                    for env in tier_envs.values():
                        step_through(env, prefix[pos:d])
                    pos = d
                    est = k * (cal["reset_s"] + (d + h) * cal["step_s"])
                    plan = plan_replay(est, k, reps, args.replay_budget_s)
                    got = bench_depth(plain, tier_envs, methods, prefix[:d], branches, h, reps, plan,
                                      warmup=1 if j == 0 else 0)
                    got["replay"]["estimated_s"] = est
                    for m in got:
                        cells[m][d] = got[m]
                    prog.step(f"{env_id} D={d}: " + ", ".join(f"{SHORT.get(m, m)} {got[m]['s']['median']:.2f} s"
                                                             for m in got)
                              + (f" (replay extrapolated from {plan[1]}/{k} branches)" if plan[1] < k else "")
                              + f", exact={all(got[m]['exact'] for m in methods)}")
                plain.close()
                if counts:
                    for t, env in tier_envs.items():
                        rates[t] = bench_fork_rate(env, counts, reps, branches[0][0])
                        prog.step(f"{env_id} {t} fork rate: "
                                  + ", ".join(f"{n}: {v['branches_per_s']:.0f}/s" for n, v in rates[t].items()))
            finally:
                for env in tier_envs.values():
                    env.close()
            rep = [cells["replay"][d]["s"]["median"] for d in depths]
            results["break_even"][env_id] = {
                m: break_even(depths, rep, [cells[m][d]["s"]["median"] for d in depths]) for m in methods}
            results["exact"][env_id] = {m: all(cells[m][d]["exact"] for d in depths) for m in methods}
    return results


def report(results: dict) -> None:
    a = results["args"]
    k, h, depths, methods = a["branches"], a["horizon"], a["depths"], a["methods"]
    for env_id, cells in results["cells"].items():
        cal = results["calibration"][env_id]
        rows = []
        for d in depths:
            rc = cells["replay"][d]
            rp = rc["s"]["median"]
            mark = "†" if rc["extrapolated"] else "‡" if rc["reps"] < a["reps"] else ""
            how = (f"{rc['timed_branches']}/{k} branches ×{k / rc['timed_branches']:.2f}" if rc["extrapolated"]
                   else f"{rc['reps']} rep{'s' * (rc['reps'] > 1)}")
            exact = "yes" if all(cells[m][d]["exact"] for m in methods) else "NO"
            rows.append([d, fmt(rp) + mark, how] + [fmt(cells[m][d]["s"]["median"]) for m in methods]
                        + [fmt_ratio(rp, cells[m][d]["s"]["median"]) for m in methods] + [exact])
        extrap = [d for d in depths if cells["replay"][d]["extrapolated"]]
        fewer = [d for d in depths if not cells["replay"][d]["extrapolated"] and cells["replay"][d]["reps"] < a["reps"]]
        note = (f"Medians in seconds; K={k} branches × H={h} steps; fork/criu: snapshot + explore, "
                f"median of {a['reps']} reps; closed-loop = a policy callable (one IPC round trip per "
                f"step and branch), open-loop = explore(actions=...) (one per branch). Replay in-process: "
                f"seeded reset {cal['reset_s'] * 1e3:.1f} ms, {cal['step_s'] * 1e6:.0f} µs/step. "
                "exact: replayed and forked branches agree bit for bit.")
        if extrap:
            note += (f"\n† EXTRAPOLATED (D={', '.join(map(str, extrap))}): only the stated number of branches "
                     f"was replayed (1 rep) and the time scaled to {k} branches (over --replay-budget-s).")
        if fewer:
            note += f"\n‡ fewer reps than {a['reps']} (D={', '.join(map(str, fewer))}) to fit --replay-budget-s."
        print_table(["depth D", "replay s", "replay timing"] + [f"{SHORT[m]} s" for m in methods]
                    + [f"replay/{SHORT[m]}" for m in methods] + ["exact"], rows,
                    title=f"{env_id}: explore {k}×{h} steps from depth D", note=note)
    rows = []
    for env_id, be in results["break_even"].items():
        for m in methods:
            b = be[m]
            rows.append([env_id, LABELS[m], b["text"], b["how"], " / ".join(f"{x:.2f}" for x in b["ratios"])])
    print_table(["env", "method", "break-even depth", "how", f"replay/method at D={depths}"], rows,
                title="break-even depth (replay/method = 1)",
                note="model: replay = a + b·D and method = c + d·D fitted over the measured depths; "
                     "the crossing D = (c − a)/(b − d).")
    if any(results["fork_rate"].values()):
        counts = a["counts"]
        rows = []
        for env_id, rates in results["fork_rate"].items():
            for t, r in rates.items():
                rows.append([env_id, LABELS[t]] + [f"{r[n]['branches_per_s']:.0f}" for n in counts])
        print_table(["env", "snapshots"] + [f"n={n}" for n in counts], rows,
                    title="branches per second, forking n at once (fork(snap, n) + 1 step each + close)")
    rows = []
    nmax = max(a["counts"]) if a["counts"] else None
    for env_id, cells in results["cells"].items():
        cal = results["calibration"][env_id]
        rows.append([env_id, "replay", f"reset(seed) {cal['reset_s'] * 1e3:.1f} ms + "
                     f"{cal['step_s'] * 1e6:.0f} µs/step, in process", "—", "—", "—"])
        fr = results["fork_rate"].get(env_id, {})
        for m in methods:
            tier = BRANCH_METHODS[m][0]
            snap_ms = statistics.median(cells[m][d]["snapshot_ms"]["median"] for d in depths)
            expl = statistics.median(cells[m][d]["explore_s"]["median"] for d in depths)
            fork_n = fr[tier][nmax]["s"]["median"] if nmax and fr.get(tier) else None
            rows.append([env_id, LABELS[m], "—", fmt(snap_ms), fmt(expl), fmt(fork_n)])
    print_table(["env", "method", "replay cost model", "snapshot ms", "explore s",
                 f"{nmax} forks + 1 step + close s"], rows,
                title="where the time goes (medians over depths)",
                note="explore s = forking the K branches + running them (K×H steps) + closing the K branch "
                     "workers; a fork/criu cell = snapshot + explore.")


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a = results["args"]
    depths = a["depths"]
    colors = {"replay": "tab:red", "fork": "tab:green", "criu": "tab:blue", "fork_open": "yellowgreen",
              "criu_open": "deepskyblue"}
    markers = {"replay": "o", "fork": "o", "criu": "o", "fork_open": "s", "criu_open": "s"}
    styles = ["-", "--", ":", "-."]
    has_rate = any(results["fork_rate"].values())
    fig, axes = plt.subplots(1, 2 if has_rate else 1, figsize=(14 if has_rate else 8, 5.5), squeeze=False,
                             gridspec_kw={"width_ratios": [1.4, 1]} if has_rate else None)
    ax = axes[0][0]
    ex_label = "replay extrapolated (subset of branches timed)"
    for i, (env_id, cells) in enumerate(results["cells"].items()):
        for m in cells:
            ys = [cells[m][d]["s"]["median"] for d in depths]
            ax.plot(depths, ys, styles[i % 4], color=colors[m], marker=markers[m], ms=5,
                    label=f"{LABELS[m]} — {env_id}")
            if m == "replay":
                ex = [(d, y) for d, y in zip(depths, ys) if cells[m][d]["extrapolated"]]
                if ex:
                    ax.scatter(*zip(*ex), s=140, facecolors="none", edgecolors="k", zorder=5, label=ex_label)
                    ex_label = None
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("prefix depth D (steps since reset)")
    ax.set_ylabel(f"seconds to explore {a['branches']}×{a['horizon']} steps from depth D")
    ax.set_title("replay the prefix vs snapshot + fork")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    if has_rate:
        ax = axes[0][1]
        for i, (env_id, rates) in enumerate(results["fork_rate"].items()):
            for t, r in rates.items():
                ns = sorted(r)
                ax.plot(ns, [r[n]["branches_per_s"] for n in ns], styles[i % 4], color=colors[t], marker="o",
                        label=f"{LABELS[t]} — {env_id}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("branches forked at once (n)")
        ax.set_ylabel("branches / s  (fork + 1 step + close)")
        ax.set_title("fork throughput")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def load_results(path: Path) -> dict:
    """A results JSON back in memory, depth and count keys as ints again (for --replot)."""
    import json

    with open(path) as f:
        r = json.load(f)
    r["cells"] = {e: {m: {int(d): v for d, v in dd.items()} for m, dd in c.items()} for e, c in r["cells"].items()}
    r["fork_rate"] = {e: {t: {int(n): v for n, v in rr.items()} for t, rr in c.items()}
                      for e, c in r["fork_rate"].items()}
    return r


def code_version() -> dict:
    """The gym_fork revision measured: git HEAD and uncommitted changes under gym_fork/ (read-only git)."""
    import subprocess

    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], cwd=REPO_ROOT, capture_output=True, text=True,
                                  timeout=10).stdout.rstrip("\n")
        except (OSError, subprocess.SubprocessError):
            return ""

    return {"head": git("rev-parse", "--short", "HEAD").strip(),
            "dirty": [ln[3:] for ln in git("status", "--porcelain", "--", "gym_fork").splitlines()]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--envs", default=DEFAULT_ENVS, help=f"comma-separated env ids (default {DEFAULT_ENVS})")
    p.add_argument("--depths", default=None, help=f"comma-separated prefix depths (default {DEFAULT_DEPTHS}; "
                                                  "10,100 with --quick)")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions per cell (default 3; 1 with --quick)")
    p.add_argument("--branches", type=int, default=16, help="K branches (default 16)")
    p.add_argument("--horizon", type=int, default=100, help="H steps per branch (default 100)")
    p.add_argument("--counts", default=None, help=f"fork-at-once counts for branches/s (default {DEFAULT_COUNTS}; "
                                                  "'' to skip)")
    p.add_argument("--replay-budget-s", type=float, default=None,
                   help="max seconds for one replay cell; beyond it fewer reps, then a subset of branches "
                        "scaled to K (default 30; 5 with --quick; 0 = no limit)")
    p.add_argument("--quick", action="store_true", help="smoke run: depths 10,100, 1 rep, counts 1,4,16")
    p.add_argument("--name", default=None, help="results/<name>.json and .png (default recompute; "
                                                "recompute_quick with --quick)")
    p.add_argument("--loop", choices=("closed", "open", "both"), default="both",
                   help="branches driven by a policy callable (closed: one round trip per step), by "
                        "explore(actions=...) (open: one per branch), or both (default)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--replot", metavar="JSON", help="only redraw the tables and plot of a results JSON")
    add_out_option(p)
    args = p.parse_args(argv)
    if args.replot:
        results = load_results(Path(args.replot))
        report(results)
        png = Path(args.replot).with_suffix(".png")
        plot(results, png)
        print(f"\nwrote {png}")
        return 0
    q = args.quick
    args.depths = args.depths or ("10,100" if q else DEFAULT_DEPTHS)
    args.reps = args.reps or (1 if q else 3)
    args.counts = args.counts if args.counts is not None else ("1,4,16" if q else DEFAULT_COUNTS)
    args.replay_budget_s = args.replay_budget_s if args.replay_budget_s is not None else (5.0 if q else 30.0)
    args.name = args.name or ("recompute_quick" if q else "recompute")

    t0 = time.perf_counter()
    load0 = os.getloadavg()
    results = run(args)
    results["wall_s"] = time.perf_counter() - t0
    results["loadavg"] = {"start": load0, "end": os.getloadavg()}
    results["code"] = code_version()
    report(results)
    if not args.no_plot:
        png = results_dir() / f"{args.name}.png"
        plot(results, png)
        results["plot"] = str(png)
    path = save_results(args.name, results)
    la = results["loadavg"]
    print(f"\nwrote {path}" + (f" and {results['plot']}" if "plot" in results else "")
          + f" ({results['wall_s']:.0f} s; 1-min load average {la['start'][0]:.1f} at start, "
            f"{la['end'][0]:.1f} at end, on {os.cpu_count()} CPUs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

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
  stop_at_done=False)`` (K copy-on-write clones, stepped in lockstep, then closed).
* **criu dumps** (``fork_tier=False``): the same, but the snapshot is a CRIU dump to disk and the
  K branches are K concurrent CRIU restores.

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
plot to ``results/recompute.png`` (``--name`` changes both; ``--quick`` uses ``recompute_quick``).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python benchmarks/x.py` too

import gymnasium as gym  # noqa: E402
import numpy as np  # noqa: E402

import gym_fork  # noqa: E402
from benchmarks.common import (  # noqa: E402
    RESULTS_DIR,
    Progress,
    fmt,
    fmt_ratio,
    print_table,
    ratio,
    save_results,
    summarize,
    time_reps,
)

DEFAULT_ENVS = "LunarLander-v3,ALE/Pong-v5"
DEFAULT_DEPTHS = "10,100,1000,10000"
DEFAULT_COUNTS = "1,2,4,8,16"
SEED = 0
METHODS = ("replay", "fork", "criu")
LABELS = {"replay": "replay", "fork": "fork tier", "criu": "criu dumps"}
TIERS = {"fork": True, "criu": False}  # method -> fork_tier=


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


def bench_replay(env: gym.Env, prefix_d: list, branches: list, reps: int, n_timed: int) -> dict:
    k = len(branches)
    out: dict = {}

    def run():
        out["results"] = [replay_branch(env, prefix_d, b) for b in branches[:n_timed]]

    samples = time_reps(run, reps=reps, warmup=0)
    scale = k / n_timed
    return {"s": summarize([x * scale for x in samples], unit=1.0), "reps": reps, "timed_branches": n_timed,
            "extrapolated": n_timed < k, "measured_s": summarize(samples, unit=1.0), "_results": out["results"]}


def bench_branching(env: gym_fork.ForkableEnv, branches: list, h: int, reps: int, warmup: int) -> dict:
    """Timed: snapshot() + explore(K branches x H steps) from the env's current state."""
    k = len(branches)
    snap_s: list[float] = []
    explore_s: list[float] = []
    state: dict = {}

    def fn():
        t0 = time.perf_counter()
        snap = env.snapshot()
        t1 = time.perf_counter()
        res = gym_fork.explore(env, snap, PlannedActions(branches), n_branches=k, horizon=h, rng="same",
                               stop_at_done=False, progress=False)
        snap_s.append(t1 - t0)
        explore_s.append(time.perf_counter() - t1)
        state["res"], state["size"] = res, snap.size_bytes
        state["mem"] = snap.memory_bytes()
        return snap

    samples = time_reps(fn, reps=reps, warmup=warmup, teardown=lambda snap: snap.release())
    res = state["res"]
    assert res.steps == k * h, (res.steps, k * h)
    return {"s": summarize(samples, unit=1.0), "reps": reps,
            "snapshot_ms": summarize(snap_s[warmup:], unit=1e3),
            "explore_s": summarize(explore_s[warmup:], unit=1.0),
            "snapshot_bytes": state["size"], "snapshot_private_bytes": state["mem"],
            "_results": [(b.rewards, b.final_obs) for b in res.branches]}


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
    envs = [e for e in args.envs.split(",") if e]
    depths = sorted(int(d) for d in args.depths.split(","))
    counts = [int(n) for n in args.counts.split(",")] if args.counts else []
    k, h, reps = args.branches, args.horizon, args.reps
    results: dict = {"args": {"envs": envs, "depths": depths, "branches": k, "horizon": h, "reps": reps,
                              "replay_budget_s": args.replay_budget_s, "counts": counts, "quick": args.quick,
                              "seed": SEED, "episode_ends": "auto-reset (unseeded reset, env's own RNG)"},
                     "calibration": {}, "cells": {}, "exact": {}, "break_even": {}, "fork_rate": {}}
    n_cells = len(envs) * (len(depths) * 3 + (2 if counts else 0))
    with Progress(n_cells, "recompute") as prog:
        for env_id in envs:
            plain = make_plain(env_id)
            n_act = plain.action_space.n
            prefix, branches = action_plan(n_act, depths[-1], k, h)
            cal = calibrate(plain, prefix, min(1000, max(200, depths[-1])))
            results["calibration"][env_id] = cal
            cells = results["cells"][env_id] = {m: {} for m in METHODS}
            ref: dict = {}
            # replay
            for d in depths:
                est = k * (cal["reset_s"] + (d + h) * cal["step_s"])
                r, nb = plan_replay(est, k, reps, args.replay_budget_s)
                cell = bench_replay(plain, prefix[:d], branches, r, nb)
                cell["estimated_s"] = est
                ref[d] = cell.pop("_results")
                cells["replay"][d] = cell
                prog.step(f"{env_id} replay D={d}: {cell['s']['median']:.2f} s"
                          + (f" (extrapolated from {nb}/{k} branches)" if nb < k else ""))
            plain.close()
            # fork tier, criu dumps: one env each, the prefix stepped incrementally (untimed)
            rates = results["fork_rate"].setdefault(env_id, {})
            for m in ("fork", "criu"):
                env = gym_fork.make(env_id, backend="criu", fork_tier=TIERS[m])
                try:
                    env.reset(seed=SEED)
                    pos = 0
                    for j, d in enumerate(depths):
                        step_through(env, prefix[pos:d])
                        pos = d
                        cell = bench_branching(env, branches, h, reps, warmup=1 if j == 0 else 0)
                        got = cell.pop("_results")
                        n_cmp = cells["replay"][d]["timed_branches"]
                        cell["exact"] = same_results(ref[d], got[:n_cmp])
                        cell["exact_branches_compared"] = n_cmp
                        cells[m][d] = cell
                        prog.step(f"{env_id} {m} D={d}: {cell['s']['median']:.2f} s, exact={cell['exact']}")
                    if counts:
                        rates[m] = bench_fork_rate(env, counts, reps, branches[0][0])
                        prog.step(f"{env_id} {m} fork rate: "
                                  + ", ".join(f"{n}: {v['branches_per_s']:.0f}/s" for n, v in rates[m].items()))
                finally:
                    env.close()
            rep = [cells["replay"][d]["s"]["median"] for d in depths]
            results["break_even"][env_id] = {
                m: break_even(depths, rep, [cells[m][d]["s"]["median"] for d in depths]) for m in ("fork", "criu")}
            results["exact"][env_id] = {m: all(cells[m][d]["exact"] for d in depths) for m in ("fork", "criu")}
    return results


def report(results: dict) -> None:
    a = results["args"]
    k, h, depths = a["branches"], a["horizon"], a["depths"]
    notes = []
    for env_id, cells in results["cells"].items():
        cal = results["calibration"][env_id]
        rows = []
        for d in depths:
            rp, fk, cr = (cells[m][d]["s"]["median"] for m in METHODS)
            rc = cells["replay"][d]
            mark = ""
            if rc["extrapolated"]:
                mark = "†"
            elif rc["reps"] < a["reps"]:
                mark = "‡"
            how = (f"{rc['timed_branches']}/{k} branches ×{k / rc['timed_branches']:.2f}" if rc["extrapolated"]
                   else f"{rc['reps']} rep{'s' * (rc['reps'] > 1)}")
            exact = "yes" if cells["fork"][d]["exact"] and cells["criu"][d]["exact"] else "NO"
            rows.append([d, fmt(rp) + mark, how, fmt(fk), fmt(cr), fmt_ratio(rp, fk), fmt_ratio(rp, cr), exact])
        extrap = [d for d in depths if cells["replay"][d]["extrapolated"]]
        fewer = [d for d in depths if not cells["replay"][d]["extrapolated"] and cells["replay"][d]["reps"] < a["reps"]]
        note = (f"Medians in seconds; K={k} branches × H={h} steps; fork/criu: snapshot + explore, "
                f"median of {a['reps']} reps. Replay in-process: seeded reset {cal['reset_s'] * 1e3:.1f} ms, "
                f"{cal['step_s'] * 1e6:.0f} µs/step. exact: replayed and forked branches agree bit for bit.")
        if extrap:
            note += (f"\n† EXTRAPOLATED (D={', '.join(map(str, extrap))}): only the stated number of branches "
                     f"was replayed (1 rep) and the time scaled to {k} branches (over --replay-budget-s).")
        if fewer:
            note += f"\n‡ fewer reps than {a['reps']} (D={', '.join(map(str, fewer))}) to fit --replay-budget-s."
        print_table(["depth D", "replay s", "replay timing", "fork-tier s", "criu s", "replay/fork",
                     "replay/criu", "exact"], rows, title=f"{env_id}: explore {k}×{h} steps from depth D",
                    note=note)
        if extrap:
            notes.append(f"{env_id}: replay at D={extrap} extrapolated")
    rows = []
    for env_id, be in results["break_even"].items():
        for m in ("fork", "criu"):
            b = be[m]
            rows.append([env_id, LABELS[m], b["text"], b["how"],
                         " / ".join(f"{x:.2f}" for x in b["ratios"])])
    print_table(["env", "method", "break-even depth", "how", f"replay/method at D={depths}"], rows,
                title="break-even depth (replay/method = 1)",
                note="model: replay = a + b·D and method = c + d·D fitted over the measured depths; "
                     "the crossing D = (c − a)/(b − d).")
    if any(results["fork_rate"].values()):
        counts = a["counts"]
        rows = []
        for env_id, rates in results["fork_rate"].items():
            for m, r in rates.items():
                rows.append([env_id, LABELS[m]] + [f"{r[n]['branches_per_s']:.0f}" for n in counts])
        print_table(["env", "method"] + [f"n={n}" for n in counts], rows,
                    title="branches per second, forking n at once (fork(snap, n) + 1 step each + close)")
    rows = []
    for env_id, cells in results["cells"].items():
        cal = results["calibration"][env_id]
        fr = results["fork_rate"].get(env_id, {})
        row = [env_id, f"{cal['reset_s'] * 1e3:.1f}", f"{cal['step_s'] * 1e6:.0f}"]
        for m in ("fork", "criu"):
            snap_ms = statistics.median(cells[m][d]["snapshot_ms"]["median"] for d in depths)
            expl = statistics.median(cells[m][d]["explore_s"]["median"] for d in depths)
            nmax = max(fr[m]) if fr.get(m) else None
            fork_n = fr[m][nmax]["s"]["median"] if nmax else None
            row += [fmt(snap_ms), fmt(expl), fmt(fork_n)]
        rows.append(row)
    nmax = max(a["counts"]) if a["counts"] else "n"
    print_table(["env", "replay reset(seed) ms", "replay µs/step", "fork snapshot ms", "fork explore s",
                 f"fork {nmax} forks+1 step+close s", "criu snapshot ms", "criu explore s",
                 f"criu {nmax} restores+1 step+close s"], rows,
                title="where the time goes (medians over depths)",
                note="explore s = forking K branches + K×H lockstep steps over IPC + closing the K "
                     "branch workers; the rest of a fork/criu cell is the snapshot.")
    results["summary_notes"] = notes


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a = results["args"]
    depths = a["depths"]
    colors = {"replay": "tab:red", "fork": "tab:green", "criu": "tab:blue"}
    styles = ["-", "--", ":", "-."]
    has_rate = any(results["fork_rate"].values())
    fig, axes = plt.subplots(1, 2 if has_rate else 1, figsize=(13 if has_rate else 7, 5), squeeze=False)
    ax = axes[0][0]
    for i, (env_id, cells) in enumerate(results["cells"].items()):
        for m in METHODS:
            ys = [cells[m][d]["s"]["median"] for d in depths]
            ax.plot(depths, ys, styles[i % 4], color=colors[m], marker="o", label=f"{LABELS[m]} — {env_id}")
            if m == "replay":
                ex = [(d, y) for d, y in zip(depths, ys) if cells[m][d]["extrapolated"]]
                if ex:
                    ax.scatter(*zip(*ex), s=120, facecolors="none", edgecolors="k", zorder=5,
                               label="replay extrapolated" if i == 0 else None)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("prefix depth D (steps since reset)")
    ax.set_ylabel(f"seconds to explore {a['branches']}×{a['horizon']} steps from depth D")
    ax.set_title("replay the prefix vs snapshot + fork")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    if has_rate:
        ax = axes[0][1]
        for i, (env_id, rates) in enumerate(results["fork_rate"].items()):
            for m, r in rates.items():
                ns = sorted(r)
                ax.plot(ns, [r[n]["branches_per_s"] for n in ns], styles[i % 4], color=colors[m], marker="o",
                        label=f"{LABELS[m]} — {env_id}")
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
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    q = args.quick
    args.depths = args.depths or ("10,100" if q else DEFAULT_DEPTHS)
    args.reps = args.reps or (1 if q else 3)
    args.counts = args.counts if args.counts is not None else ("1,4,16" if q else DEFAULT_COUNTS)
    args.replay_budget_s = args.replay_budget_s if args.replay_budget_s is not None else (5.0 if q else 30.0)
    args.name = args.name or ("recompute_quick" if q else "recompute")

    t0 = time.perf_counter()
    results = run(args)
    results["wall_s"] = time.perf_counter() - t0
    report(results)
    if not args.no_plot:
        png = RESULTS_DIR / f"{args.name}.png"
        plot(results, png)
        results["plot"] = str(png)
    path = save_results(args.name, results)
    print(f"\nwrote {path}" + (f" and {results['plot']}" if "plot" in results else "")
          + f" ({results['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

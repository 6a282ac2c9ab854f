"""Go-Explore on MountainCar-v0: "return to a promising state, then explore", with gym_fork snapshots.

MountainCar-v0's reward is -1 per step until the car reaches the flag (position >= 0.5), within a
200-step time limit.  The engine is too weak to drive up the hill: the car must rock back and
forth to build momentum, so random exploration almost never gets there.

Go-Explore (Ecoffet et al., 2019) keeps an *archive* of the states it has reached, one per
*cell* (a 24x24 grid over position x velocity), and repeatedly (1) picks a cell, favouring rarely
chosen ones (weight 1/sqrt(times chosen + 1)), (2) *returns* to it by restoring the cell's
snapshot, and (3) explores from there with random actions (100 steps), snapshotting every new
cell it enters, or a known cell reached in >= 5 fewer steps since reset (the archive keeps the
fastest way into each cell and releases the snapshot it replaces).  Returning is exactly what
gym_fork's ``restore()`` gives: here a copy-on-write ``fork()`` of the env process (the fork tier,
``backend="criu"``), whatever the env is written in, with no determinism or pickling needed.

Both methods get the SAME budget of env steps (every exploration step counts; a restore costs
none) and the same random explorer: each step, repeat the previous action with probability 0.6,
else draw one uniformly (``--repeat-prob``).  How much the explorer's action persistence matters:
with i.i.d. actions (``--repeat-prob 0``) neither method reaches the flag in 40-60k steps
(Go-Explore still gets much further up the hill, ~0.0-0.4 vs ~-0.2); with 0.8 and more, plain
random episodes reach it too.  Episode ends are real: the TimeLimit wrapper lives in the worker
and is part of every snapshot (a cell reached at step 190 has 10 steps left), so a goal found by
Go-Explore is a genuine episode of at most 200 steps.  The script checks that by replaying the
winning action sequence from ``reset(seed)`` in a plain ``gymnasium`` env.

Run:
    scripts/run.sh examples/go_explore.py          # 40k steps x 3 seeds: ~1-2 min on 2 idle cores
    scripts/run.sh examples/go_explore.py --budget 60000 --seeds 0,1,2,3 --out /tmp/ge.png

Prints a table (max position, at which step of the budget the flag was first reached, the
episode length of that solution) and saves a figure (default results/go_explore.png): (a, b) the
states each method visited in (position, velocity) space, (c) the best position so far as the
step budget is spent, every seed.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import gymnasium as gym
import numpy as np

import gym_fork

ENV_ID = "MountainCar-v0"
GOAL = 0.5
LOW = np.array([-1.2, -0.07])
HIGH = np.array([0.6, 0.07])
REPEAT_PROB = 0.6
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "results" / "go_explore.png"


def cell_of(obs, grid: int) -> tuple[int, int]:
    """Grid cell of a (position, velocity) observation."""
    x = (np.asarray(obs, dtype=np.float64) - LOW) / (HIGH - LOW) * grid
    i, j = np.clip(x.astype(int), 0, grid - 1)
    return int(i), int(j)


@dataclass
class Run:
    """What one method did with its budget."""

    method: str
    seed: int
    states: list = field(default_factory=list)  # (position, velocity) after every step
    goal_at: int | None = None  # budget step (1-based) at which the flag was first reached
    solution: list | None = None  # actions from reset(seed) to the flag
    cells: int = 0
    snapshots: int = 0
    returns: int = 0  # restores (Go-Explore iterations)
    wall_s: float = 0.0
    time_s: dict = field(default_factory=dict)  # where Go-Explore's wall time went

    @property
    def steps(self) -> int:
        return len(self.states)

    @property
    def positions(self) -> np.ndarray:
        return np.array([s[0] for s in self.states]) if self.states else np.zeros(0)

    @property
    def max_pos(self) -> float:
        return float(self.positions.max()) if self.states else float("nan")


class Explorer:
    """The random action policy both methods use: each step, repeat the previous action with
    probability ``repeat_prob``, else draw one uniformly (a new episode or branch starts fresh)."""

    def __init__(self, rng: np.random.Generator, repeat_prob: float):
        self.rng, self.p, self.prev = rng, repeat_prob, None

    def restart(self) -> None:
        self.prev = None

    def __call__(self) -> int:
        if self.prev is None or self.rng.random() >= self.p:
            self.prev = int(self.rng.integers(3))
        return self.prev


def random_exploration(seed: int, budget: int, repeat_prob: float = REPEAT_PROB) -> Run:
    """Plain random exploration: episodes of random actions from reset, ``budget`` steps in all."""
    run = Run("random", seed)
    t0 = time.perf_counter()
    act = Explorer(np.random.default_rng(seed), repeat_prob)
    env = gym.make(ENV_ID)
    env.reset(seed=seed)
    path: list[int] = []
    for _ in range(budget):
        a = act()
        obs, _r, term, trunc, _ = env.step(a)
        path.append(a)
        run.states.append((float(obs[0]), float(obs[1])))
        if term and run.goal_at is None:
            run.goal_at, run.solution = run.steps, list(path)
        if term or trunc:
            env.reset()
            path = []
            act.restart()
    env.close()
    run.wall_s = time.perf_counter() - t0
    return run


@dataclass
class Cell:
    snap: gym_fork.Snapshot
    path: list  # actions from reset(seed) to this state
    chosen: int = 0


def go_explore(seed: int, budget: int, grid: int = 24, explore_steps: int = 100,
               repeat_prob: float = REPEAT_PROB, min_gain: int = 5) -> Run:
    """Go-Explore with fork-tier snapshots; ``budget`` env steps in all."""
    run = Run("go-explore", seed)
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    act = Explorer(np.random.default_rng([seed, 1]), repeat_prob)
    t_restore = t_snap = 0.0
    env = gym_fork.make(ENV_ID, backend="criu", fork_tier=True, record_actions=False)
    try:
        obs, _ = env.reset(seed=seed)
        archive: dict[tuple[int, int], Cell] = {cell_of(obs, grid): Cell(env.snapshot(), [])}
        run.snapshots = 1
        while run.steps < budget:
            keys = list(archive)
            w = np.array([1.0 / math.sqrt(archive[k].chosen + 1) for k in keys])
            home = archive[keys[rng.choice(len(keys), p=w / w.sum())]]
            home.chosen += 1
            t = time.perf_counter()
            env.restore(home.snap)  # return: a fresh copy of the frozen state (~ms)
            t_restore += time.perf_counter() - t
            run.returns += 1
            act.restart()
            path = list(home.path)
            for _ in range(min(explore_steps, budget - run.steps)):
                a = act()
                obs, _r, term, trunc, _ = env.step(a)
                path.append(a)
                run.states.append((float(obs[0]), float(obs[1])))
                if term:
                    if run.goal_at is None:
                        run.goal_at, run.solution = run.steps, list(path)
                    break
                if trunc:
                    break  # time limit: this state has no future
                c = cell_of(obs, grid)
                old = archive.get(c)
                if old is None or len(path) <= len(old.path) - min_gain:
                    t = time.perf_counter()
                    archive[c] = Cell(env.snapshot(), list(path), old.chosen if old else 0)
                    t_snap += time.perf_counter() - t
                    run.snapshots += 1
                    if old is not None:
                        old.snap.release()  # dropped from the archive: free its frozen process
        run.cells = len(archive)
    finally:
        t = time.perf_counter()
        env.close()  # releases every snapshot it took
        t_close = time.perf_counter() - t
    run.wall_s = time.perf_counter() - t0
    run.time_s = {"restore": t_restore, "snapshot": t_snap, "close": t_close,
                  "steps_and_rest": run.wall_s - t_restore - t_snap - t_close}
    return run


def verify_solution(seed: int, actions: list) -> bool:
    """Replay ``actions`` from reset(seed) in a plain gymnasium env: does it end at the flag?"""
    env = gym.make(ENV_ID)
    env.reset(seed=seed)
    term = trunc = False
    obs = None
    for a in actions:
        if term or trunc:
            return False
        obs, _r, term, trunc, _ = env.step(a)
    env.close()
    return bool(term and obs[0] >= GOAL)


def plot(runs: list[Run], out: Path, budget: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    first = runs[0].seed
    for ax, method in zip(axes[:2], ("random", "go-explore")):
        r = next(x for x in runs if x.method == method and x.seed == first)
        s = np.array(r.states)
        ax.scatter(s[:, 0], s[:, 1], s=1, c=np.arange(len(s)), cmap="viridis", alpha=0.5, rasterized=True)
        ax.axvline(GOAL, color="red", ls="--", lw=1, label="flag (0.5)")
        ax.set_xlim(LOW[0], HIGH[0])
        ax.set_ylim(LOW[1], HIGH[1])
        ax.set_xlabel("position")
        ax.set_ylabel("velocity")
        goal = f"flag at step {r.goal_at}" if r.goal_at else "flag not reached"
        ax.set_title(f"({'ab'[method == 'go-explore']}) {method}, seed {first}: states visited\n"
                     f"{r.steps} steps, max position {r.max_pos:.3f}, {goal}", fontsize=9)
        ax.legend(loc="upper left", fontsize=8)
    ax = axes[2]
    colors = {"random": "tab:gray", "go-explore": "tab:green"}
    for r in runs:
        ax.plot(np.arange(1, r.steps + 1), np.maximum.accumulate(r.positions), color=colors[r.method], lw=1.2,
                alpha=0.8, label=r.method if r.seed == first else None)
        if r.goal_at:
            ax.plot([r.goal_at], [GOAL], "o", color=colors[r.method], ms=5)
    ax.axhline(GOAL, color="red", ls="--", lw=1, label="flag")
    ax.set_xlim(0, budget)
    ax.set_xlabel("env steps spent (budget)")
    ax.set_ylabel("max position so far")
    ax.set_title(f"(c) best position vs steps, seeds {sorted({r.seed for r in runs})}", fontsize=9)
    ax.legend(fontsize=8)
    fig.suptitle(f"{ENV_ID}: Go-Explore with gym_fork snapshots vs random exploration, same step budget",
                 fontsize=11)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def markdown(rows: list[list], headers: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]
    line = lambda r: "| " + " | ".join(str(x).ljust(w) for x, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join([line(headers), "| " + " | ".join("-" * w for w in widths) + " |"] + [line(r) for r in rows])


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", type=int, default=40_000, help="env steps per method and seed (default 40000)")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default 0,1,2)")
    p.add_argument("--out", default=str(DEFAULT_OUT), help=f"figure path (default {DEFAULT_OUT})")
    p.add_argument("--grid", type=int, default=24, help="cells per dimension (default 24)")
    p.add_argument("--explore-steps", type=int, default=100, help="random steps after each return (default 100)")
    p.add_argument("--min-gain", type=int, default=5,
                   help="replace a cell's snapshot when a path is at least this many steps shorter (default 5)")
    p.add_argument("--repeat-prob", type=float, default=REPEAT_PROB,
                   help=f"explorer: repeat the previous action with this probability (default {REPEAT_PROB}; "
                        "0 = i.i.d. uniform actions)")
    args = p.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s != ""]

    runs: list[Run] = []
    for seed in seeds:
        for fn in (lambda s, b: random_exploration(s, b, args.repeat_prob),
                   lambda s, b: go_explore(s, b, args.grid, args.explore_steps, args.repeat_prob,
                                          args.min_gain)):
            r = fn(seed, args.budget)
            runs.append(r)
            print(f"[seed {seed}] {r.method}: max position {r.max_pos:.3f}, "
                  f"goal {'at step ' + str(r.goal_at) if r.goal_at else 'not reached'} ({r.wall_s:.1f} s)",
                  file=sys.stderr, flush=True)

    rows, results = [], []
    for r in runs:
        verified = verify_solution(r.seed, r.solution) if r.solution else None
        res = {"method": r.method, "seed": r.seed, "steps": r.steps, "max_pos": r.max_pos,
               "goal_reached": r.goal_at is not None, "goal_at_step": r.goal_at,
               "solution_len": len(r.solution) if r.solution else None, "verified": verified,
               "cells": r.cells if r.method == "go-explore" else None,
               "snapshots": r.snapshots if r.method == "go-explore" else None,
               "returns": r.returns if r.method == "go-explore" else None,
               "wall_s": r.wall_s, "time_s": r.time_s}
        results.append(res)
        rows.append([r.method, r.seed, r.steps, f"{r.max_pos:.3f}",
                     f"yes, at step {r.goal_at}" if r.goal_at else "no",
                     f"{len(r.solution)}" + (" (replayed ok)" if verified else " (REPLAY FAILED)")
                     if r.solution else "—",
                     r.cells if r.method == "go-explore" else "—", f"{r.wall_s:.1f}"])
    print(f"\n### {ENV_ID}: {args.budget} env steps per run (explorer repeat_prob={args.repeat_prob}, "
          f"grid {args.grid}x{args.grid}, {args.explore_steps} steps per return)\n")
    print(markdown(rows, ["method", "seed", "steps", "max position", "flag reached", "episode length to flag",
                          "cells", "wall s"]))
    for m in ("random", "go-explore"):
        rs = [x for x in results if x["method"] == m]
        print(f"\n{m}: flag reached in {sum(x['goal_reached'] for x in rs)}/{len(rs)} seeds, "
              f"mean max position {np.mean([x['max_pos'] for x in rs]):.3f}", end="")
    print()
    ge = [r for r in runs if r.method == "go-explore"]
    if ge:
        tot = {k: sum(r.time_s[k] for r in ge) for k in ge[0].time_s}
        n_ret, n_snap = sum(r.returns for r in ge), sum(r.snapshots for r in ge)
        print(f"go-explore time: {n_ret} restores {tot['restore']:.1f} s "
              f"({1e3 * tot['restore'] / max(n_ret, 1):.1f} ms each), {n_snap} snapshots {tot['snapshot']:.1f} s "
              f"({1e3 * tot['snapshot'] / max(n_snap, 1):.1f} ms each), steps + bookkeeping "
              f"{tot['steps_and_rest']:.1f} s, close {tot['close']:.1f} s")
    out = Path(args.out)
    plot(runs, out, args.budget)
    print(f"\nwrote {out}")
    return {"budget": args.budget, "seeds": seeds, "repeat_prob": args.repeat_prob, "results": results,
            "png": str(out)}


if __name__ == "__main__":
    main()

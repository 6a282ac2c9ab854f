"""Fork-tier restore() and snapshot() as the learner feels them, by how long the learner paused
before: what `hot_path.py`'s rows average over, split by the case.

    .venv/bin/python benchmarks/restore_pauses.py                 # LunarLander, 5 runs
    .venv/bin/python benchmarks/restore_pauses.py --env CartPole-v1 --runs 3

Two checkouts side by side (the numbers of stop 52 were measured so, alternating):

    for i in 1 2 3; do
      (cd /tmp/base && PYTHONPATH=. /work/main/.venv/bin/python benchmarks/restore_pauses.py --runs 1)
      (cd /work/main && .venv/bin/python benchmarks/restore_pauses.py --runs 1)
    done

Each run, in a fresh ``ForkableEnv`` (fork tier) stepped 200 steps:

* restores of one snapshot with a pause of 0 (back to back), 3, 10 or 50 ms before each
  (the learner's own work, slept), each followed by a step: restore() + step, and the
  restore() call alone;
* snapshots after 10 plain steps, then the next step -- with nothing between them, and with
  1 ms of the learner's work between them (a busy loop, not counted): the worker forks
  while the learner works; the snapshot() call alone.

Each cell is the median of its run's samples, minus a plain step's median where it says
"− step"; the table shows the median over runs. Tests never run this.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))
from benchmarks.common import print_table  # noqa: E402

import gym_fork  # noqa: E402

PAUSES_MS = (0, 3, 10, 50)
WORK_S = 0.001


def busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def plain_step_s(env: gym_fork.ForkableEnv, n: int = 30) -> float:
    xs = []
    for _ in range(n):
        t = time.perf_counter()
        env.step(0)
        xs.append(time.perf_counter() - t)
    return statistics.median(xs)


def one_run(env_id: str, reps: int) -> dict[str, float]:
    """One fresh env: every cell's median in ms."""
    env = gym_fork.ForkableEnv(env_id, fork_tier=True)
    out: dict[str, float] = {}
    try:
        env.reset(seed=0)
        for _ in range(200):
            _, _, term, trunc, _ = env.step(0)
            if term or trunc:
                env.reset()
        plain = plain_step_s(env)
        root = env.snapshot()
        time.sleep(0.05)
        for pause in PAUSES_MS:
            total, call = [], []
            gc.collect()
            gc.disable()
            try:
                for _ in range(reps + 3):
                    time.sleep(pause / 1e3)
                    t0 = time.perf_counter()
                    env.restore(root)
                    t1 = time.perf_counter()
                    env.step(0)
                    total.append(time.perf_counter() - t0)
                    call.append(t1 - t0)
            finally:
                gc.enable()
            out[f"restore_{pause}"] = (statistics.median(total[3:]) - plain) * 1e3
            out[f"restore_call_{pause}"] = statistics.median(call[3:]) * 1e3
        for work in (0.0, WORK_S):
            total, call = [], []
            for _ in range(reps):
                plain_step_s(env, 10)
                gc.collect()
                gc.disable()
                try:
                    t0 = time.perf_counter()
                    snap = env.snapshot()
                    t1 = time.perf_counter()
                    busy(work)
                    t2 = time.perf_counter()
                    env.step(0)
                    total.append(time.perf_counter() - t2 + (t1 - t0))
                    call.append(t1 - t0)
                finally:
                    gc.enable()
                snap.release()
                time.sleep(0.03)
            out[f"snapshot_{work}"] = (statistics.median(total) - plain) * 1e3
            out[f"snapshot_call_{work}"] = statistics.median(call) * 1e3
        root.release()
    finally:
        env.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--env", default="LunarLander-v3", help="a Gymnasium id (default LunarLander-v3)")
    ap.add_argument("--runs", type=int, default=5, help="fresh envs, one after another (default 5)")
    ap.add_argument("--reps", type=int, default=20, help="samples per cell and run (default 20)")
    args = ap.parse_args(argv)
    runs = [one_run(args.env, args.reps) for _ in range(args.runs)]

    def cell(key: str) -> str:
        vals = [r[key] for r in runs]
        spread = f" ({min(vals):.2f}-{max(vals):.2f})" if len(vals) > 1 else ""
        return f"{statistics.median(vals):.2f} ms{spread}"

    rows = [[f"restore() + step − step, {p} ms pause before" if p else "restore() + step − step, back to back",
             cell(f"restore_{p}"), cell(f"restore_call_{p}")] for p in PAUSES_MS]
    rows += [["snapshot() + step − step, nothing between", cell("snapshot_0.0"), cell("snapshot_call_0.0")],
             [f"snapshot() + {WORK_S * 1e3:g} ms of learner work + step − work − step", cell(f"snapshot_{WORK_S}"),
              cell(f"snapshot_call_{WORK_S}")]]
    print_table(["work", "as the learner feels it", "the call alone"], rows,
                title=f"{args.env}, fork tier (gym_fork from {Path(gym_fork.__file__).parent})",
                note=f"medians over {args.runs} run(s) of {args.reps} samples (min-max of the runs' medians)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Snapshot and restore cost of the Stable-Baselines3 idiom ``make_vec_env(id, vec_env_cls=ForkableVecEnv)``.

    .venv/bin/python benchmarks/sb3_idioms.py              # ~1 min on 2 cores
    .venv/bin/python -m benchmarks.sb3_idioms --reps 15 --out /tmp/results

``make_vec_env`` wraps every env in SB3's ``Monitor``.  Rows, each one slot of a 2-env
ForkableVecEnv of CartPole-v1 after 20 steps:

* ``make_vec_env (Monitor)``: the idiom as users write it (the worker loads ``Monitor`` without
  SB3's algorithms and torch: see ``gym_fork.worker.lean``);
* ``Monitor + torch imported``: a factory that also imports torch in the worker, single-threaded
  (torch imported but idle still forks);
* ``CRIU dumps (fork_tier=False)``: the slow path -- what every snapshot of these envs cost when
  torch in the worker turned the copy-on-write tier off.

Printed: whether the worker loaded torch, whether it uses the fork tier, the median ms of
``snapshot(0)`` and ``restore(0, snap)``, and each median's ratio to the CRIU-dump row.  Numbers
also go to ``results/sb3_idioms.json`` (``--out DIR``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python benchmarks/x.py` too

import gymnasium as gym  # noqa: E402
import numpy as np  # noqa: E402
from stable_baselines3.common.env_util import make_vec_env  # noqa: E402
from stable_baselines3.common.monitor import Monitor  # noqa: E402

from benchmarks.common import add_out_option, fmt, fmt_ratio, median_ms, print_table, save_results  # noqa: E402
from gym_fork.vec_env import ForkableVecEnv  # noqa: E402


def monitor_with_torch() -> gym.Env:
    import torch  # noqa: F401 - the point: torch imported in the worker, no thread started

    return Monitor(gym.make("CartPole-v1"))


def measure(venv: ForkableVecEnv, reps: int) -> dict:
    venv.reset()
    for _ in range(20):
        venv.step(np.zeros(venv.num_envs, dtype=np.int64))
    env = venv.envs[0]
    snap_ms = median_ms(lambda: venv.snapshot(0), reps=reps, teardown=lambda s: s.release())
    snap = venv.snapshot(0)
    restore_ms = median_ms(lambda: venv.restore(0, snap), reps=reps)
    snap.release()
    return {"torch_in_worker": bool(env._meta.get("torch_loaded")), "fork_tier": bool(env._handle.fork_tier),
            "snapshot_ms": snap_ms, "restore_ms": restore_ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=9)
    add_out_option(parser)
    args = parser.parse_args()
    rows = {
        "make_vec_env (Monitor)": lambda: make_vec_env("CartPole-v1", n_envs=2, vec_env_cls=ForkableVecEnv),
        "Monitor + torch imported": lambda: ForkableVecEnv([monitor_with_torch] * 2),
        "CRIU dumps (fork_tier=False)": lambda: make_vec_env("CartPole-v1", n_envs=2, vec_env_cls=ForkableVecEnv,
                                                             vec_env_kwargs=dict(fork_tier=False)),
    }
    results = {}
    for name, build in rows.items():
        venv = build()
        try:
            results[name] = measure(venv, args.reps)
        finally:
            venv.close()
    base = results["CRIU dumps (fork_tier=False)"]
    print_table(["idiom", "torch in worker", "fork tier", "snapshot ms", "vs dumps", "restore ms", "vs dumps"],
                [[name, r["torch_in_worker"], r["fork_tier"], fmt(r["snapshot_ms"]),
                  fmt_ratio(r["snapshot_ms"], base["snapshot_ms"]), fmt(r["restore_ms"]),
                  fmt_ratio(r["restore_ms"], base["restore_ms"])] for name, r in results.items()],
                title="make_vec_env(..., vec_env_cls=ForkableVecEnv): snapshot/restore of one slot (medians)")
    save_results("sb3_idioms", results)


if __name__ == "__main__":
    main()

"""Ctrl-C (SIGINT) at random moments of ``explore()``, checked against the env and the machine.

Each call of ``explore()`` (4 branches x 20 steps of LunarLander; closed loop, open loop, or the
policy in the workers; from a snapshot or from the env's current state) gets a SIGINT 0.2-300 ms
in (log-uniform). After each call, interrupted or not: the explored env must not have moved (its
step count, and its next step against an in-process reference), and within 5 s no worker process
may be left but the env's own (the branches', the snapshot's). Prints what broke that, and
``(bad, interrupted)`` per seed.

    .venv/bin/python scripts/ctrl_c_explore_campaign.py --seeds 1-8 --calls 40
"""

from __future__ import annotations

import functools
import sys
import time
import warnings

import gymnasium as gym
import numpy as np

import gym_fork
from gym_fork.testing.campaigns import parse_seeds, parser, report, worker_processes
from gym_fork.testing.interrupts import interrupt_after


def run(seed: int, calls: int) -> tuple[int, int]:
    rng = np.random.default_rng(seed)
    others = worker_processes()  # (others', e.g. a test's: not this run's to end)
    env, ref = gym_fork.make("LunarLander-v3"), gym.make("LunarLander-v3")
    bad = interrupted = 0
    try:
        env.reset(seed=1)
        ref.reset(seed=1)
        for i in range(calls):
            a = int(rng.integers(4))
            if not np.array_equal(env.step(a)[0], ref.step(a)[0]):
                print(f"  call {i}: the env's step differs from the reference's")
                return bad + 1, interrupted
            snap = env.snapshot() if rng.random() < 0.5 else None
            kind = str(rng.choice(["closed loop", "open loop", "policy in the workers"]))
            plans = [[int(x) for x in rng.integers(4, size=20)] for _ in range(4)]
            delay = float(np.exp(rng.uniform(np.log(2e-4), np.log(3e-1))))
            steps = env.steps
            try:
                with interrupt_after(delay, sigint=True):
                    if kind == "open loop":
                        gym_fork.explore(env, snap, None, n_branches=4, horizon=20, progress=False, actions=plans)
                    else:
                        gym_fork.explore(env, snap, lambda o: int(o[0] > 0), n_branches=4, horizon=20,
                                         progress=False, policy_in_worker=kind == "policy in the workers")
            except KeyboardInterrupt:
                interrupted += 1
            if env.steps != steps:
                bad += 1
                print(f"  call {i} ({kind}): the env counts {env.steps} steps, {steps} before")
            if snap is not None:
                snap.release()
            deadline = time.monotonic() + 5
            while (left := worker_processes() - {env.worker_pid} - others) and time.monotonic() < deadline:
                time.sleep(0.05)
            if left:
                bad += 1
                print(f"  call {i} ({kind}, SIGINT {delay * 1e3:.2f} ms in): worker processes left: {sorted(left)}")
                return bad, interrupted  # (they would count against every later call)
    finally:
        env.close()
        ref.close()
    return bad, interrupted


def main() -> int:
    args = parser(__doc__, seeds="1-5", count="calls", per_seed=40).parse_args()
    warnings.simplefilter("ignore", RuntimeWarning)  # (explore(): "all branches went on identically")

    def one(seed: int) -> tuple[bool, str]:
        bad, n = run(seed, args.calls)
        return bad > 0, f"{bad} calls broken, {n} interrupted"

    return report((f"seed {seed}", functools.partial(one, seed)) for seed in parse_seeds(args.seeds))


if __name__ == "__main__":
    sys.exit(main())

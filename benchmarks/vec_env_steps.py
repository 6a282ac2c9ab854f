"""Vec-steps per second: ForkableVecEnv (criu) vs SB3's SubprocVecEnv and DummyVecEnv.

    python benchmarks/vec_env_steps.py [--n-envs 4] [--steps 2000] [--runs 3]

Each run steps every VecEnv through the same random actions (auto-resets included), the
kinds taking turns, and the median over runs of (vec-steps / wall seconds) is reported, with
its ratio to SubprocVecEnv's (above 1: faster); start-up is not timed. ``forkable-polling`` is
a ForkableVecEnv whose workers poll for their next request even where they and the learner
outnumber the CPUs (what every ForkableVecEnv did before ``gym_fork.env.share_cpus``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import gymnasium as gym
import numpy as np
from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv

from gym_fork.vec_env import ForkableVecEnv


def _factory(env_id: str):
    return lambda: gym.make(env_id)


def make(kind: str, env_id: str, n: int):
    if kind.startswith("forkable"):
        venv = ForkableVecEnv(env_id, n_envs=n, backend="criu")
        if kind == "forkable-polling":
            for env in venv.envs:
                env._set_worker_polling(True)
        return venv
    if kind == "subproc":
        return SubprocVecEnv([_factory(env_id)] * n)
    return DummyVecEnv([_factory(env_id)] * n)


def rate(venv, steps: int, seed: int) -> float:
    venv.seed(seed)
    venv.reset()
    rng = np.random.default_rng(seed)
    space = venv.action_space
    actions = [np.stack([space.sample() for _ in range(venv.num_envs)]) for _ in range(steps)] \
        if not isinstance(space, gym.spaces.Discrete) else rng.integers(0, space.n, size=(steps, venv.num_envs))
    t = time.perf_counter()
    for a in actions:
        venv.step(a)
    return steps / (time.perf_counter() - t)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n-envs", type=int, default=4)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--envs", nargs="+", default=["CartPole-v1", "LunarLander-v3"])
    args = p.parse_args()
    print(f"{'env':16} {'vec env':17} {'vec-steps/s':>12} {'env-steps/s':>12} {'x subproc':>10}   runs")
    for env_id in args.envs:
        kinds = ("forkable", "forkable-polling", "subproc", "dummy")
        venvs = {kind: make(kind, env_id, args.n_envs) for kind in kinds}
        rates: dict[str, list[float]] = {kind: [] for kind in kinds}
        try:
            for seed in range(args.runs):  # interleaved: background load hits every kind alike
                for kind in kinds:
                    rates[kind].append(rate(venvs[kind], args.steps, seed))
        finally:
            for venv in venvs.values():
                venv.close()
        base = statistics.median(rates["subproc"])
        for kind in kinds:
            med = statistics.median(rates[kind])
            print(f"{env_id:16} {kind:17} {med:12.0f} {med * args.n_envs:12.0f} {med / base:10.2f}   "
                  + " ".join(f"{r:.0f}" for r in rates[kind]), flush=True)


if __name__ == "__main__":
    main()

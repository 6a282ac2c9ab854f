"""gym_fork in one minute: snapshot LunarLander mid-flight, try two futures, come back exactly.

Run:  scripts/run.sh examples/quickstart.py
"""

import logging
import time

import numpy as np

import gym_fork

logging.basicConfig(level=logging.INFO, format="%(message)s")

env = gym_fork.make("LunarLander-v3")  # backend="auto": CRIU when usable, else pickle
print(f"env {env.spec.id} runs in worker pid {env.worker_pid} (backend {env.backend})")
obs, info = env.reset(seed=0)
env.action_space.seed(0)
for _ in range(120):
    obs, *_ = env.step(env.action_space.sample())

t = time.perf_counter()
snap = env.snapshot()  # the whole process: Box2D world, RNG, TimeLimit counter
print(f"snapshot at step {snap.steps}: {snap.size_bytes / 1e6:.1f} MB in {1e3 * (time.perf_counter() - t):.0f} ms")


def future(action: int, n: int = 60) -> float:
    """Return of n steps of one fixed action."""
    total = 0.0
    for _ in range(n):
        _, r, term, trunc, _ = env.step(action)
        total += r
        if term or trunc:
            break
    return total


names = {0: "do nothing", 2: "fire main engine"}
returns = {}
for action in names:
    t = time.perf_counter()
    start_obs, _ = env.restore(snap)
    dt = 1e3 * (time.perf_counter() - t)
    assert np.array_equal(start_obs, obs), "restore must bring back the snapshot's observation"
    returns[action] = future(action)
    print(f"  restore {dt:5.0f} ms -> '{names[action]}' for 60 steps: return {returns[action]:8.2f}")

env.restore(snap)
again = future(0)
print(f"restored once more, 'do nothing' again: return {again:.2f} (bit-identical: {again == returns[0]})")
snap.release()
env.close()

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
for _ in range(40):
    obs, *_ = env.step(env.action_space.sample())

t = time.perf_counter()
snap = env.snapshot()  # the whole process: Box2D world, RNG, TimeLimit counter
dt = 1e3 * (time.perf_counter() - t)
mem = snap.memory_bytes()
print(f"snapshot at step {snap.steps} in {dt:.1f} ms"
      + (f" (copy-on-write: {mem / 1e6:.1f} MB private so far)" if mem is not None else f" ({snap.size_bytes / 1e6:.1f} MB)"))


def future(action: int, n: int = 150) -> float:
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
    print(f"  restore {dt:5.0f} ms -> '{names[action]}' for 150 steps: return {returns[action]:8.2f}")

env.restore(snap)
again = future(0)
print(f"restored once more, 'do nothing' again: return {again:.2f} (bit-identical: {again == returns[0]})")

if env.backend == "criu":
    t = time.perf_counter()
    snap.persist(keep_in_memory=False)  # CRIU images on disk: survives the frozen process
    print(f"persisted as CRIU images in {1e3 * (time.perf_counter() - t):.0f} ms; restoring from disk ...")
    env.restore(snap)
    print(f"  'do nothing' from the images: return {future(0):.2f}")

branches = gym_fork.explore(env, snap, lambda o: env.action_space.sample(), n_branches=8, horizon=100)
print(f"explore: 8 random branches of 100 steps in {branches.wall_s:.2f} s, returns "
      + ", ".join(f"{r:.0f}" for r in branches.returns()))
snap.release()
env.close()

"""Ctrl-C (SIGINT) at random moments of steps, rollouts, snapshots and restores, checked against the worker.

Each call is interrupted half of the time, 5 us - 5 ms in (log-uniform). After every call that
returns, the env's accounting must be the worker's: its step count, and the recorded actions
since its parent snapshot hashed from that snapshot's state must give the worker's hash. Prints
the calls that broke that (and the error that ended a run) and ``(bad, interrupted)`` per seed.

    .venv/bin/python scripts/ctrl_c_campaign.py --seeds 1-8 --calls 150 [--criu-dumps | --pickle]
"""

from __future__ import annotations

import argparse
import signal
import sys

import gymnasium as gym
import numpy as np

import gym_fork
from gym_fork.testing.campaigns import parse_seeds
from gym_fork.testing.interrupts import interrupt_after


class EchoEnv(gym.Env):
    """Observation ``[t, action, h]``: the step count and a running hash of the actions."""

    observation_space = gym.spaces.Box(-1e12, 1e12, (3,), np.float64)
    action_space = gym.spaces.Discrete(1000)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t, self.h = 0, 0
        return np.array([0, -1, 0], dtype=np.float64), {}

    def step(self, action):
        self.t += 1
        self.h = (self.h * 31 + int(action)) % 1_000_003
        return np.array([self.t, action, self.h], dtype=np.float64), 0.0, False, False, {}


def run(calls: int, seed: int, fork_tier: bool, backend: str = "auto") -> tuple[int, int]:
    rng = np.random.default_rng(seed)
    env = gym_fork.ForkableEnv(EchoEnv, fork_tier=fork_tier, record_actions=True, backend=backend)
    bad = interrupted = 0
    try:
        env.reset(seed=0)
        first = env.snapshot()
        snaps = {first.id: (first, 0, 0)}  # id -> (snapshot, t, h) at the snapshot
        for i in range(calls):
            kind = rng.choice(["step", "step", "restore", "restore", "snapshot", "rollout", "sendrecv"])
            a = int(rng.integers(1000))
            delay = float(np.exp(rng.uniform(np.log(5e-6), np.log(5e-3)))) if i % 2 else 0.0
            try:
                with interrupt_after(delay, sigint=True):
                    if kind == "restore":
                        snap = list(snaps.values())[int(rng.integers(len(snaps)))][0]
                        out = env.restore(snap)[0]
                    elif kind == "rollout":
                        out = env.rollout([a, a + 1, a + 2])["final_obs"]
                    elif kind == "sendrecv":
                        env.step_send(a)
                        out = env.step_receive()[0]
                    else:
                        out = env.step(a)[0]
                        if kind == "snapshot":
                            s = env.snapshot()
                            snaps[s.id] = (s, int(out[0]), int(out[2]))
            except KeyboardInterrupt:
                interrupted += 1
                if kind == "sendrecv" and env._handle._send_holds:
                    # Ctrl-C between step_send() and step_receive(): the step was sent and its reply
                    # waits, as documented (a step() now would raise ConcurrentUseError): read it
                    env.step_receive()
                continue
            except gym_fork.errors.IncompleteStepError:
                # (backend="pickle": an interrupt cut the env's own code; it refuses until a restore)
                env.restore(first)
                continue
            parent = snaps.get(env._parent_id)
            if parent is None:
                bad += 1
                print(f"  call {i} {kind}: the env's parent snapshot is not one taken here")
                continue
            _, t, h = parent
            for x in env._actions:
                h = (h * 31 + int(x)) % 1_000_003
            if not (env.steps == int(out[0]) == t + len(env._actions) and h == int(out[2])):
                bad += 1
                print(f"  call {i} {kind}: the env counts {env.steps} steps ({t} + {len(env._actions)} actions), "
                      f"the worker is at step {int(out[0])}")
                env.restore(first)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        env.close()
    return bad, interrupted


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="1-5", help="seeds, as 'A-B' or 'A,B,C' (default: 1-5)")
    ap.add_argument("--calls", type=int, default=150, help="calls per seed (default: 150)")
    ap.add_argument("--criu-dumps", action="store_true", help="every snapshot a CRIU dump (default: the fork tier)")
    ap.add_argument("--pickle", action="store_true", help="backend='pickle': the env runs in this process")
    args = ap.parse_args()
    seeds = parse_seeds(args.seeds)
    broken = 0
    for seed in seeds:
        try:
            bad, n = run(args.calls, seed, not args.criu_dumps, "pickle" if args.pickle else "auto")
            print(f"seed {seed}: {bad} calls answered with the accounting off, {n} interrupted")
            broken += bad > 0
        except Exception as e:  # noqa: BLE001 - reported: the run ended there
            print(f"seed {seed}: ended by {type(e).__name__}: {e}")
            broken += 1
    print(f"{broken} of {len(seeds)} seeds broken")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())

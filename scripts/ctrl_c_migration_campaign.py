"""Ctrl-C (SIGINT) at random moments of ``migrate()`` to a local ``gym-fork agent``, checked
against the env and both machines' processes.

Each round makes an env (the step count and a running hash of the actions in its observation),
steps it, perhaps snapshots it, and moves it to the agent -- stop and copy, or live (the env keeps
stepping and switches inside a later step) -- with a SIGINT 1-400 ms into the move, half of the
time (log-uniform; for a live move, into the steps that follow it too). Then every step must give
what the env's own history says, bit for bit, wherever the env now runs; after the env is closed,
within 5 s no worker may be left here nor under the agent. Prints what broke that and per seed
``(bad, interrupted, moved)``.

    .venv/bin/python scripts/ctrl_c_migration_campaign.py --seeds 1-3 --rounds 20
"""

from __future__ import annotations

import functools
import sys
import time

import numpy as np

import gym_fork
from gym_fork.migration.client import NetworkHandle
from gym_fork.testing.campaigns import parse_seeds, parser, report, worker_processes
from gym_fork.testing.interrupts import interrupt_after
from gym_fork.testing.nodes import Nodes

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from ctrl_c_campaign import EchoEnv  # noqa: E402 - (the scripts directory, put on the path above)


def expected(t: int, h: int, a: int) -> tuple[int, int]:
    """EchoEnv's step: the count and the hash after action ``a``."""
    return t + 1, (h * 31 + a) % 1_000_003


def left_behind(nodes: Nodes) -> set[int]:
    """Worker processes still running here or under the agent."""
    return worker_processes() | worker_processes(nodes.agents["B"].pid)


def round_(nodes: Nodes, rng: np.random.Generator, seed: int, k: int) -> tuple[int, int, int]:
    before = left_behind(nodes)  # (others', e.g. a test's: not this round's to end)
    env = gym_fork.ForkableEnv(EchoEnv, record_actions=True)
    t = h = 0
    bad = interrupted = 0
    what = f"seed {seed} round {k}"
    try:
        env.reset(seed=0)
        snap = None
        for _ in range(int(rng.integers(1, 30))):
            a = int(rng.integers(1000))
            env.step(a)
            t, h = expected(t, h, a)
            if rng.random() < 0.1:
                snap = env.snapshot()
        live = bool(rng.random() < 0.5)
        delay = float(np.exp(rng.uniform(np.log(1e-3), np.log(4e-1)))) if rng.random() < 0.5 else 0.0
        what += f" ({'live' if live else 'stop and copy'}, SIGINT {delay * 1e3:.1f} ms in)"
        mig = None
        try:
            with interrupt_after(delay, sigint=True):
                mig = env.migrate(nodes.agents["B"].target, token=nodes.token, live=live)
                if live:  # the switch comes inside one of these steps
                    for _ in range(40):
                        a = int(rng.integers(1000))
                        obs = env.step(a)[0]
                        t, h = expected(t, h, a)
                        if (int(obs[0]), int(obs[2])) != (t, h):
                            print(f"  {what}: a step while moving answered {obs}, the history says t={t} h={h}")
                            return 1, interrupted, 0
                        time.sleep(0.005)
                time.sleep(0.05)  # (a SIGINT due after the call lands here, not in the checks)
        except KeyboardInterrupt:
            interrupted = 1
            # a step cut by the interrupt ran or not: the env knows (its steps), the history follows it
            if env.steps == t + 1:
                t, h = expected(t, h, a)
            elif env.steps != t:
                print(f"  {what}: the env counts {env.steps} steps, the history {t}")
                return 1, interrupted, 0
        except gym_fork.errors.GymForkError as e:  # a refusal must leave the env running as before
            print(f"  {what}: note: {type(e).__name__}: {str(e)[:160]}")
        if live and mig is not None and not mig.done() and rng.random() < 0.5:
            try:
                mig.result(timeout=60)
            except gym_fork.errors.GymForkError:
                pass
        for _ in range(20):
            a = int(rng.integers(1000))
            obs = env.step(a)[0]
            t, h = expected(t, h, a)
            if (int(obs[0]), int(obs[2])) != (t, h):
                bad += 1
                print(f"  {what}: a step after the move answered {obs}, the history says t={t} h={h}")
                break
        moved = int(isinstance(env._handle, NetworkHandle))
    finally:
        if snap is not None:
            snap.release()
        env.close()
    deadline = time.monotonic() + 5
    while (left := left_behind(nodes) - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    if left:
        bad += 1
        print(f"  {what}: worker processes left after close: {sorted(left)}")
    return bad, interrupted, moved


def main() -> int:
    args = parser(__doc__, seeds="1-3", count="rounds", per_seed=20).parse_args()

    def one(nodes: Nodes, seed: int) -> tuple[bool, str]:
        rng = np.random.default_rng(seed)
        bad = interrupted = moved = 0
        for k in range(args.rounds):
            b, i, m = round_(nodes, rng, seed, k)
            bad, interrupted, moved = bad + b, interrupted + i, moved + m
            if b:
                break
        return bad > 0, f"{bad} rounds broken, {interrupted} interrupted, {moved} moved"

    with Nodes(["B"], use_netns=False) as nodes:
        return report((f"seed {seed}", functools.partial(one, nodes, seed)) for seed in parse_seeds(args.seeds))


if __name__ == "__main__":
    sys.exit(main())

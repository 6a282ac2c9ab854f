"""``gym-fork bench ID|module:factory``: what a step, a snapshot and a restore of an env cost
through gym_fork here, and from what depth branching beats replaying from ``reset()``."""

from __future__ import annotations

import argparse
import json
import sys

from gym_fork.cli.check import add_env_options, env_errors, prepare_env_options, resolve

HELP = "measure an env's step, snapshot and restore costs here, and when branching beats replay"
DESCRIPTION = (
    "Measure what ENV costs through gym_fork on this machine, next to the same env in this "
    "process: the median env.step() call (and its overhead over the in-process step); "
    "snapshot() plus the next step, minus a plain step; restore() after a short pause plus the "
    "next step, minus a plain step -- per backend (the copy-on-write fork tier, CRIU dumps, "
    "pickle).\n\n"
    "From those it solves for the break-even depth: to try another continuation of HORIZON steps "
    "from D steps into an episode, replaying costs reset() + D + HORIZON in-process steps, "
    "branching one restore() + HORIZON steps through the worker; past that D, branching wins. "
    "Cheap envs (CartPole) break even late, expensive ones (MuJoCo, Atari, anything that starts "
    "servers or writes files) early.\n\n"
    "ENV is a Gymnasium env id or module:factory, as for `gym-fork check`.  Timings vary with the "
    "machine's load (a virtual machine's more): compare numbers from one run.  Exit status: 0 "
    "when at least one backend was measured, 1 otherwise, 2 on a usage error."
)
EPILOG = (
    "examples:\n"
    "  gym-fork bench LunarLander-v3\n"
    "  gym-fork bench HalfCheetah-v5 --backends fork --horizon 50\n"
    "  gym-fork bench myenvs:make_env --json > costs.json\n"
    "  gym-fork bench MyEnv-v0 --import myenvs      # a module that registers MyEnv-v0"
)


def configure(p: argparse.ArgumentParser) -> None:
    add_env_options(p, "fork,criu", "fork,criu")
    p.add_argument("--steps", type=int, default=300, help="steps timed per backend (default 300)")
    p.add_argument("--reps", type=int, default=10, help="snapshots and restores timed per backend (default 10)")
    p.add_argument("--horizon", type=int, default=100,
                   help="branch length the break-even depth is solved for (default 100)")
    p.add_argument("--seed", type=int, default=0, help="seed of reset() and of the actions (default 0)")
    p.add_argument("--json", action="store_true", help="print the measurements as one JSON object instead")


def run(args: argparse.Namespace) -> int:
    from gym_fork.costs import measure_costs

    for name, value in (("--steps", args.steps), ("--reps", args.reps), ("--horizon", args.horizon)):
        if value < 1:
            print(f"gym-fork bench: {name} must be at least 1, got {value}", file=sys.stderr)
            return 2
    backends = prepare_env_options(args, "bench")
    if isinstance(backends, int):
        return backends
    try:
        report = measure_costs(resolve(args.env), backends=backends, steps=args.steps, reps=args.reps,
                               horizon=args.horizon, seed=args.seed, verbose=not args.json)
    except env_errors() as e:
        print(f"gym-fork bench: cannot make {args.env}: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
    measured = [r for r in report.rows[1:] if r.step_us is not None and r.restore_ms is not None]
    return 0 if measured else 1

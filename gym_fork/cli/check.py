"""``gym-fork check ID|module:factory``: Gymnasium's env checker on the env in its worker, and
gym_fork's exactness check on every backend, as one verdict table."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Any

HELP = "check an env: Gymnasium's checker in the worker, and exact snapshot/restore/fork on every backend"
DESCRIPTION = (
    "Check an env the way gym_fork will run it.  Gymnasium's env checker "
    "(gymnasium.utils.env_checker.check_env) runs on the env itself inside a worker process, where "
    "it sees the env's own reset/step/spaces.  Then, for each backend (the copy-on-write fork tier, "
    "CRIU dumps, pickle), the env is stepped with seeded random actions, snapshotted, and the same "
    "continuation is run after the snapshot, after restore(), in a fork() child and (CRIU) from "
    "the snapshot saved as a bundle and loaded back: every step must be bit-identical.  A backend "
    "that cannot work here shows n/a, one that refuses the env shows why.\n\n"
    "ENV is a Gymnasium env id (CartPole-v1, ALE/Pong-v5, mypackage:MyEnv-v0) or module:factory, "
    "a zero-argument function or class in an importable module (the current directory is on the "
    "path) that returns the env.\n\n"
    "Exit status: 0 when nothing failed and at least one backend copies the env exactly, 1 "
    "otherwise, 2 on a usage error."
)
EPILOG = (
    "examples:\n"
    "  gym-fork check CartPole-v1\n"
    "  gym-fork check myenvs:make_env --steps 100\n"
    "  gym-fork check LunarLander-v3 --backends fork,criu\n"
    "  gym-fork check MyEnv-v0 --import myenvs      # a module that registers MyEnv-v0"
)


def configure(p: argparse.ArgumentParser) -> None:
    add_env_options(p, "fork,criu,pickle", "all three")
    p.add_argument("--steps", type=int, default=40, help="random steps before the snapshot and after it (default 40)")
    p.add_argument("--seed", type=int, default=0, help="seed of reset() and of the actions (default 0)")
    p.add_argument("--render-check", action="store_true", help="let Gymnasium's checker check render() too")


def add_env_options(p: argparse.ArgumentParser, backends: str, backends_said: str) -> None:
    """ENV, ``--backends`` (default ``backends``, said as ``backends_said``) and ``--import``:
    the options of the commands that take an env (``check``, ``bench``)."""
    p.add_argument("env", metavar="ENV", help="env id, or module:factory")
    p.add_argument("--backends", default=backends,
                   help=f"comma-separated, from fork, criu, pickle (default: {backends_said})")
    p.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                   help="import MODULE first (e.g. one that registers the env id); repeatable")


def env_errors() -> tuple[type[BaseException], ...]:
    """What making ENV raises when the id or factory is wrong (an unknown id, a missing module):
    said as one line on stderr, exit status 1, not as a traceback."""
    import gymnasium as gym

    from gym_fork.errors import GymForkError

    return gym.error.Error, GymForkError, ImportError


def prepare_env_options(args: argparse.Namespace, command: str) -> list[str] | int:
    """The backends ``args`` names, after putting the current directory on the path (for
    ``module:factory``) and importing the ``--import`` modules; else the exit status, with the
    reason said on stderr: 2 when a backend is unknown or none is named, 1 when a module does
    not import."""
    from gym_fork.check import BACKENDS

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = [b for b in backends if b not in BACKENDS]
    if not backends:
        print(f"gym-fork {command}: --backends names no backend; give at least one of {', '.join(BACKENDS)} "
              "(comma-separated)", file=sys.stderr)
        return 2
    if unknown:
        print(f"gym-fork {command}: unknown backend(s) {', '.join(unknown)}; choose from {', '.join(BACKENDS)}",
              file=sys.stderr)
        return 2
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    for name in args.imports:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - the user's module: said in one line, not a traceback
            print(f"gym-fork {command}: --import {name} failed: {type(e).__name__}: {e} (is it installed or in "
                  f"the current directory? `python -c 'import {name}'` shows the traceback)", file=sys.stderr)
            return 1
    return backends


def resolve(target: str) -> Any:
    """An env id, or the factory that ``module:factory`` names (when the module has it)."""
    if ":" in target:
        module_name, attr = target.split(":", 1)
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            return target  # Gymnasium's own "module:EnvId-v0" syntax, or a typo: gym.make says which
        factory = getattr(module, attr, None)
        if callable(factory):
            return factory
    return target


def run(args: argparse.Namespace) -> int:
    from gym_fork.check import check_env

    if args.steps < 1:  # 0 steps would compare nothing and pass
        print(f"gym-fork check: --steps must be at least 1, got {args.steps}", file=sys.stderr)
        return 2
    backends = prepare_env_options(args, "check")
    if isinstance(backends, int):
        return backends
    try:
        report = check_env(resolve(args.env), backends=backends, steps=args.steps, seed=args.seed,
                           skip_render_check=not args.render_check, verbose=True)
    except env_errors() as e:
        print(f"gym-fork check: cannot make {args.env}: {e}", file=sys.stderr)
        return 1
    return 0 if report.ok else 1

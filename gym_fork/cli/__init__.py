"""The ``gym-fork`` command line tool.

    gym-fork doctor            can gym_fork use CRIU here? what is missing and how to fix it
    gym-fork doctor --json     the same, as one JSON object (for scripts and CI)
    gym-fork install-criu      build and install CRIU 4.1.1 + pycriu (root; the installer ships in the package)
    gym-fork check ENV         Gymnasium's checker in the worker + exact snapshot/restore/fork on every backend
    gym-fork bench ENV         what a step, a snapshot and a restore of ENV cost here; the break-even depth
    gym-fork --version

Also runnable as ``python -m gym_fork.cli``.  Subcommands are registered in ``COMMANDS``
(name -> :class:`Command`); a new one needs only a ``configure(parser)`` and a ``run(args)``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import textwrap
from dataclasses import dataclass
from typing import Callable

from gym_fork import __version__

def _fill(text: str, width: int = 88) -> str:
    """Wrap each blank-line-separated paragraph (help texts are raw so the examples keep their layout)."""
    return "\n\n".join(textwrap.fill(par, width) for par in text.split("\n\n"))


@dataclass
class Command:
    help: str  # one line, shown in `gym-fork --help`
    description: str  # shown in `gym-fork CMD --help`
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    epilog: str = ""


def _lazy(module: str) -> tuple[Callable, Callable]:
    """configure/run of ``gym_fork.cli.<module>``, imported only when that command is used."""
    def mod():
        return importlib.import_module(f"gym_fork.cli.{module}")
    return (lambda p: mod().configure(p)), (lambda a: mod().run(a))


def _command(name: str) -> Command:
    m = importlib.import_module(f"gym_fork.cli.{name.replace('-', '_')}")
    return Command(help=m.HELP, description=m.DESCRIPTION, epilog=m.EPILOG, configure=m.configure, run=m.run)


COMMANDS: dict[str, Command] = {name: _command(name) for name in ("doctor", "check", "bench", "agent", "run", "snapshots", "install-criu")}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gym-fork",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=_fill(
            "gym_fork gives any Gymnasium env snapshot(), restore() and fork().  The 'criu' backend "
            "snapshots the env's whole worker process: copy-on-write fork() copies in milliseconds, "
            "CRIU >= 4 images when a snapshot must last or move (exact for every env; Linux, as root "
            "or as a plain user with unprivileged user namespaces); the 'pickle' backend copies "
            "pure-Python envs in-process and works anywhere.  backend='auto' picks what works here.\n\n"
            "This tool checks your setup (start with `gym-fork doctor`) and your env (`gym-fork check`, "
            "`gym-fork bench`), runs migration agents and managed training jobs, and manages snapshot stores."
        ),
        epilog=(
            "examples:\n"
            "  gym-fork doctor            is CRIU usable here? which backend will 'auto' pick?\n"
            "  gym-fork doctor --json     the same, machine-readable\n"
            "  gym-fork bench LunarLander-v3   its step/snapshot/restore costs here; when branching pays\n"
            "  sudo $(which gym-fork) install-criu   set up CRIU (root)\n"
            "  gym-fork COMMAND --help    details and examples for one command\n\n"
            "in Python:\n"
            "  import gym_fork\n"
            "  env = gym_fork.make('CartPole-v1')   # backend='auto'\n"
            "  env.reset(seed=0); snap = env.snapshot(); ...; env.restore(snap)"
        ),
    )
    parser.add_argument("--version", action="version",
                        version=f"%(prog)s {__version__} (Python {sys.version.split()[0]}, "
                                f"{os.path.dirname(os.path.abspath(__file__))})")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for name, cmd in COMMANDS.items():
        p = sub.add_parser(name, help=cmd.help, description=_fill(cmd.description), epilog=cmd.epilog,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        cmd.configure(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``gym-fork``; returns the exit status (also for --help / --version / usage errors)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, usage errors: hand back argparse's status
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        status = COMMANDS[args.command].run(args)
        sys.stdout.flush()  # a reader that left shows here, not as a traceback when Python exits
        return status
    except BrokenPipeError:  # `gym-fork doctor --json | head`: the reader left, not an error of ours
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:  # Ctrl-C: one line and the shell's status for SIGINT, not a traceback
        print(f"gym-fork {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

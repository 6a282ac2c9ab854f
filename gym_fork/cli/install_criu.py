"""``gym-fork install-criu``: set up CRIU 4.1.1 and pycriu with the script shipped in the package."""

from __future__ import annotations

import argparse
import contextlib
import importlib.resources
import os
import subprocess
import sys
from typing import Iterator

HELP = "build and install CRIU 4.1.1 and pycriu (what the 'criu' backend needs); needs root"
DESCRIPTION = (
    "Run the installer that ships inside gym_fork (no checkout needed): it keeps a working "
    "criu >= 4 that is already there, else builds CRIU 4.1.1 from Debian's checksum-verified source "
    "with gym_fork's patches and installs it into PREFIX/sbin, then installs pycriu into PYTHON "
    "(the Python running this command, so the venv gym_fork lives in). Idempotent and quick when "
    "everything is already there; the build is cached in ~/.cache/gym_fork.\n\n"
    "Building needs root (apt build dependencies, /usr/local). As a plain user with a working "
    "criu >= 4 on PATH it only installs pycriu. Without CRIU, gym_fork still works: "
    "backend='auto' falls back to copy-on-write snapshots or pickle (see `gym-fork doctor`).\n\n"
    "Exit status: the installer's (0 when CRIU and pycriu are ready)."
)
EPILOG = (
    "examples:\n"
    "  sudo $(which gym-fork) install-criu         as root, for the Python gym-fork runs in\n"
    "  gym-fork install-criu --script              print the installer's path (to read it first)\n"
    "  gym-fork doctor                             then check what gym_fork can use"
)


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--python", default=sys.executable,
                   help="the Python to install pycriu into (default: this one, %(default)s)")
    p.add_argument("--prefix", default=None, help="install criu into PREFIX/sbin (default /usr/local)")
    p.add_argument("--cache", default=None, help="build cache directory (default ~/.cache/gym_fork)")
    p.add_argument("--script", action="store_true", help="print the path of the installer script and exit")


@contextlib.contextmanager
def installer_script() -> Iterator[str]:
    """The path of the shipped ``install_criu.sh`` (its patches lie next to it).

    Raises:
        FileNotFoundError: the package was installed without its data files.
    """
    res = importlib.resources.files("gym_fork.criu").joinpath("install", "install_criu.sh")
    with importlib.resources.as_file(res) as path:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} is missing: reinstall gym_fork (the installer ships with it)")
        yield str(path)


def run(args: argparse.Namespace) -> int:
    try:
        with installer_script() as script:
            if args.script:
                print(script)
                return 0
            env = dict(os.environ, PYTHON=args.python)
            if args.prefix:
                env["PREFIX"] = args.prefix
            if args.cache:
                env["GYM_FORK_CACHE"] = args.cache
            return subprocess.run(["bash", script], env=env).returncode
    except FileNotFoundError as e:
        print(f"gym-fork install-criu: {e}", file=sys.stderr)
        return 1

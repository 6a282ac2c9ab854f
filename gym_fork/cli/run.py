"""``gym-fork run``: run a training script as a managed job that can be live-migrated."""

from __future__ import annotations

import argparse
import logging
import math
import shutil
import socket
import sys

log = logging.getLogger("gym_fork.job")

HELP = "run a training script as a managed job that can be live-migrated to another node"
DESCRIPTION = (
    "Start `python train.py ...` in its own PID namespace with stdio in O_APPEND log files "
    "owned by this supervisor, so the whole job tree can be checkpointed. A "
    "gym_fork.sb3.LiveMigrationCallback in the script asks this supervisor to move the job "
    "to a `gym-fork agent`; this process exits once the target confirms.\n\n"
    "SIGTERM, SIGINT (Ctrl-C) or SIGHUP to this supervisor stops the job: it gets the same signal, "
    "and SIGKILL if it still runs after --stop-timeout seconds; the exit status is then 128 + the "
    "signal's number (130 for Ctrl-C).  The job is PID 1 of its namespace, so a signal sent straight "
    "to its pid reaches it only when it handles that signal (Python handles SIGINT): signal this "
    "supervisor instead.  A job killed by a signal gives 128 + its number too (137: SIGKILL)."
)
EPILOG = "example:\n  gym-fork run --node A --log-dir logs -- python train.py"


def _seconds(text: str) -> float:
    """A positive, finite number of seconds for argparse."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds > 0")
    return value


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--node", default=socket.gethostname(), help="this node's name (logged; default hostname)")
    p.add_argument("--log-dir", default=".", help="where the job's stdout.log/stderr.log go (O_APPEND)")
    p.add_argument("--token-file", help="shared token for the agents (else $GYM_FORK_TOKEN); Ray node targets "
                   "use it too when given, else the token derived from the gym_fork HMAC key, like the hosts")
    p.add_argument("--tls-ca", help="CA/cert file the agents' certificates must chain to (optional: the token "
                   "handshake covers the agent's certificate in any case)")
    p.add_argument("--insecure", action="store_true",
                   help="plain TCP to agents started with --insecure: nothing after the handshake is encrypted or "
                   "authenticated (anyone on the path can read the job's memory as it moves and inject code into "
                   "it); only where every host on the path is trusted")
    p.add_argument("--ray-address", default=None,
                   help="Ray cluster for 'ray:<node id>' targets (LiveMigrationCallback(RayNode(...))); "
                   "default $RAY_ADDRESS, else 'auto'. Only this supervisor connects to Ray, when the job asks to move")
    p.add_argument("--stop-timeout", type=_seconds, default=10.0, metavar="SECONDS",
                   help="on SIGTERM/SIGINT/SIGHUP to this supervisor, how long the job has to stop after "
                   "getting the same signal before it is killed (SIGKILL; default 10)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- python train.py ...")


def run(args: argparse.Namespace) -> int:
    from gym_fork.migration.job import supervise
    from gym_fork.migration.targets import TargetContext
    from gym_fork.migration.wire.auth import load_token

    logging.basicConfig(level=logging.INFO, format="%(asctime)s gym-fork run %(levelname)s %(message)s", stream=sys.stderr)
    cmd = args.cmd[1:] if args.cmd and args.cmd[0] == "--" else args.cmd
    if not cmd:
        print("gym-fork run: give the command after --", file=sys.stderr)
        return 2
    if shutil.which(cmd[0]) is None:  # else the job's exec fails inside its namespace, seen only in its log
        print(f"gym-fork run: cannot run {cmd[0]!r}: no such executable (not a path to one, and not on PATH)",
              file=sys.stderr)
        return 127
    try:
        token: bytes | None = load_token(None, args.token_file)
    except ValueError as e:
        if args.token_file:
            print(f"gym-fork run: {e} (needed to migrate)", file=sys.stderr)
            return 2
        token = None  # agents ("host:port") refuse to be targets then; Ray node targets derive theirs
        log.info("no token (--token-file, $GYM_FORK_TOKEN): the job can move to Ray nodes only")
    except OSError as e:
        print(f"gym-fork run: {e} (needed to migrate)", file=sys.stderr)
        return 2
    if args.insecure and args.tls_ca:
        print("gym-fork run: --insecure is plain TCP: it cannot be combined with --tls-ca", file=sys.stderr)
        return 2
    targets = TargetContext(token=token, tls=args.tls_ca or False, insecure=args.insecure,
                            options={"ray_address": args.ray_address})
    return supervise(cmd, node=args.node, log_dir=args.log_dir, token=token, targets=targets,
                     stop_timeout=args.stop_timeout)

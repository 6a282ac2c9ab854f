"""``gym-fork agent``: the node agent that receives checkpoints and restores them here."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from typing import Any

HELP = "node agent: receive checkpoints over TLS (token-authenticated) and restore them here"
DESCRIPTION = (
    "Listen for live migrations. Every connection is TLS (a certificate made at start, or "
    "--cert/--key) and peers must pass an HMAC challenge-response with the shared token "
    "(--token-file or $GYM_FORK_TOKEN) that also covers the TLS certificate, so a relay in "
    "between can neither read nor change the stream. Every checkpoint is integrity-checked "
    "before anything is restored. Handshakes are bounded in time, connections are capped, and "
    "running out of fds or threads only sheds new connections. Runs until SIGTERM/SIGINT; what "
    "it hosts is stopped then."
)
EPILOG = "example:\n  gym-fork agent --host 10.0.0.2 --port 7000 --state-dir /var/lib/gym_fork --token-file tok"
INSECURE_HELP = (
    "plain TCP instead of TLS (clients need insecure=True / `gym-fork run --insecure`). Gives up "
    "everything after the handshake: anyone on the network path can read the checkpoints (whole "
    "process memory) and the env's traffic, and inject commands and pickles that run as this "
    "agent's user and as the learner. Only where every host on the path is trusted "
    "(loopback, a private network namespace)"
)


def _port(text: str) -> int:
    """A TCP port for argparse: 0..65535 (said as a usage error, not bind()'s OverflowError)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r} (give 0..65535; 0: any free port)") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port {port} is out of range: give 0..65535 (0: any free port)")
    return port


def _at_least_one(text: str) -> int:
    """A connection limit for argparse: a whole number >= 1 (0 would refuse every connection,
    so it is refused here rather than silently read as "the default")."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n} (leave the option out for the default)")
    return n


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=_port, default=7000, help="TCP port, 0..65535 (0: any free; printed)")
    p.add_argument("--state-dir", required=True, help="private (0700) directory for received checkpoints")
    p.add_argument("--token-file", help="file with the shared token (else $GYM_FORK_TOKEN)")
    p.add_argument("--node", help="this node's name (default: hostname)")
    p.add_argument("--cert", help="TLS certificate (PEM; with --key) instead of one made at start")
    p.add_argument("--key", help="TLS private key (PEM)")
    p.add_argument("--insecure", action="store_true", help=INSECURE_HELP)
    p.add_argument("--max-connections", type=_at_least_one, default=None,
                   help="connections at once (at least 1), hosted env workers' included (default: what the fd limit "
                   "allows, at most 256); more are closed at once")
    p.add_argument("--max-unauthenticated", type=_at_least_one, default=None,
                   help="connections still in their handshake at once (at least 1; default: half of --max-connections, "
                   "at most 32)")
    p.add_argument("--handshake-timeout", type=float, default=10.0,
                   help="seconds for a connection's whole TLS + token handshake (default 10)")


def run(args: argparse.Namespace) -> int:
    from gym_fork.migration.agent import Agent
    from gym_fork.migration.wire.auth import load_token

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        stream=sys.stderr)
    try:
        token = load_token(None, args.token_file)
    except (OSError, ValueError) as e:
        print(f"gym-fork agent: {e}", file=sys.stderr)
        return 2
    try:
        agent = Agent(args.host, args.port, args.state_dir, token, node=args.node, cert=args.cert, key=args.key,
                      insecure=args.insecure, max_connections=args.max_connections,
                      max_unauthenticated=args.max_unauthenticated, handshake_timeout=args.handshake_timeout)
    except (OSError, ValueError) as e:
        print(f"gym-fork agent: {e}", file=sys.stderr)
        return 2
    how = f"TLS certificate sha256 {agent.fingerprint}" if agent.fingerprint else "INSECURE: plain TCP"
    print(f"gym-fork agent {agent.node} listening on {agent.address[0]}:{agent.address[1]} ({how})", flush=True)

    def stop(*_a: Any) -> None:
        agent.stop()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        agent.serve_forever()
    finally:
        agent.shutdown()
    return 0

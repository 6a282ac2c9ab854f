"""``gym-fork agent``: the node agent that receives checkpoints and restores them here."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from typing import Any

HELP = "node agent: receive checkpoints over TCP (authenticated) and restore them here"
DESCRIPTION = (
    "Listen for live migrations. Peers must pass an HMAC challenge-response with the shared "
    "token (--token-file or $GYM_FORK_TOKEN); TLS with --cert/--key. Every checkpoint is "
    "integrity-checked before anything is restored. Runs until SIGTERM/SIGINT; what it hosts "
    "is stopped then."
)
EPILOG = "example:\n  gym-fork agent --host 10.0.0.2 --port 7000 --state-dir /var/lib/gym_fork --token-file tok"


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=7000, help="TCP port (0: any free; printed)")
    p.add_argument("--state-dir", required=True, help="private (0700) directory for received checkpoints")
    p.add_argument("--token-file", help="file with the shared token (else $GYM_FORK_TOKEN)")
    p.add_argument("--node", help="this node's name (default: hostname)")
    p.add_argument("--cert", help="TLS certificate (PEM); with --key enables TLS")
    p.add_argument("--key", help="TLS private key (PEM)")


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
    agent = Agent(args.host, args.port, args.state_dir, token, node=args.node, cert=args.cert, key=args.key)
    print(f"gym-fork agent {agent.node} listening on {agent.address[0]}:{agent.address[1]}", flush=True)

    def stop(*_a: Any) -> None:
        agent.stop()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        agent.serve_forever()
    finally:
        agent.shutdown()
    return 0

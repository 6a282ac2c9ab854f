#!/usr/bin/env bash
# Run a gym_fork script after setting everything up:  scripts/run.sh examples/quickstart.py
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >&2
exec .venv/bin/python "$@"

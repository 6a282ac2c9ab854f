#!/usr/bin/env bash
# Run a gym_fork script after setting everything up:  scripts/run.sh examples/quickstart.py
# The venv is .venv, or $GYM_FORK_VENV (as in scripts/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >&2
exec "${GYM_FORK_VENV:-.venv}/bin/python" "$@"

#!/usr/bin/env bash
# Install CRIU 4.1.1 and pycriu: runs the script that ships inside the package
# (gym_fork/criu/install/install_criu.sh, also reachable as `gym-fork install-criu`).
#   PYTHON=.venv/bin/python scripts/install_criu.sh
exec bash "$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/gym_fork/criu/install/install_criu.sh" "$@"

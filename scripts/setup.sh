#!/usr/bin/env bash
# One-stop set-up: a venv in .venv (or $GYM_FORK_VENV) with gym_fork and every extra (tests, docs
# included), plus CRIU 4.x and pycriu.
# Idempotent and quick when everything is already there.  Usage: scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${GYM_FORK_VENV:-.venv}
BASE_PYTHON=${BASE_PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1
[ -x "$VENV/bin/python" ] || "$BASE_PYTHON" -m venv "$VENV"
PY=$VENV/bin/python
stamp=$VENV/.gym_fork-installed
if [ ! -f "$stamp" ] || [ setup.cfg -nt "$stamp" ]; then
  echo "[setup] installing gym_fork and its extras into $VENV (first time: a few minutes)" >&2
  "$PY" -m pip install -q --upgrade pip 'setuptools>=61' wheel 2>&1 | grep -v "^WARNING: Location" >&2 || true
  # torch first and pinned: SB3 would otherwise pull a multi-GB CUDA build.
  "$PY" -m pip install -q torch==2.13.0 2>&1 | grep -v "^WARNING: Location" >&2 || true
  "$PY" -m pip install -q -e '.[all]' 2>&1 | grep -v "^WARNING: Location" >&2 || true
  "$PY" -c 'import gym_fork, gymnasium, stable_baselines3, ale_py, Box2D, mujoco, torch, importlinter, build, mkdocs, mkdocstrings_handlers.python, material, redis' \
    || { echo "[setup] ERROR: the Python dependencies did not install" >&2; exit 1; }
  touch "$stamp"
fi
# Programs the agent envs and private networks use: redis-server (a real server child in the
# tests and examples/agent_webapp.py), ip and iptables-restore (CRIU needs them for network
# namespaces).  Installed with apt when missing (root only; otherwise say what to install).
missing=()
command -v redis-server >/dev/null || missing+=(redis-server)
command -v ip >/dev/null || missing+=(iproute2)
command -v iptables-restore >/dev/null || missing+=(iptables)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "[setup] apt-get install ${missing[*]}" >&2
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
  else
    echo "[setup] WARNING: missing ${missing[*]}; install them (as root: apt-get install ${missing[*]})" >&2
  fi
fi
# CRIU: only built when no working criu 4.x is there (see scripts/install_criu.sh).
PYTHON="$PY" bash scripts/install_criu.sh

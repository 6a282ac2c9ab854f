#!/usr/bin/env bash
# The core of the suite on the other Pythons gym_fork supports (setup.cfg: python_requires and its
# classifiers), beside the full suite that scripts/test.sh runs on the machine's python3.
#
# For each version in $GYM_FORK_PYTHONS (default "3.13", the newest on this machine; "3.12 3.13"
# for both, ~2-3 min each): find its interpreter (pyenv's /root/.pyenv/versions/3.X.*, or
# python3.X on PATH), make a venv .venv-3.X with gym_fork and what the core tests need (no torch,
# SB3 or Ray: those tests run on python3 only), install pycriu into it (scripts/install_criu.sh;
# CRIU itself is the machine's), and run the unit tests, the fork tier, the agent envs (CRIU
# dumps of process trees), errors, bundles and the Gymnasium compatibility tests there.  A version whose interpreter is not on this machine is said
# loudly and not tested; a version whose tests fail makes the exit status 1.
# Usage: scripts/test_pythons.sh [pytest args]      GYM_FORK_PYTHONS="3.12 3.13" scripts/test_pythons.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
versions=${GYM_FORK_PYTHONS-3.13}
tests=(tests/unit tests/test_fork_tier.py tests/test_agent_envs.py tests/test_errors.py tests/test_bundle.py
       tests/compat/test_boundary.py tests/compat/test_copy.py tests/compat/test_check.py
       tests/compat/test_wrappers.py tests/compat/test_vector.py tests/test_random_operations.py
       tests/test_pickle_store.py tests/test_pickle_hazards.py tests/test_interrupts.py tests/test_criu_working_dir.py)
deselect="not torch and not atari"  # the tests that need torch or ALE (installed in .venv only)
failed=()

find_python() {  # $1 = 3.X -> the path of an interpreter that runs and is 3.X, or nothing
  local v=$1 p
  # (pyenv's shims are on PATH too, and fail for a version that is not selected: each is tried)
  for p in "${PYENV_ROOT:-/root/.pyenv}"/versions/"$v".*/bin/python"$v" $(type -ap "python$v"); do
    if [ -x "$p" ] && [ "$("$p" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)" = "$v" ]; then
      echo "$p"; return
    fi
  done
}

for v in $versions; do
  base=$(find_python "$v")
  if [ -z "$base" ]; then
    echo "[pythons] Python $v: NOT TESTED, no python$v on this machine (PATH, pyenv)" >&2
    continue
  fi
  venv=.venv-$v
  stamp=$venv/.gym_fork-installed
  if [ ! -f "$stamp" ] || [ setup.cfg -nt "$stamp" ]; then
    echo "[pythons] Python $v: making $venv from $base" >&2
    rm -rf "$venv"
    if ! { "$base" -m venv "$venv" \
           && "$venv/bin/python" -m pip install -q 'setuptools>=61' wheel \
           && "$venv/bin/python" -m pip install -q -e '.[test,agents]' 'gymnasium[classic-control,box2d,mujoco]' \
           && PYTHON="$venv/bin/python" bash scripts/install_criu.sh >&2; } 2>&1 | grep -v "^WARNING: Location" >&2 \
       || ! "$venv/bin/python" -c 'import gym_fork, pycriu, pytest, Box2D, mujoco, redis'; then
      echo "[pythons] Python $v: FAILED to set up $venv" >&2
      failed+=("$v (set-up)")
      continue
    fi
    touch "$stamp"
  fi
  echo "[pythons] Python $v: $("$venv/bin/python" -c 'import sys; print(sys.version.split()[0])'), ${tests[*]} -k '$deselect'" >&2
  bash scripts/run_pytest.sh "$venv/bin/python" "${tests[@]}" -k "$deselect" "$@" || failed+=("$v")
done
for f in "${failed[@]}"; do echo "[pythons] FAILED: Python $f" >&2; done
[ "${#failed[@]}" -eq 0 ]

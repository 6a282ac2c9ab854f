#!/usr/bin/env bash
# The test command (README, CI): set everything up (venv, gym_fork + extras, CRIU 4.x), then
# run the whole suite.  Extra arguments go to pytest, e.g.  scripts/test.sh -k exactness
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -c 'from gym_fork.criu.status import criu_status as s; st=s(); print("[test] CRIU:", st.binary, st.version, "usable" if st.usable else "NOT usable: " + "; ".join(st.reasons))'
exec .venv/bin/python -m pytest -p no:cacheprovider -q "$@"

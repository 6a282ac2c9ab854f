#!/usr/bin/env bash
# Run pytest with PYTHON in two parts, as scripts/test.sh and scripts/test_pythons.sh do:
#   1. every test not marked `alone` in $GYM_FORK_TEST_JOBS test processes at once (pytest-xdist,
#      one test file per process at a time: a file's fixtures and its processes stay together);
#   2. the tests marked `alone` (timing behaviour -- spinning, polling, faulting in on a free CPU --
#      that needs the machine's CPUs to itself), in one process, after the rest.
# Why: the suite mostly waits (process starts, CRIU, servers, sleeps): run one test at a time it
# left ~45 % of 2 CPUs idle and took 13.8-18 min; two test processes take 7-8.5.
# GYM_FORK_TEST_JOBS: default 2 where 2+ CPUs are ours, else 1; 1 runs everything in one process
# in file order (no pytest-xdist needed).  Extra arguments go to both parts (-k, -x, paths, ...);
# a part they select nothing from is fine.  Exit status: the first failing part's; 5 when neither
# part selected a test; else 0.
# Usage: scripts/run_pytest.sh PYTHON [pytest args]
set -uo pipefail
py=$1; shift
cpus=$("$py" -c 'import os; print(len(os.sched_getaffinity(0)))')
jobs=${GYM_FORK_TEST_JOBS:-$(( cpus >= 2 ? 2 : 1 ))}
if ! [[ "$jobs" =~ ^[1-9][0-9]*$ ]]; then
  echo "run_pytest.sh: GYM_FORK_TEST_JOBS must be a whole number >= 1 (test processes at once), not '$jobs'" >&2
  exit 2
fi
if [ "$jobs" -le 1 ]; then
  exec "$py" -m pytest -p no:cacheprovider -q "$@"
fi
rcs=()
echo "[pytest] part 1: the tests that may share the machine, $jobs test processes (pytest-xdist)"
GYM_FORK_TEST_PART=shared "$py" -m pytest -p no:cacheprovider -q -n "$jobs" --dist loadfile "$@"; rcs+=($?)
echo "[pytest] part 2: the tests marked alone, one at a time"
GYM_FORK_TEST_PART=alone "$py" -m pytest -p no:cacheprovider -q "$@"; rcs+=($?)
# 5 is pytest's "no tests selected": fine for one part, not for both (a -k that matches nothing)
for r in "${rcs[@]}"; do [ "$r" -eq 0 ] || [ "$r" -eq 5 ] && continue; exit "$r"; done
[ "${rcs[0]}" -eq 5 ] && [ "${rcs[1]}" -eq 5 ] && exit 5
exit 0

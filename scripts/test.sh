#!/usr/bin/env bash
# The test command (README, CI): set everything up (venv, gym_fork + extras, CRIU 4.x), then check
# the import contracts (setup.cfg [importlinter]), build the docs strictly, run the whole suite
# (scripts/run_pytest.sh: two test processes at once, GYM_FORK_TEST_JOBS=1 for one), and
# (without arguments) its core on Python 3.13 too (scripts/test_pythons.sh; GYM_FORK_PYTHONS picks).
# Every step runs; the exit status is non-zero when any failed.  Extra arguments go to pytest,
# e.g.  scripts/test.sh -k exactness
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${GYM_FORK_VENV:-.venv}  # as in scripts/setup.sh
"$VENV"/bin/python -c 'from gym_fork.criu.status import criu_status as s; st=s(); print("[test] CRIU:", st.binary, st.version, "usable" if st.usable else "NOT usable: " + "; ".join(st.reasons))' || true
failed=()
echo "[test] import contracts: lint-imports"
"$VENV"/bin/lint-imports || failed+=("import contracts (lint-imports: an import across a layer, into the Ray plugin or in a cycle, see above)")
echo "[test] docs: mkdocs build --strict"
site=$(mktemp -d)
export NO_MKDOCS_2_WARNING=1  # (a notice about MkDocs 2 on every build)
"$VENV"/bin/mkdocs build --strict --quiet --site-dir "$site" || failed+=("docs (mkdocs build --strict: a broken page or API reference, see above)")
rm -rf "$site"
rc=0
bash scripts/run_pytest.sh "$VENV"/bin/python "$@" || rc=$?  # two test processes, then the `alone` tests
if [ "$#" -eq 0 ]; then  # the whole suite: also its core on the other supported Pythons
  echo "[test] other Pythons: scripts/test_pythons.sh (${GYM_FORK_PYTHONS-3.13})"
  bash scripts/test_pythons.sh || failed+=("other Pythons (scripts/test_pythons.sh, see above)")
fi
for f in "${failed[@]}"; do echo "[test] FAILED: $f" >&2; done
[ "${#failed[@]}" -eq 0 ] || [ "$rc" -ne 0 ] || rc=1
exit "$rc"

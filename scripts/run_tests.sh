#!/usr/bin/env bash
# Runs a tier of the suite: test (what CI runs), test-all (adds the tests marked `long`), unit.
# pytest's "no tests collected" (exit 5) is a failure here, never a pass. Each module's time is
# checked against its budget in `make test` (tests/time_budget.py); extra arguments go to pytest.
set -uo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0 RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
tier="${1:-test}"
shift || true
case "$tier" in
  test) args=(-m "not long"); export PDSERVE_TIME_BUDGET=test ;;
  test-all) args=() ;;
  unit) args=(tests/unit) ;;
  *) echo "usage: $0 [test|test-all|unit] [pytest args...]" >&2; exit 2 ;;
esac
# --durations: the slowest tests in every run's log
.venv/bin/python -m pytest -q --durations=15 "${args[@]}" "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: treating as a failure" >&2
  exit 1
fi
exit "$rc"

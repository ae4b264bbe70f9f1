#!/usr/bin/env bash
# Runs the whole suite; pytest's "no tests collected" (exit 5) is a failure here, never a pass.
set -uo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0 RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
# --durations: the slowest tests in every run's log, to keep the suite within its time budget
.venv/bin/python -m pytest -q --durations=15 "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: treating as a failure" >&2
  exit 1
fi
exit "$rc"

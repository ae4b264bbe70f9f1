#!/usr/bin/env bash
# Line coverage of the product packages over the whole suite (`make test-all`), untimed; extra
# arguments go to pytest (e.g. `-m "not long"` for what `make test` covers). Every
# Python subprocess is measured too (coverage's subprocess patch: Ray's worker actors, the heads
# the CLI tests start); processes ended by SIGKILL (the chaos tests' victims) write nothing.
# The configuration is [tool.coverage.*] in pyproject.toml; the report goes to stdout and
# .coverage-data/report.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0 RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
rm -rf .coverage-data && mkdir -p .coverage-data
.venv/bin/python -m coverage run -m pytest -q -p no:cacheprovider "$@"
rc=$?
# one data file per process (parallel = true); one a SIGKILL cut short is skipped with a warning
.venv/bin/python -m coverage combine -q
.venv/bin/python -m coverage report | tee .coverage-data/report.txt | tail -1
exit "$rc"

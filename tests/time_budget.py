"""A time budget per test module, checked from pytest's own durations, so the suite cannot creep.

Every run adds up each module's setup, call and teardown durations. Session-scoped fixtures (the
shared clusters, Ray, Redis) are counted apart, under ``SHARED``: which module happens to start
them first depends on the selection and order, not on the module. ``make test`` sets
``PDSERVE_TIME_BUDGET=test``; the run then fails, naming the module, when one took longer than its
budget for that tier in ``tests/time_budget.json`` or has none (``make test-all``, which runs the
long tests beside them, checks none). Budgets are twice the slowest of the measured runs they were made from
(``python tests/time_budget.py TIER RUN.json [RUN.json ...]`` rewrites that tier's budgets; every
run writes its figures to ``$PDSERVE_TIME_RECORD`` when that is set). A run of a selection checks
only what it ran, against the same budgets.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

BUDGET_FILE = Path(__file__).with_name("time_budget.json")
SHARED = "<session fixtures>"
HEADROOM = 2.0
MIN_BUDGET_S = 5.0     # a module of a few fast tests: a budget below this would only measure noise


class TimeBudget:
    def __init__(self, tier: str, record: str | None) -> None:
        self.tier = tier
        self.record = record
        self.seconds: dict[str, float] = defaultdict(float)
        self._shared_in_phase = 0.0

    # ------------------------------------------------------------ measuring
    @pytest.hookimpl(hookwrapper=True)
    def pytest_fixture_setup(self, fixturedef, request):
        if fixturedef.scope != "session":
            yield
            return
        started: list[float] = []
        # finalizers run last-in first-out: this one after the fixture's own teardown ...
        fixturedef.addfinalizer(lambda: self._add_shared(time.perf_counter() - started[-1]) if started else None)
        t0 = time.perf_counter()
        yield
        self._add_shared(time.perf_counter() - t0)
        # ... and this one before it
        fixturedef.addfinalizer(lambda: started.append(time.perf_counter()))

    def _add_shared(self, seconds: float) -> None:
        self._shared_in_phase += seconds

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        module = report.nodeid.split("::")[0]
        shared = min(self._shared_in_phase, report.duration)
        self._shared_in_phase = 0.0
        self.seconds[module] += report.duration - shared
        self.seconds[SHARED] += shared

    # ------------------------------------------------------------- checking
    def over_budget(self, budgets: dict[str, float]) -> list[str]:
        wrong = []
        for module, took in sorted(self.seconds.items()):
            limit = budgets.get(module)
            if limit is None:
                wrong.append(f"{module}: took {took:.1f} s and has no budget in {BUDGET_FILE.name}")
            elif took > limit:
                wrong.append(f"{module}: took {took:.1f} s, over its budget of {limit:.0f} s")
        return wrong

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if self.record:
            Path(self.record).write_text(json.dumps(dict(sorted(self.seconds.items())), indent=1) + "\n")
        if not self.tier or not self.seconds:
            return
        tiers = json.loads(BUDGET_FILE.read_text())["tiers"] if BUDGET_FILE.exists() else {}
        wrong = self.over_budget(tiers.get(self.tier, {}).get("seconds", {}))
        if wrong:
            reporter = session.config.pluginmanager.get_plugin("terminalreporter")
            lines = ["time budget exceeded (tests/time_budget.py says how budgets are made):", *wrong]
            if reporter is not None:
                reporter.write_sep("=", "time budget", red=True)
                for line in lines:
                    reporter.write_line(line)
            if session.exitstatus == 0:
                session.exitstatus = pytest.ExitCode.TESTS_FAILED


TIERS = ("test",)


def pytest_configure(config: pytest.Config) -> None:
    tier = os.environ.get("PDSERVE_TIME_BUDGET", "")
    if tier not in ("", *TIERS):
        raise pytest.UsageError(f"PDSERVE_TIME_BUDGET={tier!r}: one of {', '.join(TIERS)} or unset")
    config.pluginmanager.register(TimeBudget(tier, os.environ.get("PDSERVE_TIME_RECORD")), "pdserve-time-budget")


def budgets_from(runs: list[dict[str, float]]) -> dict[str, float]:
    """Twice the slowest measured time of each module, rounded up to whole seconds."""
    modules = sorted({m for run in runs for m in run})
    return {m: float(max(MIN_BUDGET_S, math.ceil(HEADROOM * max(run.get(m, 0.0) for run in runs))))
            for m in modules}


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in TIERS:
        print(__doc__)
        return 2
    tier, runs = argv[0], [json.loads(Path(p).read_text()) for p in argv[1:]]
    budgets = json.loads(BUDGET_FILE.read_text()) if BUDGET_FILE.exists() else {"tiers": {}}
    budgets["tiers"][tier] = {
        "made_from": f"{len(runs)} run(s) of `make {tier}`; budget = {HEADROOM:g}x the slowest, at least {MIN_BUDGET_S:g} s",
        "seconds": budgets_from(runs)}
    BUDGET_FILE.write_text(json.dumps(budgets, indent=1, sort_keys=True) + "\n")
    print(f"wrote {tier} budgets into {BUDGET_FILE} ({len(runs)} runs)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

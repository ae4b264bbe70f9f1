"""The suite's time budget (tests/time_budget.py): budgets from measured runs, and what a run over them says."""

from __future__ import annotations

from time_budget import MIN_BUDGET_S, SHARED, TimeBudget, budgets_from


def test_a_budget_is_twice_the_slowest_run_and_never_below_the_floor() -> None:
    runs = [{"tests/a.py": 10.2, "tests/b.py": 1.0, SHARED: 30.0}, {"tests/a.py": 12.1, SHARED: 20.0}]
    assert budgets_from(runs) == {"tests/a.py": 25.0, "tests/b.py": MIN_BUDGET_S, SHARED: 60.0}


def test_a_module_over_its_budget_or_without_one_is_named() -> None:
    tb = TimeBudget("test", None)
    tb.seconds.update({"tests/a.py": 30.0, "tests/b.py": 4.0, "tests/new.py": 1.0})
    wrong = tb.over_budget({"tests/a.py": 25.0, "tests/b.py": 5.0})
    assert wrong == ["tests/a.py: took 30.0 s, over its budget of 25 s",
                     "tests/new.py: took 1.0 s and has no budget in time_budget.json"]


def test_time_in_session_fixtures_is_counted_apart_from_the_module_that_started_them() -> None:
    class Report:
        def __init__(self, nodeid: str, duration: float) -> None:
            self.nodeid, self.duration = nodeid, duration

    tb = TimeBudget("", None)
    tb._add_shared(8.0)                      # a shared cluster started in this test's setup
    tb.pytest_runtest_logreport(Report("tests/a.py::test_x", 9.5))
    tb.pytest_runtest_logreport(Report("tests/a.py::test_x", 2.0))
    assert tb.seconds == {"tests/a.py": 3.5, SHARED: 8.0}

"""A worker's recent stats reports, and the rates each reader takes from them over its own window."""

from __future__ import annotations

import pytest

from pdserve.engine.contract import WorkerRole, WorkerStats
from pdserve.router.stats_history import StatsHistory


def report(generated: int) -> WorkerStats:
    return WorkerStats(worker_id="decode-a", role=WorkerRole.DECODE, num_running=0, num_waiting=0,
                       num_free_blocks=10, num_blocks=10, kv_usage=0.0, prefix_hit_rate=0.0,
                       generated_tokens=generated, prompt_tokens_computed=0, prefill_compute_s=0.0,
                       prefill_budget_tokens=None, max_prefill_tokens_with_decodes=0, kv_open_transfers=0,
                       kv_mailboxes=0, started_at=1.0, niceness=0, pid=1, transfer_timeout_s=None)


def generated(s: WorkerStats) -> float:
    return s.generated_tokens


def test_a_window_starts_on_the_newest_report_at_or_before_it_and_ends_on_the_latest() -> None:
    h = StatsHistory()
    assert h.since(100.0) is None                          # nothing reported yet
    h.add(100.0, report(0))
    assert h.since(100.0) is None                          # one report: no span
    assert h.since(99.0) is None                           # it joined after the window began: nothing to compare
    h.add(100.25, report(10))
    h.add(100.5, report(30))
    p = h.since(100.3)
    assert p is not None and p.span_s == pytest.approx(0.25) and p.per_s(generated) == pytest.approx(80.0)
    whole = h.since(100.0)
    assert whole is not None and whole.span_s == pytest.approx(0.5) and whole.gained(generated) == 30
    assert h.since(100.5) is None                          # nothing newer than the window's start


def test_counters_that_went_back_read_as_no_progress() -> None:
    h = StatsHistory()
    h.add(0.0, report(500))
    h.add(1.0, report(20))   # the worker restarted under the same id
    p = h.since(0.0)
    assert p is not None and p.per_s(generated) == 0.0 and p.gained(generated) == -480


def test_reports_past_the_horizon_are_dropped_and_a_longer_window_starts_on_the_oldest_kept() -> None:
    h = StatsHistory(horizon_s=10.0)
    for t in range(0, 31):
        h.add(float(t), report(10 * t))
    assert len(h._reports) == 11                           # 20 s .. 30 s: every window up to 10 s is exact
    p = h.since(25.0)
    assert p is not None and p.span_s == 5.0 and p.per_s(generated) == 10.0
    longer = h.since(3.0)                                  # further back than kept: shortened to the horizon
    assert longer is not None and longer.span_s == 10.0 and longer.gained(generated) == 100
    with pytest.raises(ValueError):
        StatsHistory(horizon_s=0.0)

"""The figures of ``pdserve bench serve`` from token timestamps (pure functions, no server)."""

from __future__ import annotations

import pytest

from pdserve.bench.serve_load import GroupSpec, LoadResult, RequestRecord, build_items
from pdserve.bench.serve_stats import dist_ms, highest_rate_meeting, meets_slo, percentile, stalls, summarize_run


def _rec(sent: float, times: list[float], group: str = "g", error: str | None = None) -> RequestRecord:
    return RequestRecord(group, 0, prompt_len=10, output_len=len(times), sent=sent, token_times=times, error=error)


def test_percentile_interpolates_like_numpy() -> None:
    xs = [4.0, 1.0, 3.0, 2.0]
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 4.0
    assert percentile(xs, 50) == pytest.approx(2.5)
    assert percentile(xs, 90) == pytest.approx(3.7)
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile(xs, 101)


def test_ttft_tpot_itl_and_stalls_of_one_request() -> None:
    r = _rec(0.0, [0.5, 0.6, 0.7, 2.2])
    summary = summarize_run(LoadResult([r], 0.0, 2.2, 0.1, stall_threshold_s=1.0), ttft_slo_s=1.0, itl_slo_s=0.6)
    g = summary["groups"]["g"]
    assert g["ttft_ms"]["p50"] == pytest.approx(500.0)
    assert g["tpot_ms"]["p50"] == pytest.approx(1700.0 / 3)
    assert g["itl_ms"]["max"] == pytest.approx(1500.0) and g["itl_ms"]["n"] == 3
    assert g["stalls"]["count"] == 1 and g["stalls"]["max_ms"] == pytest.approx(1500.0)
    assert g["output_tokens"] == 4 and g["output_tokens_per_s"] == pytest.approx(4 / 2.2)
    # TPOT 0.567 s <= 0.6: met; strict (every gap <= 0.6): not met because of the 1.5 s stall
    assert g["slo_met_frac"] == 1.0 and g["slo_strict_frac"] == 0.0


def test_failed_requests_count_as_failed_and_never_meet_the_slo() -> None:
    ok, bad = _rec(0.0, [0.1, 0.2]), _rec(0.0, [], error="HTTP 503: busy")
    result = LoadResult([ok, bad], 0.0, 1.0, 0.0, stall_threshold_s=1.0)
    g = summarize_run(result, ttft_slo_s=1.0, itl_slo_s=1.0)["groups"]["g"]
    assert g["completed"] == 1 and g["failed"] == 1
    assert g["slo_met_frac"] == 0.5
    assert not meets_slo(bad, 10.0, 10.0)
    assert result.errors == ["g#0: HTTP 503: busy"]


def test_stalls_and_distribution_helpers() -> None:
    assert stalls([0.0, 0.1, 1.5, 1.6], 1.0) == [(0.1, pytest.approx(1.4))]
    d = dist_ms([0.001, 0.002, 0.003])
    assert d["p50"] == pytest.approx(2.0) and d["max"] == pytest.approx(3.0) and d["n"] == 3
    assert dist_ms([])["p50"] is None


def test_highest_rate_meeting_the_slo() -> None:
    assert highest_rate_meeting([(1.0, 1.0), (2.0, 0.95), (4.0, 0.5)]) == 2.0
    assert highest_rate_meeting([(1.0, 0.2), (2.0, None)]) is None


def test_prompts_are_exact_length_reproducible_and_share_their_prefix() -> None:
    g = GroupSpec("g", 5, prompt_len=(20, 30), output_len=8, concurrency=2, shared_prefix_len=12, seed=3)
    a, b = build_items(g, vocab_size=100), build_items(g, vocab_size=100)
    assert [i.prompt for i in a] == [i.prompt for i in b]
    assert all(len(i.prompt) == i.prompt_len and 20 <= i.prompt_len <= 30 for i in a)
    assert len({tuple(i.prompt[:12]) for i in a}) == 1 and len({tuple(i.prompt[12:]) for i in a}) == 5
    assert all(3 <= t < 100 for i in a for t in i.prompt)


def test_group_spec_refuses_what_cannot_run() -> None:
    with pytest.raises(ValueError, match="exactly one of concurrency and rate"):
        GroupSpec("g", 4)
    with pytest.raises(ValueError, match="rate must be > 0"):
        GroupSpec("g", 4, rate=0.0)
    with pytest.raises(ValueError, match="prompt_len"):
        GroupSpec("g", 4, prompt_len=(9, 3), concurrency=1)


def test_log_normal_lengths_are_reproducible_clipped_and_long_tailed() -> None:
    from pdserve.bench.serve_load import LogNormal

    spec = GroupSpec("g", 400, prompt_len=8, output_len=LogNormal(128, 1.0, 8, 1024), concurrency=4, seed=3)
    outs = [it.output_len for it in build_items(spec, vocab_size=100)]
    assert outs == [it.output_len for it in build_items(spec, vocab_size=100)]
    assert min(outs) >= 8 and max(outs) <= 1024
    median = sorted(outs)[len(outs) // 2]
    assert 100 <= median <= 160                       # around the median asked for
    assert sum(outs) / len(outs) > 1.3 * median       # the tail pulls the mean above it
    with pytest.raises(ValueError, match="output_len"):
        GroupSpec("g", 1, output_len=LogNormal(10, 1.0, 0, 5), concurrency=1)


def test_the_servers_table_prints_the_sweep_figures_beside_the_ratios() -> None:
    from pdserve.bench.serve import format_table

    result = {"when": "now", "host": "cpu", "load": {"num_prompts": 4, "prompt_len": 8, "output_len": 2},
              "summary": {}, "unavailable": {},
              "ratios": {"colocated": {"rounds_compared": 0}, "max_rate_90pct_slo": {"pdserve": 4.0, "vllm": 2.0},
                         "disaggregated_vs_vllm_goodput_rate": 2.0}}
    text = format_table(result)
    assert "highest swept rate with >= 90% within SLO: {'pdserve': 4.0, 'vllm': 2.0}" in text
    assert "disaggregated_vs_vllm_goodput_rate: 2.0" in text

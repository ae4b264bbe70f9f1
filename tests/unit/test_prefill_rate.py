"""The router's measure of a prefill worker's speed (``worker_pool.measured_prefill_rate``), the
input of admission by predicted time to first token."""

from __future__ import annotations

import pytest

from factories import worker_stats
from pdserve.router.worker_pool import measured_prefill_rate


def _stats(tokens: int, seconds: float):
    return worker_stats(prompt_tokens_computed=tokens, prefill_compute_s=seconds)


def test_rate_is_tokens_over_prefill_step_time_and_smoothed() -> None:
    first = measured_prefill_rate(None, _stats(0, 0.0), _stats(1000, 0.5))
    assert first == pytest.approx(2000.0)
    # a slower sample moves it half way
    assert measured_prefill_rate(first, _stats(1000, 0.5), _stats(1500, 1.0)) == pytest.approx(1500.0)


def test_idle_restarted_or_old_workers_keep_the_last_rate() -> None:
    assert measured_prefill_rate(800.0, _stats(500, 1.0), _stats(500, 1.0)) == 800.0      # idle
    assert measured_prefill_rate(800.0, _stats(500, 1.0), _stats(10, 0.1)) == 800.0       # restarted
    assert measured_prefill_rate(800.0, None, _stats(10, 0.1)) == 800.0                   # no previous stats

"""ItlBudget: the prompt tokens a decode worker's step may take beside its decodes (slo.itl_ms)."""

from __future__ import annotations

import pytest

from pdserve.engine.llm_engine import ItlBudget


def test_budget_is_the_spare_time_of_the_target_at_the_measured_prefill_rate():
    b = ItlBudget(target_ms=100.0, block_size=16, max_tokens=2048)
    assert b.tokens() == 4 * 16                 # nothing measured yet: four blocks
    b.observe(decode_tokens=0, prefill_tokens=1000, elapsed_s=0.5)   # 2,000 prompt tokens/s
    assert b.prefill_tokens_per_s == pytest.approx(2000.0)
    assert b.tokens() == 200                    # no decode step measured: the whole 100 ms
    b.observe(decode_tokens=8, prefill_tokens=0, elapsed_s=0.02)     # a 20 ms decode step
    assert b.decode_step_s == pytest.approx(0.02)
    assert b.tokens() == 160                    # (100 - 20) ms x 2,000 tokens/s
    # A mixed step: its decode part is the decode step, the rest was prefill (100 tokens in 50 ms).
    b.observe(decode_tokens=8, prefill_tokens=100, elapsed_s=0.07)
    assert b.prefill_tokens_per_s == pytest.approx(0.3 * 2000.0 + 0.7 * 2000.0)


def test_budget_is_clamped_so_a_prompt_always_progresses_and_never_exceeds_the_step():
    b = ItlBudget(target_ms=10.0, block_size=16, max_tokens=256)
    b.observe(decode_tokens=0, prefill_tokens=100, elapsed_s=0.1)    # 1,000 tokens/s
    b.observe(decode_tokens=32, prefill_tokens=0, elapsed_s=0.05)    # decode alone is over target
    assert b.tokens() == 16                     # one block per step, not zero
    fast = ItlBudget(target_ms=1000.0, block_size=16, max_tokens=256)
    fast.observe(decode_tokens=0, prefill_tokens=10_000, elapsed_s=0.1)
    assert fast.tokens() == 256                 # max_num_batched_tokens

"""A decode worker protects its streams (issue 10): with an ITL target, a prompt prefilled while
sequences decode is chunked under the per-step budget, and its tokens do not change.

Real engine on the tiny model. The target is set far below any step time, so the budget sits
at its floor (one block a step; four before a prefill has been timed) whatever this host's
speed: the bound checked does not depend on timing."""

from __future__ import annotations


from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import ItlBudget, LLMEngine
from pdserve.engine.sampling_params import SamplingParams


LONG = 300


def _run(model_dir, itl_target_ms: float | None) -> tuple[LLMEngine, list[int], int]:
    engine = LLMEngine(EngineConfig(str(model_dir), dtype="float32", kv_cache_memory_gb=0.05,
                                    max_num_batched_tokens=512, itl_target_ms=itl_target_ms))
    streams = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"s{i}", [5 + i] * 8, streams)
    while any(s.in_prefill for s in engine.scheduler.running()) or engine.scheduler.num_waiting:
        engine.step()
    engine.add_request("long", list(range(10, 10 + LONG)), SamplingParams(max_tokens=4, temperature=0.0))
    long_tokens: list[int] = []
    steps_with_long_prefill = 0
    while engine.has_unfinished():
        seq = engine.scheduler.get("long")
        steps_with_long_prefill += seq is not None and seq.num_computed_tokens < LONG
        for out in engine.step():
            if out.request_id == "long":
                long_tokens.extend(out.new_token_ids)
    return engine, long_tokens, steps_with_long_prefill


def test_a_prompt_beside_decoding_streams_is_chunked_under_the_budget(tiny_model) -> None:
    free, free_tokens, free_steps = _run(tiny_model, None)
    capped, capped_tokens, capped_steps = _run(tiny_model, itl_target_ms=0.001)
    # Without a target the whole prompt joins one step beside the four decodes.
    assert free.stats().prefill_budget_tokens is None
    assert free.stats().max_prefill_tokens_with_decodes == LONG
    assert free_steps == 1
    # With one, no step beside decodes takes more than the budget ...
    stats = capped.stats()
    assert stats.prefill_budget_tokens == capped.config.block_size
    assert 0 < stats.max_prefill_tokens_with_decodes <= ItlBudget.FALLBACK_BLOCKS * capped.config.block_size
    assert capped_steps >= LONG // (ItlBudget.FALLBACK_BLOCKS * capped.config.block_size)
    # ... and the tokens are the same (chunked prefill is exact).
    assert capped_tokens == free_tokens and len(capped_tokens) == 4

"""Disaggregated prefill/decode on real Ray actors, real NIXL and the tiny model.

One prefill and one decode worker serve the whole module. Every answer is compared token by
token with the colocated engine (same settings, in this process); chunks of 32 tokens make the
long prompts prefill, and stream their KV, chunk by chunk. Each test ends with both workers
holding nothing: no KV block, no request, no NIXL transfer handle or mailbox.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from disagg_helpers import (CALL_TIMEOUT_S, DisaggOutcome, DisaggPool, DisaggRequest, drain_until_finished,
                            engine_config, new_request_id, run_disagg, wait_nothing_leaked, wait_until)
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model_runner import load_model_spec
from pdserve.engine.sampling_params import SamplingParams


LENGTHS = (1, 15, 16, 17, 100, 300)
CHUNK = 32       # max_num_batched_tokens: every prompt over 32 tokens is prefilled in chunks
MAX_TOKENS = 12


def greedy() -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def seeded(seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, seed=seed, ignore_eos=True)


@pytest.fixture(scope="module")
def spec(tiny_model):
    return load_model_spec(tiny_model)


@pytest.fixture(scope="module")
def pool(ray_session, tiny_model):
    p = DisaggPool(engine_config(tiny_model, max_num_batched_tokens=CHUNK), "dg")
    yield p
    p.close()


@pytest.fixture(scope="module")
def reference(tiny_model) -> LLMEngine:
    """The colocated engine with the workers' settings."""
    return LLMEngine(engine_config(tiny_model, max_num_batched_tokens=CHUNK))


@pytest.fixture(autouse=True)
def nothing_leaked(pool):
    yield
    wait_nothing_leaked([pool.prefill, pool.decode])


def make_prompt(spec, length: int, salt: str) -> list[int]:
    rng = random.Random(f"{salt}:{length}")
    return [rng.randrange(3, spec.vocab_size) for _ in range(length)]


def expected(reference: LLMEngine, prompt: list[int], params: SamplingParams) -> list[int]:
    return reference.generate([prompt], params)[0]


@pytest.mark.parametrize("mode", ["greedy", "seeded"])
def test_disaggregated_tokens_match_colocated(pool, reference, spec, mode):
    for i, n in enumerate(LENGTHS):
        prompt = make_prompt(spec, n, f"match-{mode}")
        params = greedy() if mode == "greedy" else seeded(1000 + i)
        rid = new_request_id(f"match-{mode}-{n}")
        out = run_disagg(pool.prefill, pool.decode, [DisaggRequest(rid, prompt, params)])[rid]

        assert out.prefill is not None and out.prefill.finish_reason == "prefilled", out.prefill
        assert out.finish_reason == "length"
        assert out.token_ids == expected(reference, prompt, params), f"prompt of {n} tokens"
        blocks = -(-n // 16)
        assert out.prefill.prompt_tokens == n
        assert out.prefill.kv_blocks == blocks
        assert out.prefill.kv_bytes == blocks * 16 * 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 4
        # Chunked prefill streams one write per chunk (at least one descriptor each).
        assert out.prefill.kv_descriptors >= -(-n // CHUNK)
        assert out.final is not None and out.final.phase.output_tokens == MAX_TOKENS


def test_landed_kv_bytes_equal_what_prefill_computed(pool, reference, spec):
    """Before ``start``, the decode worker's reserved blocks hold exactly the prefill worker's KV.

    Only the first ``prompt_len`` positions are defined: the rest of the last block is compared
    nowhere (the first output token's K/V is computed later, on the decode worker).
    """
    import ray

    P, D = pool.prefill.actor, pool.decode.actor
    shape = (spec.num_layers, 2, 16, spec.num_kv_heads, spec.head_dim)

    def blocks(actor, ids: list[int]) -> np.ndarray:
        raw = ray.get(actor.read_blocks.remote(ids), timeout=CALL_TIMEOUT_S)
        return np.frombuffer(raw, np.float32).reshape(len(ids), *shape)

    def defined(kv: np.ndarray, n: int) -> list[np.ndarray]:
        full, rows = divmod(n, 16)
        return [kv[:full]] + ([kv[full, :, :, :rows]] if rows else [])

    for n in (1, 17, 300):
        prompt = make_prompt(spec, n, "bytes")
        params = greedy()
        rid = new_request_id(f"bytes-{n}")
        tp = ray.get(D.reserve.remote(rid, n), timeout=CALL_TIMEOUT_S)
        res = ray.get(P.prefill.remote(rid, prompt, params, tp), timeout=60)
        assert res.finish_reason == "prefilled", res
        dst = ray.get(D.reserved_blocks.remote(rid), timeout=CALL_TIMEOUT_S)
        assert len(dst) == len(res.src_blocks) == -(-n // 16)

        computed = defined(blocks(P, res.src_blocks), n)
        assert any(np.any(part != 0) for part in computed), "the prefill worker's KV is all zeros"
        # DONE was sent after every write completed; allow the last bytes a moment to be visible.
        wait_until(lambda: all(np.array_equal(a, b) for a, b in zip(defined(blocks(D, dst), n), computed)),
                   5.0, interval_s=0.05, what=f"{rid}: landed KV equal to computed KV")
        for landed, sent in zip(defined(blocks(D, dst), n), computed):
            np.testing.assert_array_equal(landed, sent)

        ray.get(D.start.remote(rid, prompt, res.first_token_id, params), timeout=CALL_TIMEOUT_S)
        outcome = DisaggOutcome(rid, prefill=res, token_ids=[res.first_token_id], started=True)
        drain_until_finished(pool.decode, {rid: outcome}, timeout_s=30.0)
        assert outcome.token_ids == expected(reference, prompt, params)


def test_prefix_cache_hit_on_prefill_worker(pool, reference, spec):
    prompt = make_prompt(spec, 300, "prefix")
    params = greedy()
    want = expected(reference, prompt, params)
    results = []
    for attempt in range(2):
        rid = new_request_id(f"prefix-{attempt}")
        out = run_disagg(pool.prefill, pool.decode, [DisaggRequest(rid, prompt, params)])[rid]
        assert out.token_ids == want, f"attempt {attempt}"
        results.append(out.prefill)
    first, second = results
    assert first.cached_prompt_tokens == 0
    assert second.cached_prompt_tokens == (300 - 1) // 16 * 16
    # Cached blocks are sent too: the decode worker gets the whole prompt's KV either way.
    assert second.kv_blocks == first.kv_blocks == -(-300 // 16)
    assert second.kv_bytes == first.kv_bytes


def test_six_requests_in_flight_at_once(pool, reference, spec):
    requests = []
    for i, n in enumerate(LENGTHS):
        prompt = make_prompt(spec, n, "concurrent")
        params = greedy() if i % 2 == 0 else seeded(7 + i)
        requests.append(DisaggRequest(new_request_id(f"conc-{n}"), prompt, params))
    outcomes = run_disagg(pool.prefill, pool.decode, requests, timeout_s=90.0)
    for req in requests:
        out = outcomes[req.request_id]
        assert out.prefill.finish_reason == "prefilled", out.prefill
        assert out.finish_reason == "length"
        assert out.token_ids == expected(reference, req.prompt, req.params), f"{len(req.prompt)} tokens"


def test_request_that_ends_at_its_first_token(pool, reference, spec):
    """max_tokens=1: the prefill worker's answer is the whole answer; nothing is decoded."""
    prompt = make_prompt(spec, 40, "first-token")
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    rid = new_request_id("first-token")
    out = run_disagg(pool.prefill, pool.decode, [DisaggRequest(rid, prompt, params)])[rid]
    assert out.prefill.finish_reason == "length"
    assert not out.started
    assert out.token_ids == expected(reference, prompt, params)

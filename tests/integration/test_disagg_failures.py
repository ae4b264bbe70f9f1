"""Failure paths of the prefill -> decode handoff, on real Ray actors, real NIXL, the tiny model.

Every case ends the same way: the caller got an explicit error (an error ``PrefillResult``, an
error or abort ``StepOutput`` from ``drain``, or a typed exception), and every surviving worker
holds nothing (no KV block, no request, no NIXL handle or mailbox).

The workers run with a 3 s transfer timeout and a 0.5 s quarantine for the blocks of a transfer
that did not land, and with 16-token chunks, so a 1,500-token prompt prefills for a second or
two: long enough to kill or abort it halfway. Killed workers are replaced inside the test that
killed them, so the next test finds a full pool.
"""

from __future__ import annotations

import random

import pytest

from disagg_helpers import (CALL_TIMEOUT_S, DisaggOutcome, DisaggPool, DisaggRequest, drain_until_finished,
                            engine_config, new_request_id, run_disagg, wait_nothing_leaked, wait_until)
from pdserve.cluster.runtime.workers import stop_worker
from pdserve.engine.errors import CompatibilityError, KVTransferError
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model_runner import load_model_spec
from pdserve.engine.sampling_params import SamplingParams


TRANSFER_TIMEOUT_S = 3.0
QUARANTINE_S = 0.5
CHUNK = 16
LONG = 1500          # tokens: ~94 chunks of 16, a second or two of prefill
# A freed reservation needs the timeout, the quarantine and a few loop ticks; bounded generously.
FREE_WITHIN_S = TRANSFER_TIMEOUT_S + QUARANTINE_S + 8.0


@pytest.fixture(scope="module")
def spec(tiny_model):
    return load_model_spec(tiny_model)


@pytest.fixture(scope="module")
def pool(ray_session, tiny_model):
    p = DisaggPool(engine_config(tiny_model, max_num_batched_tokens=CHUNK), "df",
                   transfer_timeout_s=TRANSFER_TIMEOUT_S, kv_quarantine_s=QUARANTINE_S)
    yield p
    p.close()


@pytest.fixture(scope="module")
def reference(tiny_model) -> LLMEngine:
    return LLMEngine(engine_config(tiny_model, max_num_batched_tokens=CHUNK))


@pytest.fixture(autouse=True)
def nothing_leaked(pool):
    yield
    wait_nothing_leaked([pool.prefill, pool.decode], timeout_s=FREE_WITHIN_S)


def make_prompt(spec, length: int, salt: str) -> list[int]:
    rng = random.Random(f"{salt}:{length}")
    return [rng.randrange(3, spec.vocab_size) for _ in range(length)]


def greedy(max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def prompt_tokens_computed(handle) -> int:
    import ray

    return ray.get(handle.actor.stats.remote(), timeout=CALL_TIMEOUT_S).prompt_tokens_computed


def wait_prefilling(handle, baseline: int, prompt_len: int) -> None:
    """Wait until the prefill worker computed some, but not all, of a prompt."""
    state = {}

    def midway() -> bool:
        state["done"] = prompt_tokens_computed(handle) - baseline
        return state["done"] > 0

    wait_until(midway, 10.0, interval_s=0.01, what="prefill under way")
    assert state["done"] < prompt_len, "the prefill finished before the test could interrupt it"


def assert_pool_serves(pool, reference, spec, salt: str) -> None:
    """A short request end to end, token-identical to the colocated engine."""
    prompt = make_prompt(spec, 40, salt)
    rid = new_request_id(salt)
    out = run_disagg(pool.prefill, pool.decode, [DisaggRequest(rid, prompt, greedy())])[rid]
    assert out.finish_reason == "length", out
    assert out.token_ids == reference.generate([prompt], greedy())[0]


def test_transfer_timeout_frees_blocks_and_a_later_start_fails(pool, spec):
    import ray

    D = pool.decode.actor
    never_started = new_request_id("timeout-idle")
    started = new_request_id("timeout-started")
    prompt = make_prompt(spec, 40, "timeout")
    expired = ray.get(D.stats.remote(), timeout=CALL_TIMEOUT_S).expired_reservations
    ray.get([D.reserve.remote(rid, len(prompt)) for rid in (never_started, started)], timeout=CALL_TIMEOUT_S)
    assert ray.get(D.blocks_in_use.remote(), timeout=CALL_TIMEOUT_S) == 2 * 3

    # Started, but no prefill worker ever writes: drain ends it with an explicit error.
    ray.get(D.start.remote(started, prompt, 7, greedy()), timeout=CALL_TIMEOUT_S)
    outcome = DisaggOutcome(started, started=True)
    drain_until_finished(pool.decode, {started: outcome}, timeout_s=FREE_WITHIN_S)
    assert outcome.final.finish_reason == "error"
    assert "timed_out" in outcome.final.error and outcome.token_ids == []

    wait_nothing_leaked([pool.decode], timeout_s=FREE_WITHIN_S)
    with pytest.raises(KVTransferError, match="no live KV reservation"):
        ray.get(D.start.remote(never_started, prompt, 7, greedy()), timeout=CALL_TIMEOUT_S)
    # both ended for want of their KV: the worker counts them (stats, pdserve status)
    assert ray.get(D.stats.remote(), timeout=CALL_TIMEOUT_S).expired_reservations == expired + 2


def test_abort_after_reserve(pool, spec):
    import ray

    D = pool.decode.actor
    rid = new_request_id("abort-reserved")
    prompt = make_prompt(spec, 40, "abort-reserved")
    ray.get(D.reserve.remote(rid, len(prompt)), timeout=CALL_TIMEOUT_S)
    assert ray.get(D.abort.remote(rid), timeout=CALL_TIMEOUT_S) is True
    with pytest.raises(KVTransferError):
        ray.get(D.start.remote(rid, prompt, 7, greedy()), timeout=CALL_TIMEOUT_S)
    # No sender ever wrote, so nobody confirms: the blocks come back after the quarantine.
    wait_nothing_leaked([pool.decode], timeout_s=FREE_WITHIN_S)


def test_abort_after_start_before_the_kv_landed(pool, spec):
    """The caller is already draining for it, so the abort must reach ``drain`` as a final output."""
    import ray

    D = pool.decode.actor
    rid = new_request_id("abort-started")
    prompt = make_prompt(spec, 40, "abort-started")
    ray.get(D.reserve.remote(rid, len(prompt)), timeout=CALL_TIMEOUT_S)
    ray.get(D.start.remote(rid, prompt, 7, greedy()), timeout=CALL_TIMEOUT_S)
    assert ray.get(D.abort.remote(rid), timeout=CALL_TIMEOUT_S) is True
    outcome = DisaggOutcome(rid, started=True)
    drain_until_finished(pool.decode, {rid: outcome}, timeout_s=5.0)
    assert outcome.final.finish_reason == "abort" and outcome.token_ids == []


def test_abort_during_prefill(pool, spec):
    import ray

    P, D = pool.prefill.actor, pool.decode.actor
    rid = new_request_id("abort-prefill")
    prompt = make_prompt(spec, LONG, "abort-prefill")
    baseline = prompt_tokens_computed(pool.prefill)
    tp = ray.get(D.reserve.remote(rid, LONG), timeout=CALL_TIMEOUT_S)
    ref = P.prefill.remote(rid, prompt, greedy(), tp)
    wait_prefilling(pool.prefill, baseline, LONG)

    assert ray.get(P.abort.remote(rid), timeout=CALL_TIMEOUT_S) is True
    # P's SENDER_ABORT may already have ended the reservation on D (then abort finds nothing).
    assert ray.get(D.abort.remote(rid), timeout=CALL_TIMEOUT_S) in (True, False)
    result = ray.get(ref, timeout=CALL_TIMEOUT_S)
    assert result.finish_reason == "abort" and result.error
    assert not result.ok
    with pytest.raises(KVTransferError):
        ray.get(D.start.remote(rid, prompt, 7, greedy()), timeout=CALL_TIMEOUT_S)


def test_abort_while_decoding(pool, spec):
    import ray

    P, D = pool.prefill.actor, pool.decode.actor
    rid = new_request_id("abort-decoding")
    prompt = make_prompt(spec, 40, "abort-decoding")
    params = greedy(max_tokens=2000)
    tp = ray.get(D.reserve.remote(rid, len(prompt)), timeout=CALL_TIMEOUT_S)
    res = ray.get(P.prefill.remote(rid, prompt, params, tp), timeout=CALL_TIMEOUT_S)
    assert res.finish_reason == "prefilled", res
    ray.get(D.start.remote(rid, prompt, res.first_token_id, params), timeout=CALL_TIMEOUT_S)
    outcome = DisaggOutcome(rid, prefill=res, token_ids=[res.first_token_id], started=True)

    def decoding() -> bool:
        for out in ray.get(D.take_outputs.remote(0.1), timeout=CALL_TIMEOUT_S):
            if out.request_id == rid:
                outcome.token_ids.extend(out.new_token_ids)
                outcome.final = out if out.finished else None
        return len(outcome.token_ids) >= 3

    wait_until(decoding, 20.0, interval_s=0.0, what="decoding under way")
    assert outcome.final is None
    assert ray.get(D.abort.remote(rid), timeout=CALL_TIMEOUT_S) is True
    drain_until_finished(pool.decode, {rid: outcome}, timeout_s=10.0)
    assert outcome.final.finish_reason == "abort"
    assert len(outcome.token_ids) < 2000
    assert ray.get(P.abort.remote(rid), timeout=CALL_TIMEOUT_S) is False  # long gone from P


def test_abort_after_finish_is_a_no_op(pool, reference, spec):
    import ray

    prompt = make_prompt(spec, 40, "abort-finished")
    rid = new_request_id("abort-finished")
    out = run_disagg(pool.prefill, pool.decode, [DisaggRequest(rid, prompt, greedy())])[rid]
    assert out.finish_reason == "length"
    assert ray.get(pool.decode.actor.abort.remote(rid), timeout=CALL_TIMEOUT_S) is False
    assert ray.get(pool.prefill.actor.abort.remote(rid), timeout=CALL_TIMEOUT_S) is False
    assert out.token_ids == reference.generate([prompt], greedy())[0]


def test_incompatible_decode_worker_is_refused_before_any_byte_moves(pool, tiny_model, spec):
    import ray

    P = pool.prefill.actor
    # One worker that differs in both fields the brief names: each difference must be reported.
    bad = pool.start_extra_decode(engine_config(tiny_model, max_num_batched_tokens=CHUNK, block_size=32,
                                                dtype="bfloat16"))
    try:
        with pytest.raises(CompatibilityError) as refused:
            ray.get(P.add_peer.remote(bad.metadata), timeout=CALL_TIMEOUT_S)
        assert "block_size" in str(refused.value) and "dtype" in str(refused.value)
        with pytest.raises(CompatibilityError, match="block_size"):
            ray.get(bad.actor.add_peer.remote(pool.prefill.metadata), timeout=CALL_TIMEOUT_S)

        rid = new_request_id("incompatible")
        prompt = make_prompt(spec, 40, rid)
        tp = ray.get(bad.actor.reserve.remote(rid, len(prompt)), timeout=CALL_TIMEOUT_S)
        baseline = prompt_tokens_computed(pool.prefill)
        with pytest.raises(CompatibilityError, match="layout hash"):
            ray.get(P.prefill.remote(rid, prompt, greedy(), tp), timeout=CALL_TIMEOUT_S)
        # Refused before the engine saw it: nothing computed, nothing held, nothing posted.
        assert prompt_tokens_computed(pool.prefill) == baseline
        wait_nothing_leaked([pool.prefill], timeout_s=5.0)
        assert ray.get(bad.actor.abort.remote(rid), timeout=CALL_TIMEOUT_S) is True
        wait_nothing_leaked([bad], timeout_s=FREE_WITHIN_S)
    finally:
        stop_worker(bad, graceful=True, timeout_s=10.0)


def test_prefill_worker_killed_mid_transfer(pool, reference, spec):
    import ray

    P, D = pool.prefill.actor, pool.decode.actor
    spare = pool.spawn("prefill")
    rid = new_request_id("kill-prefill")
    prompt = make_prompt(spec, LONG, "kill-prefill")
    baseline = prompt_tokens_computed(pool.prefill)
    tp = ray.get(D.reserve.remote(rid, LONG), timeout=CALL_TIMEOUT_S)
    ref = P.prefill.remote(rid, prompt, greedy(), tp)
    try:
        wait_prefilling(pool.prefill, baseline, LONG)
        ray.kill(P, no_restart=True)
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(ref, timeout=CALL_TIMEOUT_S)
        # The decode worker gives the blocks back after its transfer timeout (+ quarantine).
        wait_nothing_leaked([pool.decode], timeout_s=FREE_WITHIN_S)
        with pytest.raises(KVTransferError):
            ray.get(D.start.remote(rid, prompt, 7, greedy()), timeout=CALL_TIMEOUT_S)
    finally:
        pool.adopt(spare)
    assert_pool_serves(pool, reference, spec, "after-prefill-killed")


def test_decode_worker_killed_before_kv_lands(pool, reference, spec):
    import ray

    P, D = pool.prefill.actor, pool.decode.actor
    spare = pool.spawn("decode")
    rid = new_request_id("kill-decode")
    prompt = make_prompt(spec, LONG, "kill-decode")
    baseline = prompt_tokens_computed(pool.prefill)
    tp = ray.get(D.reserve.remote(rid, LONG), timeout=CALL_TIMEOUT_S)
    ref = P.prefill.remote(rid, prompt, greedy(), tp)
    try:
        wait_prefilling(pool.prefill, baseline, LONG)
        ray.kill(D, no_restart=True)
        result = ray.get(ref, timeout=CALL_TIMEOUT_S)
        assert result.finish_reason == "error", result
        assert result.error and not result.ok
        wait_nothing_leaked([pool.prefill], timeout_s=FREE_WITHIN_S)
    finally:
        pool.adopt(spare)
    assert_pool_serves(pool, reference, spec, "after-decode-killed")

"""One request cannot fail another: a request whose sampling goes NaN fails alone, with a 400.

Poisoned requests carry sampling values that validation refuses (``temperature=1e-300``,
``top_p=1e-300``, which overflow to NaN / filter out every token), in a ``SamplingParams``
subclass with its checks off (``factories.UncheckedSamplingParams``, sent to the Ray workers by
value): they stand for any value that slips through validation.

1. The engine alone (tiny model): poisoned and valid greedy requests share batches, at their
   first token and in the middle of decoding; the valid ones produce exactly the tokens of a run
   without the poisoned ones, each poisoned one ends with ``sampling_failed``, no block leaks.
2. The disaggregated cluster through the real router: over HTTP the poisoned values get a 400
   naming the field at once; past validation (the backend called directly) a poisoned request
   fails on its first worker with its own 400 error and is not retried; concurrent valid
   requests get 200 and the reference tokens; nothing is held afterwards.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import factories
import pytest
import ray.cloudpickle
from cluster_helpers import ClusterHarness, reference_engine
from shared_clusters import ModuleView
from factories import make_unchecked_params

from pdserve.engine.config import EngineConfig
from pdserve.engine.errors import SamplingError
from pdserve.engine.llm_engine import LLMEngine, StepOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.router.backend import Finished, GenerateRequest, TokenDelta

pytestmark = pytest.mark.timeout(300)

GEN = 12
PROMPTS = [[5 + (7 * i + j) % 200 for j in range(n)] for i, n in enumerate((3, 17, 40, 9))]
POISONS = [dict(temperature=1e-300), dict(temperature=1.0, top_p=1e-300)]


def greedy() -> SamplingParams:
    return SamplingParams(max_tokens=GEN, temperature=0.0, ignore_eos=True)


def poisoned(i: int) -> SamplingParams:
    return make_unchecked_params(max_tokens=GEN, ignore_eos=True, **POISONS[i % len(POISONS)])


def make_engine(model_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=str(model_dir), kv_cache_memory_gb=0.02, num_threads=1,
                                  max_num_batched_tokens=32, dtype="float32"))


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]],
        poison_at_step: dict[str, int] | None = None) -> dict[str, tuple[list[int], StepOutput]]:
    """Every request to its end: (tokens, final output). ``poison_at_step`` swaps a running
    request's params for poisoned ones after that many steps (a failure in mid-decode)."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    final: dict[str, StepOutput] = {}
    steps = 0
    while engine.has_unfinished():
        for rid, at in (poison_at_step or {}).items():
            seq = engine.scheduler.get(rid)
            if steps == at and seq is not None:
                seq.params = poisoned(0)
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                final[out.request_id] = out
        steps += 1
        assert steps < 500, "the engine did not finish"
    return {rid: (tokens[rid], final[rid]) for rid in requests}


def assert_failed_alone(out: StepOutput) -> None:
    assert (out.finished, out.finish_reason, out.error_code) == (True, "error", SamplingError.code), out
    assert "no valid probability distribution" in (out.error or "")


# ------------------------------------------------------------------- engine
def test_poisoned_requests_fail_alone_in_the_engine(tiny_model) -> None:
    valid = {f"valid-{i}": (p, greedy()) for i, p in enumerate(PROMPTS)}
    alone = run(make_engine(tiny_model), valid)

    engine = make_engine(tiny_model)
    mixed = {**valid, **{f"poisoned-{i}": (p, poisoned(i)) for i, p in enumerate(PROMPTS)}}
    got = run(engine, mixed, poison_at_step={"valid-3": 6})

    for rid in ("valid-0", "valid-1", "valid-2"):
        assert got[rid][0] == alone[rid][0] and len(got[rid][0]) == GEN
        assert got[rid][1].finish_reason == "length" and got[rid][1].error is None
    for i in range(len(PROMPTS)):
        tokens, out = got[f"poisoned-{i}"]
        assert tokens == []  # failed at its first token
        assert_failed_alone(out)
    # Poisoned in mid-decode: the tokens before it match, then it ends with the error.
    tokens, out = got["valid-3"]
    assert 0 < len(tokens) < GEN and tokens == alone["valid-3"][0][:len(tokens)]
    assert_failed_alone(out)
    assert engine.block_manager.all_free()
    assert engine.stats().num_running == engine.stats().num_waiting == 0


# ------------------------------------------------------------ whole cluster
@pytest.fixture(scope="module")
def cluster(router_cluster: ClusterHarness):
    """The session's router cluster (1 prefill, 2 decode workers; tests/shared_clusters.py)."""
    ray.cloudpickle.register_pickle_by_value(factories)  # the workers cannot import tests/
    engine = reference_engine(router_cluster.config)
    ref = dict(zip(map(tuple, PROMPTS), engine.generate(PROMPTS, greedy())))
    del engine
    yield ModuleView(router_cluster, ref=ref)
    router_cluster.assert_nothing_held()


async def post(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, dict, float]:
    t0 = time.monotonic()
    async with session.post(url + "/v1/completions", json=body) as resp:
        return resp.status, await resp.json(), time.monotonic() - t0


def valid_body(model: str, prompt: list[int]) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": GEN, "temperature": 0, "ignore_eos": True}


def check_valid(cluster: ClusterHarness, prompt: list[int], status: int, body: dict) -> None:
    assert status == 200, body
    pd = body["pdserve"]
    assert pd["token_ids"] == cluster.ref[tuple(prompt)], body
    assert pd["phase"]["attempts"] == 1 and pd["phase"]["migrations"] == 0, pd["phase"]


def test_http_poisoned_values_get_400_at_once_and_valid_requests_are_untouched(cluster: ClusterHarness) -> None:
    model = cluster.model_name
    bad = [({"temperature": 1e-300}, "temperature"), ({"top_p": 1e-300}, "top_p"),
           ({"temperature": 1e-39, "top_p": 0.5}, "temperature"), ({"seed": 2**64}, "seed")]

    async def scenario():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
            valid = [post(s, cluster.http_url, valid_body(model, p)) for p in PROMPTS]
            poison = [post(s, cluster.http_url, {**valid_body(model, PROMPTS[i % len(PROMPTS)]), **fields})
                      for i, (fields, _) in enumerate(bad * 3)]
            results = await asyncio.gather(*valid, *poison)
            return results[:len(valid)], results[len(valid):]

    retries_before = cluster.service.backend.retries
    valid, poison = asyncio.run(scenario())
    for (fields, param), (status, body, elapsed) in zip(bad * 3, poison):
        assert status == 400, body
        assert body["error"]["param"] == param and param in body["error"]["message"], body
        assert elapsed < 10.0  # refused at the door, not after queueing or retries
    for prompt, (status, body, _) in zip(PROMPTS, valid):
        check_valid(cluster, prompt, status, body)
    assert cluster.service.backend.retries == retries_before


def test_poison_past_validation_fails_on_its_first_worker_only(cluster: ClusterHarness) -> None:
    """The backend itself (what Serving calls after validation) with values that slipped through."""
    backend = cluster.service.backend
    model = cluster.model_name

    async def one(rid: str, prompt: list[int], params: SamplingParams) -> tuple[list[int], Finished]:
        tokens: list[int] = []
        async for item in backend.generate(GenerateRequest(rid, list(prompt), params)):
            if isinstance(item, TokenDelta):
                tokens.extend(item.token_ids)
            else:
                return tokens, item
        raise AssertionError(f"{rid}: the stream ended without Finished")

    async def valid_over_http():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
            return await asyncio.gather(*[post(s, cluster.http_url, valid_body(model, p)) for p in PROMPTS])

    async def poisoned_direct():
        return await asyncio.gather(*[one(f"isolation-poisoned-{i}", PROMPTS[i % len(PROMPTS)], poisoned(i))
                                      for i in range(8)])

    retries_before, migrations_before = backend.retries, backend.migrations
    poison_future = asyncio.run_coroutine_threadsafe(poisoned_direct(), cluster.loop)
    valid = asyncio.run(valid_over_http())
    poison = poison_future.result(120)

    for tokens, fin in poison:
        assert tokens == [] and fin.finish_reason == "error"
        assert isinstance(fin.error, SamplingError) and fin.error.http_status == 400, fin.error
        assert fin.phase.attempts == 1 and fin.phase.migrations == 0, fin.phase
    for prompt, (status, body, _) in zip(PROMPTS, valid):
        check_valid(cluster, prompt, status, body)
    assert (backend.retries, backend.migrations) == (retries_before, migrations_before)
    cluster.assert_nothing_held()

"""The router over the disaggregated cluster, end to end: a real ``RouterService`` with one
prefill and two decode Ray actors (NIXL between them, ledger in Redis; the session's
``router_cluster``, tests/shared_clusters.py), the unmodified
``openai`` client and gRPC stubs over 127.0.0.1, the tiny model.

Every prompt goes through the prefill pool (``local_prefill_max_tokens: 0``) and prompts longer
than 64 tokens are prefilled in chunks. Greedy outputs are compared token for token with the
engine alone, run in this process before the cluster starts. Tests that stop a request early
end by checking that no worker holds a block and that the ledger has no live entry; the module
ends by checking that nothing at all is held.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import time

import aiohttp
import grpc
import openai
import pytest
import ray
from grpc_checks import assert_health_and_reflection
from logprob_checks import rank_band, transformers_logprobs
from cluster_helpers import (
    ClusterHarness,
    greedy,
    reference_engine,
    wait_until,
)
from shared_clusters import ROUTER_GRAMMAR_BUDGET_S, ModuleView
from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pb_grpc
from pdserve.router.backend import Finished, GenerateRequest

pytestmark = pytest.mark.timeout(300)

GEN = 24
GRAMMAR_BUDGET_S = ROUTER_GRAMMAR_BUDGET_S   # structured.compile_timeout_s of this cluster
LONG = 1500  # max_tokens of requests that a test stops early
# The lease tests: a generation that outlives several leases (3,000 tokens took ~3.6 s on a fast
# 2-core host against the 3 s needed). A 0.5 s lease (renewed every 0.17 s) once expired in CI
# when the loaded 2-core host stalled the router for longer; 1 s leaves 0.67 s between renewals.
LEASE_S = 1.0
RENEWED_TOKENS = 3000
PAUSE_LEASES = 2.5  # how many leases the paused reader of the second lease test stays away
SHORT_PROMPT = "The quick brown fox jumps over the lazy dog"
LONG_PROMPT = "A kitchen at seven in the morning: twelve cooks read the whole ticket at once. " * 8
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colours."}]
N_STREAMS, STREAM_TOKENS = 200, 8
STREAM_PROMPTS = [f"Stream {i} of the load test says" for i in range(4)]


@pytest.fixture(scope="module")
def cluster(router_cluster: ClusterHarness):
    """The session's router cluster (tests/shared_clusters.py), with this module's references."""
    config = router_cluster.config
    engine = reference_engine(config)
    tok = engine.stopper.tokenizer
    prompts = {p: list(tok(p)["input_ids"]) for p in [SHORT_PROMPT, LONG_PROMPT]}
    chat = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    prompts["chat"] = list(tok(chat, add_special_tokens=False)["input_ids"])
    ref = {k: (ids, out) for (k, ids), out in
           zip(prompts.items(), engine.generate(list(prompts.values()), greedy(GEN)))}
    stream_ids = [list(tok(p)["input_ids"]) for p in STREAM_PROMPTS]
    ref["streams"] = dict(zip(STREAM_PROMPTS, engine.generate(stream_ids, greedy(STREAM_TOKENS))))
    assert len(ref[LONG_PROMPT][0]) > 2 * config.prefill.engine.max_num_batched_tokens  # chunked prefill
    del engine
    assert len(router_cluster.members("prefill")) == 1 and len(router_cluster.members("decode")) == 2
    yield ModuleView(router_cluster, ref=ref, tokenizer=tok)
    router_cluster.assert_nothing_held()


def test_workers_run_at_normal_cpu_priority(cluster: ClusterHarness) -> None:
    """Ray would start them at niceness 15, behind the router and every other process."""
    stats = ray.get([m.actor.stats.remote() for m in cluster.members("prefill") + cluster.members("decode")],
                    timeout=30)
    assert [st.niceness for st in stats] == [0] * 3
    # Both pools got the configured KV transfer timeout.
    wanted = cluster.config.router.disaggregation.kv_transfer_timeout_s
    assert [st.transfer_timeout_s for st in stats] == [wanted] * 3


def check_phase(phase: dict, prompt_tokens: int, output_tokens: int) -> None:
    """A disaggregated request's record: both workers named, KV moved, times in order."""
    assert phase["prompt_tokens"] == prompt_tokens and phase["output_tokens"] == output_tokens
    assert 0 < phase["ttft_s"] <= phase["total_s"], phase
    assert phase["kv_bytes"] > 0 and phase["kv_transfer_s"] >= 0
    assert phase["prefill_worker"].startswith("prefill-") and phase["decode_worker"].startswith("decode-")
    assert phase["finish_reason"] == "length"
    assert (phase["attempts"], phase["migrations"]) == (1, 0), phase  # no hidden retry on a healthy cluster


def extra(obj) -> dict:
    return (obj.model_extra or {}).get("pdserve") or {}


# --------------------------------------------------------------------------- HTTP
def test_openai_completions_match_the_engine_plain_and_streamed(cluster: ClusterHarness) -> None:
    client = cluster.openai()
    for prompt in (SHORT_PROMPT, LONG_PROMPT):
        ids, expected = cluster.ref[prompt]
        r = client.completions.create(model=cluster.model_name, prompt=prompt, max_tokens=GEN, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert extra(r)["token_ids"] == expected
        assert r.choices[0].text == cluster.tokenizer.decode(expected, skip_special_tokens=True)
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), GEN)
        assert r.choices[0].finish_reason == "length"
        check_phase(extra(r)["phase"], len(ids), GEN)

        chunks = list(client.completions.create(model=cluster.model_name, prompt=prompt, max_tokens=GEN,
                                                temperature=0, stream=True, stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True}))
        assert [t for c in chunks for t in extra(c).get("token_ids", [])] == expected
        assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
        phases = [extra(c)["phase"] for c in chunks if extra(c).get("phase")]
        assert len(phases) == 1
        check_phase(phases[0], len(ids), GEN)
        assert chunks[-1].usage.completion_tokens == GEN


def test_openai_chat_matches_the_engine_plain_and_streamed(cluster: ClusterHarness) -> None:
    client = cluster.openai()
    ids, expected = cluster.ref["chat"]
    r = client.chat.completions.create(model=cluster.model_name, messages=CHAT, max_tokens=GEN, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert extra(r)["token_ids"] == expected and r.usage.prompt_tokens == len(ids)
    assert r.choices[0].message.role == "assistant"
    check_phase(extra(r)["phase"], len(ids), GEN)
    chunks = list(client.chat.completions.create(model=cluster.model_name, messages=CHAT, max_tokens=GEN,
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [t for c in chunks for t in extra(c).get("token_ids", [])] == expected
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content
    check_phase(extra(chunks[-1])["phase"], len(ids), GEN)


STRUCT_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "rooms", "pets"],
                 "properties": {"city": {"type": "string", "maxLength": 10},
                                "rooms": {"type": "integer", "minimum": 1, "maximum": 9},
                                "pets": {"type": "boolean"}}}


def test_structured_outputs_through_disaggregation_match_the_engine(cluster: ClusterHarness) -> None:
    """The prefill worker samples the first token under the grammar, the decode worker's grammar
    consumes it and goes on: the seeded, constrained outputs equal the engine's alone, token for
    token, and they validate against the schema."""
    import jsonschema

    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.engine.structured import StructuredOutput

    client = cluster.openai()
    engine = reference_engine(cluster.config)
    ids, _ = cluster.ref["chat"]
    fmt = {"type": "json_schema", "json_schema": {"name": "flat", "schema": STRUCT_SCHEMA, "strict": True}}
    structured = StructuredOutput("json_schema", json.dumps(STRUCT_SCHEMA, separators=(",", ":")))
    for seed in range(3):
        r = client.chat.completions.create(model=cluster.model_name, messages=CHAT, max_tokens=120, temperature=0.9,
                                           seed=seed, response_format=fmt)
        jsonschema.validate(json.loads(r.choices[0].message.content), STRUCT_SCHEMA)
        assert r.choices[0].finish_reason == "stop"
        expected = engine.generate([ids], SamplingParams(max_tokens=120, temperature=0.9, seed=seed,
                                                         structured=structured))[0]
        assert extra(r)["token_ids"] == expected
        assert extra(r)["phase"]["prefill_worker"].startswith("prefill")
    stream = client.completions.create(model=cluster.model_name, prompt=SHORT_PROMPT, max_tokens=8, temperature=0,
                                       stream=True, extra_body={"guided_choice": ["north", "south", "east west"]})
    assert "".join(c.choices[0].text for c in stream) in ("north", "south", "east west")
    cluster.assert_nothing_held()


def test_hostile_grammars_are_400s_naming_the_limit_and_stall_no_one(cluster: ClusterHarness) -> None:
    """guided_json text nested 2,500 deep (an HTTP 500 before), a schema deeper than
    structured.max_depth, and 1,200 optional properties, whose compile on the prefill worker runs
    past structured.compile_timeout_s: each a 400 naming its limit. Small requests sent while the
    hostile one compiles on the same prefill worker finish at their normal pace."""
    from concurrent.futures import ThreadPoolExecutor

    client = cluster.openai()

    def refused(guided_json) -> openai.BadRequestError:
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=cluster.model_name, prompt=SHORT_PROMPT, max_tokens=4,
                                      extra_body={"guided_json": guided_json})
        return info.value

    err = refused("[" * 2500 + "]" * 2500)
    assert err.status_code == 400 and err.param == "guided_json" and "structured.max_depth" in err.message
    deep = json.loads('{"type":"array","items":' * 100 + '{"type":"string"}' + "}" * 100)
    err = refused(deep)
    assert err.status_code == 400 and "more than 64 levels of JSON" in err.message and "structured.max_depth" in err.message

    def small() -> float:
        t0 = time.monotonic()
        client.completions.create(model=cluster.model_name, prompt=SHORT_PROMPT, max_tokens=4, temperature=0)
        return time.monotonic() - t0

    normal = [small() for _ in range(3)]
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(1200)}}
    with ThreadPoolExecutor(1) as pool:
        hostile = pool.submit(refused, wide)
        time.sleep(0.5)
        beside = []
        while not hostile.done():
            beside.append(small())
        err = hostile.result()
    print(f"\nsmall requests: {max(normal) * 1000:.0f} ms alone, at most {max(beside) * 1000:.0f} ms beside the "
          f"hostile grammar ({len(beside)} of them)")
    assert err.status_code == 400 and err.code == "grammar_refused"
    assert f"within {GRAMMAR_BUDGET_S:g} s (structured.compile_timeout_s)" in err.message
    assert len(beside) >= 2 and max(beside) < max(1.0, 4 * max(normal))
    cluster.assert_nothing_held()


def test_repeated_prefix_reports_cached_tokens(cluster: ClusterHarness) -> None:
    prompt = "Cache me if you can, said the long prompt to the prefill worker. " * 6
    client = cluster.openai()
    first = client.completions.create(model=cluster.model_name, prompt=prompt, max_tokens=4, temperature=0)
    second = client.completions.create(model=cluster.model_name, prompt=prompt, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens > 64
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached == extra(second)["phase"]["cached_prompt_tokens"]
    assert cached <= second.usage.prompt_tokens - 1
    assert extra(second)["token_ids"] == extra(first)["token_ids"]
    assert extra(second)["phase"]["kv_bytes"] > 0  # cached on P still moves to D


def test_prompt_logprobs_and_cache_salt_through_disaggregation(cluster: ClusterHarness) -> None:
    """The prefill worker scores a chunked prompt (vLLM's prompt_logprobs) and the router returns
    what the engine alone computes; a salted prompt's cached blocks serve only its own salt."""
    from pdserve.engine.sampling_params import SamplingParams

    client = cluster.openai()
    ids, expected = cluster.ref[LONG_PROMPT]
    r = client.completions.create(model=cluster.model_name, prompt=LONG_PROMPT, max_tokens=GEN, temperature=0,
                                  extra_body={"prompt_logprobs": 1}).model_dump()
    assert r["pdserve"]["token_ids"] == expected
    assert r["pdserve"]["phase"]["prefill_worker"].startswith("prefill")
    engine = reference_engine(cluster.config)
    seq = engine.add_request("scored", ids, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1))
    while engine.has_unfinished():
        engine.step()
    pl = r["choices"][0]["prompt_logprobs"]
    assert pl[0] is None and len(pl) == len(ids)
    ref = transformers_logprobs(cluster.config.model.path, ids)   # whole rows: ranks among near-ties
    for p in range(len(ids) - 1):
        got = pl[p + 1][str(ids[p + 1])]
        assert abs(got["logprob"] - seq.prompt_lp_entries[p][ids[p + 1]]) < 1e-4
        assert got["rank"] in rank_band(ref[p], ids[p + 1], 1e-3)
    prompt = "Salted on the prefill worker, so only its own tenant hits it. " * 6

    def cached(salt: str) -> int:
        out = client.completions.create(model=cluster.model_name, prompt=prompt, max_tokens=2, temperature=0,
                                        extra_body={"cache_salt": salt})
        return out.usage.prompt_tokens_details.cached_tokens

    assert cached("a") == 0 and cached("a") > 0 and cached("b") == 0
    cluster.assert_nothing_held()


def test_request_ended_by_its_prefill_frees_its_ledger_entry_at_once(cluster: ClusterHarness) -> None:
    """max_tokens 1 (as a migration with one token left also asks): the prefill worker's token
    ends the request, so its entry goes TRANSFERRING -> FREED at once, not at lease expiry."""
    r = cluster.openai().completions.create(model=cluster.model_name, prompt=SHORT_PROMPT, max_tokens=1,
                                            temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 1
    assert extra(r)["token_ids"] == cluster.ref[SHORT_PROMPT][1][:1]
    wait_until(lambda: not cluster.ledger_active(), 5.0, "the ledger entry freed (lease is 120 s)")
    # The ledger keys the router's own id; the request log maps the client's id to it.
    records: list = []
    wait_until(lambda: records.extend(x for x in cluster.service.request_log.tail(50)
                                      if x.get("client_request_id") == r.id) or records, 5.0, "the request logged")
    entry = cluster.service.ledger.get(f"{records[0]['request_id']}#1")
    assert entry is not None and entry.state.value == "FREED" and entry.held_sides() == ()


def test_a_stop_string_in_the_first_token_ends_the_request_without_running_it_again(cluster: ClusterHarness) -> None:
    """The first token reaches the client before decoding starts on the decode worker; a stop
    string in it aborts the request, which must end as "stop" with nothing run again and its
    ledger entry released. (Whether the abort reaches the decode worker before or after its
    start is a race this test does not steer; ``DisaggBackend`` ends an aborted request either way.)"""
    tok = cluster.tokenizer
    firsts = {p: cluster.ref[p][1][0] for p in (SHORT_PROMPT, LONG_PROMPT)}
    firsts |= {p: out[0] for p, out in cluster.ref["streams"].items()}
    found = [(p, tok.decode([t])) for p, t in firsts.items()]
    first_texts = [(p, t) for p, t in found if t.strip()]
    assert first_texts, f"no prompt's first greedy token has text: {found}"
    prompt, stop = first_texts[0]
    backend = cluster.service.backend
    before = (backend.migrations, backend.retries)
    r = cluster.openai().completions.create(model=cluster.model_name, prompt=prompt, max_tokens=LONG,
                                            temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == ""
    assert (backend.migrations, backend.retries) == before
    assert extra(r)["phase"]["attempts"] == 1
    wait_until(lambda: not cluster.ledger_active(), 10.0, "the ledger entry released")


# --------------------------------------------------------------------------- gRPC
def test_grpc_matches_the_engine_with_health_and_reflection(cluster: ClusterHarness) -> None:
    assert_health_and_reflection(cluster.grpc_target)
    with grpc.insecure_channel(cluster.grpc_target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        sampling = pb.SamplingParams(max_tokens=GEN, temperature=0.0, ignore_eos=True)
        for prompt in (SHORT_PROMPT, LONG_PROMPT):
            ids, expected = cluster.ref[prompt]
            for req in (pb.GenerateRequest(text=prompt, sampling=sampling),
                        pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=sampling)):
                msgs = list(stub.Generate(req, timeout=60))
                assert [t for m in msgs for t in m.token_ids] == expected
                assert [m.HasField("final") for m in msgs].count(True) == 1 and msgs[-1].HasField("final")
                final = msgs[-1].final
                assert final.finish_reason == pb.FINISH_REASON_LENGTH
                assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (len(ids), GEN)
                p = final.phase
                assert p.HasField("ttft_s") and 0 < p.ttft_s <= p.total_s and p.kv_bytes > 0
                assert (p.prompt_tokens, p.output_tokens) == (len(ids), GEN)
                assert p.prefill_worker.startswith("prefill-") and p.decode_worker.startswith("decode-")


# ------------------------------------------------------------------- cancellation
def test_http_disconnect_mid_stream_frees_every_block(cluster: ClusterHarness) -> None:
    before = cluster.generated_tokens()
    host, port = cluster.http_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", "/v1/completions", body=json.dumps(
        {"model": cluster.model_name, "prompt": LONG_PROMPT, "max_tokens": LONG, "ignore_eos": True,
         "stream": True}), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    lines = [resp.readline() for _ in range(6)]  # three events, each "data: ..." + blank line
    assert all(line.startswith(b"data: {") for line in lines[::2])
    assert cluster.busy_member("decode") is not None
    conn.close()
    cluster.assert_nothing_held()
    assert cluster.generated_tokens() - before < LONG // 2, "the request ran on after its client left"


def test_grpc_cancel_mid_stream_frees_every_block(cluster: ClusterHarness) -> None:
    before = cluster.generated_tokens()
    with grpc.insecure_channel(cluster.grpc_target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        call = stub.Generate(pb.GenerateRequest(text=LONG_PROMPT, sampling=pb.SamplingParams(
            max_tokens=LONG, ignore_eos=True)), timeout=60)
        got = [t for _, m in zip(range(3), call) for t in m.token_ids]
        assert got and cluster.busy_member("decode") is not None
        call.cancel()
        with pytest.raises(grpc.RpcError) as info:
            list(call)
        assert info.value.code() is grpc.StatusCode.CANCELLED
    cluster.assert_nothing_held()
    assert cluster.generated_tokens() - before < LONG // 2, "the request ran on after its client cancelled"


# -------------------------------------------------------------------- concurrency
def test_two_hundred_concurrent_streams_lose_nothing(cluster: ClusterHarness) -> None:
    model = cluster.model_name
    expected = cluster.ref["streams"]

    async def sse_stream(session: aiohttp.ClientSession, prompt: str) -> tuple[str, list[int], str]:
        body = {"model": model, "prompt": prompt, "max_tokens": STREAM_TOKENS, "temperature": 0,
                "ignore_eos": True, "stream": True}
        tokens, reason, done = [], None, False
        async with session.post(cluster.http_url + "/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            async for raw in resp.content:
                line = raw.strip()
                if not line:
                    continue
                assert line.startswith(b"data: "), line
                if line == b"data: [DONE]":
                    done = True
                    break
                event = json.loads(line[6:])
                assert "error" not in event, event
                tokens.extend(event["pdserve"]["token_ids"])
                reason = event["choices"][0]["finish_reason"] or reason
        assert done, "the stream ended without [DONE]"
        return prompt, tokens, reason

    async def openai_stream(client: openai.AsyncOpenAI, prompt: str) -> tuple[str, list[int], str]:
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=STREAM_TOKENS,
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True})
        tokens, reason = [], None
        async for chunk in stream:
            tokens.extend(extra(chunk).get("token_ids", []))
            reason = (chunk.choices[0].finish_reason if chunk.choices else None) or reason
        return prompt, tokens, reason

    async def grpc_stream(stub, prompt: str) -> tuple[str, list[int], str]:
        req = pb.GenerateRequest(text=prompt, sampling=pb.SamplingParams(
            max_tokens=STREAM_TOKENS, temperature=0.0, ignore_eos=True))
        tokens, final = [], None
        async for msg in stub.Generate(req, timeout=100):
            tokens.extend(msg.token_ids)
            final = msg.final if msg.HasField("final") else final
        assert final is not None and final.usage.completion_tokens == len(tokens)
        return prompt, tokens, "length" if final.finish_reason == pb.FINISH_REASON_LENGTH else str(final)

    async def run() -> list:
        client = openai.AsyncOpenAI(base_url=cluster.http_url + "/v1", api_key="unused", max_retries=0,
                                    timeout=100)
        timeout = aiohttp.ClientTimeout(total=100)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session, \
                grpc.aio.insecure_channel(cluster.grpc_target) as channel:
            stub = pb_grpc.GenerationStub(channel)
            jobs = []
            for i in range(N_STREAMS):
                prompt = STREAM_PROMPTS[i % len(STREAM_PROMPTS)]
                kind = i % 5
                if kind in (0, 2):
                    jobs.append(grpc_stream(stub, prompt))
                elif kind == 4:
                    jobs.append(openai_stream(client, prompt))
                else:
                    jobs.append(sse_stream(session, prompt))
            try:
                return await asyncio.wait_for(asyncio.gather(*jobs, return_exceptions=True), 110)
            finally:
                await client.close()

    started = time.monotonic()
    results = asyncio.run(run())
    elapsed = time.monotonic() - started
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, f"{len(errors)} of {N_STREAMS} streams failed, first: {errors[0]!r}"
    assert len(results) == N_STREAMS
    wrong = [(p, toks) for p, toks, reason in results if toks != expected[p] or reason != "length"]
    assert not wrong, f"{len(wrong)} streams differ from the engine, first: {wrong[0]} vs {expected[wrong[0][0]]}"
    wait_until(lambda: cluster.busy_member("decode") is None, 30, "router attempts closed")
    cluster.assert_nothing_held()
    print(f"{N_STREAMS} streams in {elapsed:.1f} s")


def test_a_generation_longer_than_its_ledger_lease_is_not_reaped(cluster: ClusterHarness) -> None:
    """The router renews the lease while tokens flow, so the reaper (every 0.5 s here) never
    takes the blocks of a request that is still decoding, however long it runs."""
    backend = cluster.service.backend
    saved = backend.lease_s
    backend.lease_s = LEASE_S
    try:
        started = time.monotonic()
        resp = cluster.openai().completions.create(
            model=cluster.model_name, prompt=SHORT_PROMPT, max_tokens=RENEWED_TOKENS, temperature=0,
            extra_body={"ignore_eos": True})
        elapsed = time.monotonic() - started
    finally:
        backend.lease_s = saved
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == RENEWED_TOKENS
    assert elapsed > 3 * LEASE_S, f"the request ({elapsed:.1f} s) must outlive several leases to test renewal"
    cluster.assert_nothing_held()


def test_a_stream_whose_reader_pauses_past_its_lease_is_not_reaped(cluster: ClusterHarness) -> None:
    """The lease is renewed on a timer, not as tokens are handed out: a reader that stops for
    longer than the lease (the stream waits at a ``yield``) while the decode worker goes on
    generating keeps its blocks, and gets every token once it reads again."""
    backend = cluster.service.backend
    ids = list(cluster.tokenizer(SHORT_PROMPT)["input_ids"])

    async def read_with_a_pause() -> tuple[int, str | None]:
        req = GenerateRequest(request_id=f"pause-{time.monotonic_ns()}", prompt_token_ids=ids,
                              params=greedy(RENEWED_TOKENS))
        tokens, reason, items = 0, None, 0
        async for item in backend.generate(req):
            items += 1
            if isinstance(item, Finished):
                reason = item.finish_reason
                continue
            tokens += len(item.token_ids)
            if items == 3:  # decoding has begun; the decode worker keeps going meanwhile
                await asyncio.sleep(PAUSE_LEASES * LEASE_S)
        return tokens, reason

    saved = backend.lease_s
    backend.lease_s = LEASE_S
    try:
        tokens, reason = cluster.call(read_with_a_pause(), 120)
    finally:
        backend.lease_s = saved
    assert reason == "length", f"the paused stream ended with {reason!r} after {tokens} tokens"
    assert tokens == RENEWED_TOKENS
    cluster.assert_nothing_held()


# --------------------------------------------------------------------------- metrics
def _documented(prefix: str) -> set[str]:
    """The metric names docs/metrics.md's tables list with ``prefix``."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    return set(re.findall(rf"^\| `({prefix}\w+)` \|", text, re.M))


def _families(text: str) -> set[str]:
    """Metric family names with at least one sample in a Prometheus exposition."""
    import re

    names = set()
    for line in text.splitlines():
        if line and not line.startswith("#"):
            names.add(re.sub(r"_(bucket|sum|count)$", "", re.split(r"[{ ]", line, maxsplit=1)[0]))
    return names


# Documented series that only an event this module's cluster never has produces: the planner is
# off here (tests/integration/test_planner_scaling.py scales), no KV transfer fails and no
# sequence is preempted on a healthy pair, Redis stays up (test_redis_outage.py covers it).
_EVENT_ONLY = {"ray_pdserve_planner_target_replicas", "ray_pdserve_planner_utilization",
               "ray_pdserve_planner_decisions_total", "ray_pdserve_pool_replicas",
               "ray_pdserve_kv_transfer_failures_total", "ray_pdserve_num_preemptions_total",
               "ray_pdserve_redis_calls_dropped_total"}


def test_every_documented_metric_has_samples_under_traffic(cluster: ClusterHarness) -> None:
    """Requests through the disaggregated cluster (one stream left early by its client), then the
    router's /metrics and the Ray node's Prometheus export: every family docs/metrics.md lists is
    there, bar the event-only ones named above."""
    import urllib.request

    client = cluster.openai()
    for prompt in (SHORT_PROMPT, LONG_PROMPT, LONG_PROMPT):      # the repeat hits the prefix cache
        client.completions.create(model=cluster.model_name, prompt=prompt, max_tokens=GEN, temperature=0)
    stream = client.completions.create(model=cluster.model_name, prompt=SHORT_PROMPT, max_tokens=64, stream=True,
                                       temperature=0, extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()                                   # a cancelled request counts too
    with urllib.request.urlopen(cluster.http_url + "/metrics", timeout=10) as resp:
        router = _families(resp.read().decode())
    assert _documented("pdserve_router_") - router == set()
    assert len(_documented("pdserve_router_")) >= 14
    node = next(n for n in ray.nodes() if n["Alive"])
    want = _documented("ray_pdserve_") - _EVENT_ONLY
    assert len(want) >= 20
    missing, deadline = want, time.monotonic() + 40.0  # Ray flushes its export every few seconds
    while missing and time.monotonic() < deadline:
        with urllib.request.urlopen(f"http://127.0.0.1:{node['MetricsExportPort']}/metrics", timeout=10) as resp:
            missing = want - _families(resp.read().decode())
        time.sleep(1.0)
    assert missing == set(), f"documented but not exported after traffic: {sorted(missing)}"
    cluster.assert_nothing_held()

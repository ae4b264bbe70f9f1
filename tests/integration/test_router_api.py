"""The router's client APIs end to end: real HTTP and gRPC servers on 127.0.0.1, a real engine.

One engine (tiny model) runs behind ``LocalEngineBackend``; its greedy outputs for a few prompts
are recorded before the servers start, and every API must reproduce them token for token.
Servers run on an asyncio loop in a thread; tests use the unmodified ``openai`` client, raw
HTTP, and gRPC stubs. Every test that stops a request early ends by checking the engine freed
its blocks; the module ends by checking nothing at all leaked.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time
from dataclasses import dataclass

import grpc
import openai
import pytest

from grpc_checks import assert_health_and_reflection
from logprob_checks import rank_band, transformers_logprobs
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tokenizer import load_tokenizer
from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pb_grpc
from pdserve.router.admission import Admission, AdmissionConfig
from pdserve.router.auth import ApiKeyAuth
from pdserve.router.grpc_server import start_grpc_server
from pdserve.router.http_server import start_http_server
from pdserve.router.local_backend import LocalEngineBackend
from pdserve.router.serving import Serving

pytestmark = pytest.mark.timeout(120)

MAX_LEN = 256
MAX_BODY = 64 * 1024
KEY = "sekrit-key"
PROMPTS = ["The quick brown fox", "Once upon a time, in a land far away,", "def main():"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
GEN = 24
LONG = 220  # max_tokens of requests that a test stops early


@dataclass
class Stack:
    engine: LLMEngine
    backend: LocalEngineBackend
    tokenizer: object
    loop: asyncio.AbstractEventLoop
    http_url: str
    grpc_target: str
    guarded_url: str       # API key required, one request in flight, no queue
    guarded_target: str
    ref: dict              # prompt text (or "chat") -> (prompt ids, greedy output ids)

    def client(self, *, guarded: bool = False) -> openai.OpenAI:
        url = self.guarded_url if guarded else self.http_url
        return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=30)

    def wait_idle(self, timeout: float = 15.0) -> None:
        """Until the engine holds no request; then every KV block must be free."""
        end = time.monotonic() + timeout
        while self.backend.num_active or self.engine.has_unfinished():
            assert time.monotonic() < end, "the engine did not finish its requests in time"
            time.sleep(0.02)
        assert self.engine.block_manager.all_free()

    def call(self, coro, timeout: float = 30.0):
        """Run a coroutine on the servers' event loop."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def generated(self) -> int:
        """Tokens the engine has sampled so far (to tell an aborted request from a finished one)."""
        return self.engine.stats().generated_tokens


def chat_ids(tokenizer, messages) -> list[int]:
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.fixture(scope="module")
def stack(tiny_model):
    engine = LLMEngine(EngineConfig(model_dir=str(tiny_model), num_blocks=512, max_model_len=MAX_LEN,
                                    max_num_seqs=64, dtype="float32"))  # references batched differently
    tokenizer = load_tokenizer(tiny_model)
    greedy = SamplingParams(max_tokens=GEN, temperature=0.0)
    prompts = {p: tokenizer(p)["input_ids"] for p in PROMPTS} | {"chat": chat_ids(tokenizer, CHAT)}
    outputs = engine.generate(list(prompts.values()), greedy)  # the engine alone, before any server
    ref = {k: (ids, out) for (k, ids), out in zip(prompts.items(), outputs)}
    backend = LocalEngineBackend(engine, model_name="tiny")
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="test-servers", daemon=True)
    thread.start()

    def call(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(30)

    async def start():
        serving = Serving(backend, tokenizer=tokenizer)
        guarded = Serving(backend, tokenizer=tokenizer,
                          admission=Admission(AdmissionConfig(max_in_flight=1, max_queued=0, retry_after_s=2)))
        auth = ApiKeyAuth([KEY])
        return [await start_http_server(serving, max_body_bytes=MAX_BODY), await start_grpc_server(serving),
                await start_http_server(guarded, auth=auth), await start_grpc_server(guarded, auth=auth)]

    servers = call(start())
    yield Stack(engine, backend, tokenizer, loop, servers[0].base_url, servers[1].target,
                servers[2].base_url, servers[3].target, ref)
    for server in servers:
        call(server.stop())
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()
    backend.close()
    assert backend.num_active == 0 and not engine.has_unfinished()
    assert engine.block_manager.all_free()


def raw_post(url: str, path: str, body: bytes, headers: dict | None = None) -> tuple[int, dict, dict]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), json.loads(resp.read() or b"{}")
    finally:
        conn.close()


# ------------------------------------------------------------------ HTTP happy paths
def test_completions_greedy_match_the_engine_plain_and_streamed(stack: Stack) -> None:
    client = stack.client()
    for prompt in PROMPTS:
        ids, expected = stack.ref[prompt]
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=GEN, temperature=0)
        assert r.pdserve["token_ids"] == expected
        assert r.choices[0].text == stack.tokenizer.decode(expected, skip_special_tokens=True)
        assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(expected)
        assert r.usage.prompt_tokens_details.cached_tokens >= 0
        assert r.pdserve["phase"]["prefill_worker"] == "local" and r.pdserve["phase"]["total_s"] > 0

        chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=GEN, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        streamed = [t for c in chunks if c.choices for t in c.pdserve["token_ids"]]
        assert streamed == expected
        assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == r.choices[0].finish_reason
        usage = chunks[-1].usage
        assert usage.completion_tokens == len(expected) and usage.prompt_tokens_details.cached_tokens is not None


def test_chat_greedy_matches_the_engine_plain_and_streamed(stack: Stack) -> None:
    client = stack.client()
    ids, expected = stack.ref["chat"]
    r = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=GEN, temperature=0,
                                       logprobs=True, top_logprobs=2)
    assert r.pdserve["token_ids"] == expected
    assert r.usage.prompt_tokens == len(ids)
    assert r.choices[0].message.role == "assistant"
    assert len(r.choices[0].logprobs.content) == len(expected)
    assert all(len(lp.top_logprobs) <= 2 and lp.logprob <= 0 for lp in r.choices[0].logprobs.content)
    chunks = list(client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=GEN, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [t for c in chunks[1:] for t in c.pdserve["token_ids"]] == expected
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content


def test_stop_string_cuts_the_text_and_finishes_with_stop(stack: Stack) -> None:
    prompt = PROMPTS[1]
    text = stack.tokenizer.decode(stack.ref[prompt][1], skip_special_tokens=True)
    start = next(i for i in range(len(text) // 2, len(text) - 4) if text.find(text[i:i + 4]) == i)
    stop = text[start:start + 4]
    client = stack.client()
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=GEN, temperature=0, stop=[stop])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (text[:start], "stop")
    assert r.usage.completion_tokens < GEN
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=GEN, temperature=0,
                                            stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == text[:start]
    stack.wait_idle()


def test_repeated_long_prompt_reports_cached_tokens(stack: Stack) -> None:
    prompt = "Cache me if you can, said the long prompt. " * 12
    client = stack.client()
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens > 64
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached == second.pdserve["phase"]["cached_prompt_tokens"]
    assert second.pdserve["token_ids"] == first.pdserve["token_ids"]


def test_models_health_and_metrics(stack: Stack) -> None:
    assert [m.id for m in stack.client().models.list().data] == ["tiny"]
    host, port = stack.http_url.removeprefix("http://").split(":")
    for path, status, words in (("/health", 200, '"ok"'), ("/metrics", 200, "pdserve_router_requests_finished_total"),
                                ("/nope", 404, "not an endpoint")):
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        conn.request("GET", path)
        resp = conn.getresponse()
        assert (resp.status, words in resp.read().decode()) == (status, True), path
        conn.close()


def test_tokenize_detokenize_and_version(stack: Stack) -> None:
    """vLLM's utility endpoints: the ids the completions would be served with, back to text."""
    from pdserve import __version__

    url = stack.http_url
    auth = {"Authorization": f"Bearer {KEY}"}
    for prompt in PROMPTS:
        ids, _ = stack.ref[prompt]
        status, _, body = raw_post(url, "/tokenize", json.dumps({"model": "tiny", "prompt": prompt}).encode(), auth)
        assert status == 200 and body["tokens"] == ids and body["count"] == len(ids), body
        assert body["max_model_len"] == MAX_LEN and body["token_strs"] is None
        status, _, back = raw_post(url, "/detokenize", json.dumps({"tokens": ids}).encode(), auth)
        assert status == 200 and back["prompt"] == stack.tokenizer.decode(ids)
    chat_ids, _ = stack.ref["chat"]
    status, _, body = raw_post(url, "/tokenize", json.dumps({"messages": CHAT, "return_token_strs": True}).encode(),
                               auth)
    assert status == 200 and body["tokens"] == chat_ids, body      # what a chat completion is served with
    assert body["token_strs"] == stack.tokenizer.convert_ids_to_tokens(chat_ids)
    no_bos = raw_post(url, "/tokenize", json.dumps({"prompt": "hi", "add_special_tokens": False}).encode(), auth)[2]
    assert no_bos["tokens"] == stack.tokenizer("hi", add_special_tokens=False)["input_ids"]
    for path, body, param in (("/tokenize", {"prompt": "hi", "messages": CHAT}, "prompt"),
                              ("/tokenize", {"prompt": "hi", "extra": 1}, "extra"),
                              ("/detokenize", {"tokens": [1, 10 ** 9]}, "tokens"),
                              ("/detokenize", {"tokens": "abc"}, "tokens")):
        status, _, err = raw_post(url, path, json.dumps(body).encode(), auth)
        assert status == 400 and err["error"]["param"] == param, err
    assert raw_post(url, "/tokenize", json.dumps({"prompt": "hi", "model": "x"}).encode(), auth)[0] == 404
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("GET", "/version")
    assert json.loads(conn.getresponse().read()) == {"version": __version__}
    conn.close()


# ------------------------------------------------------------------ HTTP bad inputs
def test_every_bad_input_gets_its_status_and_an_actionable_message(stack: Stack) -> None:
    url = stack.http_url
    cases = [
        (b'{"prompt": "hi", ', 400, "not valid JSON"),
        (b'{"prompt": "\xff\xfe"}', 400, "not valid UTF-8"),
        (b'["hi"]', 400, "JSON object"),
        (json.dumps({"prompt": "x" * (MAX_BODY + 10)}).encode(), 413, "larger than"),
        (json.dumps({"prompt": ""}).encode(), 400, "'prompt' is empty"),
        (json.dumps({"prompt": list(range(1, 300))}).encode(), 400, "shorten the prompt"),
        (json.dumps({"prompt": [1, 99999]}).encode(), 400, "outside the vocabulary"),
        (json.dumps({"prompt": "hi", "max_tokens": 0}).encode(), 400, "at least 1"),
        (json.dumps({"prompt": "hi", "max_tokens": 10_000}).encode(), 400, "lower max_tokens to at most"),
        (json.dumps({"prompt": "hi", "max_tokens": "5"}).encode(), 400, "must be an integer"),
        (json.dumps({"prompt": "hi", "temperature": -1}).encode(), 400, "'temperature' must be between"),
        (json.dumps({"prompt": "hi", "top_p": 0}).encode(), 400, "'top_p' must be greater than 0"),
        (json.dumps({"prompt": "hi", "model": "gpt-4"}).encode(), 404, "this server serves 'tiny'"),
    ]
    for body, status, words in cases:
        got, _, payload = raw_post(url, "/v1/completions", body)
        assert got == status, (body[:40], payload)
        assert set(payload["error"]) == {"message", "type", "param", "code"}
        assert words in payload["error"]["message"], payload
    got, _, payload = raw_post(url, "/v1/chat/completions", json.dumps({"messages": "hi"}).encode())
    assert got == 400 and payload["error"]["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as info:  # the openai client sees the same errors
        stack.client().completions.create(model="tiny", prompt="hi", max_tokens=10_000)
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        stack.client().chat.completions.create(model="other", messages=CHAT)
    stack.wait_idle()


def test_api_key_and_overload(stack: Stack) -> None:
    body = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
    assert raw_post(stack.guarded_url, "/v1/completions", body)[0] == 401
    assert raw_post(stack.guarded_url, "/v1/completions", body, {"Authorization": "Bearer wrong"})[0] == 401
    assert raw_post(stack.guarded_url, "/v1/completions", body, {"Authorization": f"Bearer {KEY}"})[0] == 200
    # Hold the guarded server's only slot with a long stream, then knock again.
    before = stack.generated()
    long = stack.client(guarded=True).completions.create(
        model="tiny", prompt="hold", max_tokens=LONG, stream=True, extra_body={"ignore_eos": True})
    next(iter(long))
    status, headers, payload = raw_post(stack.guarded_url, "/v1/completions", body, {"Authorization": f"Bearer {KEY}"})
    assert status == 429 and headers["Retry-After"] == "2" and payload["error"]["code"] == "rate_limit_exceeded"
    with grpc.insecure_channel(stack.guarded_target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(pb.GenerateRequest(text="hi"), timeout=10))
        assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(pb.GenerateRequest(text="hi"), metadata=[("authorization", f"Bearer {KEY}")],
                               timeout=10))
        assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert ("retry-after-ms", "2000") in tuple(info.value.trailing_metadata())
    long.close()  # client gone mid-stream: the server aborts the request
    stack.wait_idle()
    assert stack.generated() - before < LONG // 2, "the request ran on after its client left"


def test_http_client_disconnect_aborts_the_request(stack: Stack) -> None:
    before = stack.generated()
    host, port = stack.http_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", "/v1/completions", body=json.dumps(
        {"prompt": "go on", "max_tokens": LONG, "ignore_eos": True, "stream": True}),
        headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")
    assert stack.backend.num_active == 1
    conn.close()
    stack.wait_idle()
    assert stack.generated() - before < LONG // 2, "the request ran on after its client left"


# ------------------------------------------------------------------------- gRPC
def test_grpc_generate_streams_the_engines_tokens(stack: Stack) -> None:
    ids, expected = stack.ref[PROMPTS[0]]
    with grpc.insecure_channel(stack.grpc_target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        sampling = pb.SamplingParams(max_tokens=GEN, temperature=0.0)
        for req in (pb.GenerateRequest(text=PROMPTS[0], sampling=sampling, request_id="grpc-text"),
                    pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=sampling)):
            msgs = list(stub.Generate(req, timeout=30))
            assert [t for m in msgs for t in m.token_ids] == expected
            assert "".join(m.text for m in msgs) == stack.tokenizer.decode(expected, skip_special_tokens=True)
            assert [m.HasField("final") for m in msgs].count(True) == 1 and msgs[-1].HasField("final")
            final = msgs[-1].final
            assert final.usage.prompt_tokens == len(ids) and final.usage.completion_tokens == len(expected)
            assert final.phase.decode_worker == "local" and final.phase.HasField("ttft_s")
        assert msgs[0].request_id.startswith("grpc-") and msgs[0].request_id != "grpc-text"
        models = stub.ListModels(pb.ListModelsRequest(), timeout=10)
        assert [(m.id, m.max_model_len) for m in models.models] == [("tiny", MAX_LEN)]
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(top_p=2.0)), timeout=10))
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "top_p" in info.value.details()
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(pb.GenerateRequest(text="hi", model="gpt-4"), timeout=10))
        assert info.value.code() is grpc.StatusCode.NOT_FOUND


def test_grpc_n_best_of_bad_words_and_cache_salt_match_the_http_api(stack: Stack) -> None:
    """n and best_of on gRPC: the same choices the HTTP API returns for the same seeds, each
    message naming its choice and each choice ending with its own final."""
    client = stack.client()
    http_n = client.completions.create(model="tiny", prompt=PROMPTS[0], n=2, max_tokens=5, temperature=1.0, seed=11,
                                       extra_body={"ignore_eos": True}).model_dump()
    http_best = client.completions.create(model="tiny", prompt=PROMPTS[0], best_of=3, max_tokens=5, temperature=1.0,
                                          seed=11, extra_body={"ignore_eos": True}).model_dump()
    with grpc.insecure_channel(stack.grpc_target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        msgs = list(stub.Generate(pb.GenerateRequest(text=PROMPTS[0], sampling=pb.SamplingParams(
            max_tokens=5, temperature=1.0, seed=11, ignore_eos=True, n=2)), timeout=30))
        by_index: dict[int, list[int]] = {0: [], 1: []}
        for m in msgs:
            by_index[m.index] += list(m.token_ids)
        assert sorted(m.index for m in msgs if m.HasField("final")) == [0, 1]
        assert [by_index[0], by_index[1]] == [c["token_ids"] for c in http_n["pdserve"]["choices"]]
        msgs = list(stub.Generate(pb.GenerateRequest(text=PROMPTS[0], sampling=pb.SamplingParams(
            max_tokens=5, temperature=1.0, seed=11, ignore_eos=True, best_of=3)), timeout=30))
        assert len(msgs) == 2 and not msgs[0].logprobs and msgs[1].HasField("final")
        assert list(msgs[0].token_ids) == http_best["pdserve"]["choices"][0]["token_ids"]
        msgs = list(stub.Generate(pb.GenerateRequest(text=PROMPTS[0], sampling=pb.SamplingParams(
            max_tokens=5, temperature=1.0, seed=11, ignore_eos=True, n=2, echo=True)), timeout=30))
        for index in (0, 1):
            mine = [m for m in msgs if m.index == index]
            assert mine[0].text == PROMPTS[0] and not mine[0].token_ids
            assert [t for m in mine for t in m.token_ids] == http_n["pdserve"]["choices"][index]["token_ids"]
        _, expected = stack.ref[PROMPTS[0]]
        msgs = list(stub.Generate(pb.GenerateRequest(text=PROMPTS[0], sampling=pb.SamplingParams(
            max_tokens=3, temperature=0.0, bad_words=[stack.tokenizer.decode(expected[:1]).strip()])), timeout=30))
        assert [t for m in msgs for t in m.token_ids][:1] != expected[:1]
        prompt = "A salted gRPC prompt, long enough for whole blocks. " * 6
        cached = [list(stub.Generate(pb.GenerateRequest(text=prompt, sampling=pb.SamplingParams(
            max_tokens=1, cache_salt=salt)), timeout=30))[-1].final.usage.cached_prompt_tokens for salt in "xxy"]
        assert cached[0] == 0 and cached[1] > 0 and cached[2] == 0
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(n=3, best_of=2)), timeout=10))
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "best_of" in info.value.details()
    stack.wait_idle()


def test_grpc_health_and_reflection(stack: Stack) -> None:
    assert_health_and_reflection(stack.grpc_target)


def test_grpc_cancel_and_deadline_free_the_engine_blocks(stack: Stack) -> None:
    long = pb.SamplingParams(max_tokens=LONG, ignore_eos=True)
    with grpc.insecure_channel(stack.grpc_target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        before = stack.generated()
        call = stub.Generate(pb.GenerateRequest(text="keep going", sampling=long), timeout=30)
        next(call)
        next(call)
        call.cancel()
        stack.wait_idle()
        assert stack.generated() - before < LONG // 2, "the request ran on after its client cancelled"
        before = stack.generated()
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(pb.GenerateRequest(text="keep going", sampling=long), timeout=0.05))
        assert info.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        stack.wait_idle()
        # the tiny model makes ~1,000 tokens/s on a fast host: 0.05 s is ~50 of them, the whole
        # request 220; running to its end would mean the deadline did not stop it
        assert stack.generated() - before < LONG * 3 // 4, "the request ran on past its deadline"


# ------------------------------------------------------------------ concurrency
def test_sixty_concurrent_streams_complete(stack: Stack) -> None:
    async def http_stream(client: openai.AsyncOpenAI, i: int) -> tuple[int, str]:
        stream = await client.completions.create(model="tiny", prompt=f"Request number {i} says", max_tokens=12,
                                                 temperature=0.8, seed=i, stream=True,
                                                 stream_options={"include_usage": True})
        tokens, reason, usage = 0, None, None
        async for chunk in stream:
            if chunk.choices:
                tokens += len(chunk.pdserve["token_ids"])
                reason = chunk.choices[0].finish_reason or reason
            usage = chunk.usage or usage
        assert usage.completion_tokens == tokens
        return tokens, reason

    async def grpc_stream(stub, i: int) -> tuple[int, str]:
        req = pb.GenerateRequest(text=f"Stream {i}:", sampling=pb.SamplingParams(max_tokens=12, seed=i))
        tokens, final = 0, None
        async for msg in stub.Generate(req, timeout=60):
            tokens += len(msg.token_ids)
            final = msg.final if msg.HasField("final") else final
        assert final.usage.completion_tokens == tokens
        return tokens, pb.FinishReason.Name(final.finish_reason)

    async def run() -> list[tuple[int, str]]:
        client = openai.AsyncOpenAI(base_url=stack.http_url + "/v1", api_key="x", max_retries=0, timeout=60)
        async with grpc.aio.insecure_channel(stack.grpc_target) as channel:
            stub = pb_grpc.GenerationStub(channel)
            jobs = [http_stream(client, i) for i in range(40)] + [grpc_stream(stub, i) for i in range(20)]
            results = await asyncio.wait_for(asyncio.gather(*jobs), 90)
        await client.close()
        return results

    results = asyncio.run(run())
    assert len(results) == 60
    assert all(1 <= n <= 12 and reason in ("stop", "length", "FINISH_REASON_STOP", "FINISH_REASON_LENGTH")
               for n, reason in results)
    stack.wait_idle()


# -------------------------------------------------------------------------- TLS
def self_signed(tmp_path) -> tuple[str, str]:
    crypto = pytest.importorskip("cryptography")  # noqa: F841
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_file), str(key_file)


def test_tls_on_both_apis(stack: Stack, tmp_path) -> None:
    import ssl

    import httpx2  # the openai client's HTTP library

    from pdserve.router.auth import grpc_server_credentials, server_ssl_context

    cert, key = self_signed(tmp_path)

    async def start():
        serving = Serving(stack.backend, tokenizer=stack.tokenizer)
        return (await start_http_server(serving, ssl_context=server_ssl_context(cert, key)),
                await start_grpc_server(serving, credentials=grpc_server_credentials(cert, key)))

    http_server, grpc_server = stack.call(start())
    try:
        assert http_server.base_url.startswith("https://127.0.0.1:")
        client = openai.OpenAI(base_url=http_server.base_url + "/v1", api_key="x", max_retries=0,
                               http_client=httpx2.Client(verify=ssl.create_default_context(cafile=cert), timeout=30))
        r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=GEN, temperature=0)
        assert r.pdserve["token_ids"] == stack.ref[PROMPTS[0]][1]
        creds = grpc.ssl_channel_credentials(root_certificates=open(cert, "rb").read())
        with grpc.secure_channel(grpc_server.target, creds) as channel:
            msgs = list(pb_grpc.GenerationStub(channel).Generate(
                pb.GenerateRequest(text=PROMPTS[0], sampling=pb.SamplingParams(max_tokens=GEN, temperature=0.0)),
                timeout=30))
        assert [t for m in msgs for t in m.token_ids] == stack.ref[PROMPTS[0]][1]
        with grpc.insecure_channel(grpc_server.target) as channel:  # plaintext is refused
            with pytest.raises(grpc.RpcError):
                pb_grpc.GenerationStub(channel).ListModels(pb.ListModelsRequest(), timeout=5)
    finally:
        stack.call(http_server.stop())
        stack.call(grpc_server.stop())
    stack.wait_idle()


def test_closing_the_backend_ends_every_stream_with_an_error_and_frees_its_blocks(tiny_model) -> None:
    from pdserve.router.backend import Finished, GenerateRequest

    engine = LLMEngine(EngineConfig(model_dir=str(tiny_model), num_blocks=64, max_model_len=MAX_LEN))
    backend = LocalEngineBackend(engine, model_name="tiny")
    long = SamplingParams(max_tokens=MAX_LEN - 8, temperature=0.0, ignore_eos=True)

    async def run() -> tuple[list, list]:
        stream = backend.generate(GenerateRequest("closing", [1, 2, 3, 4], long))
        first = await anext(stream)  # the request is running
        await asyncio.to_thread(backend.close)
        rest = [item async for item in stream]
        after = [item async for item in backend.generate(GenerateRequest("late", [1, 2], long))]
        return [first, *rest], after

    during, after = asyncio.run(run())
    end = during[-1]
    assert isinstance(end, Finished) and end.finish_reason == "error" and "shutting down" in str(end.error)
    assert len(during) < long.max_tokens  # cut short, not run to the end
    assert len(after) == 1 and after[0].finish_reason == "error" and "shutting down" in str(after[0].error)
    assert backend.num_active == 0 and engine.block_manager.all_free()


def test_a_requests_queue_time_counts_from_its_submit_not_from_when_the_engine_takes_it(stack: Stack) -> None:
    """A request that waits for the engine loop (here: a command holding it 0.3 s, as a running
    step would) has that wait in its phase record's queue time and TTFT."""
    from pdserve.router.backend import Finished, GenerateRequest

    held = threading.Event()

    def hold(_engine) -> None:
        held.set()
        time.sleep(0.3)

    async def run() -> Finished:
        busy = stack.backend._loop.submit(hold)
        await asyncio.to_thread(held.wait, 10)
        items = [item async for item in stack.backend.generate(
            GenerateRequest("queued-at-submit", [1, 2, 3, 4], SamplingParams(max_tokens=2, temperature=0.0)))]
        await asyncio.wrap_future(busy)
        return items[-1]

    end = stack.call(run())
    assert isinstance(end, Finished) and end.error is None
    assert end.phase.queue_s >= 0.25, end.phase
    assert end.phase.ttft_s >= end.phase.queue_s
    stack.wait_idle()


def test_min_tokens_and_penalties_work_through_the_api(stack: Stack) -> None:
    """min_tokens keeps a stop token id from ending the request early; a repetition penalty
    changes the greedy text (random-weight models repeat themselves); neither is ignored."""
    client = stack.client()
    prompt = PROMPTS[0]
    _, expected = stack.ref[prompt]
    first = expected[0]
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=GEN, temperature=0,
                                  extra_body={"stop_token_ids": [first]})
    assert r.usage.completion_tokens == 1 and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=GEN, temperature=0,
                                  extra_body={"stop_token_ids": [first], "min_tokens": 4})
    ids = r.pdserve["token_ids"]
    assert len(ids) >= 4 and first not in ids[:4]
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=GEN, temperature=0)
    assert plain.pdserve["token_ids"] == expected
    penalized = client.completions.create(model="tiny", prompt=prompt, max_tokens=GEN, temperature=0,
                                          frequency_penalty=2.0, extra_body={"repetition_penalty": 1.5})
    assert penalized.pdserve["token_ids"] != expected
    # logit_bias: the greedy first token banned, and another forced everywhere
    banned = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0,
                                       logit_bias={str(first): -100})
    assert first not in banned.pdserve["token_ids"]
    forced = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0,
                                       logit_bias={"42": 100}, extra_body={"ignore_eos": True})
    assert forced.pdserve["token_ids"] == [42] * 4
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        client.completions.create(model="tiny", prompt=prompt, max_tokens=4, logit_bias={"999999": 1})
    stack.wait_idle()


@pytest.fixture(scope="module")
def solo(tiny_model) -> LLMEngine:
    """A second engine for references computed while the served one runs."""
    return LLMEngine(EngineConfig(model_dir=str(tiny_model), num_blocks=256, max_model_len=MAX_LEN,
                                  max_num_seqs=8, dtype="float32", warm_up=False))


def test_n_choices_are_seeded_each_and_share_the_prompts_kv(stack: Stack, solo) -> None:
    """n=3 seeded: choice j is the engine's output with seed + j; the later choices start once
    the first has its first token and find the prompt's full blocks in the prefix cache."""
    client = stack.client()
    prompt = PROMPTS[1] * 3                                   # > 2 blocks of 16 tokens
    ids = stack.tokenizer(prompt)["input_ids"]
    r = client.completions.create(model="tiny", prompt=prompt, n=3, max_tokens=8, temperature=1.0, seed=11,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    want = [solo.generate([ids], SamplingParams(max_tokens=8, temperature=1.0, seed=11 + j, ignore_eos=True))[0]
            for j in range(3)]
    got = [c["token_ids"] for c in r.pdserve["choices"]]
    assert got == want and len({tuple(t) for t in got}) == 3
    assert [c.text for c in r.choices] == [stack.tokenizer.decode(w, skip_special_tokens=True) for w in want]
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 24
    phases = [c["phase"] for c in r.pdserve["choices"]]
    assert all(p["cached_prompt_tokens"] >= len(ids) // 16 * 16 - 16 > 0 for p in phases[1:]), phases
    stack.wait_idle()


def test_several_prompts_echo_and_best_of(stack: Stack, solo) -> None:
    client = stack.client()
    r = client.completions.create(model="tiny", prompt=PROMPTS[:2], max_tokens=GEN, temperature=0, echo=True)
    assert [c.index for c in r.choices] == [0, 1]
    for choice, prompt in zip(r.choices, PROMPTS[:2]):
        ids, expected = stack.ref[prompt]
        assert choice.text == prompt + stack.tokenizer.decode(expected, skip_special_tokens=True)
    assert r.usage.prompt_tokens == sum(len(stack.ref[p][0]) for p in PROMPTS[:2])
    # best_of: the candidate with the highest sum of its tokens' logprobs (seeds 5, 6, 7)
    ids, _ = stack.ref[PROMPTS[0]]
    r = client.completions.create(model="tiny", prompt=PROMPTS[0], best_of=3, max_tokens=6, temperature=1.0,
                                  seed=5, extra_body={"ignore_eos": True})
    cands = []
    for j in range(3):
        out = solo.add_request(f"cand-{j}", ids, SamplingParams(max_tokens=6, temperature=1.0, seed=5 + j,
                                                                 ignore_eos=True, logprobs=0))
        while solo.has_unfinished():
            solo.step()
        cands.append((sum(lp[t] for t, lp in zip(out.output_token_ids, out.output_logprobs)), out.output_token_ids))
    best = max(cands)[1]
    assert len(r.choices) == 1 and r.pdserve["choices"][0]["token_ids"] == best
    assert r.choices[0].logprobs is None                      # ranked by logprobs, not asked for them
    assert r.usage.completion_tokens == 18                    # every candidate's tokens count
    stack.wait_idle()


def test_chat_n_streams_every_choice_with_its_index(stack: Stack) -> None:
    chunks = list(stack.client().chat.completions.create(
        model="tiny", messages=CHAT, n=2, max_tokens=6, temperature=1.0, seed=3, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role == "assistant"]
    assert sorted(roles) == [0, 1]
    texts: dict[int, str] = {0: "", 1: ""}
    ends = {}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                ends[ch.index] = ch.finish_reason
    assert ends == {0: "length", 1: "length"} and texts[0] != texts[1]
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].usage.prompt_tokens == len(stack.ref["chat"][0])
    stack.wait_idle()


def test_skip_special_tokens_and_include_stop_str_in_output(stack: Stack) -> None:
    client = stack.client()
    special = stack.tokenizer.convert_tokens_to_ids("<|im_start|>")
    forced = {"logit_bias": {str(special): 100}, "extra_body": {"ignore_eos": True}}
    r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=2, temperature=0, **forced)
    assert r.pdserve["token_ids"] == [special, special] and r.choices[0].text == ""
    forced["extra_body"]["skip_special_tokens"] = False
    r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=2, temperature=0, **forced)
    assert r.choices[0].text == "<|im_start|><|im_start|>"
    _, expected = stack.ref[PROMPTS[0]]
    full = stack.tokenizer.decode(expected, skip_special_tokens=True)
    stop = full[len(full) // 2: len(full) // 2 + 3]
    cut = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=GEN, temperature=0, stop=[stop])
    kept = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=GEN, temperature=0, stop=[stop],
                                     extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == cut.choices[0].text + stop and kept.choices[0].finish_reason == "stop"
    stack.wait_idle()


def test_vllm_prompt_and_token_extensions(stack: Stack) -> None:
    """allowed_token_ids, truncate_prompt_tokens, and the chat template's add_generation_prompt,
    continue_final_message and chat_template_kwargs, as vLLM serves them."""
    client = stack.client()
    r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=6, temperature=1.0, seed=2,
                                  extra_body={"allowed_token_ids": [42, 43], "ignore_eos": True})
    assert set(r.pdserve["token_ids"]) <= {42, 43} and len(r.pdserve["token_ids"]) == 6
    r = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=4, temperature=0,
                                  extra_body={"truncate_prompt_tokens": 3, "ignore_eos": True})
    assert r.usage.prompt_tokens == 3
    partial = [*CHAT, {"role": "assistant", "content": "Red, and"}]
    text = stack.tokenizer.apply_chat_template(partial, continue_final_message=True, tokenize=False)
    r = client.chat.completions.create(model="tiny", messages=partial, max_tokens=2, temperature=0,
                                       extra_body={"continue_final_message": True, "add_generation_prompt": False,
                                                   "chat_template_kwargs": {"unused_flag": True}})
    assert r.usage.prompt_tokens == len(stack.tokenizer(text, add_special_tokens=False)["input_ids"])
    for extra, param in (({"continue_final_message": True}, "continue_final_message"),
                         ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
                         ({"allowed_token_ids": [10 ** 7]}, "allowed_token_ids")):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="tiny", messages=CHAT if "continue" in param else partial,
                                           max_tokens=2, extra_body=extra)
        assert info.value.body["param"] == param, info.value.body
    stack.wait_idle()


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(stack: Stack) -> None:
    r = stack.client().completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=3, temperature=0, logprobs=2,
                                          extra_body={"return_tokens_as_token_ids": True})
    ids = r.pdserve["token_ids"]
    assert r.choices[0].logprobs.tokens == [f"token_id:{t}" for t in ids]
    assert all(k.startswith("token_id:") for top in r.choices[0].logprobs.top_logprobs for k in top)
    stack.wait_idle()


def test_cache_salt_keeps_prefix_cache_hits_within_one_salt(stack: Stack) -> None:
    """vLLM's cache_salt: a prompt's cached blocks serve only requests with the same salt."""
    client = stack.client()
    prompt = "Salted prompts share their cache only with their own tenant. " * 8

    def cached(salt: str | None) -> int:
        extra = {"cache_salt": salt} if salt is not None else {}
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0, extra_body=extra)
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0          # first of its salt
    assert cached("tenant-a") > 0           # same salt: hits
    assert cached("tenant-b") == 0          # another salt: none of tenant-a's blocks
    assert cached(None) == 0                # unsalted: none either
    assert cached(None) > 0
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=prompt, max_tokens=2, extra_body={"cache_salt": ""})
    assert info.value.body["param"] == "cache_salt"
    stack.wait_idle()


def test_bad_words_never_appear_as_tokens_in_the_output(stack: Stack) -> None:
    """vLLM's bad_words: a one-token word is banned outright; a longer one loses its last token
    whenever the output ends with the rest of it."""
    client = stack.client()
    ids, expected = stack.ref[PROMPTS[0]]
    tok = stack.tokenizer
    word = tok.decode(expected[:2])
    assert tok(word, add_special_tokens=False)["input_ids"] == expected[:2], "pick a word that tokenizes back"
    r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=4, temperature=0,
                                  extra_body={"bad_words": [word], "ignore_eos": True})
    got = r.pdserve["token_ids"]
    assert got[0] == expected[0] and got[1] != expected[1]      # the greedy path, its second token banned
    first = tok.decode(expected[:1]).strip()
    single = tok(first, add_special_tokens=False)["input_ids"]
    r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                  extra_body={"bad_words": [first], "ignore_eos": True})
    if len(single) == 1:
        assert single[0] not in r.pdserve["token_ids"]
    assert r.pdserve["token_ids"][:1] != expected[:1] or len(tok(" " + first, add_special_tokens=False)["input_ids"]) > 1
    for bad in ([""], "word", [1]):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=2, extra_body={"bad_words": bad})
        assert info.value.body["param"] == "bad_words"
    stack.wait_idle()


def test_spaces_between_special_tokens_sets_them_apart(stack: Stack) -> None:
    client = stack.client()
    special = stack.tokenizer.convert_tokens_to_ids("<|im_start|>")
    body = {"logit_bias": {str(special): 100}, "extra_body": {"ignore_eos": True, "skip_special_tokens": False}}
    r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=2, temperature=0, **body)
    assert r.choices[0].text == "<|im_start|><|im_start|>"
    body["extra_body"]["spaces_between_special_tokens"] = True
    r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=2, temperature=0, **body)
    # set apart from the prompt's text before it as well (the slow tokenizers' join)
    assert r.choices[0].text == " <|im_start|> <|im_start|>"
    stream = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=3, temperature=0, stream=True,
                                       **body)
    assert "".join(c.choices[0].text for c in stream if c.choices) == " <|im_start|> <|im_start|> <|im_start|>"
    stack.wait_idle()


def test_prompt_logprobs_and_echo_score_the_prompt_as_transformers_does(stack: Stack) -> None:
    """vLLM's prompt_logprobs, and OpenAI's echo + logprobs with max_tokens 0 (what lm-eval's
    loglikelihood sends): the prompt's logprobs match transformers' on the same checkpoint."""
    client = stack.client()
    prompt = "Cache me if you can, said the long prompt. " * 6     # cached by an earlier test, or now
    client.completions.create(model="tiny", prompt=prompt, max_tokens=1, temperature=0)
    ids = stack.tokenizer(prompt)["input_ids"]
    ref = transformers_logprobs(stack.engine.config.model_dir, ids)
    want = [float(ref[p, ids[p + 1]]) for p in range(len(ids) - 1)]

    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": 2})
    body = r.model_dump()
    pl = body["choices"][0]["prompt_logprobs"]
    assert pl[0] is None and len(pl) == len(ids)
    got = [pl[p + 1][str(ids[p + 1])]["logprob"] for p in range(len(ids) - 1)]
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-3
    for p in range(len(ids) - 1):
        assert pl[p + 1][str(ids[p + 1])]["rank"] in rank_band(ref[p], ids[p + 1], 1e-3)
    assert len(pl[1]) in (2, 3)
    assert r.usage.prompt_tokens_details.cached_tokens == 0      # scored, so computed, not read from cache

    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == prompt and r.usage.completion_tokens == 0
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:], want)) < 1e-3
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)

    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, echo=True, logprobs=0, temperature=0)
    assert len(r.choices[0].logprobs.tokens) == len(ids) + 3 and r.usage.completion_tokens == 3
    assert r.choices[0].text.startswith(prompt)

    chat = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2, temperature=0, n=2,
                                          extra_body={"prompt_logprobs": 0}).model_dump()
    assert len(chat["prompt_logprobs"]) == len(stack.ref["chat"][0]) and chat["prompt_logprobs"][0] is None
    stack.wait_idle()


def _reference_beams(model, prompt: list[int], width: int, steps: int, eos: set[int], penalty: float):
    """Beam search written out on transformers' logits: what vLLM's use_beam_search computes."""
    import torch

    live, done = [([], 0.0)], []
    for _ in range(steps):
        cands = []
        for toks, lp in live:
            with torch.no_grad():
                row = torch.log_softmax(model(torch.tensor([prompt + toks])).logits[0, -1].float(), dim=-1)
            vals, idx = row.topk(2 * width)
            cands += [(toks + [t], lp + v) for v, t in zip(vals.tolist(), idx.tolist())]
        done += [c for c in cands if c[0][-1] in eos]
        live = sorted((c for c in cands if c[0][-1] not in eos), key=lambda c: -c[1])[:width]
        if not live:
            break

    def score(c):
        return c[1] / ((len(prompt) + len(c[0]) - (1 if c[0][-1] in eos else 0)) ** penalty)

    return [c[0] for c in sorted(done + live, key=lambda c: -score(c))[:width]]


def test_beam_search_returns_the_n_best_beams(stack: Stack) -> None:
    """vLLM's use_beam_search with length_penalty: the n beams a beam search over transformers'
    logits finds, best first; every step's requests free their blocks."""
    import torch
    from transformers import AutoModelForCausalLM

    client = stack.client()
    model = AutoModelForCausalLM.from_pretrained(stack.engine.config.model_dir, dtype=torch.float32)
    ids, _ = stack.ref[PROMPTS[1]]
    eos = set(stack.backend.model_info().eos_token_ids)
    for width, penalty in ((3, 1.0), (2, 0.5)):
        r = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=5, n=width,
                                      extra_body={"use_beam_search": True, "length_penalty": penalty}).model_dump()
        got = [c["token_ids"] for c in r["pdserve"]["choices"]]
        assert got == _reference_beams(model, ids, width, 5, eos, penalty)
        assert len(r["choices"]) == width and len(set(map(tuple, got))) == width
        assert [c["text"] for c in r["choices"]][0] == stack.tokenizer.decode(
            [t for t in got[0] if t not in eos], skip_special_tokens=True)
        scores = [c["cumulative_logprob"] for c in r["pdserve"]["choices"]]
        assert all(s <= 0 for s in scores)
    chat = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=3, n=2,
                                          extra_body={"use_beam_search": True})
    assert len(chat.choices) == 2 and chat.usage.completion_tokens > 0
    for extra, param in (({"use_beam_search": True, "stream": True}, "stream"),
                         ({"use_beam_search": True, "presence_penalty": 0.5}, "presence_penalty"),
                         ({"use_beam_search": True, "temperature": 0.7}, "temperature"),
                         ({"length_penalty": 0.5}, "length_penalty")):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=2, extra_body=extra)
        assert info.value.body["param"] == param, info.value.body
    stack.wait_idle()


def test_vllm_request_fields_add_special_tokens_request_id_return_token_ids_and_chat_echo(stack: Stack) -> None:
    client = stack.client()
    tok = stack.tokenizer
    with_special = tok(PROMPTS[0])["input_ids"]
    bare = tok(PROMPTS[0], add_special_tokens=False)["input_ids"]
    r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=2, temperature=0,
                                  extra_body={"add_special_tokens": False, "return_token_ids": True}).model_dump()
    assert r["usage"]["prompt_tokens"] == len(bare) and r["choices"][0]["prompt_token_ids"] == bare
    assert r["choices"][0]["token_ids"] == r["pdserve"]["token_ids"]
    r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=2, temperature=0,
                                  extra_body={"priority": 0})   # vLLM's integer priority at its default
    assert r.usage.prompt_tokens == len(with_special)
    raw = client.completions.with_raw_response.create(model="tiny", prompt=PROMPTS[0], max_tokens=2,
                                                      extra_body={"request_id": "my-own-id-7"})
    assert raw.headers["X-Request-Id"] == "my-own-id-7"
    chunks = list(client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=3, temperature=0, stream=True,
                                                 extra_body={"return_token_ids": True, "ignore_eos": True}))
    assert chunks[0].model_dump()["prompt_token_ids"] == stack.ref["chat"][0]
    assert [t for c in chunks[1:] for t in c.choices[0].model_dump().get("token_ids", [])] == \
        [t for c in chunks for t in c.model_dump().get("pdserve", {}).get("token_ids", [])]
    partial = [*CHAT, {"role": "assistant", "content": "Red, and"}]
    echo = {"echo": True, "continue_final_message": True, "add_generation_prompt": False, "ignore_eos": True}
    r = client.chat.completions.create(model="tiny", messages=partial, max_tokens=3, temperature=0, extra_body=echo)
    plain = client.chat.completions.create(model="tiny", messages=partial, max_tokens=3, temperature=0,
                                           extra_body={k: v for k, v in echo.items() if k != "echo"})
    assert r.choices[0].message.content == "Red, and" + plain.choices[0].message.content
    streamed = client.chat.completions.create(model="tiny", messages=partial, max_tokens=3, temperature=0,
                                              stream=True, extra_body=echo)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == r.choices[0].message.content
    for extra, param in (({"echo": True}, "echo"), ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
                         ({"logits_processors": ["x"]}, "logits_processors"), ({"chat_template": "{{x}}"}, "chat_template"),
                         ({"kv_transfer_params": {}}, "kv_transfer_params"), ({"priority": 3}, "priority"),
                         ({"request_id": "has space"}, "request_id")):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2, extra_body=extra)
        assert info.value.body["param"] == param, info.value.body
    stack.wait_idle()

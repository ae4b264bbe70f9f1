"""Configured limits are enforced: a real ``RouterService`` (one prefill, one decode Ray actor,
ledger in Redis) behind HTTP and gRPC on 127.0.0.1, the tiny model.

* ``router.max_tokens_limit``: above it is 400 naming the field and the limit; a chat request
  without ``max_tokens`` gets at most the limit; gRPC prompt text too long for the context is
  INVALID_ARGUMENT before it is tokenized.
* ``router.request_timeout_s``: a generation longer than it ends with 504 (HTTP, an OpenAI error
  body; in a stream, a final error event) / DEADLINE_EXCEEDED (gRPC) after about the timeout,
  and leaves no block held and no ledger entry live.

Each class has its own cluster (its own limits), stopped before the next one starts.
"""

from __future__ import annotations

import json
import time

import grpc
import openai
import pytest
import requests
from cluster_helpers import ClusterHarness, cluster_config
from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPT = "The quick brown fox jumps over the lazy dog"
LIMIT = 48
TIMEOUT_S = 2.0
LONG = 3000  # tokens: well over TIMEOUT_S of decoding on any host


def _harness(tiny_model, redis_url: str, **overrides) -> ClusterHarness:
    h = ClusterHarness(cluster_config(tiny_model, **overrides), redis_url)
    h.start()
    return h


@pytest.fixture(scope="class")
def limited(tiny_model, ray_session, redis_server):
    h = _harness(tiny_model, redis_server.url, **{"router.max_tokens_limit": LIMIT})
    try:
        yield h
        h.assert_nothing_held()
    finally:
        h.stop()


@pytest.fixture(scope="class")
def timed(tiny_model, ray_session, redis_server):
    h = _harness(tiny_model, redis_server.url, **{"router.request_timeout_s": TIMEOUT_S})
    try:
        yield h
        h.assert_nothing_held()
    finally:
        h.stop()


class TestMaxTokensLimit:
    @pytest.fixture
    def cluster(self, limited: ClusterHarness) -> ClusterHarness:
        return limited

    def test_above_the_limit_is_400_naming_field_and_limit(self, cluster: ClusterHarness) -> None:
        for path, body, field in [
            ("/v1/completions", {"prompt": PROMPT, "max_tokens": LIMIT + 1}, "max_tokens"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                      "max_completion_tokens": 3000}, "max_completion_tokens"),
        ]:
            resp = requests.post(cluster.http_url + path, json=body, timeout=30)
            err = resp.json()["error"]
            assert resp.status_code == 400, err
            assert err["param"] == field and str(LIMIT) in err["message"] and field in err["message"]
        with grpc.insecure_channel(cluster.grpc_target) as channel:
            with pytest.raises(grpc.RpcError) as info:
                list(pb_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(
                    text=PROMPT, sampling=pb.SamplingParams(max_tokens=LIMIT + 1)), timeout=30))
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT and str(LIMIT) in info.value.details()

    def test_at_the_limit_is_served(self, cluster: ClusterHarness) -> None:
        out = cluster.openai().completions.create(model=cluster.model_name, prompt=PROMPT, max_tokens=LIMIT,
                                                  extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == LIMIT

    def test_chat_without_max_tokens_gets_at_most_the_limit(self, cluster: ClusterHarness) -> None:
        out = cluster.openai().chat.completions.create(
            model=cluster.model_name, messages=[{"role": "user", "content": "Tell me a long story."}],
            extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == LIMIT and out.choices[0].finish_reason == "length"

    def test_huge_grpc_prompt_is_invalid_argument_before_tokenizing(self, cluster: ClusterHarness) -> None:
        text = "lorem ipsum " * 250_000  # 3 MB
        t0 = time.monotonic()
        with grpc.insecure_channel(cluster.grpc_target) as channel:
            with pytest.raises(grpc.RpcError) as info:
                list(pb_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(
                    text=text, sampling=pb.SamplingParams(max_tokens=4)), timeout=60))
        print(f"3 MB prompt refused in {(time.monotonic() - t0) * 1000:.0f} ms")
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        assert "characters" in info.value.details()

    def test_grpc_message_over_the_size_limit_is_resource_exhausted_and_the_server_serves_on(
            self, cluster: ClusterHarness) -> None:
        from pdserve.router.grpc_server import max_message_bytes

        limit = max_message_bytes(cluster.service.serving.info.max_model_len)
        ids = pb.TokenIds(ids=[5] * (limit + 1024))   # packed varints of 1 byte each: over the limit
        with grpc.insecure_channel(cluster.grpc_target, options=[("grpc.max_send_message_length", -1)]) as channel:
            stub = pb_grpc.GenerationStub(channel)
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(pb.GenerateRequest(token_ids=ids, sampling=pb.SamplingParams(max_tokens=4)),
                                   timeout=60))
            assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
            ok = list(stub.Generate(pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingParams(max_tokens=2)),
                                    timeout=60))
        assert sum(len(m.token_ids) for m in ok) == 2


class TestRequestTimeout:
    @pytest.fixture
    def cluster(self, timed: ClusterHarness) -> ClusterHarness:
        return timed

    def _body(self, **extra) -> dict:
        return {"prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True, **extra}

    def test_http_504_after_the_timeout_and_nothing_held(self, cluster: ClusterHarness) -> None:
        t0 = time.monotonic()
        resp = requests.post(cluster.http_url + "/v1/completions", json=self._body(), timeout=120)
        elapsed = time.monotonic() - t0
        assert resp.status_code == 504, resp.text[:300]
        assert resp.json()["error"]["type"] == "timeout_error"
        assert elapsed < TIMEOUT_S + 3.0, elapsed
        print(f"HTTP 504 after {elapsed:.2f} s (request_timeout_s={TIMEOUT_S})")
        cluster.assert_nothing_held()

    def test_http_stream_ends_with_an_error_event(self, cluster: ClusterHarness) -> None:
        resp = requests.post(cluster.http_url + "/v1/completions", json=self._body(stream=True), stream=True,
                             timeout=120)
        assert resp.status_code == 200
        events = [line.removeprefix(b"data: ") for line in resp.iter_lines() if line.startswith(b"data: ")]
        assert events[-1] == b"[DONE]"
        last = json.loads(events[-2])
        assert last["error"]["type"] == "timeout_error", last
        cluster.assert_nothing_held()

    def test_grpc_deadline_exceeded_and_a_shorter_client_deadline_wins(self, cluster: ClusterHarness) -> None:
        with grpc.insecure_channel(cluster.grpc_target) as channel:
            stub = pb_grpc.GenerationStub(channel)
            req = pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingParams(max_tokens=LONG, ignore_eos=True))
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(req))  # no client deadline: the server's applies
            elapsed = time.monotonic() - t0
            assert info.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED, info.value.details()
            assert elapsed < TIMEOUT_S + 3.0, elapsed
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(req, timeout=0.5))
            assert info.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            assert time.monotonic() - t0 < TIMEOUT_S
        cluster.assert_nothing_held()

    def test_openai_client_sees_the_timeout(self, cluster: ClusterHarness) -> None:
        with pytest.raises(openai.APIStatusError) as info:
            cluster.openai().completions.create(model=cluster.model_name, prompt=PROMPT, max_tokens=LONG,
                                                extra_body={"ignore_eos": True})
        assert info.value.status_code == 504
        cluster.assert_nothing_held()

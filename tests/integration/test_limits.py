"""Configured limits are enforced: a real ``RouterService`` (one prefill, one decode Ray actor,
ledger in Redis) behind HTTP and gRPC on 127.0.0.1, the tiny model.

* ``router.max_tokens_limit``: above it is 400 naming the field and the limit; a chat request
  without ``max_tokens`` gets at most the limit; gRPC prompt text too long for the context is
  INVALID_ARGUMENT before it is tokenized.
* ``router.request_timeout_s``: a generation longer than it ends with 504 (HTTP, an OpenAI error
  body; in a stream, a final error event) / DEADLINE_EXCEEDED (gRPC) after about the timeout,
  and leaves no block held and no ledger entry live. Beam search and ``n`` choices end at the same
  deadline, however many sequences they run, also leaving nothing held.
* ``router.max_choices_per_request`` (on a decode pool of 4 slots): a request over it is 400
  naming the setting; a request of that many choices leaves room for a small one, which is
  admitted and answered while the wide one runs.

Each class has its own cluster (its own limits), stopped before the next one starts.
"""

from __future__ import annotations

import json
import time

import grpc
import openai
import pytest
import requests
from cluster_helpers import ClusterHarness, cluster_config, wait_until
from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(300)

PROMPT = "The quick brown fox jumps over the lazy dog"
LIMIT = 48
TIMEOUT_S = 2.0
LONG = 3000  # tokens: well over TIMEOUT_S of decoding on any host
SLOTS = 4        # the timed cluster's admission capacity: one decode replica of 4 sequences
MAX_CHOICES = 3  # its router.max_choices_per_request


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
    h = _harness(tiny_model, redis_server.url, **{"router.request_timeout_s": TIMEOUT_S,
                                                  "decode.engine.max_num_seqs": SLOTS, "decode.max_replicas": 1,
                                                  "router.max_choices_per_request": MAX_CHOICES})
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

    def test_beam_search_ends_at_the_deadline_and_leaves_nothing_held(self, cluster: ClusterHarness) -> None:
        # thousands of one-token steps, each far shorter than the deadline: the search's own deadline ends it
        t0 = time.monotonic()
        resp = requests.post(cluster.http_url + "/v1/completions", timeout=120, json={
            "prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True, "use_beam_search": True, "n": MAX_CHOICES})
        elapsed = time.monotonic() - t0
        assert resp.status_code == 504, resp.text[:300]
        assert resp.json()["error"]["type"] == "timeout_error"
        assert elapsed < TIMEOUT_S + 3.0, elapsed
        print(f"beam search: HTTP 504 after {elapsed:.2f} s (request_timeout_s={TIMEOUT_S})")
        cluster.assert_nothing_held()

    @pytest.mark.parametrize("path, body", [
        ("/v1/completions", {"prompt": PROMPT, "n": MAX_CHOICES}),
        ("/v1/completions", {"prompt": [PROMPT, "Once upon a time"], "n": 1, "best_of": 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": MAX_CHOICES}),
    ])
    def test_several_choices_end_at_the_deadline_and_leave_nothing_held(self, cluster: ClusterHarness, path: str,
                                                                        body: dict) -> None:
        t0 = time.monotonic()
        resp = requests.post(cluster.http_url + path, json={**body, "max_tokens": LONG, "ignore_eos": True},
                             timeout=120)
        elapsed = time.monotonic() - t0
        assert resp.status_code == 504, resp.text[:300]
        assert resp.json()["error"]["type"] == "timeout_error"
        assert elapsed < TIMEOUT_S + 3.0, elapsed
        cluster.assert_nothing_held()

    def test_grpc_choices_end_at_the_deadline(self, cluster: ClusterHarness) -> None:
        with grpc.insecure_channel(cluster.grpc_target) as channel:
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as info:
                list(pb_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(
                    text=PROMPT, sampling=pb.SamplingParams(max_tokens=LONG, ignore_eos=True, n=MAX_CHOICES))))
            assert info.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED, info.value.details()
            assert time.monotonic() - t0 < TIMEOUT_S + 3.0
        cluster.assert_nothing_held()

    def test_more_choices_than_the_setting_is_400_naming_it(self, cluster: ClusterHarness) -> None:
        for path, body in [("/v1/completions", {"prompt": PROMPT, "n": MAX_CHOICES + 1}),
                           ("/v1/completions", {"prompt": [PROMPT] * 2, "n": 2}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                     "n": MAX_CHOICES + 1, "use_beam_search": True})]:
            resp = requests.post(cluster.http_url + path, json={**body, "max_tokens": 2}, timeout=30)
            err = resp.json()["error"]
            assert resp.status_code == 400 and err["code"] == "too_many_choices", err
            assert "router.max_choices_per_request" in err["message"] and str(MAX_CHOICES) in err["message"], err
        with grpc.insecure_channel(cluster.grpc_target) as channel:
            with pytest.raises(grpc.RpcError) as info:
                list(pb_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(
                    text=PROMPT, sampling=pb.SamplingParams(max_tokens=2, n=MAX_CHOICES + 1)), timeout=30))
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "router.max_choices_per_request" in info.value.details()

    def test_a_wide_request_does_not_delay_a_small_ones_admission(self, cluster: ClusterHarness) -> None:
        from concurrent.futures import ThreadPoolExecutor

        assert cluster.service.serving.admission.config.max_in_flight == SLOTS

        def post(body: dict) -> tuple[int, float]:
            resp = requests.post(cluster.http_url + "/v1/completions", json=body, timeout=120)
            return resp.status_code, time.monotonic()

        with ThreadPoolExecutor(2) as pool:
            t0 = time.monotonic()
            wide = pool.submit(post, {"prompt": PROMPT, "n": MAX_CHOICES, "max_tokens": LONG, "ignore_eos": True})
            wait_until(lambda: cluster.service.serving.admission.in_flight == MAX_CHOICES, timeout_s=TIMEOUT_S,
                       what="the wide request's choices to take their slots")
            sent = time.monotonic()
            status, small_done = post({"prompt": "Hello", "max_tokens": 4, "ignore_eos": True})
            wide_status, wide_done = wide.result(60)
        print(f"small request: sent {sent - t0:.2f} s after the wide one, answered in {small_done - sent:.2f} s; "
              f"the wide one ended at {wide_done - t0:.2f} s")
        assert status == 200
        assert small_done < wide_done - 0.2 and small_done - sent < TIMEOUT_S / 2
        assert wide_status == 504     # the wide one ran on until its deadline
        cluster.assert_nothing_held()

    def test_a_freed_slot_goes_to_a_small_request_before_a_wide_ones_rest(self, cluster: ClusterHarness) -> None:
        # all 4 slots taken: a long request, a stream the test will close, and 2 of a wide request's
        # 3 choices (its third waits); a small request then waits too. The stream's slot frees:
        # it goes to the small request (holding none), not to the wide one's third choice (in line
        # first, but its request holds two), so the small one is answered long before the deadline.
        from concurrent.futures import ThreadPoolExecutor

        admission = cluster.service.serving.admission

        def post(body: dict) -> tuple[int, float]:
            resp = requests.post(cluster.http_url + "/v1/completions", json=body, timeout=120)
            return resp.status_code, time.monotonic()

        long_body = {"prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True}
        with ThreadPoolExecutor(3) as pool:
            t0 = time.monotonic()
            alone = pool.submit(post, long_body)
            stream = requests.post(cluster.http_url + "/v1/completions", json={**long_body, "stream": True},
                                   stream=True, timeout=120)
            lines = stream.iter_lines()   # kept: a dropped iterator would close the stream
            next(lines)                                                   # it runs: 2 slots taken
            wide = pool.submit(post, {**long_body, "n": MAX_CHOICES})
            wait_until(lambda: (admission.in_flight, admission.queued) == (SLOTS, 1), timeout_s=TIMEOUT_S / 2,
                       what="the wide request's third choice to wait", interval_s=0.005)
            small = pool.submit(post, {"prompt": "Hello", "max_tokens": 4, "ignore_eos": True})
            wait_until(lambda: admission.queued == 2, timeout_s=TIMEOUT_S / 2, what="the small request to wait",
                       interval_s=0.005)
            freed = time.monotonic()
            stream.close()                                                # its slot frees
            status, small_done = small.result(60)
            wide_status, wide_done = wide.result(60)
            assert alone.result(60)[0] == 504
        print(f"small request answered {small_done - freed:.2f} s after a slot freed "
              f"({freed - t0:.2f} s in); the wide one ended at {wide_done - t0:.2f} s")
        assert status == 200 and wide_status == 504
        assert small_done < wide_done - 0.2 and small_done - freed < TIMEOUT_S / 2
        cluster.assert_nothing_held()

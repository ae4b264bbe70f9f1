"""Client request ids are opaque and scoped: a real ``RouterService`` (one prefill, two decode
Ray actors, ledger in Redis: the session's ``router_cluster``) behind HTTP and gRPC on 127.0.0.1, the tiny model.

Life cycle checked: a stream with id X runs -> a second request with id X is refused at once
(gRPC ALREADY_EXISTS / HTTP 409, no internal name in the message) -> the first completes -> X is
usable again. Ids that share a prefix up to '#' are different requests: cancelling 'victim'
leaves 'victim#7' running to its end. The module ends with every block free and the ledger empty.
"""

from __future__ import annotations

import http.client
import json
import time

import grpc
import pytest
from cluster_helpers import ClusterHarness
from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(300)

PROMPT = "The quick brown fox jumps over the lazy dog"
RUN = 120    # tokens of a request that must run to its end
VICTIM7 = 600  # tokens of the request that must outlive the cancel of "victim"
LONG = 1500  # max_tokens of a request that a test cancels


@pytest.fixture(scope="module")
def cluster(router_cluster: ClusterHarness):
    yield router_cluster
    router_cluster.assert_nothing_held()


def generate(stub, request_id: str, max_tokens: int, timeout: float = 120):
    return stub.Generate(pb.GenerateRequest(request_id=request_id, text=PROMPT, sampling=pb.SamplingParams(
        max_tokens=max_tokens, ignore_eos=True, temperature=0.0)), timeout=timeout)


def read_to_end(call) -> tuple[int, pb.FinalInfo]:
    tokens, final = 0, None
    for msg in call:
        tokens += len(msg.token_ids)
        if msg.HasField("final"):
            final = msg.final
    return tokens, final


def test_grpc_duplicate_live_id_is_already_exists_and_the_first_completes(cluster: ClusterHarness) -> None:
    with grpc.insecure_channel(cluster.grpc_target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        first = generate(stub, "dup", RUN)
        opening = next(first)
        assert opening.request_id == "dup" and opening.token_ids
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            list(generate(stub, "dup", RUN))
        refused_s = time.monotonic() - t0
        assert info.value.code() is grpc.StatusCode.ALREADY_EXISTS, info.value.details()
        assert "'dup'" in info.value.details() and "#" not in info.value.details()
        tokens, final = read_to_end(first)
        assert final.finish_reason == pb.FINISH_REASON_LENGTH and tokens + len(opening.token_ids) == RUN
        # The first one ended: the id is free again.
        tokens, final = read_to_end(generate(stub, "dup", 4))
        assert (tokens, final.finish_reason) == (4, pb.FINISH_REASON_LENGTH)
    print(f"duplicate refused in {refused_s * 1000:.0f} ms")
    cluster.assert_nothing_held()


def _post(conn: http.client.HTTPConnection, request_id: str, max_tokens: int, stream: bool) -> None:
    conn.request("POST", "/v1/completions", body=json.dumps(
        {"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": stream}),
        headers={"Content-Type": "application/json", "X-Request-Id": request_id})


def test_http_duplicate_live_id_is_409_and_free_again_after(cluster: ClusterHarness) -> None:
    host, port = cluster.http_url.removeprefix("http://").split(":")
    first = http.client.HTTPConnection(host, int(port), timeout=120)
    second = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        _post(first, "dup-http", RUN, stream=True)
        resp = first.getresponse()
        assert resp.status == 200 and resp.getheader("X-Request-Id") == "dup-http"
        assert resp.readline().startswith(b"data: {")
        _post(second, "dup-http", RUN, stream=False)
        dup = second.getresponse()
        body = json.loads(dup.read())
        assert dup.status == 409, body
        assert body["error"]["code"] == "duplicate_request_id" and body["error"]["param"] == "request_id"
        rest = resp.read()
        assert rest.rstrip().endswith(b"data: [DONE]") and b'"finish_reason":"length"' in rest
        _post(second, "dup-http", 4, stream=False)
        again = second.getresponse()
        body = json.loads(again.read())
        assert again.status == 200 and again.getheader("X-Request-Id") == "dup-http"
        assert body["usage"]["completion_tokens"] == 4
    finally:
        first.close()
        second.close()
    cluster.assert_nothing_held()


def test_cancelling_victim_leaves_victim_hash_7_running(cluster: ClusterHarness) -> None:
    with grpc.insecure_channel(cluster.grpc_target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        other = generate(stub, "victim#7", VICTIM7)
        other_first = next(other)
        victim = generate(stub, "victim", LONG)
        assert next(victim).token_ids
        victim.cancel()
        assert not other.done(), "victim#7 ended before the cancel: make it longer"
        with pytest.raises(grpc.RpcError) as info:
            list(victim)
        assert info.value.code() is grpc.StatusCode.CANCELLED
        tokens, final = read_to_end(other)
        assert final is not None and final.finish_reason == pb.FINISH_REASON_LENGTH
        assert tokens + len(other_first.token_ids) == VICTIM7
    cluster.assert_nothing_held()

"""Admission by predicted time to first token: a real ``RouterService`` (one prefill, one decode
Ray actor, ledger in Redis) on 127.0.0.1, the tiny model, ``router.disaggregation.
max_predicted_ttft_s`` set, a prefill worker slowed to one request at a time in 8-token chunks.

A burst of long prompts: those whose predicted TTFT (the prompt tokens queued on the prefill
worker plus their own, over its measured rate) is over the limit get 429 with Retry-After at
once, without touching a worker; the others complete. No 5xx, nothing left held.
"""

from __future__ import annotations

import concurrent.futures
import random
import time

import pytest
import requests
from cluster_helpers import SLOW_PREFILL_OVERRIDES, ClusterHarness, cluster_config, running_cluster, wait_until

pytestmark = pytest.mark.timeout(300)

LIMIT_S = 0.3
PROMPTS = 16
PROMPT_LEN = 512


@pytest.fixture(scope="module")
def cluster(tiny_model, ray_session, redis_server):
    config = cluster_config(tiny_model, **SLOW_PREFILL_OVERRIDES,
                            **{"router.disaggregation.max_predicted_ttft_s": LIMIT_S})
    with running_cluster(config, redis_server.url) as h:
        yield h


def _post(cluster: ClusterHarness, prompt: list[int], rid: str | None = None) -> tuple[requests.Response, float]:
    t0 = time.monotonic()
    resp = requests.post(cluster.http_url + "/v1/completions", timeout=120, headers={"X-Request-Id": rid} if rid else {},
                         json={
        "model": cluster.model_name, "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    return resp, time.monotonic() - t0


def test_a_burst_over_the_predicted_ttft_limit_is_refused_at_once(cluster: ClusterHarness) -> None:
    rng = random.Random(3)
    vocab = cluster.service.serving.info.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(PROMPT_LEN)] for _ in range(PROMPTS + 1)]
    warm, _ = _post(cluster, prompts[-1])       # the router learns the prefill worker's rate
    assert warm.status_code == 200, warm.text
    prefill = cluster.members("prefill")[0]
    wait_until(lambda: prefill.view.prefill_tokens_per_s is not None, 10.0, "a measured prefill rate")
    backend = cluster.service.backend
    assert backend.max_predicted_ttft_s == LIMIT_S           # the config reached the router
    # The limit the burst meets is set from this host's measured rate: about three prompts' worth,
    # so that some fit and the rest do not on a fast host and a slow one alike.
    backend.max_predicted_ttft_s = 3.5 * PROMPT_LEN / prefill.view.prefill_tokens_per_s
    refused_before = backend.ttft_refusals
    with concurrent.futures.ThreadPoolExecutor(PROMPTS) as pool:
        results = list(pool.map(lambda i: _post(cluster, prompts[i], f"burst-{i}"), range(PROMPTS)))
    codes = [r.status_code for r, _ in results]
    assert set(codes) <= {200, 429}, codes
    ok = [r for r, _ in results if r.status_code == 200]
    refused = [(r, s) for r, s in results if r.status_code == 429]
    assert ok and refused, codes
    assert backend.ttft_refusals - refused_before == len(refused)
    for r, seconds in refused:
        err = r.json()["error"]
        assert "predicted time to first token" in err["message"] and int(r.headers["Retry-After"]) >= 1
        assert seconds < 2.0, f"a refusal took {seconds:.2f} s: it must come at once, not after queueing"
    assert all(len(r.json()["pdserve"]["token_ids"]) == 4 for r in ok)
    # Every refusal is in the request log (`pdserve requests tail`) with its reason, beside the
    # completed requests.
    ids = {f"burst-{i}" for i, (r, _) in enumerate(results) if r.status_code == 429}
    logged: dict = {}

    def all_logged() -> bool:
        logged.update({x.get("client_request_id"): x for x in cluster.service.request_log.tail(200)})
        return ids <= set(logged)

    wait_until(all_logged, 10.0, "the refused requests in the request log")
    for rid in ids:
        assert logged[rid]["outcome"] == "rate_limit_error" and "predicted time to first token" in logged[rid]["error"]

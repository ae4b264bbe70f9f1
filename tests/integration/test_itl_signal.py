"""The planner sees the inter-token latency it says it sees: a real ``RouterService`` (one prefill,
two decode Ray actors, ledger in Redis: the session's ``router_cluster``) on 127.0.0.1, the tiny model, real streams.

Under traffic a decode worker measures each stream's gaps between outputs and reports their
recent mean (``itl_ms`` in its stats), the pool manager hands it to the planner
(``WorkerMetrics.itl_ms``), and the router's ``/metrics`` histogram
``pdserve_router_inter_token_latency_seconds`` gets one sample per gap between a stream's chunks.
Before this, none of the three ever got a value (issue 10).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from cluster_helpers import ClusterHarness, wait_until

pytestmark = pytest.mark.timeout(300)

STREAMS, TOKENS = 4, 40


@pytest.fixture(scope="module")
def cluster(router_cluster: ClusterHarness):
    yield router_cluster
    router_cluster.assert_nothing_held()


def _itl_count(cluster: ClusterHarness) -> int:
    text = requests.get(cluster.http_url + "/metrics", timeout=10).text
    line = next(ln for ln in text.splitlines() if ln.startswith("pdserve_router_inter_token_latency_seconds_count{"))
    return int(float(line.split()[-1]))


def _stream(cluster: ClusterHarness, i: int) -> int:
    stream = cluster.openai().completions.create(model=cluster.model_name, prompt=f"stream {i} goes on and on",
                                                 max_tokens=TOKENS, temperature=0, stream=True,
                                                 extra_body={"ignore_eos": True})
    return sum(1 for chunk in stream if chunk.choices and chunk.choices[0].text is not None)


def test_itl_reaches_worker_stats_planner_and_router_metrics(cluster: ClusterHarness) -> None:
    before = _itl_count(cluster)
    with ThreadPoolExecutor(STREAMS) as pool:
        list(pool.map(lambda i: _stream(cluster, i), range(STREAMS)))
    # the reports of the decode workers that ran the streams (polled by the router every 0.25 s)
    measured = []

    def reported() -> bool:
        measured[:] = [m for m in cluster.members("decode") if m.view.stats is not None and m.view.stats.itl_ms is not None]
        return bool(measured)

    wait_until(reported, 10.0, "a decode worker's itl_ms in its stats")
    decode = measured[0]
    itl = decode.view.stats.itl_ms
    assert 0.0 < itl < 5000.0, itl
    # slo.itl_ms also reaches the decode worker's engine, as its budget of prompt tokens per step
    # while streams decode (a disaggregated cluster); the prefill worker has none.
    assert isinstance(decode.view.stats.prefill_budget_tokens, int)
    assert cluster.members("prefill")[0].view.stats.prefill_budget_tokens is None
    # what the planner is given
    metrics = cluster.service.manager.metrics(time.time())
    by_role = {m.role.value if hasattr(m.role, "value") else m.role: m for m in metrics}
    assert by_role["decode"].itl_ms is not None and by_role["decode"].itl_ms > 0
    assert by_role["prefill"].itl_ms is None
    # the router's histogram: a gap between every two chunks of every stream (first chunk excluded)
    assert _itl_count(cluster) - before >= STREAMS * (TOKENS - 2)

"""pdserve metrics recorded in a Ray actor show up on the node's Prometheus endpoint.

Life of the check: the session's Ray node exports metrics on ``MetricsExportPort`` -> an actor
records engine, transfer, router and planner metrics through ``pdserve.cluster.runtime.metrics`` ->
we scrape ``http://127.0.0.1:<port>/metrics`` until every expected series has its value
(Ray flushes every few seconds) -> the actor is killed and gone.
"""

from __future__ import annotations

import bisect
import re
import time
import urllib.request
import uuid
from dataclasses import dataclass

import pytest
import ray

from pdserve.cluster.runtime.metrics import METRICS
from ray_settings import METRICS_REPORT_INTERVAL_MS


SCRAPE_TIMEOUT_S = 40.0
_LINE = re.compile(r"^(?P<name>[A-Za-z_:][\w:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)$")
SPECS = {m.name: m for m in METRICS}
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


def parse_exposition(text: str) -> list[Sample]:
    samples = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if m:
            labels = dict(_LABEL.findall(m.group("labels") or ""))
            samples.append(Sample(m.group("name"), labels, float(m.group("value"))))
    return samples


def scrape(port: int) -> list[Sample]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return parse_exposition(resp.read().decode())


@ray.remote(num_cpus=0)
class Recorder:
    """Records a known set of observations through the metrics module, inside a Ray worker."""

    def record(self, uid: str) -> str:
        from dataclasses import asdict

        from pdserve.cluster.runtime.metrics import EngineMetrics, PlannerMetrics, RedisMetrics, RayRouterMetrics
        from pdserve.capacity.planner import PlannerDecision, ScaleAction
        from pdserve.engine.contract import WorkerRole
        from pdserve.engine.llm_engine import EngineStats
        from pdserve.engine.contract import RequestPhase, RequestRecord

        engine = EngineMetrics("decode", f"{uid}-d0", "tiny")

        def stats(steps: int, generated: int, **extra: int) -> dict:
            base = EngineStats(num_running=3, num_waiting=2, num_held=1, num_free_blocks=30,
                               num_blocks=40, kv_usage=0.25, prefix_hit_rate=0.5, steps=steps,
                               generated_tokens=generated, prompt_tokens_computed=100)
            return {**asdict(base), **extra}

        # Cumulative counters reported three times: only the gains count.
        engine.update_engine(stats(10, 10))
        engine.update_engine(stats(25, 25, prefix_query_tokens=64, prefix_hit_tokens=32, num_preemptions=1))
        engine.update_engine(stats(25, 25, prefix_query_tokens=64, prefix_hit_tokens=32, num_preemptions=1))
        # The engine restarted: its counters begin again from zero.
        engine.update_engine(EngineStats(3, 0, 0, 40, 40, 0.0, 0.0, 5, 5, 40))

        engine.observe_finished(RequestPhase(queue_s=0.002, prompt_tokens=40, cached_prompt_tokens=16,
                                            prefill_s=0.03, ttft_s=0.032, output_tokens=5, decode_s=0.4,
                                            total_s=0.432, finish_reason="stop"))
        engine.observe_finished(RequestPhase(queue_s=0.5, prompt_tokens=8, ttft_s=None, total_s=0.5,
                                             output_tokens=0, finish_reason="abort"))
        engine.observe_transfer(1_000_000, 0.004)
        engine.observe_transfer(500_000, 0.002)

        router = RayRouterMetrics("tiny", router_id=f"{uid}-r0")
        router.request_ended(RequestRecord(
            "r1", "c1", "http", "length", phase=RequestPhase(
                queue_s=0.001, prompt_tokens=40, prefill_s=0.05, ttft_s=0.06, output_tokens=5, decode_s=0.1,
                total_s=0.16, finish_reason="length"), itl_s=(0.01, 0.02, 0.03, 0.04)))
        router.request_ended(RequestRecord("r2", "c2", "http", "rate_limit_error"))   # a 429: no phase
        router.request_ended(RequestRecord("r3", "c3", "grpc", "cancelled"))          # left while queued
        router.set_in_flight(7, 1)

        planner = PlannerMetrics()
        decisions = [PlannerDecision(WorkerRole.PREFILL, ScaleAction.SCALE_UP, 1, 2, "busy", 0.9),
                     PlannerDecision(WorkerRole.DECODE, ScaleAction.HOLD, 2, 2, "fine", 0.5)]
        planner.observe(decisions, replicas={"prefill": 1})
        planner.observe(decisions, replicas={"prefill": 1})

        redis = RedisMetrics()  # one outage: two ledger steps deferred, one request-log write dropped
        redis.set_up(False)
        redis.dropped("ledger")
        redis.dropped("ledger")
        redis.dropped("request_log")
        redis.set_up(True)
        return ray.get_runtime_context().get_worker_id()


@dataclass(frozen=True)
class SumOf:
    """A histogram's ``_sum`` for these observations.

    Ray (OpenTelemetry export) re-aggregates histograms in its node agent and reports the sum
    of the bucket midpoints, not of the values, so the check is that the sum lies between the
    sums of the observations' bucket bounds (it would also pass an exact sum).
    """

    values: tuple[float, ...]

    def matches(self, name: str, got: float) -> bool:
        buckets = SPECS[name.removeprefix("ray_").removesuffix("_sum")].buckets
        lo = hi = 0.0
        for v in self.values:
            i = bisect.bisect_left(buckets, v)
            lo += buckets[i - 1] if i > 0 else 0.0
            hi += buckets[i] if i < len(buckets) else 2 * buckets[-1]
        return lo - 1e-9 <= got <= hi + 1e-9


def _sum_of(*values: float) -> SumOf:
    return SumOf(values)


def _expected(uid: str) -> list[tuple[str, dict[str, str], float | SumOf]]:
    d = {"role": "decode", "worker_id": f"{uid}-d0", "model": "tiny"}
    r = {"role": "router", "worker_id": f"{uid}-r0", "model": "tiny"}
    pre, dec = {"role": "planner", "pool": "prefill"}, {"role": "planner", "pool": "decode"}
    return [
        ("ray_pdserve_num_requests_running", d, 3),
        ("ray_pdserve_num_requests_waiting", d, 0),
        ("ray_pdserve_kv_cache_usage_perc", d, 0.0),
        ("ray_pdserve_engine_steps_total", d, 30),        # 25, then 5 after the restart
        ("ray_pdserve_generation_tokens_total", d, 30),
        ("ray_pdserve_prompt_tokens_total", d, 140),      # 100 before the restart, 40 after
        ("ray_pdserve_prefix_cache_queries_total", d, 64),
        ("ray_pdserve_prefix_cache_hits_total", d, 32),
        ("ray_pdserve_num_preemptions_total", d, 1),
        ("ray_pdserve_requests_finished_total", {**d, "finish_reason": "stop"}, 1),
        ("ray_pdserve_requests_finished_total", {**d, "finish_reason": "abort"}, 1),
        ("ray_pdserve_time_to_first_token_seconds_count", d, 1),
        ("ray_pdserve_time_to_first_token_seconds_bucket", {**d, "le": "0.025"}, 0),
        ("ray_pdserve_time_to_first_token_seconds_bucket", {**d, "le": "0.05"}, 1),
        ("ray_pdserve_e2e_request_latency_seconds_count", d, 2),
        ("ray_pdserve_e2e_request_latency_seconds_sum", d, _sum_of(0.432, 0.5)),
        ("ray_pdserve_request_queue_time_seconds_sum", d, _sum_of(0.002, 0.5)),
        ("ray_pdserve_request_prefill_time_seconds_sum", d, _sum_of(0.03)),
        ("ray_pdserve_request_decode_time_seconds_count", d, 1),
        ("ray_pdserve_request_time_per_output_token_seconds_sum", d, _sum_of(0.1)),
        ("ray_pdserve_request_prompt_tokens_sum", d, _sum_of(40, 8)),
        ("ray_pdserve_request_generation_tokens_sum", d, _sum_of(5, 0)),
        ("ray_pdserve_kv_transfer_bytes_total", d, 1_500_000),
        ("ray_pdserve_kv_transfer_seconds_count", d, 2),
        ("ray_pdserve_kv_transfer_seconds_sum", d, _sum_of(0.004, 0.002)),
        ("ray_pdserve_inter_token_latency_seconds_count", r, 4),
        ("ray_pdserve_inter_token_latency_seconds_sum", r, _sum_of(0.01, 0.02, 0.03, 0.04)),
        ("ray_pdserve_time_to_first_token_seconds_sum", r, _sum_of(0.06)),
        ("ray_pdserve_request_time_per_output_token_seconds_sum", r, _sum_of(0.025)),
        ("ray_pdserve_requests_finished_total", {**r, "finish_reason": "length"}, 1),
        ("ray_pdserve_requests_finished_total", {**r, "finish_reason": "rejected"}, 1),
        ("ray_pdserve_requests_finished_total", {**r, "finish_reason": "abort"}, 1),
        ("ray_pdserve_e2e_request_latency_seconds_count", r, 1),       # only the request a worker ran
        ("ray_pdserve_num_requests_running", r, 7),
        ("ray_pdserve_planner_decisions_total", {**pre, "action": "scale_up"}, 2),
        ("ray_pdserve_planner_decisions_total", {**dec, "action": "hold"}, 2),
        ("ray_pdserve_pool_replicas", pre, 1),
        ("ray_pdserve_pool_replicas", dec, 2),
        ("ray_pdserve_planner_target_replicas", pre, 2),
        ("ray_pdserve_planner_utilization", dec, 0.5),
        ("ray_pdserve_redis_up", {"role": "router"}, 1),
        ("ray_pdserve_redis_calls_dropped_total", {"role": "router", "kind": "ledger"}, 2),
        ("ray_pdserve_redis_calls_dropped_total", {"role": "router", "kind": "request_log"}, 1),
    ]


def _find(samples: list[Sample], name: str, labels: dict[str, str]) -> list[Sample]:
    def matches(s: Sample) -> bool:
        if s.name != name:
            return False
        for key, want in labels.items():
            have = s.labels.get(key)
            if key == "le" and have is not None:
                if float(have) != float(want):
                    return False
            elif have != want:
                return False
        return True

    return [s for s in samples if matches(s)]


def _agrees(name: str, want: float | SumOf, found: list[Sample]) -> bool:
    if len(found) != 1:
        return False
    if isinstance(want, SumOf):
        return want.matches(name, found[0].value)
    return found[0].value == pytest.approx(want, rel=1e-6, abs=1e-9)


def _problems(samples: list[Sample], uid: str, ray_worker_id: str,
              only: tuple[str, ...] = ()) -> list[str]:
    mine = [s for s in samples if s.labels.get("WorkerId") == ray_worker_id]
    problems = []
    for name, labels, want in _expected(uid):
        if only and name not in only:
            continue
        found = _find(mine, name, labels)
        if not _agrees(name, want, found):
            problems.append(f"{name}{labels}: want {want}, found {[s.value for s in found]}")
    return problems


GAUGES = tuple(m.scraped_name for m in METRICS if m.kind == "gauge")
# Ray drops a gauge not set again within two report intervals (conftest's ray_session sets the interval).
GAUGE_TTL_S = 2 * METRICS_REPORT_INTERVAL_MS / 1000


def test_metrics_reach_the_node_prometheus_endpoint(ray_session) -> None:
    node = next(n for n in ray_session.nodes() if n["Alive"])
    port = int(node["MetricsExportPort"])
    uid = uuid.uuid4().hex[:8]
    recorder = Recorder.remote()
    ray_worker_id = ray_session.get(recorder.record.remote(uid), timeout=60)
    recorded_at = time.monotonic()

    # Every series appears with its labels and value once Ray has flushed.
    problems = ["not scraped yet"]
    while problems and time.monotonic() < recorded_at + SCRAPE_TIMEOUT_S:
        time.sleep(1.0)
        problems = _problems(scrape(port), uid, ray_worker_id)
    assert not problems, "metrics missing or wrong after %.0f s:\n%s" % (SCRAPE_TIMEOUT_S, "\n".join(problems))
    sample = _find(scrape(port), "ray_pdserve_num_requests_running", {"worker_id": f"{uid}-d0"})[0]
    assert {"SessionName", "NodeAddress", "WorkerId"} <= set(sample.labels), "Ray's own labels ride along"

    # Gauges set once are still exported after Ray's gauge TTL: the module refreshes them.
    time.sleep(max(0.0, recorded_at + GAUGE_TTL_S + 5.0 - time.monotonic()))
    assert _problems(scrape(port), uid, ray_worker_id, only=GAUGES) == []

    # ray.kill is asynchronous: a call sent just after it may still be served. The actor must be
    # gone (calls fail with RayActorError) within the deadline.
    ray_session.kill(recorder)
    deadline = time.monotonic() + 30.0
    with pytest.raises(ray_session.exceptions.RayActorError):
        while time.monotonic() < deadline:
            ray_session.get(recorder.record.remote(uid), timeout=30)
            time.sleep(0.5)

"""pdserve's Prometheus metrics, recorded through ``ray.util.metrics``: the one place stats become metrics.

Core code returns stats (``EngineStats``, ``RequestPhase``, ``PlannerDecision``); the recorders here
(``EngineMetrics``, ``RayRouterMetrics``, ``PlannerMetrics``) turn them into metrics. ``METRICS`` is the
catalogue: every name, type, label set and bucket list (``docs/metrics.md`` and the Grafana
dashboard are checked against it by ``tests/unit/test_grafana.py``).

Naming: vLLM's name where one exists, under ``pdserve_`` instead of ``vllm:`` (Ray refuses ``:``),
with a unit suffix (``_seconds``, ``_bytes``, ``_total`` on every counter). Ray's node exporter
(the ``metrics_export_port`` of every Ray node, ``/metrics``) adds ``ray_`` in front, so
``pdserve_time_to_first_token_seconds`` is scraped as ``ray_pdserve_time_to_first_token_seconds``
and every series gains Ray's own labels (``SessionName``, ``NodeAddress``, ``WorkerId`` = the Ray
process, ...). Counters are declared with ``_total`` so the scraped name is the same whether
Ray exports through OpenTelemetry (default) or the legacy OpenCensus path.

Labels stay low-cardinality: ``role`` (prefill | decode | both | router | planner), ``worker_id``
and ``model``; ``finish_reason``, ``pool`` and ``action`` take a handful of values each.

Ray metric objects are created once per process, on first use, and only record when the process
is a Ray worker or a driver connected to Ray; elsewhere (plain unit tests) recording is a no-op.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields, is_dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.capacity.planner import PlannerDecision
    from pdserve.engine.llm_engine import EngineStats
    from pdserve.engine.contract import RequestPhase, RequestRecord

logger = logging.getLogger(__name__)

RAY_EXPORT_PREFIX = "ray_"
ENGINE_ROLES = ("prefill", "decode", "both")
FINISH_REASONS = ("stop", "length", "abort", "error", "prefilled", "rejected")
GAUGE_REFRESH_S = 1.0

# Buckets sized for CPU serving: TTFT from 1 ms to a minute, whole requests up to 10 minutes.
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                     10.0, 20.0, 30.0, 60.0)
REQUEST_BUCKETS_S = LATENCY_BUCKETS_S + (120.0, 300.0, 600.0)
TOKEN_LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2,
                           0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
TRANSFER_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                      0.25, 0.5, 1.0, 2.5, 10.0)
TOKEN_COUNT_BUCKETS = (1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0,
                       8192.0, 16384.0, 32768.0)


class MetricKind(enum.StrEnum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """One metric as declared to Ray; ``scraped_name`` is what Prometheus sees."""

    name: str
    kind: MetricKind
    description: str
    tag_keys: tuple[str, ...]
    buckets: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if not self.name.startswith("pdserve_") or ":" in self.name:
            raise ValueError(f"metric {self.name!r} must start with 'pdserve_' and contain no ':'")
        if (self.kind is MetricKind.COUNTER) != self.name.endswith("_total"):
            raise ValueError(f"{self.name!r}: counters, and only counters, end in '_total'")
        if (self.kind is MetricKind.HISTOGRAM) != bool(self.buckets):
            raise ValueError(f"{self.name!r}: histograms, and only histograms, have buckets")
        if list(self.buckets) != sorted(set(self.buckets)) or any(b <= 0 for b in self.buckets):
            raise ValueError(f"{self.name!r}: buckets must be positive and strictly increasing")

    @property
    def scraped_name(self) -> str:
        return RAY_EXPORT_PREFIX + self.name


_W = ("role", "worker_id", "model")
_POOL = ("role", "pool")


def _h(name: str, buckets: tuple[float, ...], description: str) -> MetricSpec:
    return MetricSpec(name, MetricKind.HISTOGRAM, description, _W, buckets)


def _c(name: str, description: str, tag_keys: tuple[str, ...] = _W) -> MetricSpec:
    return MetricSpec(name, MetricKind.COUNTER, description, tag_keys)


def _g(name: str, description: str, tag_keys: tuple[str, ...] = _W) -> MetricSpec:
    return MetricSpec(name, MetricKind.GAUGE, description, tag_keys)


METRICS: tuple[MetricSpec, ...] = (
    # Per request, observed by engines (their own view) and by the router (the client's view).
    _h("pdserve_time_to_first_token_seconds", LATENCY_BUCKETS_S, "Time from arrival to the first token."),
    _h("pdserve_inter_token_latency_seconds", TOKEN_LATENCY_BUCKETS_S,
       "Time between two consecutive output tokens of a request."),
    _h("pdserve_request_time_per_output_token_seconds", TOKEN_LATENCY_BUCKETS_S,
       "A request's mean decode time per output token after the first."),
    _h("pdserve_e2e_request_latency_seconds", REQUEST_BUCKETS_S, "Time from arrival to the end of a request."),
    _h("pdserve_request_queue_time_seconds", LATENCY_BUCKETS_S, "Time waited before first being scheduled."),
    _h("pdserve_request_prefill_time_seconds", LATENCY_BUCKETS_S, "Time from first scheduling to the first token."),
    _h("pdserve_request_decode_time_seconds", REQUEST_BUCKETS_S, "Time from the first token to the end."),
    _h("pdserve_request_prompt_tokens", TOKEN_COUNT_BUCKETS, "Prompt length of finished requests, in tokens."),
    _h("pdserve_request_generation_tokens", TOKEN_COUNT_BUCKETS, "Output tokens of finished requests."),
    _c("pdserve_requests_finished_total", "Finished requests by finish reason, errors included.",
       _W + ("finish_reason",)),
    # Engine state, from EngineStats.
    _g("pdserve_num_requests_running", "Requests holding KV blocks and being computed (router: in flight)."),
    _g("pdserve_num_requests_waiting", "Requests queued for their first scheduling."),
    _g("pdserve_num_requests_held", "Prefilled requests whose KV blocks are kept for a transfer."),
    _g("pdserve_kv_cache_usage_perc", "Fraction of KV cache blocks in use (0 to 1)."),
    _c("pdserve_prompt_tokens_total", "Prompt tokens whose KV the engine computed (prefix-cache hits excluded)."),
    _c("pdserve_generation_tokens_total", "Tokens sampled by the engine."),
    _c("pdserve_prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache."),
    _c("pdserve_prefix_cache_hits_total", "Prompt tokens found in the prefix cache."),
    _c("pdserve_num_preemptions_total", "Sequences preempted (blocks taken back) by the scheduler."),
    _c("pdserve_engine_steps_total", "Engine steps (schedule, forward, sample) run."),
    # KV transfer between prefill and decode workers.
    _c("pdserve_kv_transfer_bytes_total", "KV cache bytes moved between workers."),
    _h("pdserve_kv_transfer_seconds", TRANSFER_BUCKETS_S, "Time to move one request's KV blocks."),
    _c("pdserve_kv_transfer_failures_total", "KV transfers that failed or timed out."),
    # Planner.
    _g("pdserve_pool_replicas", "Replicas of a pool, running and pending.", _POOL),
    _g("pdserve_planner_target_replicas", "Replicas the planner last asked a pool to run.", _POOL),
    _g("pdserve_planner_utilization", "A pool's utilisation as the planner sees it (1.0 = at target).", _POOL),
    _c("pdserve_planner_decisions_total", "Planner decisions, by pool and action.", _POOL + ("action",)),
    # The head's Redis (ledger, request log, status), through cluster.redis_guard.
    _g("pdserve_redis_up", "1 while the head reaches Redis, 0 during an outage.", ("role",)),
    _c("pdserve_redis_calls_dropped_total", "Redis writes the head skipped (or deferred, for the "
       "ledger) because Redis was down, by kind.", ("role", "kind")),
)
_SPECS = {m.name: m for m in METRICS}


class _Instruments:
    """The process's Ray metric objects, one per ``MetricSpec``, created on first use.

    Ray's OpenTelemetry export drops a gauge series that is not set again within two report
    intervals (20 s by default), so a daemon thread sets the last value of every gauge series
    again every ``GAUGE_REFRESH_S`` until ``forget`` drops it or the process ends.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._objects: dict[str, Any] = {}
        self._gauges: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self._refresher: threading.Thread | None = None

    def get(self, name: str) -> Any:
        obj = self._objects.get(name)
        if obj is None:
            with self._lock:
                obj = self._objects.get(name)
                if obj is None:
                    obj = self._objects[name] = _create(_SPECS[name])
        return obj

    def set_gauge(self, name: str, value: float, tags: dict[str, str]) -> None:
        with self._lock:
            self._gauges[(name, tuple(sorted(tags.items())))] = value
            if self._refresher is None:
                self._refresher = threading.Thread(target=self._refresh_forever, daemon=True,
                                                   name="pdserve-gauge-refresh")
                self._refresher.start()
        self.get(name).set(value, tags)

    def forget(self, tags: Mapping[str, str]) -> None:
        """Stop refreshing the gauge series that carry all of ``tags``; Ray drops them soon after."""
        wanted = set(tags.items())
        with self._lock:
            for key in [k for k in self._gauges if wanted <= set(k[1])]:
                del self._gauges[key]

    def _refresh_forever(self) -> None:
        while True:
            time.sleep(GAUGE_REFRESH_S)
            with self._lock:
                snapshot = list(self._gauges.items())
            try:
                for (name, tags), value in snapshot:
                    self.get(name).set(value, dict(tags))
            except Exception:  # keep refreshing the others; the error is logged, not hidden
                logger.exception("refreshing pdserve gauges failed")


def _create(spec: MetricSpec) -> Any:
    from ray.util import metrics as ray_metrics

    if spec.kind is MetricKind.HISTOGRAM:
        return ray_metrics.Histogram(spec.name, spec.description, list(spec.buckets), spec.tag_keys)
    cls = ray_metrics.Counter if spec.kind is MetricKind.COUNTER else ray_metrics.Gauge
    return cls(spec.name, spec.description, spec.tag_keys)


_INSTRUMENTS = _Instruments()


def _inc(name: str, value: float, tags: dict[str, str]) -> None:
    if value > 0:  # Ray refuses increments <= 0
        _INSTRUMENTS.get(name).inc(float(value), tags)


def _set(name: str, value: float, tags: dict[str, str]) -> None:
    _INSTRUMENTS.set_gauge(name, float(value), tags)


def _observe(name: str, value: float | None, tags: dict[str, str]) -> None:
    if value is not None and value >= 0:
        _INSTRUMENTS.get(name).observe(float(value), tags)


def _as_mapping(record: object) -> Mapping[str, Any]:
    """A stats dataclass (``RequestPhase``, ``EngineStats``) or a dict of its fields."""
    if is_dataclass(record) and not isinstance(record, type):
        return {f.name: getattr(record, f.name) for f in fields(record)}
    if isinstance(record, Mapping):
        return record
    raise TypeError(f"expected a stats dataclass or a mapping, got {type(record).__name__}")


def _label(value: object, what: str) -> str:
    text = str(getattr(value, "value", value))
    if not text:
        raise ValueError(f"{what} must be a non-empty string")
    return text


class CounterDeltas:
    """Turns cumulative counts (as ``EngineStats`` reports them) into increments.

    The first value seen for a key counts in full (the engine started with this process); a
    value below the previous one means the source restarted, and counts in full again.
    """

    def __init__(self) -> None:
        self._last: dict[str, float] = {}

    def delta(self, key: str, value: float) -> float:
        last = self._last.get(key)
        self._last[key] = value
        if last is None or value < last:
            return value
        return value - last


def _observe_request(tags: dict[str, str], phase: RequestPhase, itl_s: Iterable[float]) -> None:
    reason = phase.finish_reason or ""
    _inc("pdserve_requests_finished_total", 1,
         {**tags, "finish_reason": reason if reason in FINISH_REASONS else "other"})
    _observe("pdserve_e2e_request_latency_seconds", phase.total_s, tags)
    _observe("pdserve_request_queue_time_seconds", phase.queue_s, tags)
    _observe("pdserve_request_prompt_tokens", phase.prompt_tokens, tags)
    _observe("pdserve_request_generation_tokens", phase.output_tokens, tags)
    if phase.ttft_s is not None:
        _observe("pdserve_time_to_first_token_seconds", phase.ttft_s, tags)
        _observe("pdserve_request_prefill_time_seconds", phase.prefill_s, tags)
        if phase.output_tokens > 1:
            _observe("pdserve_request_decode_time_seconds", phase.decode_s, tags)
            _observe("pdserve_request_time_per_output_token_seconds",
                     phase.decode_s / (phase.output_tokens - 1), tags)
    for gap in itl_s:
        _observe("pdserve_inter_token_latency_seconds", gap, tags)


# EngineStats field -> counter, for the cumulative counts ``update_engine`` turns into increments.
# The last three are read when the stats carry them (see docs/metrics.md).
_ENGINE_COUNTERS = {
    "prompt_tokens_computed": "pdserve_prompt_tokens_total",
    "generated_tokens": "pdserve_generation_tokens_total",
    "steps": "pdserve_engine_steps_total",
    "prefix_query_tokens": "pdserve_prefix_cache_queries_total",
    "prefix_hit_tokens": "pdserve_prefix_cache_hits_total",
    "num_preemptions": "pdserve_num_preemptions_total",
}
_ENGINE_GAUGES = {
    "num_running": "pdserve_num_requests_running",
    "num_waiting": "pdserve_num_requests_waiting",
    "num_held": "pdserve_num_requests_held",
    "kv_usage": "pdserve_kv_cache_usage_perc",
}


class EngineMetrics:
    """Metrics of one engine (a prefill, decode or colocated worker), labelled with its identity."""

    def __init__(self, role: object, worker_id: str, model: str) -> None:
        role_text = _label(role, "role")
        if role_text not in ENGINE_ROLES:
            raise ValueError(f"role must be one of {ENGINE_ROLES}, got {role_text!r}")
        self.tags = {"role": role_text, "worker_id": _label(worker_id, "worker_id"),
                     "model": _label(model, "model")}
        self._deltas = CounterDeltas()
        self._lock = threading.Lock()

    def observe_finished(self, phase: RequestPhase, itl_s: Iterable[float] = ()) -> None:
        """Record one finished request from its phase record (and its inter-token gaps, if known)."""
        _observe_request(self.tags, phase, itl_s)

    def observe_itl(self, itl_s: Iterable[float]) -> None:
        """Record inter-token gaps measured while decoding (seconds)."""
        for gap in itl_s:
            _observe("pdserve_inter_token_latency_seconds", gap, self.tags)

    def update_engine(self, stats: EngineStats | Mapping[str, Any]) -> None:
        """Set the gauges and add what the cumulative counters gained since the last call."""
        data = _as_mapping(stats)
        for field_name, metric in _ENGINE_GAUGES.items():
            if data.get(field_name) is not None:
                _set(metric, data[field_name], self.tags)
        with self._lock:
            increments = {metric: self._deltas.delta(field_name, float(data[field_name]))
                          for field_name, metric in _ENGINE_COUNTERS.items()
                          if data.get(field_name) is not None}
        for metric, value in increments.items():
            _inc(metric, value, self.tags)

    def observe_transfer(self, num_bytes: int, seconds: float) -> None:
        """Record one completed KV transfer of ``num_bytes`` that took ``seconds``."""
        if num_bytes < 0 or seconds < 0:
            raise ValueError(f"a transfer cannot be negative: {num_bytes} bytes, {seconds} s")
        _inc("pdserve_kv_transfer_bytes_total", num_bytes, self.tags)
        _observe("pdserve_kv_transfer_seconds", seconds, self.tags)

    def observe_transfer_failure(self) -> None:
        _inc("pdserve_kv_transfer_failures_total", 1, self.tags)

    def close(self) -> None:
        """Stop publishing this engine's gauges (the worker is leaving but the process stays)."""
        _INSTRUMENTS.forget(self.tags)


class RayRouterMetrics:
    """Request metrics as the client sees them, labelled ``role="router"``."""

    def __init__(self, model: str, router_id: str = "router") -> None:
        self.tags = {"role": "router", "worker_id": _label(router_id, "router_id"),
                     "model": _label(model, "model")}

    def request_ended(self, record: RequestRecord) -> None:
        """A ``RequestObserver`` (``router/request_observer.py``): record one request that a worker
        ran (its phase is known), with the gaps between the chunks its client was sent; one that
        ended before any worker ran it only counts in ``requests_finished_total``, as ``rejected``
        (a 429), ``abort`` (its client left) or ``error`` (refused input, a timeout, ...)."""
        if record.phase is not None:
            _observe_request(self.tags, record.phase, record.itl_s)
            return
        reason = ("rejected" if record.outcome == "rate_limit_error" else "abort" if record.outcome == "cancelled"
                  else "error")
        _inc("pdserve_requests_finished_total", 1, {**self.tags, "finish_reason": reason})

    def set_in_flight(self, running: int, waiting: int = 0) -> None:
        """Requests the router is serving, and those it queued (admission) before sending."""
        _set("pdserve_num_requests_running", running, self.tags)
        _set("pdserve_num_requests_waiting", waiting, self.tags)

    def close(self) -> None:
        _INSTRUMENTS.forget(self.tags)


class RedisMetrics:
    """The head's view of Redis, labelled ``role="router"``: up or not, and calls it dropped."""

    def __init__(self) -> None:
        self.tags = {"role": "router"}

    def set_up(self, up: bool) -> None:
        _set("pdserve_redis_up", 1.0 if up else 0.0, self.tags)

    def dropped(self, kind: str) -> None:
        _inc("pdserve_redis_calls_dropped_total", 1, {**self.tags, "kind": _label(kind, "kind")})

    def close(self) -> None:
        _INSTRUMENTS.forget(self.tags)


class PlannerMetrics:
    """The planner's decisions and each pool's replicas, labelled ``role="planner"``."""

    def observe(self, decisions: Iterable[PlannerDecision],
                replicas: Mapping[object, int] | None = None) -> None:
        """Count one tick's decisions; ``replicas`` (pool -> count) defaults to each decision's."""
        known = {_label(pool, "pool"): n for pool, n in (replicas or {}).items()}
        for d in decisions:
            tags = {"role": "planner", "pool": _label(d.role, "pool")}
            _inc("pdserve_planner_decisions_total", 1, {**tags, "action": _label(d.action, "action")})
            _set("pdserve_planner_target_replicas", d.target_replicas, tags)
            if d.utilization is not None:
                _set("pdserve_planner_utilization", d.utilization, tags)
            known.setdefault(tags["pool"], d.current_replicas)
        for pool, n in known.items():
            _set("pdserve_pool_replicas", n, {"role": "planner", "pool": pool})

    def close(self) -> None:
        _INSTRUMENTS.forget({"role": "planner"})

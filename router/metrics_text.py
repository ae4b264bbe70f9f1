"""The router's counters, served as Prometheus text on ``/metrics``.

Labels stay low-cardinality: ``model`` (the served name) on every sample, ``api`` (http | grpc |
batch) and ``outcome`` (a finish reason or an error type). Every family has HELP and TYPE. ``Serving`` hands it every request's ``RequestRecord`` (it is the first
``RequestObserver``); ``render`` writes the exposition format.

Written by hand, not with ``prometheus_client``, on purpose: ``request_ended`` runs on the
router's event loop for every request, and the same families on ``prometheus_client`` took
2.6-7x its time per request (22 vs 57 us with 63 ITL gaps; 14-41 vs 97-163 us in loaded runs)
and 12-23x per scrape (27 vs 634 us); its exposition also orders labels alphabetically
(``api``, ``model``, ``outcome``) and writes counts as floats, where tests and dashboards read
``model`` first. (2026-12, 2-core host; the same families, buckets and labels on both.)
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import Counter, deque
from collections.abc import Callable

from pdserve.engine.contract import RequestRecord

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_RATE_WINDOW_S = 60.0  # batch_output_tokens_per_second averages the items that ended in this window
_ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0)


class _Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str, labels: str) -> list[str]:
        out, running = [], 0
        for bound, n in zip(self.buckets, self.counts):
            running += n
            out.append(f'{name}_bucket{{{labels},le="{bound:g}"}} {running}')
        out.append(f'{name}_bucket{{{labels},le="+Inf"}} {self.count}')
        out.append(f"{name}_sum{{{labels}}} {self.sum:.6f}")
        out.append(f"{name}_count{{{labels}}} {self.count}")
        return out


# Families named as in the Ray export (``ray_pdserve_<name>``, docs/metrics.md) where they count
# the same thing there, seen from the router.
_TOKEN_FAMILIES = {
    "prompt": ("prompt_tokens_total", "Prompt tokens of completed requests (prefix-cache hits included)."),
    "cached_prompt": ("prefix_cache_hits_total",
                      "Prompt tokens of completed requests whose KV came from the prefix cache."),
    "completion": ("generation_tokens_total", "Output tokens of completed requests."),
    "batch_completion": ("batch_completion_tokens_total",
                         "Output tokens of completed Batch API items (spare-capacity work)."),
}


def _label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class RouterMetrics:
    def __init__(self, model: str = "") -> None:
        self.model = model   # the served model's name: the ``model`` label of every sample
        self._lock = threading.Lock()
        self._requests: Counter[tuple[str, str]] = Counter()
        self._tokens: Counter[str] = Counter()
        self._ttft = _Histogram(_LATENCY_BUCKETS_S)
        self._e2e = _Histogram(_LATENCY_BUCKETS_S)
        self._itl = _Histogram(_ITL_BUCKETS_S)
        self._gauges: dict[str, tuple[Callable[[], float], str, str]] = {}
        self._batch_ended: deque[tuple[float, int]] = deque()  # (monotonic end, output tokens) of batch items

    def add_gauge(self, name: str, read: Callable[[], float], help_text: str, kind: str = "gauge") -> None:
        """A value read at scrape time (e.g. requests in flight); ``kind`` "counter" for a total
        kept elsewhere (e.g. admission's rejections)."""
        if kind not in ("gauge", "counter"):
            raise ValueError(f"kind must be 'gauge' or 'counter', got {kind!r}")
        self._gauges[name] = (read, help_text, kind)

    def request_ended(self, record: RequestRecord) -> None:
        """Count the request by API and outcome; a request that completed (its phase is known and it
        ended without error) adds its tokens, TTFT, duration and inter-chunk gaps."""
        phase = record.phase
        with self._lock:
            self._requests[(record.api, record.outcome)] += 1
            if phase is None or record.error is not None or record.outcome == "cancelled":
                return
            for gap in record.itl_s:
                self._itl.observe(gap)
            self._tokens["prompt"] += phase.prompt_tokens
            self._tokens["cached_prompt"] += phase.cached_prompt_tokens
            self._tokens["completion"] += phase.output_tokens
            if record.api == "batch":
                self._tokens["batch_completion"] += phase.output_tokens
                now = time.monotonic()
                self._batch_ended.append((now, phase.output_tokens))
                while self._batch_ended[0][0] < now - BATCH_RATE_WINDOW_S:
                    self._batch_ended.popleft()
            if phase.ttft_s is not None:
                self._ttft.observe(phase.ttft_s)
            self._e2e.observe(phase.total_s)

    def render(self) -> str:
        p = "pdserve_router_"
        m = f'model="{_label_value(self.model)}"'
        lines = [f"# HELP {p}requests_finished_total Requests ended, by API and outcome (a finish reason, "
                 f"or what ended it: an error type, cancelled, rejected).",
                 f"# TYPE {p}requests_finished_total counter"]
        with self._lock:
            for (api, outcome), n in sorted(self._requests.items()):
                lines.append(f'{p}requests_finished_total{{{m},api="{api}",outcome="{outcome}"}} {n}')
            for kind, (family, help_text) in _TOKEN_FAMILIES.items():
                name = f"{p}{family}"
                lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter", f"{name}{{{m}}} {self._tokens[kind]}"]
            horizon = time.monotonic() - BATCH_RATE_WINDOW_S
            while self._batch_ended and self._batch_ended[0][0] < horizon:
                self._batch_ended.popleft()
            rate = sum(n for _, n in self._batch_ended) / BATCH_RATE_WINDOW_S
            name = f"{p}batch_output_tokens_per_second"
            lines += [f"# HELP {name} Output tokens of Batch API items that ended in the last "
                      f"{BATCH_RATE_WINDOW_S:g} s, per second: the batch's throughput on spare capacity.",
                      f"# TYPE {name} gauge", f"{name}{{{m}}} {rate:g}"]
            for name, hist, what in ((f"{p}time_to_first_token_seconds", self._ttft, "Time to first token."),
                                     (f"{p}e2e_request_latency_seconds", self._e2e, "End-to-end request time."),
                                     (f"{p}inter_token_latency_seconds", self._itl,
                                      "Gap between consecutive token chunks of one stream, as the router sends them.")):
                lines += [f"# HELP {name} {what}", f"# TYPE {name} histogram"] + hist.lines(name, m)
        for name, (read, help_text, kind) in sorted(self._gauges.items()):
            lines += [f"# HELP {p}{name} {help_text}", f"# TYPE {p}{name} {kind}", f"{p}{name}{{{m}}} {read():g}"]
        return "\n".join(lines) + "\n"

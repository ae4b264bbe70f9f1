"""The live traffic the planner's capacity model is fed: a ``RequestObserver`` that keeps the
requests that ended in the last ``window_s`` seconds and summarises them (rate, mean prompt and
output lengths, prefix-cache share), and the model that turns that summary and a profile into a
replica count per pool (``capacity/plan.py``'s arithmetic), with the steps that led to it."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pdserve.capacity.plan import colocated_estimate, estimate
from pdserve.capacity.profile import Profile
from pdserve.capacity.traffic import Traffic
from pdserve.engine.contract import RequestRecord

logger = logging.getLogger(__name__)

MIN_REQUESTS = 5


@dataclass(frozen=True, slots=True)
class ObservedTraffic:
    rate: float                 # requests/s that ended in the window
    prompt_mean: float
    output_mean: float
    prefix_share: float
    requests: int
    window_s: float


class TrafficWindow:
    """Interactive requests that ran (a phase record with prompt tokens), ended in the last ``window_s``."""

    def __init__(self, window_s: float = 120.0, clock: Callable[[], float] = time.monotonic) -> None:
        if window_s <= 0:
            raise ValueError("window_s must be > 0")
        self.window_s = window_s
        self.clock = clock
        self.started = clock()
        self._ended: deque[tuple[float, int, int, int]] = deque()

    def request_ended(self, record: RequestRecord) -> None:
        ph = record.phase
        if ph is None or ph.prompt_tokens <= 0 or record.priority == "batch":
            return
        self.add(ph.prompt_tokens, ph.cached_prompt_tokens, ph.output_tokens)

    def add(self, prompt_tokens: int, cached_tokens: int, output_tokens: int) -> None:
        """One interactive request ended now (the simulator feeds its requests here directly)."""
        self._ended.append((self.clock(), prompt_tokens, cached_tokens, output_tokens))

    def observed(self) -> ObservedTraffic | None:
        """The window's summary; None with fewer than ``MIN_REQUESTS`` requests in it."""
        now = self.clock()
        while self._ended and self._ended[0][0] < now - self.window_s:
            self._ended.popleft()
        n = len(self._ended)
        if n < MIN_REQUESTS:
            return None
        span = min(self.window_s, max(1e-3, now - self.started))
        prompt = sum(e[1] for e in self._ended)
        cached = sum(e[2] for e in self._ended)
        output = sum(e[3] for e in self._ended)
        return ObservedTraffic(rate=n / span, prompt_mean=prompt / n, output_mean=max(1.0, output / n),
                               prefix_share=min(0.99, cached / prompt) if prompt else 0.0, requests=n, window_s=span)


@dataclass(frozen=True, slots=True)
class ModelTargets:
    """Replicas per pool the capacity model asks for, and the arithmetic behind them."""

    prefill: int
    decode: int
    explanation: str


class CapacityModel:
    """A profile plus the cluster's SLOs: ``targets(observed)`` sizes the pools for that traffic."""

    def __init__(self, profile: Profile, ttft_s: float, itl_s: float, colocated: bool) -> None:
        self.profile, self.ttft_s, self.itl_s, self.colocated = profile, ttft_s, itl_s, colocated

    @classmethod
    def load(cls, path: str | Path, ttft_s: float, itl_s: float, colocated: bool) -> CapacityModel:
        return cls(Profile.load(path), ttft_s, itl_s, colocated)

    def targets(self, seen: ObservedTraffic) -> ModelTargets:
        traffic = Traffic.parse({
            "rate": max(seen.rate, 1e-6), "prompt_len": {"mean": max(1.0, seen.prompt_mean)},
            "output_len": {"mean": seen.output_mean}, "prefix_share": seen.prefix_share,
            "slo": {"ttft_s": self.ttft_s, "itl_s": self.itl_s}}, "observed traffic")
        head = (f"{seen.rate:.2f} requests/s over {seen.window_s:.0f} s, {seen.prompt_mean:.0f} prompt tokens "
                f"({seen.prefix_share:.0%} cached), {seen.output_mean:.0f} out")
        if self.colocated:
            col = colocated_estimate(self.profile, traffic)
            return ModelTargets(0, col["workers"], f"{head}: {col['line']}")
        est = estimate(self.profile, traffic)
        return ModelTargets(est["prefill"], est["decode"],
                            f"{head}: decode batch {est['decode_batch']} ({est['decode_batch_limit']}) "
                            f"{est['decode_tokens_per_s_per_worker']:.0f} tokens/s per worker = "
                            f"{est['completions_per_s_per_worker']:.2f} completions/s -> {est['decode']} decode; "
                            f"{seen.rate * seen.prompt_mean * (1 - seen.prefix_share):.0f} prompt tokens/s over "
                            f"{est['prefill_tokens_per_s_per_worker']:.0f} per prefill worker -> {est['prefill']} prefill")

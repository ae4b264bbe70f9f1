"""The traffic a plan or a simulation is for, as an operator writes it (YAML or JSON).

    rate: 2000                  # requests/s (Poisson arrivals); or a daily curve:
    # daily: [[0, 300], [9, 2000], [18, 1200], [23, 300]]   # (hour, requests/s), linear between
    prompt_len: {mean: 512, dist: lognormal, sigma: 0.6, max: 4096}
    output_len: {mean: 250, dist: exponential, max: 2048}
    prefix_share: 0.3           # fraction of prompt tokens found in the prefix cache
    slo: {ttft_s: 1.0, itl_s: 0.05, percentile: 99}
    requests: 100000            # how many a simulation draws (default: 60 s of the peak rate)

Lengths: ``dist`` is ``fixed`` (every request ``mean``), ``uniform`` (``min``..``max``),
``exponential`` or ``lognormal`` (``sigma`` of the log), each clipped to ``[min, max]``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class TrafficError(ValueError):
    """A traffic file that cannot be used; the message names the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Length(_Strict):
    mean: float = Field(gt=0, description="Mean length in tokens.")
    dist: Literal["fixed", "uniform", "exponential", "lognormal"] = "fixed"
    min: int = Field(1, ge=1)
    max: int = Field(1 << 20, ge=1)
    sigma: float = Field(0.5, gt=0, le=4, description="lognormal: standard deviation of log(length).")

    @model_validator(mode="after")
    def _range(self) -> Length:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) must be <= max ({self.max})")
        if not self.min <= self.mean <= self.max:
            raise ValueError(f"mean ({self.mean}) must lie within [min, max] = [{self.min}, {self.max}]")
        return self

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.dist == "fixed":
            x = np.full(n, self.mean)
        elif self.dist == "uniform":
            x = rng.uniform(self.min, self.max + 1, n)
        elif self.dist == "exponential":
            x = rng.exponential(self.mean, n)
        else:  # lognormal with this mean
            mu = np.log(self.mean) - self.sigma ** 2 / 2
            x = rng.lognormal(mu, self.sigma, n)
        return np.clip(np.round(x), self.min, self.max).astype(np.int64)


class SLO(_Strict):
    ttft_s: float = Field(2.0, gt=0, description="Time to first token the percentile must meet.")
    itl_s: float = Field(0.1, gt=0, description="Inter-token latency the percentile must meet.")
    percentile: float = Field(99.0, gt=0, lt=100)


class Traffic(_Strict):
    rate: float | None = Field(None, gt=0, description="Requests per second (Poisson arrivals).")
    daily: list[tuple[float, float]] | None = Field(
        None, description="(hour 0-24, requests/s) points of a daily curve, linear between them.")
    prompt_len: Length
    output_len: Length
    prefix_share: float = Field(0.0, ge=0, lt=1, description="Fraction of prompt tokens served from the "
                                "prefix cache (not prefilled again).")
    slo: SLO = Field(default_factory=SLO)
    requests: int | None = Field(None, ge=1, le=50_000_000, description="Requests a simulation draws.")
    seed: int = 0

    @model_validator(mode="after")
    def _one_rate(self) -> Traffic:
        if (self.rate is None) == (self.daily is None):
            raise ValueError("give exactly one of rate (requests/s) or daily ([hour, requests/s] points)")
        if self.daily is not None:
            hours = [h for h, _ in self.daily]
            if len(self.daily) < 2 or hours != sorted(hours) or hours[0] < 0 or hours[-1] > 24:
                raise ValueError("daily: at least two [hour, rate] points, hours increasing within 0-24")
            if any(r < 0 for _, r in self.daily) or max(r for _, r in self.daily) <= 0:
                raise ValueError("daily: rates must be >= 0 and one of them > 0")
        return self

    @property
    def peak_rate(self) -> float:
        return self.rate if self.rate is not None else max(r for _, r in self.daily)

    def at_rate(self, rate: float) -> Traffic:
        return self.model_copy(update={"rate": rate, "daily": None})

    def num_requests(self) -> int:
        return self.requests or max(1, int(60 * self.peak_rate))

    def draw(self, n: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(arrival times s, prompt lengths, cached prompt tokens, output lengths) of ``n`` requests."""
        n = n or self.num_requests()
        rng = np.random.default_rng(self.seed)
        if self.rate is not None:
            arrivals = np.cumsum(rng.exponential(1.0 / self.rate, n))
        else:
            arrivals = self._daily_arrivals(rng, n)
        prompt = self.prompt_len.draw(rng, n)
        output = self.output_len.draw(rng, n)
        # the cached part is whole blocks in pdserve; a fraction of each prompt here, at least
        # one token always computed
        cached = np.minimum(np.floor(prompt * self.prefix_share), prompt - 1).astype(np.int64)
        return arrivals, prompt, cached, output

    def _daily_arrivals(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """A non-homogeneous Poisson process over the daily curve (thinning), from hour 0,
        wrapping to the next day until ``n`` arrivals."""
        hours = np.array([h for h, _ in self.daily]) * 3600.0
        rates = np.array([r for _, r in self.daily])
        peak = rates.max()
        out: list[np.ndarray] = []
        got, t0 = 0, 0.0
        while got < n:
            batch = max(1024, int((n - got) * 1.5))
            t = t0 + np.cumsum(rng.exponential(1.0 / peak, batch))
            keep = rng.uniform(0, peak, batch) < np.interp(t % 86400.0, hours, rates)
            out.append(t[keep])
            got += int(keep.sum())
            t0 = float(t[-1])
        return np.concatenate(out)[:n]

    @classmethod
    def load(cls, path: str | Path) -> Traffic:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise TrafficError(f"cannot read traffic file {path}: {exc.strerror or exc}") from exc
        try:
            if str(path).endswith((".yaml", ".yml")):
                import yaml

                data = yaml.safe_load(text)
            else:
                data = json.loads(text)
        except Exception as exc:  # noqa: BLE001 - any parse error is the user's file
            raise TrafficError(f"traffic file {path} does not parse: {exc}") from exc
        return cls.parse(data, str(path))

    @classmethod
    def parse(cls, data: object, source: str = "traffic") -> Traffic:
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '(top)'}: {e['msg']}"
                                 for e in exc.errors())
            raise TrafficError(f"{source}: {problems}") from None

"""The measured cost model of one model on one kind of host: what ``pdserve profile`` writes and
what ``plan``, ``simulate`` and the planner read.

A profile is versioned JSON (``PROFILE_VERSION``). It holds raw measurements, not fitted
constants, and derives the costs from them the same way every time:

* ``prefill_s(n, ctx)``: one engine step that processes ``n`` prompt tokens (one prompt or
  several) after ``ctx`` tokens already in the cache: the measured step times against ``n``
  interpolated piecewise-linearly (extrapolated linearly beyond the last point), plus
  ``attn_s_per_token_ctx * n * ctx`` for attending over cached context; a step packing several
  prompts costs the attention pairs between them less (each attends only within itself).
* ``decode_s(b, ctx_total)``: one decode step of ``b`` sequences whose contexts sum to
  ``ctx_total`` tokens: the step time at the short measured context, interpolated over the
  batch sizes, plus ``decode_s_per_ctx_token * (ctx_total - b * short_ctx)``. Where the engine runs
  its matmuls at row buckets (``decode_row_buckets``, ``engine/row_buckets.py``), a batch is priced
  at its bucket's row count: the engine's cost rises in stairs there, not along a line.
* ``mixed_s(b, ctx_total, n)``: a colocated step that decodes ``b`` sequences and prefills ``n``
  prompt tokens: the decode step plus the prefill step's cost beyond one sampled token.
* ``transfer_s(nbytes)``: a KV handoff: a per-transfer overhead plus bytes over bandwidth.

Engines are profiled per thread count (a disaggregated worker on a 2-core host computes on 1
thread, the colocated worker on 2); ``roles`` says which thread count each role uses.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pdserve.engine.row_buckets import row_bucket

PROFILE_VERSION = 1
ROLES = ("prefill", "decode", "colocated")


class ProfileError(ValueError):
    """A profile file that cannot be used (wrong version, missing role, bad numbers)."""


def _interp(xs: list[float], ys: list[float], x: float) -> float:
    """Piecewise-linear through the points, extended linearly past both ends."""
    if len(xs) == 1:
        return ys[0] * x / xs[0] if xs[0] else ys[0]
    i = bisect.bisect_left(xs, x)
    i = min(max(i, 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _check_points(name: str, xs: list[float], ys: list[float]) -> None:
    if not xs or len(xs) != len(ys):
        raise ProfileError(f"{name}: needs as many measured points as sizes, and at least one")
    if any(b <= a for a, b in zip(xs, xs[1:])):
        raise ProfileError(f"{name}: sizes must increase, got {xs}")
    if any(y <= 0 for y in ys):
        raise ProfileError(f"{name}: every measured time must be > 0")


@dataclass(slots=True)
class EngineProfile:
    """One engine's step costs at one thread count (all times in seconds)."""

    threads: int
    prefill_tokens: list[int]
    prefill_s: list[float]
    decode_batch: list[int]
    decode_s: list[float]                 # at decode_ctx tokens of context per sequence
    decode_ctx: int
    decode_s_per_ctx_token: float = 0.0   # per token of context summed over the batch
    attn_s_per_token_ctx: float = 0.0     # prefill: per new token per cached-context token
    # the engine pads a decode step's rows up to their row bucket, and the profile measured the
    # buckets: price a batch at its bucket (False: profiles before 2026-12-06, or unbucketed engines)
    decode_row_buckets: bool = False

    def __post_init__(self) -> None:
        if self.threads < 1:
            raise ProfileError(f"threads must be >= 1, got {self.threads}")
        _check_points("prefill", self.prefill_tokens, self.prefill_s)
        _check_points("decode", self.decode_batch, self.decode_s)
        if self.decode_s_per_ctx_token < 0 or self.attn_s_per_token_ctx < 0:
            raise ProfileError("context costs must be >= 0")

    def prefill_step_s(self, n: int, ctx: int = 0, parts: Sequence[int] = ()) -> float:
        """``parts``: the lengths of the prompts (or chunks) whose ``n`` tokens one step packs;
        empty: one prompt. The profile timed one prompt of ``n`` tokens, whose tokens attend each
        other (``n * n / 2`` pairs); packed prompts attend only within each (the engine runs one
        attention call per chunk), so their step costs the pairs they do not form less."""
        base = _interp(self.prefill_tokens, self.prefill_s, n)
        if len(parts) > 1:
            base -= self.attn_s_per_token_ctx * (n * n - sum(k * k for k in parts)) / 2
        return max(1e-6, base) + self.attn_s_per_token_ctx * n * ctx

    def decode_step_s(self, b: int, ctx_total: float) -> float:
        rows = row_bucket(math.ceil(b)) if self.decode_row_buckets and b >= 1 else b
        base = _interp(self.decode_batch, self.decode_s, rows)
        return max(1e-6, base + self.decode_s_per_ctx_token * max(0.0, ctx_total - b * self.decode_ctx))

    def mixed_step_s(self, b: int, ctx_total: float, n: int, parts: Sequence[int] = ()) -> float:
        if b == 0:
            return self.prefill_step_s(n, parts=parts)
        if n == 0:
            return self.decode_step_s(b, ctx_total)
        extra = self.prefill_step_s(n, parts=parts) - self.decode_step_s(1, self.decode_ctx)
        return self.decode_step_s(b, ctx_total) + max(0.0, extra)

    def decode_tokens_per_s(self, b: int, ctx_per_seq: float) -> float:
        return b / self.decode_step_s(b, b * ctx_per_seq)

    def prefill_tokens_per_s(self, n: int) -> float:
        return n / self.prefill_step_s(n)


@dataclass(slots=True)
class TransferProfile:
    """A KV handoff between a prefill and a decode worker: ``overhead_s + nbytes / bytes_per_s``."""

    overhead_s: float
    bytes_per_s: float
    measured: list[dict] = field(default_factory=list)   # {"bytes", "seconds"} behind the fit
    how: str = ""

    def __post_init__(self) -> None:
        if self.overhead_s < 0 or self.bytes_per_s <= 0:
            raise ProfileError("transfer: overhead_s must be >= 0 and bytes_per_s > 0")

    def transfer_s(self, nbytes: float) -> float:
        return self.overhead_s + nbytes / self.bytes_per_s


@dataclass(slots=True)
class ServingProfile:
    """What a served request costs beyond the engine's steps (HTTP, the router, Ray calls, the
    KV handoff's control messages, streaming), measured on lone requests through a real
    ``pdserve up`` of one mode: added to every first token, and to every later token's gap."""

    ttft_overhead_s: float = 0.0
    itl_overhead_s: float = 0.0
    # the same for a request that arrives while other streams decode (the cores busy, the decode
    # side's step boundary to wait for); None: not measured, the lone figure stands for it
    ttft_overhead_busy_s: float | None = None
    # disaggregated: the busy figure for a prompt that waited at its prefill worker (it arrived
    # while that one computed; a decode worker's local prefills keep the other figure), whose first
    # token leaves while the next prompt's prefill holds the cores; ttft_overhead_busy_s is then the
    # figure for one that did not wait. None: not measured apart, ttft_overhead_busy_s stands for
    # both (beyond their whole prefill steps the two kinds read 4-20 ms apart at 45 streams, 2026-12-05)
    ttft_overhead_queued_s: float | None = None
    # an engine step as served under load (8 streams) over the same step measured alone: the
    # serving stack's own CPU on the workers' cores; the simulator multiplies that mode's steps
    step_x: float = 1.0
    # the same for prefill steps: the served prefill (the engines' own phase records of lone
    # requests) over the profiled one; None: step_x stands for it
    prefill_x: float | None = None
    # colocated: a step that takes prompts beside decoding streams costs its decodes (step_x),
    # less one sequence's decode, plus mixed_prefill_x times the profiled prefill of its prompt
    # tokens, plus mixed_extra_s. Measured with prompts of two lengths beside streams, so both the
    # factor and the fixed part are read; mixed_prefill_x None: prefill_x stands for the factor
    # (mixed_extra_s is then measured at one length). mixed_extra_s None: 0; it may be < 0
    mixed_prefill_x: float | None = None
    mixed_extra_s: float | None = None
    # disaggregated: the KV handoff beside decoding streams as served (the phase records' exposed
    # transfer: from the first token until the prefill worker sent its last block) beyond the
    # profiled raw transfer of those bytes; None: not measured (0)
    handoff_extra_s: float | None = None
    # disaggregated on one host, as served: a decode step while the prefill worker computes over
    # one while it does not, and a prefill beside decoding streams over a lone one (the phase
    # records); None: the profile's offline ``corun`` figures stand
    corun_decode_x: float | None = None
    corun_prefill_x: float | None = None
    # the served token gaps of streams at a steady batch over their median, as equal-weight
    # quantiles: the host's and the serving path's jitter, which the simulator's steps lack and
    # which decides an ITL p99; None: not measured (gaps as simulated)
    itl_jitter: list[float] | None = None
    # disaggregated: the busy first-token overhead (ttft_overhead_busy_s, or ttft_overhead_queued_s
    # for those that waited) of staggered streams, each over its kind's median, as equal-weight
    # quantiles: the KV handoff's and the router's and Ray's hops vary by request, which decides a
    # TTFT p99 beside the queue; None: not measured (a constant)
    ttft_jitter: list[float] | None = None
    # what a request's arrival adds to the step its first worker (colocated or prefill) is running:
    # the HTTP request, its tokenization, the stream it opens and the one that ends, on the same
    # cores. The simulator lengthens that step by it; None: 0. `measure_served` reads it for
    # colocated only (disaggregated, the one-host factors hold the arrivals' share)
    arrival_s: float | None = None
    # the reading of arrival_s this measurement made itself (None: too few sends read), where
    # arrival_s may be the median of it and the server's earlier readings (``bench simulate``)
    arrival_read_s: float | None = None
    start_s: float = 0.0          # `pdserve up` until the pools answered
    how: str = ""

    def __post_init__(self) -> None:
        if self.ttft_overhead_queued_s is not None and not self.ttft_overhead_queued_s >= 0:
            raise ProfileError(f"serving: ttft_overhead_queued_s must be >= 0 seconds, "
                               f"got {self.ttft_overhead_queued_s}")
        if self.ttft_jitter is not None and not (self.ttft_jitter and all(x > 0 for x in self.ttft_jitter)):
            raise ProfileError(f"serving: ttft_jitter must be a non-empty list of ratios > 0, got {self.ttft_jitter}")
        if self.arrival_s is not None and not self.arrival_s >= 0:
            raise ProfileError(f"serving: arrival_s (what an arrival adds to a step) must be >= 0 seconds, "
                               f"got {self.arrival_s}")


@dataclass(slots=True)
class Profile:
    host: dict
    model: dict                      # name, dtype, kv_bytes_per_token, num_layers, ...
    engine: dict                     # block_size, max_num_seqs, max_num_batched_tokens, num_kv_blocks
    engines: dict[str, EngineProfile]  # by thread count, as a string key
    roles: dict[str, int]            # role -> threads
    transfer: TransferProfile
    worker_start_s: float = 0.0
    serving: dict[str, ServingProfile] = field(default_factory=dict)   # "colocated" | "disaggregated"
    created: str = ""
    profile_wall_s: float = 0.0
    # a prefill and a decode worker sharing one host: {"prefill_x": how much longer a prefill step
    # takes while the other engine decodes, "decode_x": a decode step while the other prefills, ...}
    corun: dict = field(default_factory=dict)
    # seconds of a fixed CPU workload (matmuls and a copy, one thread) when the profile was taken:
    # on a shared host, ``scaled(probe_now / speed_probe_s)`` carries the profile to the speed it
    # runs at now
    speed_probe_s: float = 0.0
    version: int = PROFILE_VERSION

    def __post_init__(self) -> None:
        if self.version != PROFILE_VERSION:
            raise ProfileError(f"profile version {self.version}; this pdserve reads version {PROFILE_VERSION} "
                               "(run `pdserve profile` again)")
        for role in ROLES:
            if role not in self.roles:
                raise ProfileError(f"roles: no thread count for {role!r}")
            if str(self.roles[role]) not in self.engines:
                raise ProfileError(f"roles: {role} runs on {self.roles[role]} threads, which were not profiled")
        for key in ("kv_bytes_per_token",):
            if not self.model.get(key, 0) > 0:
                raise ProfileError(f"model.{key} must be > 0")
        for key in ("block_size", "max_num_seqs", "max_num_batched_tokens", "num_kv_blocks"):
            if not int(self.engine.get(key, 0)) > 0:
                raise ProfileError(f"engine.{key} must be > 0")

    def with_link(self, *, gbps: float | None = None, link_json: str | Path | None = None,
                  rate: str | None = None) -> Profile:
        """This profile with the KV handoff over a network link: measured by ``pdserve bench transfer
        --link`` (its JSON and one of its rates: the worker path's median push rate there), or an
        assumed ``gbps`` (Gbit/s of payload). The per-transfer overhead stays the profiled one."""
        if (gbps is None) == (link_json is None):
            raise ProfileError("give either a link speed in Gbit/s or a `bench transfer --link` JSON")
        if link_json is not None:
            try:
                links = json.loads(Path(link_json).read_text())["links"]
            except (OSError, KeyError, TypeError, json.JSONDecodeError) as exc:
                raise ProfileError(f"{link_json}: not a `pdserve bench transfer --link` result ({exc})") from None
            if rate is None:
                if len(links) != 1:
                    raise ProfileError(f"{link_json} measured several links ({', '.join(links)}): name one")
                rate = next(iter(links))
            fig = links.get(rate)
            if not fig or not fig.get("transfer_gbps"):
                raise ProfileError(f"{link_json}: no transfer figure for link {rate!r} (have {', '.join(links)})")
            gbps, how = float(fig["transfer_gbps"]), (f"the worker path across emulated hosts at {rate} "
                                                      f"({link_json}): {fig['transfer_gbps']:.2f} Gbit/s")
        else:
            if gbps <= 0:
                raise ProfileError(f"link speed must be > 0 Gbit/s, got {gbps}")
            how = f"an assumed {gbps:g} Gbit/s link (not measured)"
        out = Profile.from_dict(self.to_dict())
        out.transfer = TransferProfile(self.transfer.overhead_s, gbps * 1e9 / 8, how=how)
        return out

    def scaled(self, factor: float, prefill_factor: float | None = None) -> Profile:
        """This profile with every decode step ``factor`` times as long and every prefill step
        ``prefill_factor`` times (``factor`` when None); served overheads and the handoff unchanged."""
        pf = factor if prefill_factor is None else prefill_factor
        if factor <= 0 or pf <= 0:
            raise ProfileError(f"scale factors must be > 0, got {factor} and {pf}")
        d = self.to_dict()
        for e in d["engines"].values():
            e["prefill_s"] = [x * pf for x in e["prefill_s"]]
            e["attn_s_per_token_ctx"] *= pf
            e["decode_s"] = [x * factor for x in e["decode_s"]]
            e["decode_s_per_ctx_token"] *= factor
        return Profile.from_dict(d)

    def with_serving(self, mode: str, served: ServingProfile) -> Profile:
        """This profile with ``mode``'s served overheads replaced (a fresh calibration)."""
        if mode not in ("colocated", "disaggregated"):
            raise ProfileError(f"served mode must be colocated or disaggregated, got {mode!r}")
        out = Profile.from_dict(self.to_dict())
        out.serving[mode] = ServingProfile(**asdict(served))
        return out

    def serving_for(self, mode: str) -> ServingProfile:
        """The served overheads of a simulated mode ("conditional" runs the disaggregated path)."""
        return self.serving.get("colocated" if mode == "colocated" else "disaggregated", ServingProfile())

    def role(self, role: str) -> EngineProfile:
        return self.engines[str(self.roles[role])]

    @property
    def kv_bytes_per_token(self) -> int:
        return int(self.model["kv_bytes_per_token"])

    @property
    def kv_capacity_tokens(self) -> int:
        return int(self.engine["num_kv_blocks"]) * int(self.engine["block_size"])

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Profile:
        try:
            return cls(host=d["host"], model=d["model"], engine=d["engine"],
                       engines={k: EngineProfile(**v) for k, v in d["engines"].items()},
                       roles={k: int(v) for k, v in d["roles"].items()},
                       transfer=TransferProfile(**d["transfer"]),
                       worker_start_s=float(d.get("worker_start_s", 0.0)),
                       serving={k: ServingProfile(**v) for k, v in d.get("serving", {}).items()},
                       created=d.get("created", ""), profile_wall_s=float(d.get("profile_wall_s", 0.0)),
                       speed_probe_s=float(d.get("speed_probe_s", 0.0)), corun=dict(d.get("corun", {})),
                       version=int(d.get("version", 0)))
        except (KeyError, TypeError) as exc:
            raise ProfileError(f"not a pdserve profile: {exc}") from exc

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        try:
            d = json.loads(Path(path).read_text())
        except OSError as exc:
            raise ProfileError(f"cannot read profile {path}: {exc.strerror or exc}") from exc
        except json.JSONDecodeError as exc:
            raise ProfileError(f"profile {path} is not JSON: {exc}") from exc
        if not isinstance(d, dict):
            raise ProfileError(f"profile {path}: expected a JSON object")
        return cls.from_dict(d)

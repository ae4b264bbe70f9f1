"""`pdserve bench serve --scenario batching|prefix`: one server configuration against another on
the same load, alternating over rounds, in one run.

- ``batching``: continuous against static batching (``engine.scheduling_policy``), colocated, on
  mixed output lengths: ``continuous_over_static_throughput``.
- ``prefix``: a long system prompt shared by every request, on the default (disaggregated)
  cluster with the prefix cache on and off: TTFT in both, the hit rate,
  ``cached_over_uncached_ttft_p50``.

Each variant is one server start; every round sends the variants new prompts (another seed), the
same prompts to both, so neither hits a prefix the other round left (except, with the cache on,
the shared system prompt: the point of ``prefix``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone

from pdserve.bench.serve_load import GroupSpec, LogNormal, Target, run_load

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Variant:
    label: str
    kind: str                         # bench.servers.Server kind
    sets: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class VariantScenario:
    name: str
    variants: tuple[Variant, Variant]   # (ours, baseline): ratios are ours / baseline
    group: dict                         # GroupSpec fields other than name and seed
    ratio_name: str                     # the headline ratio
    ratio_field: str                    # "output_tokens_per_s" or "ttft_p50_ms"
    describe: str


BATCHING = VariantScenario(
    "batching",
    (Variant("continuous", "pdserve-colocated"),
     Variant("static", "pdserve-colocated", ["decode.engine.scheduling_policy=static"])),
    {"num_requests": 48, "prompt_len": 64, "output_len": LogNormal(128, 1.0, 8, 1024), "concurrency": 16},
    "continuous_over_static_throughput", "output_tokens_per_s",
    "48 requests, 64 tokens in, out log-normal (median 128, sigma 1, 8-1024: chat-like), 16 in flight; "
    "colocated, continuous vs static batching")

PREFIX = VariantScenario(
    "prefix",
    (Variant("cache", "pdserve"),
     Variant("no-cache", "pdserve", ["prefill.engine.enable_prefix_caching=false",
                                     "decode.engine.enable_prefix_caching=false"])),
    {"num_requests": 24, "prompt_len": 1088, "shared_prefix_len": 1024, "output_len": 16, "concurrency": 4},
    "cached_over_uncached_ttft_p50", "ttft_p50_ms",
    "24 requests, a 1,024-token system prompt shared by all + 64 tokens of their own, 16 out, 4 in flight; "
    "the default (disaggregated) cluster with the prefix cache on and off")

VARIANT_SCENARIOS = {s.name: s for s in (BATCHING, PREFIX)}


def _jsonable(v: object) -> object:
    if isinstance(v, tuple):
        return list(v)
    if isinstance(v, LogNormal):
        return {"lognormal": {"median": v.median, "sigma": v.sigma, "lo": v.lo, "hi": v.hi}}
    return v


def _figures(summary: dict) -> dict:
    g = summary["groups"]["load"]
    return {"output_tokens_per_s": g["output_tokens_per_s"], "ttft_p50_ms": g["ttft_ms"].get("p50"),
            "ttft_p90_ms": g["ttft_ms"].get("p90"), "e2e_p50_ms": g["e2e_ms"].get("p50"),
            "itl_p99_ms": g["itl_ms"].get("p99"), "prefix_hit_rate": g.get("prefix_hit_rate"),
            "completed": g["completed"], "failed": g["failed"], "client_cpu_s": summary["client_cpu_s"],
            "errors": summary["errors"][:5]}


def run_variant_scenario(args: argparse.Namespace, scenario: VariantScenario, model_dir: str, vocab: int) -> dict:
    from pdserve.bench.hw import cpu_model
    from pdserve.bench.servers import Server, ServerUnavailable

    runs: dict[str, list[dict]] = {v.label: [] for v in scenario.variants}
    records: dict[str, list] = {v.label: [] for v in scenario.variants}
    unavailable: dict[str, str] = {}
    started = time.monotonic()
    for rnd in range(args.rounds):
        seed = args.seed + rnd
        for v in scenario.variants:
            if v.label in unavailable:
                continue
            server = Server(v.kind, model_dir, port=args.port, extra_set=list(args.set or []) + v.sets)
            try:
                with server:
                    target = Target("openai", server.url, server.served_model, vocab_size=vocab)
                    warm = GroupSpec("load", 4, prompt_len=32, output_len=8, concurrency=4, seed=10_000 + rnd)
                    asyncio.run(run_load(target, [warm], time_limit_s=120))
                    spec = GroupSpec("load", seed=seed, **scenario.group)
                    result = asyncio.run(run_load(target, [spec], time_limit_s=args.time_limit_s,
                                                  stall_threshold_s=args.stall_threshold_s))
            except ServerUnavailable as exc:
                unavailable[v.label] = str(exc)
                print(f"{v.label}: cannot run: {exc}", flush=True)
                continue
            records[v.label].extend(result.records)
            fig = _figures(result.summary(ttft_slo_s=args.ttft_slo_s, itl_slo_s=args.itl_slo_s))
            fig["round"] = rnd
            runs[v.label].append(fig)
            hit = fig["prefix_hit_rate"]
            print(f"round {rnd} {v.label:12s} {fig['output_tokens_per_s']:7.1f} out tok/s  TTFT p50 "
                  f"{fig['ttft_p50_ms'] or float('nan'):7.0f} ms  e2e p50 {fig['e2e_p50_ms'] or float('nan'):7.0f} ms"
                  f"  prefix hits {hit if hit is None else round(hit, 3)}  failed {fig['failed']}", flush=True)
            time.sleep(3)
    ours, base = (v.label for v in scenario.variants)
    per_round = [a[scenario.ratio_field] / b[scenario.ratio_field]
                 for a, b in zip(runs[ours], runs[base]) if a[scenario.ratio_field] and b[scenario.ratio_field]]
    ratio = statistics.median(per_round) if per_round else None
    return {"benchmark": "serve", "scenario": scenario.name, "describe": scenario.describe,
            "when": datetime.now(timezone.utc).isoformat(timespec="seconds"), "host": cpu_model(),
            "model_dir": model_dir, "load": {k: _jsonable(v) for k, v in scenario.group.items()},
            "variants": {v.label: {"server": v.kind, "sets": v.sets} for v in scenario.variants},
            "runs": runs, "ratios": {scenario.ratio_name: ratio,
                                     "per_round": [round(x, 3) for x in per_round]},
            "unavailable": unavailable, "wall_s": round(time.monotonic() - started, 1), "_records": records}


def format_variant_table(result: dict) -> str:
    lines = [f"pdserve bench serve --scenario {result['scenario']}  {result['when']}  host {result['host']}",
             f"  {result['describe']}"]
    def med(runs: list[dict], key: str) -> float:
        values = [r[key] for r in runs if r[key] is not None]
        return statistics.median(values) if values else float("nan")

    for label, runs in result["runs"].items():
        if runs:
            lines.append(f"  {label:12s} {med(runs, 'output_tokens_per_s'):7.1f} out tok/s  TTFT p50 "
                         f"{med(runs, 'ttft_p50_ms'):7.0f} ms  e2e p50 {med(runs, 'e2e_p50_ms'):7.0f} ms  (median of rounds)")
    for name, value in result["ratios"].items():
        if name != "per_round":
            lines.append(f"  {name}: {value if value is None else round(value, 3)} {result['ratios']['per_round']}")
    for label, why in result["unavailable"].items():
        lines.append(f"  {label}: not run: {why}")
    return "\n".join(lines)


def model_for(args: argparse.Namespace) -> str:
    if args.model_dir:
        return args.model_dir
    from pdserve.engine.testmodel import ensure_model

    return str(ensure_model("small"))

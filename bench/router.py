"""``pdserve bench router``: what the router adds to every streamed token.

    pdserve bench router --json router.json [--quick] [--model tiny|small|both] [--api http|grpc|both]

One cluster on this machine per model: local Ray on 127.0.0.1, embedded Redis, one prefill and
one decode worker, the router (``RouterService``) in this process, every prompt prefilled on
the prefill worker (``disaggregation.mode: always``), planner off. For 1, 16 and 64 concurrent
streams, closed-loop clients in a separate process (so their parsing does not share the
router's event loop) stream completions of ``max_tokens`` tokens with ``ignore_eos`` over
HTTP (SSE) and/or gRPC, and timestamp every token they receive.

Per request the client-side inter-token latency (ITL) is compared with the decode worker's
own view of it, from the phase record its last output carries: ``decode_s / (output_tokens -
1)``, the worker's mean step interval for that request. The router's finish hook only reads
that record (once per request, nothing per token). Headline, per concurrency::

    router_itl_overhead = mean client ITL (tokens 2..N) / mean decode-worker step interval

The first gap (prefill token -> first decode token) is the P->D handoff, reported apart
(``handoff_ms``, and ``router_itl_overhead_incl_handoff`` over all gaps). ``router_cpu_ms_per_token``
is this process's CPU time (router, Ray driver, servers) per delivered token. A constant delay
per token leaves the mean unchanged; jitter shows in ``itl_p99_over_step`` (client ITL p99 over
the worker's mean step) and ``bunched_frac`` (gaps under a tenth of a step: tokens delivered
together). The worker's interval includes its first step after admission, which the client's
(from token 2) does not: the ratio reads low by up to about 1/(N-1). Aim: overhead <= 1.1 at
64 streams.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import logging
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from pdserve.bench.common import run_and_save

logger = logging.getLogger(__name__)

_MODELS = ("tiny", "small")
_APIS = ("http", "grpc")


@dataclass(frozen=True, slots=True)
class Settings:
    models: tuple[str, ...] = ("tiny",)
    apis: tuple[str, ...] = ("http",)
    concurrencies: tuple[int, ...] = (1, 16, 64)
    max_tokens: int = 64
    prompt_len: int = 32
    rounds: int = 3           # requests per level = max(rounds * concurrency, min_requests)
    min_requests: int = 8
    threads: int = 1          # torch threads per worker
    level_timeout_s: float = 600.0
    quick: bool = False
    profile: bool = False     # cProfile the router's event loop at the largest concurrency

    def __post_init__(self) -> None:
        if not self.models or any(m not in _MODELS for m in self.models):
            raise ValueError(f"models must be among {_MODELS}, got {self.models}")
        if not self.apis or any(a not in _APIS for a in self.apis):
            raise ValueError(f"apis must be among {_APIS}, got {self.apis}")
        if not self.concurrencies or min(self.concurrencies) < 1 or max(self.concurrencies) > 64:
            raise ValueError(f"concurrencies must be in [1, 64] (the decode batch), got {self.concurrencies}")
        if self.max_tokens < 4 or self.prompt_len < 1 or self.rounds < 1 or self.min_requests < 1:
            raise ValueError("max_tokens must be >= 4; prompt_len, rounds, min_requests >= 1")
        if self.threads < 1 or self.level_timeout_s <= 0:
            raise ValueError("threads must be >= 1 and level_timeout_s > 0")

    def requests_at(self, concurrency: int) -> int:
        return max(self.rounds * concurrency, self.min_requests)


# ------------------------------------------------------------------ client (own process)
def client_process(spec: dict) -> dict:
    """Entry point of the load process: run one level, return per-request token timestamps."""
    cpu0 = time.process_time()
    records = asyncio.run(_client_level(spec))
    return {"records": records, "client_cpu_s": time.process_time() - cpu0}


async def _client_level(spec: dict) -> list[dict]:
    rng = random.Random(spec["seed"])
    prompts = [[rng.randrange(3, spec["vocab"]) for _ in range(spec["prompt_len"])] for _ in range(spec["requests"])]
    todo = iter(enumerate(prompts))
    records: list[dict] = []

    async def stream_all(one) -> None:
        for i, prompt in todo:  # the iterator is shared: each stream takes the next request
            records.append(await one(i, prompt))

    if spec["api"] == "http":
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=spec["timeout_s"])
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
            async def one(_i: int, prompt: list[int]) -> dict:
                return await _http_request(session, spec, prompt)

            await asyncio.wait_for(asyncio.gather(*(stream_all(one) for _ in range(spec["concurrency"]))),
                                   spec["timeout_s"])
    else:
        import grpc
        from pdserve.proto import pdserve_pb2_grpc as pb_grpc

        async with grpc.aio.insecure_channel(spec["grpc_target"]) as channel:
            stub = pb_grpc.GenerationStub(channel)
            async def one(i: int, prompt: list[int]) -> dict:
                return await _grpc_request(stub, spec, f"bench-{spec['seed']}-{i}", prompt)

            await asyncio.wait_for(asyncio.gather(*(stream_all(one) for _ in range(spec["concurrency"]))),
                                   spec["timeout_s"])
    return records


async def _http_request(session, spec: dict, prompt: list[int]) -> dict:
    body = {"model": spec["model"], "prompt": prompt, "max_tokens": spec["max_tokens"], "temperature": 0,
            "ignore_eos": True, "stream": True}
    sent, times = time.monotonic(), []
    async with session.post(spec["http_url"] + "/v1/completions", json=body) as resp:
        rid = resp.headers.get("X-Request-Id", "")
        if resp.status != 200:
            return {"request_id": rid, "error": _short(f"HTTP {resp.status}: {await resp.text()}")}
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            now = time.monotonic()
            event = json.loads(line[6:])
            if "error" in event:
                return {"request_id": rid, "error": _short(str(event["error"]))}
            times.extend([now] * len(event.get("pdserve", {}).get("token_ids", ())))
    return {"request_id": rid, "sent": sent, "times": times}


async def _grpc_request(stub, spec: dict, rid: str, prompt: list[int]) -> dict:
    import grpc
    from pdserve.proto import pdserve_pb2 as pb

    req = pb.GenerateRequest(request_id=rid, token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(
        max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True))
    sent, times = time.monotonic(), []
    try:
        async for msg in stub.Generate(req, timeout=spec["timeout_s"]):
            if msg.token_ids:
                times.extend([time.monotonic()] * len(msg.token_ids))
    except grpc.aio.AioRpcError as exc:  # recorded; the level goes on
        return {"request_id": rid, "error": _short(str(exc))}
    return {"request_id": rid, "sent": sent, "times": times}


def _short(message: str) -> str:
    """An error for the report: its start and its end (where a Ray error names the cause)."""
    lines = [ln.strip() for ln in message.splitlines() if ln.strip()]
    text = " | ".join(lines)
    return text if len(text) <= 400 else text[:150] + " ... " + text[-250:]


# ------------------------------------------------------------------------ figures
def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1e3


def summarize(records: list[dict], phases: dict[str, dict], *, wall_s: float, router_cpu_s: float,
              client_cpu_s: float) -> dict:
    """One level's figures from the client timestamps and the decode worker's phase records."""
    ok = [r for r in records if not r.get("error") and len(r["times"]) >= 3]
    steady = [b - a for r in ok for a, b in zip(r["times"][1:], r["times"][2:])]
    per_request_all = [(r["times"][-1] - r["times"][0]) / (len(r["times"]) - 1) for r in ok]
    worker = []
    for r in ok:
        p = phases.get(r["request_id"]) or {}
        if int(p.get("output_tokens") or 0) > 1 and float(p.get("decode_s") or 0) > 0:
            worker.append(float(p["decode_s"]) / (int(p["output_tokens"]) - 1))
    tokens = sum(len(r["times"]) for r in ok)
    itl, step = (statistics.fmean(steady) if steady else None), (statistics.fmean(worker) if worker else None)
    itl_all = statistics.fmean(per_request_all) if per_request_all else None
    return {
        "requests": len(records), "errors": len(records) - len(ok), "worker_records": len(worker),
        "tokens": tokens, "wall_s": wall_s, "tokens_per_s": tokens / wall_s if wall_s > 0 else None,
        "client_itl_mean_ms": _ms(itl), "client_itl_p50_ms": _ms(_pct(steady, 50)),
        "client_itl_p99_ms": _ms(_pct(steady, 99)),
        "worker_step_mean_ms": _ms(step), "worker_step_p50_ms": _ms(_pct(worker, 50)),
        "worker_step_p99_ms": _ms(_pct(worker, 99)),
        "router_itl_overhead": itl / step if itl and step else None,
        "router_itl_overhead_incl_handoff": itl_all / step if itl_all and step else None,
        "itl_p99_over_step": _pct(steady, 99) / step if steady and step else None,
        "bunched_frac": sum(g < 0.1 * step for g in steady) / len(steady) if steady and step else None,
        "handoff_ms": _ms(statistics.fmean([r["times"][1] - r["times"][0] for r in ok]) if ok else None),
        "ttft_p50_ms": _ms(_pct([r["times"][0] - r["sent"] for r in ok], 50)),
        "ttft_max_ms": _ms(max((r["times"][0] - r["sent"] for r in ok), default=None)),
        "router_cpu_ms_per_token": router_cpu_s * 1e3 / tokens if tokens else None,
        "client_cpu_ms_per_token": client_cpu_s * 1e3 / tokens if tokens else None,
        "error_samples": sorted({r["error"] for r in records if r.get("error")})[:3],
    }


# -------------------------------------------------------------------------- cluster
def _watch_decode_phases(backend) -> dict[str, dict]:
    """Keep each finished request's decode-worker phase record (read once per request)."""
    seen: dict[str, dict] = {}
    finish = backend._finish

    def finish_and_keep(fin, req, emitted, started, first_token_at, acc):
        # keyed by the id the client sees (X-Request-Id / the gRPC request_id), not the server's own
        seen[req.client_id] = acc.decode_phase.to_dict() if acc.decode_phase is not None else {}
        return finish(fin, req, emitted, started, first_token_at, acc)

    backend._finish = finish_and_keep
    return seen


def _start_profile():
    import cProfile

    prof = cProfile.Profile(time.thread_time)  # the loop thread's CPU time: idle waits and preemption excluded
    prof.enable()
    return prof


def _profile_top(prof, tokens: int, top: int = 25) -> list[dict]:
    """The router loop's functions by own CPU time, in microseconds per delivered token."""
    import pstats

    prof.disable()
    rows = []
    for (file, line, func), (_cc, calls, own, cum, _callers) in pstats.Stats(prof).stats.items():
        rows.append({"function": f"{Path(file).name}:{line}({func})", "calls_per_token": calls / max(1, tokens),
                     "own_us_per_token": own * 1e6 / max(1, tokens), "cum_us_per_token": cum * 1e6 / max(1, tokens)})
    return sorted(rows, key=lambda r: -r["own_us_per_token"])[:top]


async def _bench_model(model: str, st: Settings) -> dict:
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    from pdserve.cluster.config_io import apply_overrides, config_from_model
    from pdserve.cluster.state.redis_server import EmbeddedRedis
    from pdserve.cluster.head.router_service import RouterService
    from pdserve.engine.testmodel import ensure_model

    path = ensure_model(model)
    kv_gb = 0.25 if model == "tiny" else 0.6
    cfg = apply_overrides(config_from_model(path), {
        "router.http_port": 0, "router.grpc_port": 0, "router.disaggregation.mode": "always",
        "planner.enabled": False, "prefill.engine.kv_cache_memory_gb": kv_gb,
        "decode.engine.kv_cache_memory_gb": kv_gb, "decode.engine.max_num_seqs": 64,
        "prefill.engine.num_threads": st.threads, "decode.engine.num_threads": st.threads})
    loop = asyncio.get_running_loop()
    levels: list[dict] = []
    with EmbeddedRedis() as redis, ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
        svc = RouterService(cfg, redis_url=redis.url)
        try:
            t0 = time.monotonic()
            ep = await svc.start()
            logger.info("%s cluster up in %.1fs: %s", model, time.monotonic() - t0, ep)
            phases = _watch_decode_phases(svc.backend)
            base = {"model": cfg.model.served_name, "http_url": ep.http_url, "grpc_target": ep.grpc_target,
                    "vocab": svc.backend.model_info().vocab_size, "prompt_len": st.prompt_len,
                    "max_tokens": st.max_tokens, "timeout_s": st.level_timeout_s}
            warm = dict(base, api=st.apis[0], concurrency=2, requests=4, seed=0)
            await loop.run_in_executor(pool, client_process, warm)  # also starts the client process
            for api in st.apis:
                for c in st.concurrencies:
                    spec = dict(base, api=api, concurrency=c, requests=st.requests_at(c), seed=len(levels) + 1)
                    prof = _start_profile() if st.profile and c == max(st.concurrencies) else None
                    cpu0, t1 = time.process_time(), time.monotonic()
                    out = await loop.run_in_executor(pool, client_process, spec)
                    wall, cpu = time.monotonic() - t1, time.process_time() - cpu0
                    row = {"model": model, "api": api, "concurrency": c,
                           **summarize(out["records"], phases, wall_s=wall, router_cpu_s=cpu,
                                       client_cpu_s=out["client_cpu_s"])}
                    if prof is not None:
                        row["profile"] = _profile_top(prof, row["tokens"])
                    logger.info("%s %s x%d: overhead %s", model, api, c, row["router_itl_overhead"])
                    levels.append(row)
            await asyncio.sleep(0.5)  # the last ledger transitions are written in threads
            leaked = [e.request_id for e in svc.ledger.active()] if svc.ledger else []
        finally:
            await svc.stop()
    return {"levels": levels, "ledger_active_after": leaked}


def run_bench(st: Settings) -> dict:
    """Start Ray on loopback, bench each model on its own cluster; returns the JSON-ready result."""
    from pdserve.cluster.runtime.ray_env import LOOPBACK_IP, use_loopback

    use_loopback()
    import ray

    started, load0 = time.monotonic(), os.getloadavg()[0]
    ray.init(address="local", _node_ip_address=LOOPBACK_IP, include_dashboard=False, num_cpus=8,
             log_to_driver=False)
    by_model: dict[str, dict] = {}
    try:
        for model in st.models:
            by_model[model] = asyncio.run(_bench_model(model, st))
    finally:
        ray.shutdown()
    levels = [row for m in by_model.values() for row in m["levels"]]
    overhead: dict = {}
    for row in levels:
        overhead.setdefault(row["model"], {}).setdefault(row["api"], {})[str(row["concurrency"])] = \
            row["router_itl_overhead"]
    return {
        "benchmark": "router",
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "command": "pdserve " + " ".join(sys.argv[1:]),
        "settings": asdict(st), "cpu_count": os.cpu_count(),
        "load_avg_start": load0, "load_avg_end": os.getloadavg()[0],
        "router_itl_overhead": overhead, "aim": "router_itl_overhead <= 1.1 at 64 streams",
        "levels": levels,
        "ledger_active_after": {m: r["ledger_active_after"] for m, r in by_model.items()},
        "wall_s": time.monotonic() - started,
    }


def format_table(result: dict) -> str:
    def f(x, spec=".2f"):
        return "-" if x is None else format(x, spec)

    head = ("| model | api | streams | requests | client ITL mean / p50 / p99 ms | worker step ms | "
            "router_itl_overhead | incl. handoff | ITL p99 / step | bunched | router CPU ms/token | tokens/s |")
    lines = [head, "|" + "---|" * 12]
    for r in result["levels"]:
        lines.append(
            f"| {r['model']} | {r['api']} | {r['concurrency']} | {r['requests']}"
            f"{' (' + str(r['errors']) + ' failed)' if r['errors'] else ''} | {f(r['client_itl_mean_ms'])} / "
            f"{f(r['client_itl_p50_ms'])} / {f(r['client_itl_p99_ms'])} | {f(r['worker_step_mean_ms'])} | "
            f"**{f(r['router_itl_overhead'], '.3f')}** | {f(r['router_itl_overhead_incl_handoff'], '.3f')} | "
            f"{f(r['itl_p99_over_step'])} | {f(r['bunched_frac'])} | {f(r['router_cpu_ms_per_token'], '.3f')} | {f(r['tokens_per_s'], '.0f')} |")
    return "\n".join(lines)


def settings_from_args(args: argparse.Namespace) -> Settings:
    models = _MODELS if args.model == "both" else (args.model,)
    apis = _APIS if args.api == "both" else (args.api,)
    conc = tuple(int(c) for c in args.concurrency.split(",") if c.strip())
    if args.quick:
        return Settings(models, apis, conc, max_tokens=32, rounds=1, min_requests=4, threads=args.threads,
                        quick=True, profile=args.profile)
    return Settings(models, apis, conc, max_tokens=args.max_tokens, threads=args.threads, profile=args.profile)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", type=Path, required=True, metavar="FILE", help="write the full result here")
    p.add_argument("--quick", action="store_true", help="one round of 32 tokens per level (~1 min with tiny)")
    p.add_argument("--model", choices=(*_MODELS, "both"), default="tiny", help="model preset (default: tiny)")
    p.add_argument("--api", choices=(*_APIS, "both"), default="http", help="client protocol (default: http)")
    p.add_argument("--concurrency", default="1,16,64", help="concurrent streams per level (default: 1,16,64)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per request, ignore_eos (default: 64)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker (default: 1)")
    p.add_argument("--profile", action="store_true", help="cProfile the router's event loop at the largest "
                   "concurrency (JSON 'profile'); it slows the router, so keep such runs out of the docs")
    scale = p.add_argument_group("scale-out (bench/router_scale.py): tokens/s through N routers, synthetic workers")
    scale.add_argument("--routers", help="router counts to compare, e.g. 1,3 (this mode ignores the options above "
                       "but --json)")
    scale.add_argument("--streams", type=int, default=128, help="concurrent streams over the routers (default 128)")
    scale.add_argument("--seconds", type=float, default=20.0, help="measured seconds per router count (default 20)")
    scale.add_argument("--ingress", default="actors", help="actors (the router actors), serve (Ray Serve's bare "
                       "streaming path, bench/serve_ingress.py; needs ray[serve]) or actors,serve side by side")


def run(args: argparse.Namespace) -> int:
    if args.routers:
        from pdserve.bench import router_scale

        scaled = run_and_save("router", args, router_scale.settings_from_args, router_scale.run_scale,
                              router_scale.format_scale)
        return 0 if scaled is not None else 2
    result = run_and_save("router", args, settings_from_args, run_bench, format_table)
    if result is None:
        return 2
    leaked = {m: ids for m, ids in result["ledger_active_after"].items() if ids}
    if leaked:
        print(f"ledger entries still active after the run: {leaked}", file=sys.stderr)
    print(f"\nwrote {args.json} in {result['wall_s']:.0f}s")
    return 1 if leaked else 0

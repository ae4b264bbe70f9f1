"""``pdserve bench router --routers 1,3``: streamed tokens per second through N routers.

    pdserve bench router --routers 1,3 --json routers.json [--streams 128] [--seconds 20]

This process runs a local Ray on 127.0.0.1 and an embedded Redis, and two synthetic decode
workers (``bench/synthetic_worker.py``: the decode worker's interface, one token per request
every 10 ms, no model), listed in the worker registry. For each router count N, N routers run
as Ray actors (``RouterActor``, as ``router.replicas`` starts them) with an elected control
plane; one adopts the workers, all route to them. A client process opens ``--streams``
concurrent streaming completions spread round-robin over the routers' HTTP ports, each one
re-issued when it ends (closed loop), and counts the token events it receives over
``--seconds`` after a warm-up. Headline: ``routers_3_over_1`` = tokens/s through 3 routers over
tokens/s through 1 (aim >= 2.5 on a host with a core per router).

On a host with fewer cores than routers + client + workers, the routers share cores and the
ratio is bounded by the cores, not by the routers: the result names the host's CPU count, and each
level reports where the host's CPU went over the measured window (``cpu``: seconds of the routers,
the workers, the client and the rest of the host, read from ``/proc`` every 0.25 s; the host's busy
share of its cores; the routers' CPU milliseconds per token).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as _dt
import logging
import os
import socket
import sys
import time
import threading
from dataclasses import asdict, dataclass

logger = logging.getLogger(__name__)

_TICK = os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a live process (``/proc/PID/stat``); None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / _TICK   # utime, stime (fields 14 and 15)


def host_cpu_s() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole host since boot (``/proc/stat``)."""
    with open("/proc/stat") as f:
        values = [int(x) for x in f.readline().split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)   # idle + iowait
    total = sum(values[:8])                                    # guest time is inside user already
    return (total - idle) / _TICK, total / _TICK


class CpuSampler:
    """Samples named processes' CPU time and the host's, every ``period_s``, in a thread."""

    def __init__(self, pids: dict[str, list[int]], period_s: float = 0.25) -> None:
        self.pids = pids
        self.period_s = period_s
        self.samples: list[tuple[float, dict[str, float], float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)

    def __enter__(self) -> CpuSampler:
        self.sample()   # a sample from before anything measured starts
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5.0)

    def _run(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self.period_s):
                self.sample()
                return

    def sample(self) -> None:
        groups = {name: sum(process_cpu_s(pid) or 0.0 for pid in pids) for name, pids in self.pids.items()}
        busy, total = host_cpu_s()
        self.samples.append((time.time(), groups, busy, total))

    def window(self, t0: float, t1: float) -> dict:
        """CPU seconds per group and the host's over [t0, t1] (the samples nearest outside it)."""
        before = [s for s in self.samples if s[0] <= t0] or self.samples[:1]
        after = [s for s in self.samples if s[0] >= t1] or self.samples[-1:]
        a, b = before[-1], after[0]
        span = max(1e-9, b[0] - a[0])
        out = {name: b[1][name] - a[1][name] for name in self.pids}
        out["host_busy"] = b[2] - a[2]
        out["host_busy_frac"] = (b[2] - a[2]) / max(1e-9, b[3] - a[3])
        out["rest_of_host"] = max(0.0, out["host_busy"] - sum(out[name] for name in self.pids))
        out["span_s"] = span
        return out


@dataclass(frozen=True, slots=True)
class ScaleSettings:
    routers: tuple[int, ...] = (1, 3)
    streams: int = 128
    seconds: float = 20.0
    warmup_s: float = 3.0
    max_tokens: int = 64
    workers: int = 2
    step_s: float = 0.01
    ingress: tuple[str, ...] = ("actors",)   # "actors" (RouterActor), "serve" (bench/serve_ingress.py)

    def __post_init__(self) -> None:
        if not self.ingress or set(self.ingress) - {"actors", "serve"}:
            raise ValueError(f"--ingress takes actors, serve or both (comma-separated), got {','.join(self.ingress)}")
        if not self.routers or min(self.routers) < 1 or max(self.routers) > 8:
            raise ValueError(f"--routers takes router counts in [1, 8], got {self.routers}")
        if not 1 <= self.streams <= 512 or not 1 <= self.seconds <= 600 or not 4 <= self.max_tokens <= 4096:
            raise ValueError("--streams must be in [1, 512], --seconds in [1, 600], --max-tokens in [4, 4096]")


def client_process(spec: dict) -> dict:
    """The load (own process): closed-loop streams over the routers' URLs; token events counted."""
    cpu0 = time.process_time()
    out = asyncio.run(_client(spec))
    out["client_cpu_s"] = time.process_time() - cpu0
    return out


async def _client(spec: dict) -> dict:
    import aiohttp

    urls = spec["urls"]
    counts = {"events": 0, "requests": 0, "errors": 0}
    measuring = {"on": False}
    end = time.monotonic() + spec["warmup_s"] + spec["seconds"]
    body = {"model": spec["model"], "prompt": [5, 6, 7, 8], "max_tokens": spec["max_tokens"], "temperature": 0,
            "ignore_eos": True, "stream": True}

    async def stream_loop(i: int, session) -> None:
        n = i
        while time.monotonic() < end:
            url = urls[n % len(urls)]
            n += len(urls) if len(urls) > 1 else 1
            try:
                async with session.post(url + "/v1/completions", json=body) as resp:
                    if resp.status != 200:
                        counts["errors"] += 1
                        await asyncio.sleep(0.05)
                        continue
                    async for chunk in resp.content.iter_any():
                        if measuring["on"]:
                            counts["events"] += chunk.count(b"data: ")
                        if time.monotonic() >= end:
                            break
                if measuring["on"]:
                    counts["requests"] += 1
            except (aiohttp.ClientError, asyncio.TimeoutError):
                counts["errors"] += 1

    timeout = aiohttp.ClientTimeout(total=spec["seconds"] + spec["warmup_s"] + 60)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks = [asyncio.create_task(stream_loop(i, session)) for i in range(spec["streams"])]
        await asyncio.sleep(spec["warmup_s"])
        measuring["on"] = True
        t0, clock0 = time.monotonic(), time.time()
        await asyncio.sleep(spec["seconds"])
        measuring["on"] = False
        wall, clock1 = time.monotonic() - t0, time.time()
        await asyncio.gather(*tasks, return_exceptions=True)
    return {"events": counts["events"], "requests": counts["requests"], "errors": counts["errors"], "wall_s": wall,
            "window": (clock0, clock1)}


def run_scale(st: ScaleSettings) -> dict:
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    from pdserve.bench.hw import cpu_model
    from pdserve.bench.synthetic_worker import SyntheticDecodeWorker
    from pdserve.cluster.config_io import apply_overrides, config_from_model
    from pdserve.cluster.runtime.ray_env import LOOPBACK_IP, use_loopback
    from pdserve.cluster.state.redis_server import EmbeddedRedis, connect
    from pdserve.cluster.state.worker_registry import WorkerRecord, WorkerRegistry
    from pdserve.engine.testmodel import ensure_model

    use_loopback()
    import ray

    namespace = "pdserve-bench-routers"
    started = time.monotonic()
    load0 = os.getloadavg()[0]
    model = ensure_model("tiny")
    ray.init(address="local", _node_ip_address=LOOPBACK_IP, include_dashboard=False, num_cpus=16,
             log_to_driver=False, namespace=namespace)
    password = f"pw-{os.urandom(8).hex()}"
    levels: list[dict] = []
    workers = []
    try:
        with EmbeddedRedis(password=password) as redis_server, \
                ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
            base = apply_overrides(config_from_model(model), {"ray.namespace": namespace,
                "router.http_port": 0, "router.grpc_port": 0, "router.disaggregation.mode": "never",
                "prefill.min_replicas": 0, "prefill.initial_replicas": 0, "decode.min_replicas": 1,
                "decode.max_replicas": st.workers, "decode.engine.max_num_seqs": 256, "planner.enabled": False,
                "control_plane.election": True, "control_plane.lease_s": 3.0})
            registry = WorkerRegistry(connect(redis_server.url), namespace="pdserve")
            for i in range(st.workers):
                wid = f"decode-syn-{i}"
                actor = ray.remote(SyntheticDecodeWorker).options(
                    name=f"pdserve-decode-{wid}", namespace=namespace, num_cpus=0, max_concurrency=64).remote(
                    wid, st.step_s)
                workers.append(actor)
                ray.get(actor.metadata.remote(), timeout=60)
                registry.add(WorkerRecord(wid, "decode", f"pdserve-decode-{wid}", namespace))
            worker_pids = [ray.get(actor.stats.remote(), timeout=60).pid for actor in workers]
            client_pid = pool.submit(os.getpid).result(60)
            with contextlib.ExitStack() as stack:
                serve_ingress = None
                if "serve" in st.ingress:
                    from pdserve.bench.serve_ingress import ServeIngress

                    serve_ingress = stack.enter_context(ServeIngress(base.model.served_name, st.step_s, st.streams))
                for n in st.routers:
                    for ingress in st.ingress:
                        if ingress == "actors":
                            row = _actors_level(st, n, base, redis_server, password, pool, worker_pids, client_pid)
                        else:
                            row = _serve_level(st, n, serve_ingress, pool, client_pid)
                        logger.info("%s, %d router(s): %.0f tokens/s, routers %.2f cores, host %.0f%% busy", ingress,
                                    n, row["tokens_per_s"], row["router_cores"], 100 * row["cpu"]["host_busy_frac"])
                        levels.append(row)
    finally:
        for actor in workers:
            ray.kill(actor, no_restart=True)
        ray.shutdown()
    by_n = {row["routers"]: row["tokens_per_s"] for row in levels if row["ingress"] == "actors"}
    result = {
        "benchmark": "router-scale",
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "command": "pdserve " + " ".join(sys.argv[1:]),
        "host": {"cpu": cpu_model(), "cpu_count": os.cpu_count(), "hostname": socket.gethostname()},
        "settings": asdict(st), "load_avg_start": load0, "load_avg_end": os.getloadavg()[0],
        "levels": levels, "aim": "routers_3_over_1 >= 2.5 (a core per router)",
        "wall_s": round(time.monotonic() - started, 1),
    }
    if 1 in by_n and 3 in by_n and by_n[1] > 0:
        result["routers_3_over_1"] = by_n[3] / by_n[1]
    serve = {row["routers"]: row for row in levels if row["ingress"] == "serve"}
    actors = {row["routers"]: row for row in levels if row["ingress"] == "actors"}
    both = sorted(set(serve) & set(actors))
    if both:   # Ray Serve's bare path against the whole router actor, side by side in this run
        result["serve_over_actors"] = {str(n): {
            "tokens_per_s": serve[n]["tokens_per_s"] / max(1e-9, actors[n]["tokens_per_s"]),
            "cpu_ms_per_token": serve[n]["router_cpu_ms_per_token"] / max(1e-9, actors[n]["router_cpu_ms_per_token"]),
        } for n in both}
    return result


def _measure(st: ScaleSettings, pool, urls: list[str], model: str, pids: dict[str, list[int]],
             ingress_groups: tuple[str, ...]) -> dict:
    """The closed-loop client against ``urls``, with every named process's CPU sampled; the CPU
    of ``ingress_groups`` is the routers' (what a token costs the ingress)."""
    spec = {"urls": urls, "model": model, "streams": st.streams, "seconds": st.seconds, "warmup_s": st.warmup_s,
            "max_tokens": st.max_tokens}
    with CpuSampler(pids) as sampler:
        out = pool.submit(client_process, spec).result(st.seconds + st.warmup_s + 180)
    tokens = max(0, out["events"] - 2 * out["requests"])  # each stream's closing events
    cpu = sampler.window(*out["window"])
    router_cpu = sum(cpu[g] for g in ingress_groups)
    return {"tokens_per_s": tokens / out["wall_s"], "events": out["events"], "requests": out["requests"],
            "errors": out["errors"], "client_cpu_s": out["client_cpu_s"], "wall_s": out["wall_s"], "cpu": cpu,
            "router_cpu_ms_per_token": 1000 * router_cpu / max(1, tokens), "router_cores": router_cpu / cpu["span_s"]}


def _actors_level(st: ScaleSettings, n: int, base, redis_server, password: str, pool, worker_pids: list[int],
                  client_pid: int) -> dict:
    """``n`` router actors (as ``router.replicas`` starts them) over the synthetic workers."""
    from pdserve.cluster.config_io import apply_overrides
    from pdserve.cluster.head.router_actor import start_router_actors, stop_router_actors

    config = apply_overrides(base, {"router.replicas": n + 1})  # router i = 1..n on free ports
    routers = start_router_actors(config, redis_server.address_url, password, detached=False,
                                  name_prefix=f"pdserve-bench-router-{n}-")
    try:
        pids = {"routers": [ep.pid for _, ep in routers], "workers": worker_pids,
                "client": [client_pid], "bench_driver": [os.getpid()]}
        row = _measure(st, pool, [ep.http_url for _, ep in routers], config.model.served_name, pids,
                       ("routers",))
    finally:
        stop_router_actors([actor for actor, _ in routers])
    return {"ingress": "actors", "routers": n, **row}


def _serve_level(st: ScaleSettings, n: int, serve_ingress, pool, client_pid: int) -> dict:
    """Ray Serve's proxy and ``n`` replicas of the bare streaming deployment."""
    from pdserve.bench.serve_ingress import serve_pids

    url = serve_ingress.deploy(n)
    try:
        found = serve_pids()
        if len(found["serve_replicas"]) != n or len(found["serve_proxy"]) != 1:
            raise RuntimeError(f"expected {n} Serve replica processes and one proxy, found {found}")
        pids = {**found, "client": [client_pid], "bench_driver": [os.getpid()]}
        row = _measure(st, pool, [url], serve_ingress.model, pids, ("serve_replicas", "serve_proxy"))
    finally:
        serve_ingress.undeploy()
    return {"ingress": "serve", "routers": n, **row}


def format_scale(r: dict) -> str:
    lines = [f"host: {r['host']['cpu']} ({r['host']['cpu_count']} CPUs)",
             f"{'ingress':>7s} {'routers':>7s} {'tokens/s':>9s} {'requests':>8s} {'errors':>6s} {'client CPU s':>12s} "
             f"{'router cores':>12s} {'router ms/token':>15s} {'host busy':>9s} "
             "  CPU s by process group"]
    for row in r["levels"]:
        line = (f"{row.get('ingress', 'actors'):>7s} {row['routers']:7d} {row['tokens_per_s']:9.0f} "
                f"{row['requests']:8d} {row['errors']:6d} {row['client_cpu_s']:12.1f}")
        if "cpu" in row:
            c = row["cpu"]
            line += (f" {row['router_cores']:12.2f} {row['router_cpu_ms_per_token']:15.3f} "
                     f"{100 * c['host_busy_frac']:8.0f}% "
                     + "  " + ", ".join(f"{k} {v:.1f}" for k, v in c.items()
                                        if k not in ("host_busy", "host_busy_frac", "span_s")))
        lines.append(line)
    if "routers_3_over_1" in r:
        lines.append(f"routers_3_over_1 = {r['routers_3_over_1']:.2f} (aim >= 2.5 with a core per router)")
    for n, ratio in r.get("serve_over_actors", {}).items():
        lines.append(f"{n} router(s): Ray Serve's bare path / router actors: tokens/s x{ratio['tokens_per_s']:.2f}, "
                     f"CPU per token x{ratio['cpu_ms_per_token']:.2f}")
    return "\n".join(lines)


def settings_from_args(args: argparse.Namespace) -> ScaleSettings:
    routers = tuple(int(x) for x in str(args.routers).split(",") if x.strip())
    ingress = tuple(x.strip() for x in str(getattr(args, "ingress", "actors")).split(",") if x.strip())
    if "serve" in ingress:
        from pdserve.bench.serve_ingress import serve_available

        missing = serve_available()
        if missing:
            raise ValueError(missing)
    return ScaleSettings(routers=routers, streams=args.streams, seconds=args.seconds, ingress=ingress)

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
ratio is bounded by the cores, not by the routers: the result names the host's CPU count.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import logging
import os
import socket
import sys
import time
from dataclasses import asdict, dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ScaleSettings:
    routers: tuple[int, ...] = (1, 3)
    streams: int = 128
    seconds: float = 20.0
    warmup_s: float = 3.0
    max_tokens: int = 64
    workers: int = 2
    step_s: float = 0.01

    def __post_init__(self) -> None:
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
        t0 = time.monotonic()
        await asyncio.sleep(spec["seconds"])
        measuring["on"] = False
        wall = time.monotonic() - t0
        await asyncio.gather(*tasks, return_exceptions=True)
    return {"events": counts["events"], "requests": counts["requests"], "errors": counts["errors"], "wall_s": wall}


def run_scale(st: ScaleSettings) -> dict:
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    from pdserve.bench.hw import cpu_model
    from pdserve.bench.synthetic_worker import SyntheticDecodeWorker
    from pdserve.cluster.config_io import apply_overrides, config_from_model
    from pdserve.cluster.ray_env import LOOPBACK_IP, use_loopback
    from pdserve.cluster.redis_server import EmbeddedRedis, connect
    from pdserve.cluster.router_actor import start_router_actors, stop_router_actors
    from pdserve.cluster.worker_registry import WorkerRecord, WorkerRegistry
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
            for n in st.routers:
                config = apply_overrides(base, {"router.replicas": n + 1})  # router i = 1..n on free ports
                routers = start_router_actors(config, redis_server.address_url, password, detached=False,
                                              name_prefix=f"pdserve-bench-router-{n}-")
                try:
                    spec = {"urls": [ep["http_url"] for _, ep in routers], "model": config.model.served_name,
                            "streams": st.streams, "seconds": st.seconds, "warmup_s": st.warmup_s,
                            "max_tokens": st.max_tokens}
                    out = pool.submit(client_process, spec).result(st.seconds + st.warmup_s + 180)
                finally:
                    stop_router_actors([actor for actor, _ in routers])
                tokens = max(0, out["events"] - 2 * out["requests"])  # each stream's role and closing events
                row = {"routers": n, "tokens_per_s": tokens / out["wall_s"], "events": out["events"],
                       "requests": out["requests"], "errors": out["errors"], "client_cpu_s": out["client_cpu_s"],
                       "wall_s": out["wall_s"]}
                logger.info("%d router(s): %.0f tokens/s", n, row["tokens_per_s"])
                levels.append(row)
    finally:
        for actor in workers:
            ray.kill(actor, no_restart=True)
        ray.shutdown()
    by_n = {row["routers"]: row["tokens_per_s"] for row in levels}
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
    return result


def format_scale(r: dict) -> str:
    lines = [f"host: {r['host']['cpu']} ({r['host']['cpu_count']} CPUs)",
             f"{'routers':>7s} {'tokens/s':>9s} {'requests':>8s} {'errors':>6s} {'client CPU s':>12s}"]
    for row in r["levels"]:
        lines.append(f"{row['routers']:7d} {row['tokens_per_s']:9.0f} {row['requests']:8d} {row['errors']:6d} "
                     f"{row['client_cpu_s']:12.1f}")
    if "routers_3_over_1" in r:
        lines.append(f"routers_3_over_1 = {r['routers_3_over_1']:.2f} (aim >= 2.5 with a core per router)")
    return "\n".join(lines)


def settings_from_args(args: argparse.Namespace) -> ScaleSettings:
    routers = tuple(int(x) for x in str(args.routers).split(",") if x.strip())
    return ScaleSettings(routers=routers, streams=args.streams, seconds=args.seconds)

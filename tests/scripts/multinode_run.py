"""A pdserve cluster over three Ray nodes on this machine, run as its own process.

``ray.cluster_utils.Cluster`` starts a head node (no pool resources) and two worker nodes, one
advertising the ``prefill`` resource and one the ``decode`` resource, all on 127.0.0.1. A
``RouterService`` places each pool on its resource, serves a few greedy completions over HTTP
(every prompt prefilled on the prefill node, KV moved over NIXL into the decode node's
process) and the same prompts are run on the engine alone in this process. The last line on
stdout is one JSON object (prefixed ``RESULT ``) that ``tests/integration/test_multinode.py``
checks; everything is stopped before the process exits.

Usage: ``python tests/scripts/multinode_run.py MODEL_DIR``
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/ (cluster_helpers)

from pdserve.cluster.runtime.ray_env import use_loopback  # noqa: E402

use_loopback()  # before ray is imported: every node's IP stays 127.0.0.1

import ray  # noqa: E402
import ray._private.utils  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

# Cluster() records its address in /tmp/ray/ray_current_cluster, where any other ray.init()
# without an address on this shared machine would find (and join) it; keep it private.
ray._private.utils.write_ray_address = lambda *args, **kwargs: None

PROMPTS = [
    "The quick brown fox jumps over the lazy dog",
    "A kitchen at seven in the morning: twelve cooks read the whole ticket at once. " * 6,
    "Decode workers are sized for memory bandwidth, prefill workers for compute.",
]
GEN = 12
NODE = {"node_ip_address": "127.0.0.1", "include_dashboard": False, "object_store_memory": 80 * 1024 * 1024}


def _actor_nodes() -> dict[str, str]:
    """Actor name -> node id, for every live actor (from the GCS actor table)."""
    table = ray._private.state.actors()
    return {a["Name"]: a["Address"]["NodeID"] for a in table.values() if a.get("State") == "ALIVE" and a.get("Name")}


async def _serve(config, redis_url: str, prompts: list[str], result: dict) -> None:
    import aiohttp

    from pdserve.cluster.head.router_service import RouterService
    from pdserve.cluster.runtime.workers import ACTOR_PREFIX

    service = RouterService(config, redis_url=redis_url, namespace="pdserve-multinode", reap_interval_s=0.5)
    t0 = time.monotonic()
    try:
        endpoints = await service.start()
        result["start_s"] = round(time.monotonic() - t0, 1)
        placed = _actor_nodes()
        result["placement"] = {
            role: [placed.get(ACTOR_PREFIX[role] + wid) for wid in service.manager.pools[role].handles]
            for role in ("prefill", "decode")}
        await service.pool.refresh()
        result["reported_nodes"] = {  # what each worker says of itself, as `pdserve status` shows it
            role: [(service.pool.members[wid].view.stats or None) and service.pool.members[wid].view.stats.node_id for wid in service.manager.pools[role].handles]
            for role in ("prefill", "decode")}
        name = service.backend.model_info().name

        async def one(session: aiohttp.ClientSession, prompt: str) -> dict:
            body = {"model": name, "prompt": prompt, "max_tokens": GEN, "temperature": 0, "ignore_eos": True}
            async with session.post(endpoints.http_url + "/v1/completions", json=body,
                                    timeout=aiohttp.ClientTimeout(total=120)) as resp:
                data = await resp.json()
                if resp.status != 200:
                    raise RuntimeError(f"HTTP {resp.status}: {data}")
                return data["pdserve"]

        async with aiohttp.ClientSession() as session:
            served = [await one(session, prompts[0])]  # one alone, then the rest at once
            served += await asyncio.gather(*(one(session, p) for p in prompts[1:]))
        result["served"] = [{"token_ids": s["token_ids"], "phase": s["phase"]} for s in served]

        members = list(service.pool.members.values())
        deadline = time.monotonic() + 20
        while True:  # every block freed on both nodes, the ledger empty (bounded)
            held = dict(zip([m.worker_id for m in members],
                            await asyncio.gather(*(m.actor.blocks_in_use.remote() for m in members))))
            active = await asyncio.to_thread(service.ledger.active)
            if (not any(held.values()) and not active) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        result["blocks_in_use"] = held
        result["ledger_active"] = len(active)
    finally:
        await service.stop()
    result["actors_after_stop"] = sorted(n for n in _actor_nodes() if n.startswith("pdserve-"))


def main() -> int:
    from cluster_helpers import cluster_config, greedy, reference_engine
    from pdserve.cluster.state.redis_server import EmbeddedRedis

    model_dir = sys.argv[1]
    config = cluster_config(model_dir, **{"prefill.resources": {"prefill": 1}, "decode.resources": {"decode": 1},
                                          "prefill.num_cpus": 1, "decode.num_cpus": 1,
                                          # every prompt crosses the nodes (an idle decode worker
                                          # would otherwise prefill part of the burst itself)
                                          "router.disaggregation.local_prefill_when_idle": False})
    engine = reference_engine(config)
    tok = engine.stopper.tokenizer
    ids = [list(tok(p)["input_ids"]) for p in PROMPTS]
    result: dict = {"reference": engine.generate(ids, greedy(GEN)), "prompt_tokens": [len(i) for i in ids]}
    del engine

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, **NODE})
    try:
        prefill_node = cluster.add_node(num_cpus=2, resources={"prefill": 1}, **NODE)
        decode_node = cluster.add_node(num_cpus=2, resources={"decode": 1}, **NODE)
        result["nodes"] = {"head": cluster.head_node.node_id, "prefill": prefill_node.node_id,
                           "decode": decode_node.node_id}
        ray.init(address=cluster.address, namespace="pdserve-multinode", log_to_driver=False,
                 runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}})
        result["node_ips"] = sorted({n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]})
        with EmbeddedRedis() as redis:
            asyncio.run(_serve(config, redis.url, PROMPTS, result))
    finally:
        ray.shutdown()
        cluster.shutdown()
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())

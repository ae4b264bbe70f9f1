"""The router of a cluster whose pools live on other emulated hosts, run inside host 0.

``tests/integration/test_netns_hosts.py`` builds three emulated hosts (``bench/netns.py``) and a
Ray node on each (``bench/transfer_link.start_ray``): the head on host 0, ``pd_prefill`` on host 1,
``pd_decode`` on host 2. This script joins that Ray from host 0 and runs a ``RouterService`` (with
an embedded Redis on host 0's own loopback) whose pools are placed by those resources, so every
prompt is prefilled on host 1 and its KV crosses the links (UCX over TCP) into host 2.

1. A few greedy completions over HTTP, with host 1's link counters read before and after.
2. A long prompt whose prefill host loses its link for ``OUTAGE_S`` in the middle of prefill and
   transfer (the bridge port taken down and up again): it must end in a retry that completes or
   in an explicit error, never hang.
3. Every worker's blocks freed and the ledger empty; the service stopped.

The last line on stdout is one JSON object (``RESULT ...``). Usage:
``python tests/scripts/netns_run.py SPEC_JSON`` with model_dir, address, node_ip, bridge_ns,
prefill_ns.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/ (cluster_helpers)

import ray  # noqa: E402

PROMPTS = [
    "The quick brown fox jumps over the lazy dog",
    "A kitchen at seven in the morning: twelve cooks read the whole ticket at once. " * 6,
]
GEN = 12
LONG_PROMPT = "Twelve cooks read the whole ticket at once, then each one starts a different dish. " * 60
LONG_GEN = 8
OUTAGE_S = 4.0
PREFILL_HOST = 1


def main() -> int:
    from cluster_helpers import ClusterHarness, cluster_config, greedy, reference_engine, wait_until
    from pdserve.bench.netns import read_link_bytes, set_port
    from pdserve.bench.transfer_link import PLACEMENT
    from pdserve.cluster.state.redis_server import EmbeddedRedis

    spec = json.loads(sys.argv[1])
    config = cluster_config(spec["model_dir"], **{
        "prefill.resources": PLACEMENT["prefill"], "decode.resources": PLACEMENT["decode"],
        "prefill.num_cpus": 1, "decode.num_cpus": 1, "prefill.max_replicas": 1, "decode.max_replicas": 1,
        "router.disaggregation.local_prefill_when_idle": False,
        "router.disaggregation.kv_transfer_timeout_s": 3.0,
        "router.disaggregation.prefill_wait_s": 60.0})
    engine = reference_engine(config)
    tok = engine.stopper.tokenizer
    ids = [list(tok(p)["input_ids"]) for p in PROMPTS]
    long_ids = list(tok(LONG_PROMPT)["input_ids"])
    result: dict = {"reference": engine.generate(ids, greedy(GEN)), "prompt_tokens": [len(i) for i in ids],
                    "long_reference": engine.generate([long_ids], greedy(LONG_GEN))[0]}
    del engine

    ray.init(address=spec["address"], _node_ip_address=spec["node_ip"], log_to_driver=False,
             namespace="pdserve-netns", runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}})
    wait_until(lambda: sum(n["Alive"] for n in ray.nodes()) == 3, 120.0, "3 Ray nodes")
    result["node_ips"] = sorted({n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]})
    with EmbeddedRedis() as redis:
        h = ClusterHarness(config, redis.url)
        h.start()
        try:
            result["worker_ips"] = {role: sorted({str(m.view.stats.node_ip if m.view.stats else None) for m in h.members(role)})
                                    for role in ("prefill", "decode")}
            client = h.openai(timeout_s=120.0)
            before = read_link_bytes(spec["prefill_ns"])
            served = []
            for p in PROMPTS:
                r = client.completions.create(model=h.model_name, prompt=p, max_tokens=GEN, temperature=0,
                                              extra_body={"ignore_eos": True})
                ext = r.model_extra["pdserve"]
                served.append({"token_ids": ext["token_ids"], "phase": ext["phase"]})
            after = read_link_bytes(spec["prefill_ns"])
            result["served"] = served
            result["link_tx_bytes"] = after.tx - before.tx

            outcome: dict = {}

            def long_request() -> None:
                try:
                    r = client.completions.create(model=h.model_name, prompt=LONG_PROMPT, max_tokens=LONG_GEN,
                                                  temperature=0, extra_body={"ignore_eos": True})
                    ext = r.model_extra["pdserve"]
                    outcome.update(token_ids=ext["token_ids"], phase=ext["phase"])
                except Exception as exc:  # an explicit error is an allowed ending: recorded, checked
                    outcome.update(error=f"{type(exc).__name__}: {exc}")

            t = threading.Thread(target=long_request, daemon=True)
            t.start()
            h.wait_busy("prefill", timeout_s=60.0, poll_s=0.005)
            set_port(spec["bridge_ns"], PREFILL_HOST, up=False)
            result["outage_started"] = time.time()
            time.sleep(OUTAGE_S)
            set_port(spec["bridge_ns"], PREFILL_HOST, up=True)
            t.join(240.0)
            outcome["finished"] = not t.is_alive()
            result["long"] = outcome
            result["retries"] = h.service.backend.retries
            try:
                h.assert_nothing_held(timeout_s=90.0)
                result["held"] = None
            except AssertionError as exc:
                result["held"] = str(exc)
        finally:
            h.stop()
    ray.shutdown()
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

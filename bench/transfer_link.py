"""``pdserve bench transfer --link 1gbit,10gbit``: a prompt's KV pushed from a prefill host to a
decode host over an emulated network link, one link rate after another.

Per rate:
1. Three emulated hosts (``bench/netns.py``) on links shaped to the rate: host 0 runs the Ray
   head and the driver, host 1 a Ray node advertising ``pd_prefill``, host 2 one advertising
   ``pd_decode``. Ray, NIXL and the workers talk across the links only.
2. The driver (this module with ``--driver``, inside host 0) joins that Ray and runs the real
   worker path (``bench/transfer_cluster.py``): a decode worker on host 2, two prefill workers on
   host 1 (``overlap``: each chunk's blocks pushed as it is computed; ``no_overlap``: all blocks
   after the prompt), UCX over TCP on the hosts' ``eth0`` (cross-memory attach would bypass the
   link, since the "hosts" share one kernel).
3. Host 1's link counters before and after: the bytes that really crossed the link.

Figures per rate (``links[rate]``): ``link_gbps``; ``transfer_gbps`` (the median rate of every
no-overlap push of the run, all prompt lengths; ``transfer_gbps_at_prompt_len``: the median of the
main length's pushes alone); ``link_utilization`` = transfer / link;
``wire_bytes_per_kv_byte``; ``ttft_s`` and ``transfer_share_of_ttft`` per case
(``kv_exposed_s`` / TTFT: the transfer not hidden behind prefill compute); ``share_by_length``
(overlap share per measured prompt length) and ``hidden_up_to_tokens``: the longest measured
prompt whose overlap share stays within ``HIDDEN_SHARE`` (None when none does);
``break_even_gbps``: KV bytes per token x measured prefill tokens/s, the link speed below which
the KV is made faster than the link moves it (the exposed transfer then grows with the prompt).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pdserve.bench.netns import EmulatedHosts, rate_bits

logger = logging.getLogger(__name__)

HIDDEN_SHARE = 0.05
HEAD_PORT = 6390
NODE_RESOURCES = ({"pd_head": 1}, {"pd_prefill": 1}, {"pd_decode": 1})
NODE_CPUS = (1, 2, 1)            # host 1 runs the two prefill workers
OBJECT_STORE_BYTES = 100 * 1024 * 1024
DRIVER_TIMEOUT_S = 900.0
WORKER_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0"}
# a sliver of the node's resource: any number of workers of that role fit on their host
PLACEMENT = {"prefill": {"pd_prefill": 0.01}, "decode": {"pd_decode": 0.01}}


def ray_env(token_path: Path) -> dict[str, str]:
    """The environment of every Ray process on the emulated hosts: token authentication with this
    run's own token (a file only root reads; never in argv), routable node IPs (not the loopback
    switch the tests set), serving priority, nothing fetched."""
    env = dict(os.environ)
    for key in ("RAY_ADDRESS", "RAY_AUTH_TOKEN"):
        env.pop(key, None)
    env.update(WORKER_ENV)   # the workers the raylets start inherit it: KV over the link, not memory
    env.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_path),
                "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1", "RAY_worker_niceness": "0",
                "RAY_USAGE_STATS_ENABLED": "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    return env


def run_dir(hosts: EmulatedHosts) -> Path:
    """``/tmp/<tag>-ray``: the nodes' logs and this run's Ray token (mode 0700)."""
    d = Path(f"/tmp/{hosts.tag}-ray")
    d.mkdir(mode=0o700, exist_ok=True)
    token = d / "auth_token"
    if not token.exists():
        fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    return d


def start_ray(hosts: EmulatedHosts) -> str:
    """A Ray head on host 0 and one node per other host (``--block``: each stays the child that
    ``hosts`` kills at close); returns the head's address."""
    ray_bin = str(Path(sys.executable).with_name("ray"))
    head = f"{hosts.ip(0)}:{HEAD_PORT}"
    log_dir = run_dir(hosts)
    env = ray_env(log_dir / "auth_token")
    common = ["--block", "--disable-usage-stats", f"--object-store-memory={OBJECT_STORE_BYTES}"]
    for i in range(hosts.n):
        role = ["--head", f"--port={HEAD_PORT}", "--include-dashboard=false"] if i == 0 else [f"--address={head}"]
        # a temp dir per node: nodes of one machine would otherwise share socket paths
        argv = [ray_bin, "start", *role, *common, f"--temp-dir={node_dir(hosts, i)}", f"--node-ip-address={hosts.ip(i)}",
                f"--num-cpus={NODE_CPUS[i]}", f"--resources={json.dumps(NODE_RESOURCES[i])}"]
        with open(log_dir / f"node{i}.log", "w") as log:
            hosts.popen(i, argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        if i == 0:
            time.sleep(3.0)   # the GCS first: nodes that start before it retry, but slowly
    return head


def node_dir(hosts: EmulatedHosts, i: int) -> str:
    return f"/tmp/{hosts.tag}n{i}"


def run_link(rate: str, settings: dict[str, Any]) -> dict[str, Any]:
    """One rate: hosts up, Ray across them, the driver's figures, link counters, all torn down."""
    with EmulatedHosts(3, rate) as hosts:
        head = start_ray(hosts)
        logs = run_dir(hosts)
        before = hosts.link_bytes(1)
        argv = [sys.executable, "-m", "pdserve.bench.transfer_link", "--driver",
                json.dumps({**settings, "address": head, "node_ip": hosts.ip(0)})]
        driver = hosts.popen(0, argv, env=ray_env(logs / "auth_token"), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
        try:
            out, _ = driver.communicate(timeout=DRIVER_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            hosts.close()
            raise RuntimeError(f"the driver on {rate} did not finish in {DRIVER_TIMEOUT_S:g} s") from None
        after = hosts.link_bytes(1)
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    if driver.returncode or len(lines) != 1:
        raise RuntimeError(f"the driver on {rate} failed ({driver.returncode}), node logs in {logs}:\n"
                           f"{out[-3000:]}")
    for d in (logs, *(node_dir(hosts, i) for i in range(hosts.n))):
        shutil.rmtree(d, ignore_errors=True)
    cluster = json.loads(lines[0][len("RESULT "):])
    return link_figures(rate, cluster, wire_tx=after.tx - before.tx)


def link_figures(rate: str, cluster: dict[str, Any], wire_tx: int) -> dict[str, Any]:
    """The per-rate figures of the module docstring from the driver's records (pure)."""
    def med(runs: list[dict], key: str) -> float | None:
        vals = [r[key] for r in runs if not r.get("error") and r.get(key) is not None]
        return statistics.median(vals) if vals else None

    runs = cluster["runs"]
    kv_bytes = next((r["kv_bytes"] for r in runs["no_overlap"] if not r.get("error")), None)
    transfer_s = med(runs["no_overlap"], "kv_transfer_s")
    link_gbps = rate_bits(rate) / 1e9
    at_len_gbps = kv_bytes * 8 / transfer_s / 1e9 if kv_bytes and transfer_s else None
    # every no-overlap push of the run, each prompt length: one slow push of three no longer
    # decides the figure (a shared 2-core host preempts the sender now and then)
    pushes = [r["kv_bytes"] * 8 / r["kv_transfer_s"] / 1e9
              for rs in [runs["no_overlap"], *[c["no_overlap"] for c in cluster.get("by_length", {}).values()]]
              for r in rs if not r.get("error") and r.get("kv_transfer_s")]
    transfer_gbps = statistics.median(pushes) if pushes else None
    ttft = {case: med(rs, "ttft_s") for case, rs in runs.items()}
    exposed = {case: med(rs, "kv_exposed_s") for case, rs in runs.items()}
    share = {case: (exposed[case] / ttft[case] if exposed[case] is not None and ttft[case] else None)
             for case in runs}
    by_length = {str(cluster["prompt_len"]): share.get("overlap")}
    for n, cases in cluster.get("by_length", {}).items():
        e, t = med(cases["overlap"], "kv_exposed_s"), med(cases["overlap"], "ttft_s")
        by_length[n] = e / t if e is not None and t else None
    hidden = [int(n) for n, s in by_length.items() if s is not None and s <= HIDDEN_SHARE]
    # The link speed at which the KV leaves as fast as prefill makes it: below it the unhidden
    # part of the transfer grows with the prompt; above it only the last chunk's push is exposed.
    prefill_s = med(runs["no_overlap"], "prefill_s")
    break_even = kv_bytes * 8 / prefill_s / 1e9 if kv_bytes and prefill_s else None
    sent_kv = sum(r["kv_bytes"] for rs in (*runs.values(), *[c for v in cluster.get("by_length", {}).values()
                                                          for c in v.values()])
                  for r in rs if not r.get("error")) + sum(w.get("kv_bytes", 0) for w in cluster["warmup"].values())
    return {
        "link_gbps": link_gbps,
        "kv_bytes": kv_bytes,
        "transfer_s": transfer_s,
        "transfer_gbps": transfer_gbps,
        "transfer_gbps_at_prompt_len": at_len_gbps,
        "pushes": len(pushes),
        "link_utilization": transfer_gbps / link_gbps if transfer_gbps else None,
        "ttft_s": ttft,
        "prefill_s": {case: med(rs, "prefill_s") for case, rs in runs.items()},
        "transfer_share_of_ttft": share,
        "share_by_length": dict(sorted(by_length.items(), key=lambda kv: int(kv[0]))),
        "hidden_up_to_tokens": max(hidden) if hidden else None,
        "break_even_gbps": break_even,
        "wire_bytes": wire_tx,
        "wire_bytes_per_kv_byte": wire_tx / sent_kv if sent_kv else None,
        "errors": cluster["errors"],
        "leaked_blocks": cluster["leaked_blocks"],
        "bytes_match": cluster["bytes_match"],
        "startup_s": cluster.get("startup_s"),
        "records": {"runs": runs, "by_length": cluster.get("by_length", {}), "warmup": cluster["warmup"]},
    }


def run_links(rates: list[str], settings: dict[str, Any]) -> dict[str, Any]:
    for rate in rates:
        rate_bits(rate)   # refuse a bad rate before any host is built
    return {"links": {rate: run_link(rate, settings) for rate in rates}}


# ------------------------------------------------------------------ the driver, inside host 0
def _driver(spec: dict[str, Any]) -> int:
    import ray

    from pdserve.bench.transfer_cluster import run_cluster

    ray.init(address=spec["address"], _node_ip_address=spec["node_ip"], log_to_driver=False,
             namespace=f"pdserve-bench-link-{os.getpid()}")
    deadline = time.monotonic() + 120.0
    while sum(n["Alive"] for n in ray.nodes()) < 3:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {sum(n['Alive'] for n in ray.nodes())} of 3 Ray nodes joined")
        time.sleep(0.5)
    try:
        cluster = run_cluster(spec["model_dir"], prompt_len=spec["prompt_len"], chunk_tokens=spec["chunk_tokens"],
                              threads=spec["threads"], repeats=spec["repeats"], vocab_size=spec["vocab_size"],
                              kv_cache_memory_gb=spec["kv_cache_memory_gb"], env={**WORKER_ENV, **spec["env"]},
                              placement=PLACEMENT,
                              more_lengths=tuple(spec["more_lengths"]))
    finally:
        ray.shutdown()
    cluster["prompt_len"] = spec["prompt_len"]
    print("RESULT " + json.dumps(cluster), flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--driver":
        logging.basicConfig(level=logging.WARNING)
        sys.exit(_driver(json.loads(sys.argv[2])))
    sys.exit("usage: python -m pdserve.bench.transfer_link --driver SPEC_JSON (run by pdserve bench transfer --link)")

"""The real prefill -> decode path of ``pdserve bench transfer``: Ray actors, NIXL between them.

One decode worker and two prefill workers (``overlap_transfer=True`` and ``False``), each its
own OS process, all on loopback. Each request: reserve on the decode worker, prefill (which
pushes the KV into the reserved blocks), then start + drain on the decode worker until it
finishes, so the blocks are freed before the next request and nothing else runs meanwhile.
The first request of each case is a warm-up (it also opens the UCX connection) and checks that
the bytes that landed equal the bytes that were sent.
"""

from __future__ import annotations

import logging
import os
import random
import time
from typing import Any

logger = logging.getLogger(__name__)

#: case name -> the prefill worker's ``overlap_transfer``
CASES: dict[str, bool] = {"overlap": True, "no_overlap": False}

_CALL_TIMEOUT_S = 600.0


def run_cluster(model_dir: str, *, prompt_len: int, chunk_tokens: int, threads: int, repeats: int,
                vocab_size: int, kv_cache_memory_gb: float, env: dict[str, str],
                seed: int = 0, placement: dict[str, dict[str, float]] | None = None,
                more_lengths: tuple[int, ...] = ()) -> dict[str, Any]:
    """Start the workers, run ``1 + repeats`` requests per case (interleaved), stop them.

    ``placement``: Ray custom resources per role ("prefill", "decode") that place the workers on
    particular nodes (emulated hosts). ``more_lengths``: other prompt lengths, ``repeats`` requests
    per case each after the main ones, recorded under ``by_length``."""
    import ray

    from pdserve.cluster.runtime.workers import connect_pools, start_worker, stop_worker, wait_ready
    from pdserve.engine.config import EngineConfig

    own_ray = not ray.is_initialized()
    if own_ray:
        ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=4, log_to_driver=False,
                 namespace=f"pdserve-bench-transfer-{os.getpid()}")
    worker_env = {"UCX_NET_DEVICES": "lo", **env}
    cfg = EngineConfig(model_dir=model_dir, kv_cache_memory_gb=kv_cache_memory_gb,
                       max_num_batched_tokens=chunk_tokens, num_threads=threads)
    tag = f"bt{os.getpid()}"
    t0 = time.perf_counter()
    where = placement or {}
    decode = start_worker("decode", f"{tag}-d", cfg, env=worker_env, resources=where.get("decode"))
    prefill = {case: start_worker("prefill", f"{tag}-p-{case}", cfg, env=worker_env, resources=where.get("prefill"),
                                  worker_kwargs={"overlap_transfer": overlap})
               for case, overlap in CASES.items()}
    handles = [decode, *prefill.values()]
    out: dict[str, Any] = {"env": worker_env, "chunk_tokens": chunk_tokens, "threads": threads,
                           "runs": {c: [] for c in CASES}, "warmup": {}, "errors": 0,
                           "leaked_blocks": 0, "bytes_match": None}
    try:
        wait_ready(handles, timeout_s=_CALL_TIMEOUT_S)
        connect_pools(list(prefill.values()), [decode])
        out["startup_s"] = time.perf_counter() - t0
        rng = random.Random(seed)
        for i in range(1 + repeats):
            for case, p in prefill.items():
                prompt = [rng.randrange(16, vocab_size) for _ in range(prompt_len)]
                rec = _one_request(decode, p, f"{case}-{i}", prompt, verify=i == 0)
                logger.info("%s #%d: %s", case, i, rec)
                if rec.get("error"):
                    out["errors"] += 1
                if i == 0:
                    out["warmup"][case] = rec
                    ok = rec.get("bytes_match")
                    out["bytes_match"] = ok if out["bytes_match"] is None else out["bytes_match"] and ok
                else:
                    out["runs"][case].append(rec)
        if more_lengths:
            out["by_length"] = {str(n): {c: [] for c in CASES} for n in more_lengths}
        for n in more_lengths:
            for i in range(repeats):
                for case, p in prefill.items():
                    prompt = [rng.randrange(16, vocab_size) for _ in range(n)]
                    rec = _one_request(decode, p, f"{case}-{n}-{i}", prompt, verify=False)
                    out["errors"] += bool(rec.get("error"))
                    out["by_length"][str(n)][case].append(rec)
        out["leaked_blocks"] = sum(ray.get([h.actor.blocks_in_use.remote() for h in handles],
                                           timeout=_CALL_TIMEOUT_S))
    finally:
        for h in handles:
            stop_worker(h)
        if own_ray:
            ray.shutdown()
    return out


def _one_request(decode, prefill, rid: str, prompt: list[int], *, verify: bool) -> dict[str, Any]:
    import ray

    from pdserve.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    tp = ray.get(decode.actor.reserve.remote(rid, len(prompt)), timeout=_CALL_TIMEOUT_S)
    t1 = time.perf_counter()
    res = ray.get(prefill.actor.prefill.remote(rid, prompt, params, tp), timeout=_CALL_TIMEOUT_S)
    t2 = time.perf_counter()
    rec: dict[str, Any] = {
        "request_id": rid, "ttft_s": t2 - t0, "reserve_s": t1 - t0, "prefill_call_s": t2 - t1,
        "finish_reason": res.finish_reason, "queue_s": res.queue_s, "prefill_s": res.prefill_s,
        "kv_transfer_s": res.kv_transfer_s, "kv_exposed_s": res.kv_exposed_s, "kv_bytes": res.kv_bytes,
        "kv_blocks": res.kv_blocks, "kv_descriptors": res.kv_descriptors,
        "non_compute_s": (t2 - t0) - res.prefill_s,
    }
    if res.finish_reason != "prefilled":
        rec["error"] = res.error or res.finish_reason
        ray.get(decode.actor.abort.remote(rid), timeout=_CALL_TIMEOUT_S)
        return rec
    if verify:
        dst = ray.get(decode.actor.reserved_blocks.remote(rid), timeout=_CALL_TIMEOUT_S)
        landed = ray.get(decode.actor.read_blocks.remote(dst), timeout=_CALL_TIMEOUT_S)
        sent = ray.get(prefill.actor.read_blocks.remote(res.src_blocks), timeout=_CALL_TIMEOUT_S)
        rec["bytes_match"] = len(dst) == res.kv_blocks and landed == sent
    ray.get(decode.actor.start.remote(rid, prompt, res.first_token_id, params), timeout=_CALL_TIMEOUT_S)
    deadline = time.monotonic() + 120.0
    while time.monotonic() < deadline:
        done = [o for o in ray.get(decode.actor.take_outputs.remote(0.2), timeout=_CALL_TIMEOUT_S)
                if o.request_id == rid and o.finished]
        if done:
            if done[0].finish_reason not in ("stop", "length"):
                rec["error"] = f"decode ended with {done[0].finish_reason}: {done[0].error}"
            return rec
    rec["error"] = "decode did not finish within 120 s"
    ray.get(decode.actor.abort.remote(rid), timeout=_CALL_TIMEOUT_S)
    return rec

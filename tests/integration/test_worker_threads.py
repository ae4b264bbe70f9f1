"""Every core used, none shared: a worker computes on as many threads as Ray gave it CPUs
(not Ray's OMP_NUM_THREADS=1) and is pinned to cores no other worker of the host holds.

Life cycle: A takes every core -> B finds none free and runs unpinned -> A dies -> C gets A's
core (a dead worker's cores are freed) -> everything stopped, the core table empty."""

from __future__ import annotations

import json
import os
import time


from pdserve.cluster.runtime.workers import start_worker, stop_worker, wait_ready
from pdserve.engine.config import EngineConfig


CALL_TIMEOUT_S = 60.0


def stats(handle) -> dict:
    """The worker's report as plain values (``WorkerStats.to_dict``)."""
    import ray

    return ray.get(handle.actor.stats.remote(), timeout=CALL_TIMEOUT_S).to_dict()


def test_workers_get_threads_of_their_cpus_and_distinct_cores(ray_session, tiny_model, tmp_path):
    cores = sorted(os.sched_getaffinity(0))
    n = len(cores)
    # a core table of this test's own: no other test's workers in it; dense kernels: no timing
    env = {"PDSERVE_CORE_DIR": str(tmp_path)}
    config = EngineConfig(model_dir=str(tiny_model), kv_cache_memory_gb=0.02, dtype="float32",
                          linear_backend="dense")
    started = []

    def start(name: str, num_cpus: float):
        h = start_worker("decode", f"thr-{name}-{os.getpid()}", config, num_cpus=num_cpus, env=env)
        started.append(h)
        wait_ready([h], timeout_s=180)
        return h

    try:
        a = start("a", n)                       # every core of the host
        sa = stats(a)
        assert sa["num_threads"] == n and sorted(sa["cores"]) == cores and sa["pinning"] == "pinned"
        assert set(sa["cores"]) == os.sched_getaffinity(sa["pid"])
        assert sa["dtype"] == "float32" and sa["kernels"]["mlp_add"] == "dense"

        b = start("b", 1)                       # nothing left: runs, unpinned, still 1 thread
        sb = stats(b)
        assert sb["num_threads"] == 1 and sb["cores"] == [] and "free cores" in sb["pinning"]

        stop_worker(a, graceful=False)
        deadline = time.monotonic() + 30
        while _alive(sa["pid"]) and time.monotonic() < deadline:
            time.sleep(0.1)
        c = start("c", 1)                       # A's cores are free again
        sc = stats(c)
        assert sc["num_threads"] == 1 and sc["cores"] == [cores[0]]
        assert os.sched_getaffinity(sc["pid"]) == {cores[0]}
        assert set(sc["cores"]).isdisjoint(sb["cores"])
    finally:
        for h in started:
            stop_worker(h, graceful=True)
    table = json.loads((tmp_path / "pdserve-cores.json").read_text())
    assert table == {}                          # graceful shutdown gave every core back


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True

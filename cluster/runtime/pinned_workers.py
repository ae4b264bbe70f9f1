"""The Ray actor classes of the workers: metered workers (``cluster/runtime/metered.py``) that first claim
distinct cores of their host and compute on as many threads as Ray gave them CPUs
(``cluster/runtime/core_allocator.py``). Ray itself sets ``OMP_NUM_THREADS=1`` for a 1-CPU actor and
would leave a 4-CPU worker computing on one thread."""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from pdserve.cluster.runtime.core_allocator import CoreAllocator, place_this_process
from pdserve.cluster.runtime.metered import MeteredDecodeWorker, MeteredPrefillWorker
from pdserve.engine.config import EngineConfig
from pdserve.engine.contract import WorkerStats
from pdserve.engine.gc_freeze import freeze_startup_heap

logger = logging.getLogger(__name__)


def log_to_ray() -> None:
    """pdserve's INFO events (model load, kernel choice, readiness, failures) on this worker
    process's stderr, which Ray keeps as the actor's log (the dashboard's Actors -> Logs, and
    ``/tmp/ray/session_latest/logs/worker-*.err``); Ray's workers otherwise keep only warnings."""
    pkg = logging.getLogger("pdserve")
    if not any(getattr(h, "_pdserve_ray", False) for h in pkg.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        handler._pdserve_ray = True  # type: ignore[attr-defined]
        pkg.addHandler(handler)
        pkg.propagate = False
    pkg.setLevel(logging.INFO)


class _Pinned:
    def __init__(self, worker_id: str, engine_config: EngineConfig, *, num_cpus: float = 1.0, **kwargs) -> None:
        log_to_ray()
        t0 = time.monotonic()
        self._placement = place_this_process(num_cpus, engine_config.num_threads)
        logger.info("worker %s starting: %s on %d thread(s), %s, dtype %s", worker_id, engine_config.model_dir,
                    self._placement.threads,
                    f"cores {list(self._placement.cores)}" if self._placement.cores else
                    f"unpinned ({self._placement.reason})", engine_config.dtype)
        try:
            super().__init__(worker_id, replace(engine_config, num_threads=self._placement.threads), **kwargs)
        except BaseException:
            logger.exception("worker %s failed to start", worker_id)
            CoreAllocator().release()
            raise
        freeze_startup_heap(f"worker {worker_id}")
        logger.info("worker %s ready in %.1f s", worker_id, time.monotonic() - t0)

    def stats(self) -> WorkerStats:
        return replace(super().stats(), **self._placement.as_stats())

    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            CoreAllocator().release()


class PinnedPrefillWorker(_Pinned, MeteredPrefillWorker):
    pass


class PinnedDecodeWorker(_Pinned, MeteredDecodeWorker):
    def _remote(self, actor, method: str, *args, timeout_s: float = 30.0, **kwargs):
        """Another worker's actor method, awaited (live KV migration calls its target's
        ``reserve``, ``start`` and ``abort``)."""
        import ray

        return ray.get(getattr(actor, method).remote(*args, **kwargs), timeout=timeout_s)

"""The Ray actor classes of the workers: metered workers (``cluster/metered.py``) that first claim
distinct cores of their host and compute on as many threads as Ray gave them CPUs
(``cluster/core_allocator.py``). Ray itself sets ``OMP_NUM_THREADS=1`` for a 1-CPU actor and
would leave a 4-CPU worker computing on one thread."""

from __future__ import annotations

import logging
from dataclasses import replace

from pdserve.cluster.core_allocator import CoreAllocator, place_this_process
from pdserve.cluster.metered import MeteredDecodeWorker, MeteredPrefillWorker
from pdserve.engine.config import EngineConfig
from pdserve.engine.contract import WorkerStats

logger = logging.getLogger(__name__)


class _Pinned:
    def __init__(self, worker_id: str, engine_config: EngineConfig, *, num_cpus: float = 1.0, **kwargs) -> None:
        self._placement = place_this_process(num_cpus, engine_config.num_threads)
        try:
            super().__init__(worker_id, replace(engine_config, num_threads=self._placement.threads), **kwargs)
        except BaseException:
            CoreAllocator().release()
            raise

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
    pass

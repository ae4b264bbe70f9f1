"""Worker actor classes that also publish Ray metrics (``cluster/runtime/metrics.py``) from inside the
worker process. The worker services themselves stay free of Ray; this module gives them an
observer (``worker.base.WorkerObserver``) whose hooks they call as things happen."""

from __future__ import annotations

import logging
import threading
from dataclasses import replace

from pdserve.decode_worker.worker import DecodeWorker
from pdserve.engine.contract import WorkerStats
from pdserve.engine.contract import RequestPhase
from pdserve.kv_transfer.engine_layout import model_identity
from pdserve.worker.base import WorkerObserver
from pdserve.cluster.runtime.metrics import EngineMetrics
from pdserve.prefill_worker.worker import PrefillWorker

logger = logging.getLogger(__name__)

STATS_INTERVAL_S = 1.0


class _Publisher:
    """Pushes the engine's stats into the metrics every second, on its own thread."""

    def __init__(self, worker, role: str) -> None:
        model = worker.engine.config.model_dir.rstrip("/").rsplit("/", 1)[-1] or model_identity(
            worker.engine.config.model_dir)
        self.metrics = EngineMetrics(role, worker.worker_id, model)
        self._worker = worker
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(STATS_INTERVAL_S):
            try:
                self.metrics.update_engine(self._worker.engine.stats())
            except Exception:
                logger.exception("metrics update failed")

    def stop(self) -> None:
        self._stop.set()
        self.metrics.close()


def _placement() -> dict[str, str]:
    """The Ray node this worker runs on (operators see it in ``pdserve status``)."""
    import ray

    try:
        return {"node_id": ray.get_runtime_context().get_node_id(),
                "node_ip": ray.util.get_node_ip_address()}
    except Exception as exc:  # outside a Ray worker: nothing to report
        logger.debug("no Ray placement: %s", exc)
        return {"node_id": "", "node_ip": ""}


class _Placed:
    """Adds the worker's node (read once, at start) to its stats."""

    _node: dict[str, str]

    def _base_stats(self, **role_fields: object) -> WorkerStats:
        return replace(super()._base_stats(**role_fields), **self._node)


class _MetricsObserver(WorkerObserver):
    """The worker's hooks, recorded as Ray metrics."""

    def __init__(self, metrics) -> None:
        self.metrics = metrics

    def itl_gaps(self, gaps_s: list[float]) -> None:
        self.metrics.observe_itl(gaps_s)

    def request_finished(self, phase: RequestPhase) -> None:
        self.metrics.observe_finished(phase)

    def transfer_done(self, kv_bytes: int, seconds: float) -> None:
        self.metrics.observe_transfer(kv_bytes, seconds)

    def transfer_failed(self) -> None:
        self.metrics.observe_transfer_failure()


class MeteredPrefillWorker(_Placed, PrefillWorker):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._node = _placement()
        self._publisher = _Publisher(self, "prefill")
        self.observer = _MetricsObserver(self._publisher.metrics)

    def shutdown(self) -> None:
        self._publisher.stop()
        super().shutdown()


class MeteredDecodeWorker(_Placed, DecodeWorker):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._node = _placement()
        self._publisher = _Publisher(self, "decode")
        self.observer = _MetricsObserver(self._publisher.metrics)

    def shutdown(self) -> None:
        self._publisher.stop()
        super().shutdown()

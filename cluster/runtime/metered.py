"""The worker actor's observer: the worker's hooks (``worker.base.WorkerObserver``) recorded as
Ray metrics (``cluster/runtime/metrics.py``), and the engine's stats pushed into them every
second on a thread of their own. The worker services themselves stay free of Ray."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.cluster.runtime.metrics import EngineMetrics
from pdserve.engine.contract import RequestPhase, WorkerRole
from pdserve.engine.llm_engine import EngineStats
from pdserve.kv_transfer.engine_layout import model_identity
from pdserve.worker.base import WorkerObserver

logger = logging.getLogger(__name__)

STATS_INTERVAL_S = 1.0


def model_label(model_dir: str) -> str:
    """The model's metric label: its directory's name (its identity hash when it has none)."""
    return model_dir.rstrip("/").rsplit("/", 1)[-1] or model_identity(model_dir)


class MetricsObserver(WorkerObserver):
    """The worker's hooks as Ray metrics, and its engine's stats published every second
    (``start_publishing``) until ``stop``."""

    def __init__(self, role: WorkerRole, worker_id: str, model: str) -> None:
        self.metrics = EngineMetrics(role, worker_id, model)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start_publishing(self, engine_stats: Callable[[], EngineStats]) -> None:
        def run() -> None:
            while not self._stop.wait(STATS_INTERVAL_S):
                try:
                    self.metrics.update_engine(engine_stats())
                except Exception:
                    logger.exception("metrics update failed")

        self._thread = threading.Thread(target=run, name="metrics", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.metrics.close()

    def itl_gaps(self, gaps_s: list[float]) -> None:
        self.metrics.observe_itl(gaps_s)

    def request_finished(self, phase: RequestPhase) -> None:
        self.metrics.observe_finished(phase)

    def transfer_done(self, kv_bytes: int, seconds: float) -> None:
        self.metrics.observe_transfer(kv_bytes, seconds)

    def transfer_failed(self) -> None:
        self.metrics.observe_transfer_failure()


@dataclass(frozen=True, slots=True)
class RayNode:
    """The Ray node a worker runs on, read once at start (operators see it in ``pdserve status``)."""

    node_id: str = ""
    node_ip: str = ""

    @classmethod
    def here(cls) -> RayNode:
        import ray

        try:
            return cls(ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address())
        except Exception as exc:  # outside a Ray worker: nothing to report
            logger.debug("no Ray placement: %s", exc)
            return cls()

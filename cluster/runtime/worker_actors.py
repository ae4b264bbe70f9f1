"""The Ray actor classes of the workers, each built from three parts:

- the engine worker (``PrefillWorker`` or ``DecodeWorker``: Ray-free services);
- its observer (``cluster/runtime/metered.py``): the worker's hooks and its engine's stats as
  Ray metrics;
- its pinning policy (``cluster/runtime/core_allocator.py``): distinct cores of its host, claimed
  before the engine is built, so the worker computes on as many threads as Ray gave it CPUs (Ray
  itself sets ``OMP_NUM_THREADS=1`` for a 1-CPU actor and would leave a 4-CPU worker computing on
  one thread).

An actor's methods are what the router, the pool manager and the other workers call remotely;
each hands the call to the engine worker. ``stats`` is the worker's report with where it runs
(the Ray node and the cores) filled in."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

from pdserve.cluster.runtime.core_allocator import CorePinning
from pdserve.cluster.runtime.metered import MetricsObserver, RayNode, model_label
from pdserve.decode_worker.migration import MIGRATION_CALL_TIMEOUT_S, MigrationOutcome, MigrationTarget
from pdserve.decode_worker.worker import DEFAULT_OWNER, DecodeWorker, StreamRecord
from pdserve.engine.config import EngineConfig
from pdserve.engine.contract import PrefillResult, StepOutput, WorkerStats
from pdserve.engine.gc_freeze import freeze_startup_heap
from pdserve.engine.kv_events import KVEvent
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import Priority
from pdserve.prefill_worker.worker import PrefillWorker
from pdserve.worker.base import WorkerBase

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


class _WorkerActor:
    """What both actors share: start (cores, engine worker, observer), the peer and status calls, stop."""

    worker: WorkerBase

    def __init__(self, worker_id: str, engine_config: EngineConfig, *, num_cpus: float = 1.0,
                 **worker_kwargs: Any) -> None:
        log_to_ray()
        t0 = time.monotonic()
        self.pinning = CorePinning.claim(num_cpus, engine_config.num_threads)
        placement = self.pinning.placement
        logger.info("worker %s starting: %s on %d thread(s), %s, dtype %s", worker_id, engine_config.model_dir,
                    placement.threads,
                    f"cores {list(placement.cores)}" if placement.cores else f"unpinned ({placement.reason})",
                    engine_config.dtype)
        try:
            self.worker = self._build(worker_id, replace(engine_config, num_threads=placement.threads),
                                      **worker_kwargs)
            self.node = RayNode.here()
            self.observer = MetricsObserver(self.worker.role, worker_id,
                                            model_label(self.worker.engine.config.model_dir))
            self.observer.start_publishing(self.worker.engine.stats)
            self.worker.observer = self.observer
        except BaseException:
            logger.exception("worker %s failed to start", worker_id)
            self.pinning.release()
            raise
        freeze_startup_heap(f"worker {worker_id}")
        logger.info("worker %s ready in %.1f s", worker_id, time.monotonic() - t0)

    def _build(self, worker_id: str, engine_config: EngineConfig, **worker_kwargs: Any) -> WorkerBase:
        raise NotImplementedError

    # ------------------------------------------------------------------ peers
    def metadata(self) -> bytes:
        return self.worker.metadata()

    def add_peer(self, peer_metadata: bytes) -> str:
        return self.worker.add_peer(peer_metadata)

    # ------------------------------------------------------------- status
    def stats(self) -> WorkerStats:
        stats = self.worker.stats()
        return self.pinning.placement.stamp(replace(stats, node_id=self.node.node_id, node_ip=self.node.node_ip))

    def read_blocks(self, block_ids: list[int]) -> bytes:
        return self.worker.read_blocks(block_ids)

    def blocks_in_use(self) -> int:
        return self.worker.blocks_in_use()

    def ping(self) -> str:
        return self.worker.ping()

    def shutdown(self) -> None:
        try:
            self.observer.stop()
            self.worker.shutdown()
        finally:
            self.pinning.release()


class PrefillWorkerActor(_WorkerActor):
    worker: PrefillWorker

    def _build(self, worker_id: str, engine_config: EngineConfig, **worker_kwargs: Any) -> PrefillWorker:
        return PrefillWorker(worker_id, engine_config, **worker_kwargs)

    def prefill(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                transfer_params: bytes, priority: Priority = Priority.INTERACTIVE,
                timeout_s: float | None = None) -> PrefillResult:
        return self.worker.prefill(request_id, prompt_token_ids, params, transfer_params, priority, timeout_s)

    def extend(self, request_id: str, expires_at: float) -> bool:
        return self.worker.extend(request_id, expires_at)

    def abort(self, request_id: str) -> bool:
        return self.worker.abort(request_id)

    def take_kv_events(self) -> list[KVEvent]:
        return self.worker.take_kv_events()


class RayDecodePeer:
    """Another decode worker's actor as a ``MigrationPeer``: each call awaited, at most ``timeout_s``."""

    def __init__(self, actor: Any, timeout_s: float = MIGRATION_CALL_TIMEOUT_S) -> None:
        self._actor = actor
        self._timeout_s = timeout_s

    def _wait(self, ref: Any) -> Any:
        import ray

        return ray.get(ref, timeout=self._timeout_s)

    def reserve(self, request_id: str, num_prompt_tokens: int, owner: str) -> bytes:
        return self._wait(self._actor.reserve.remote(request_id, num_prompt_tokens, owner=owner))

    def start(self, request_id: str, prompt_token_ids: list[int], first_token_id: int, params: SamplingParams,
              priority: Priority, resume_key: str) -> None:
        self._wait(self._actor.start.remote(request_id, prompt_token_ids, first_token_id, params, priority,
                                            resume_key=resume_key))

    def abort(self, request_id: str) -> bool:
        return self._wait(self._actor.abort.remote(request_id))


class DecodeWorkerActor(_WorkerActor):
    worker: DecodeWorker

    def _build(self, worker_id: str, engine_config: EngineConfig, **worker_kwargs: Any) -> DecodeWorker:
        return DecodeWorker(worker_id, engine_config, **worker_kwargs)

    def reserve(self, request_id: str, num_prompt_tokens: int, timeout_s: float | None = None,
                owner: str = DEFAULT_OWNER) -> bytes:
        return self.worker.reserve(request_id, num_prompt_tokens, timeout_s, owner)

    def start(self, request_id: str, prompt_token_ids: list[int], first_token_id: int, params: SamplingParams,
              priority: Priority = Priority.INTERACTIVE, resume_key: str = "") -> None:
        self.worker.start(request_id, prompt_token_ids, first_token_id, params, priority, resume_key)

    def renew(self, request_id: str, timeout_s: float | None = None) -> float:
        return self.worker.renew(request_id, timeout_s)

    def generate_local(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       priority: Priority = Priority.INTERACTIVE, owner: str = DEFAULT_OWNER, resume_key: str = "") -> None:
        self.worker.generate_local(request_id, prompt_token_ids, params, priority, owner, resume_key)

    def take_stream(self, resume_key: str) -> StreamRecord | None:
        return self.worker.take_stream(resume_key)

    def abort(self, request_id: str, sender_dead: bool = False) -> bool:
        return self.worker.abort(request_id, sender_dead)

    def take_outputs(self, timeout_s: float = 0.05, owner: str = DEFAULT_OWNER) -> list[StepOutput]:
        return self.worker.take_outputs(timeout_s, owner)

    def reserved_blocks(self, request_id: str) -> list[int]:
        return self.worker.reserved_blocks(request_id)

    def migrate_out(self, targets: list[tuple[str, Any]]) -> MigrationOutcome:
        """Move this worker's running streams to ``targets`` ((worker id, actor) pairs, tried in
        order) with their KV (``decode_worker/migration.py``)."""
        return self.worker.migrate_out([MigrationTarget(worker_id, RayDecodePeer(actor))
                                        for worker_id, actor in targets])

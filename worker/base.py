"""What a prefill worker and a decode worker share: an engine driven by its own loop thread,
a NIXL agent over the engine's KV cache, and the control calls around them."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import replace
from collections.abc import Callable

from pdserve.engine.config import EngineConfig, EngineMode
from pdserve.engine.contract import WorkerRole, WorkerStats
from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.llm_engine import LLMEngine, StepOutput
from pdserve.engine.contract import RequestPhase
from pdserve.kv_transfer.agent import KVAgent, KVAgentConfig
from pdserve.kv_transfer.engine_layout import layout_of

logger = logging.getLogger(__name__)


class WorkerObserver:
    """What a worker reports as it happens, to whoever watches (the Ray metrics of
    ``cluster/runtime/metered.py``). The worker calls these hooks; each does nothing here. A hook that
    raises is logged and never disturbs the request it reports on."""

    def itl_gaps(self, gaps_s: list[float]) -> None:
        """A decode step's inter-token gaps, in seconds."""

    def request_finished(self, phase: RequestPhase) -> None:
        """A request ended on this decode worker, with its phase record."""

    def transfer_done(self, kv_bytes: int, seconds: float) -> None:
        """A prefill worker's KV push completed."""

    def transfer_failed(self) -> None:
        """A prefill worker's KV push failed."""


class WorkerBase:
    """Subclasses set ``role`` and start the loop with their own hooks (``_start_loop``)."""

    role: WorkerRole

    def __init__(self, worker_id: str, engine_config: EngineConfig, mode: EngineMode) -> None:
        if engine_config.mode is not mode:
            raise ValueError(f"a {self.role} worker needs an engine in {mode.value} mode")
        self.worker_id = worker_id
        # The router detokenizes; the worker's engine decodes text only for stop strings.
        self.engine = LLMEngine(replace(engine_config, detokenize=False))
        self.layout = layout_of(self.engine)
        self.agent = KVAgent(worker_id, self.engine.runner.kv_cache, self.layout,
                             KVAgentConfig(staging=engine_config.kv_staging))
        self.started_at = time.time()
        self._loop: EngineLoop | None = None
        self.observer = WorkerObserver()

    def _start_loop(self, on_outputs: Callable[[list[StepOutput]], None], on_tick: Callable[[], bool]) -> None:
        self._loop = EngineLoop(self.engine, on_outputs, on_tick, name=f"{self.role}-{self.worker_id}")
        self._loop.start()

    def _notify(self, hook: Callable[..., None], *args: object) -> None:
        try:
            hook(*args)
        except Exception:
            logger.exception("worker observer %s failed", getattr(hook, "__name__", hook))

    # ------------------------------------------------------------------ peers
    def metadata(self) -> bytes:
        return self.agent.metadata()

    def add_peer(self, peer_metadata: bytes) -> str:
        return self._loop.call(lambda _e: self.agent.add_peer(peer_metadata))

    # ------------------------------------------------------------- status
    def _base_stats(self, **role_fields: object) -> WorkerStats:
        """The report every worker gives; ``role_fields`` are its role's own ``WorkerStats`` fields.
        The engine's resolved dtype, threads and matmul kernels ride along (``pdserve status``)."""
        s = self.engine.stats()
        d = self.engine.runner.describe()
        return WorkerStats(
            worker_id=self.worker_id, role=self.role, num_running=s.num_running, num_waiting=s.num_waiting,
            num_free_blocks=s.num_free_blocks, num_blocks=s.num_blocks, kv_usage=s.kv_usage,
            prefix_hit_rate=s.prefix_hit_rate, generated_tokens=s.generated_tokens,
            prompt_tokens_computed=s.prompt_tokens_computed, prefill_compute_s=s.prefill_compute_s,
            prefill_budget_tokens=s.prefill_budget_tokens,
            max_prefill_tokens_with_decodes=s.max_prefill_tokens_with_decodes,
            num_batch_seqs=s.num_batch_seqs, batch_kv_usage=s.batch_kv_usage,
            kv_open_transfers=self.agent.open_handles, kv_mailboxes=self.agent.subscriptions,
            started_at=self.started_at, niceness=os.getpriority(os.PRIO_PROCESS, 0), pid=os.getpid(),
            transfer_timeout_s=getattr(self, "transfer_timeout_s", None),
            dtype=str(d["dtype"]), num_threads=int(d["num_threads"]), linear_backend=str(d["linear_backend"]),
            kernels=dict(d["kernels"]), kernels_source=str(d["kernels_source"]),
            attention_backend=str(d["attention_backend"]), **role_fields)

    def read_blocks(self, block_ids: list[int]) -> bytes:
        """Raw bytes of KV blocks (diagnostics and tests compare what was sent and what landed)."""
        return self._loop.call(lambda e: e.runner.read_blocks(block_ids))

    def blocks_in_use(self) -> int:
        """KV blocks referenced by a request or reservation (0 when idle: nothing leaked)."""
        return self._loop.call(lambda e: e.block_manager.num_used_blocks)

    def ping(self) -> str:
        return self.worker_id

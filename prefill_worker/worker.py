"""The prefill service: an engine in prefill-only mode that pushes each prompt's KV blocks into
blocks a decode worker reserved, chunk by chunk, so the transfer hides behind the compute.

Life of one request here:
1. ``prefill`` receives the prompt and the decode side's ``TransferParams`` (its reserved
   blocks); a ``KVSender`` is created (compatibility is checked before any byte moves).
2. The engine prefills the prompt with others, chunk by chunk; blocks served by the prefix
   cache are final at once.
3. After every step the blocks that became full are written to the decode worker at once
   (overlap), while later chunks are still computing.
4. The step that finishes the prompt samples the first token; the last (partial) block is
   written and the sender finishes: the DONE notification follows the last write.
5. When the sender is DONE, the engine releases the request's blocks (full ones stay in the
   prefix cache) and the caller gets a ``PrefillResult``. Any failure (transfer error,
   timeout, abort) releases the blocks too and returns an explicit error.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

from pdserve.engine.config import EngineConfig, EngineMode
from pdserve.engine.contract import PrefillResult, WorkerRole, WorkerStats
from pdserve.engine.kv_events import KVEvent
from pdserve.engine.llm_engine import LLMEngine, StepOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import Priority
from pdserve.kv_transfer import KVSender, SendState, TransferParams
from pdserve.worker.base import WorkerBase

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Job:
    request_id: str
    sender: KVSender
    dst_blocks: tuple[int, ...]
    future: Future
    deadline: float
    sent_blocks: int = 0
    num_prompt_tokens: int = 0
    finishing: bool = False
    result: PrefillResult | None = None
    first_token_at: float = 0.0
    src_blocks: list[int] = field(default_factory=list)


class PrefillWorker(WorkerBase):
    role = WorkerRole.PREFILL

    def __init__(self, worker_id: str, engine_config: EngineConfig, *, transfer_timeout_s: float = 30.0,
                 overlap_transfer: bool = True) -> None:
        """``overlap_transfer=False`` sends every block only after the whole prompt is computed
        (the baseline the transfer benchmark compares against)."""
        super().__init__(worker_id, engine_config, EngineMode.PREFILL)
        self.transfer_timeout_s = transfer_timeout_s
        self.overlap_transfer = overlap_transfer
        self._jobs: dict[str, _Job] = {}
        self._events: list[KVEvent] = []
        self._events_lock = threading.Lock()
        self.engine.between_layers = self._advance_pushes
        self._start_loop(self._on_outputs, self._on_tick)

    # ------------------------------------------------------------------ peers
    # --------------------------------------------------------------- requests
    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               transfer_params: bytes, priority: Priority = Priority.INTERACTIVE) -> Future:
        """Start prefilling; the future resolves to a ``PrefillResult`` (never raises for a
        request-level failure: those come back as ``finish_reason="error"``)."""
        transfer = TransferParams.from_bytes(transfer_params)
        fut: Future = Future()
        arrived = time.monotonic()  # the wait for the running step counts in the request's queue time

        def start(engine: LLMEngine) -> None:
            sender = KVSender(self.agent, transfer)  # checks compatibility before anything moves
            try:
                engine.add_request(request_id, prompt_token_ids, params, priority, arrival_time=arrived)
            except BaseException:
                sender.close()
                raise
            self._jobs[request_id] = _Job(request_id, sender, transfer.dst_blocks, fut, self._deadline_of(transfer),
                                          num_prompt_tokens=len(prompt_token_ids))

        started = self._loop.submit(start, urgent=priority is Priority.INTERACTIVE)
        started.add_done_callback(lambda f: f.exception() and not fut.done() and fut.set_exception(f.exception()))
        return fut

    def _deadline_of(self, transfer: TransferParams) -> float:
        """The job's deadline (monotonic): the decode side's reservation expiry when it has one,
        which the router renews while the job waits or runs; else the transfer timeout."""
        if transfer.expires_at:
            return time.monotonic() + max(0.0, transfer.expires_at - time.time())
        return time.monotonic() + self.transfer_timeout_s

    def extend(self, request_id: str, expires_at: float) -> bool:
        """The decode side renewed this request's reservation until ``expires_at`` (epoch s):
        its blocks may be written until then. False when the job is no longer here."""
        def do(_engine: LLMEngine) -> bool:
            job = self._jobs.get(request_id)
            if job is None or expires_at <= job.sender.params.expires_at:
                return job is not None
            job.sender.params = replace(job.sender.params, expires_at=expires_at)
            job.deadline = max(job.deadline, self._deadline_of(job.sender.params))
            return True

        return self._loop.call(do)

    def prefill(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                transfer_params: bytes, priority: Priority = Priority.INTERACTIVE,
                timeout_s: float | None = None) -> PrefillResult:
        """Blocking form of ``submit`` (Ray runs it on one of the actor's threads). Without
        ``timeout_s`` it waits as long as the job lives: a queued job is bounded by its
        reservation's expiry, which only the router's renewals move."""
        return self.submit(request_id, prompt_token_ids, params, transfer_params, priority).result(
            timeout=timeout_s)

    def abort(self, request_id: str) -> bool:
        def do(engine: LLMEngine) -> bool:
            job = self._jobs.get(request_id)
            if job is not None:
                job.sender.abort("aborted by the router")
                self._fail(job, "abort", "request aborted")
            return engine.abort(request_id) or job is not None
        return self._loop.call(do)

    # ------------------------------------------------------------ loop hooks
    def _on_outputs(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            job = self._jobs.get(out.request_id)
            if job is None:
                continue
            try:
                self._on_output(job, out)
            except Exception as exc:  # one request's failed transfer must not strand the others
                logger.warning("request %s: KV transfer failed: %s", job.request_id, exc)
                self._abort_job(job, f"KV transfer failed: {exc}")

    def _on_output(self, job: _Job, out: StepOutput) -> None:
        if not out.finished:
            if self.overlap_transfer:
                self._send_ready_blocks(job, out.num_computed_tokens // self.engine.config.block_size)
            return
        phase = out.phase
        result = PrefillResult(out.request_id, self.worker_id, out.finish_reason or "error",
                               first_token_id=out.new_token_ids[0] if out.new_token_ids else None,
                               first_token_logprobs=out.new_logprobs[0] if out.new_logprobs else None,
                               prompt_logprobs=out.prompt_logprobs,
                               error=out.error, error_code=out.error_code)
        if phase is not None:
            result.prompt_tokens = phase.prompt_tokens
            result.cached_prompt_tokens = phase.cached_prompt_tokens
            result.queue_s = phase.queue_s
            result.prefill_s = phase.prefill_s
        job.result = result
        job.first_token_at = time.perf_counter()
        if out.finish_reason == "prefilled":
            total = -(-job.num_prompt_tokens // self.engine.config.block_size)
            if self._send_ready_blocks(job, total):
                job.sender.finish()
                job.finishing = True
        else:
            # Ended at its first token (stop/length) or failed: nothing to decode remotely.
            job.sender.abort(f"request ended at prefill: {out.finish_reason}")
            self._resolve(job)

    def _send_ready_blocks(self, job: _Job, upto: int) -> bool:
        """Write blocks ``[sent_blocks, upto)``; False if the job ended (it is then resolved)."""
        seq = self.engine.held(job.request_id) or self.engine.scheduler.get(job.request_id)
        if seq is None or upto <= job.sent_blocks:
            return seq is not None
        src = seq.block_table[job.sent_blocks:upto]
        dst = list(job.dst_blocks[job.sent_blocks:upto])
        try:
            job.sender.write(src, dst)
        except Exception as exc:
            logger.warning("request %s: KV write failed: %s", job.request_id, exc)
            self._abort_job(job, f"KV transfer failed: {exc}")
            return False
        job.src_blocks.extend(src)
        job.sent_blocks = upto
        return True

    def _on_tick(self) -> bool:
        now = time.monotonic()
        for job in list(self._jobs.values()):
            try:
                self._poll_job(job, now)
            except Exception as exc:  # e.g. NIXL raising for a lost peer: end this job only
                logger.warning("request %s: KV transfer failed: %s", job.request_id, exc)
                self._abort_job(job, f"KV transfer failed: {exc}")
        self._collect_events()
        return bool(self._jobs)

    def _advance_pushes(self) -> None:
        """Between two layers of a step: move the finished prompts' KV pushes on (NIXL progresses
        when polled) and answer each caller whose push landed, so its first token and the decode
        side's start do not wait for the end of the step. Only reads and answers: freeing the
        blocks, failures and deadlines stay with ``_on_tick`` between steps."""
        for job in self._jobs.values():
            if job.finishing and not job.future.done() and job.sender.poll() is SendState.DONE:
                self._fill_transfer(job)
                job.future.set_result(job.result)

    def _fill_transfer(self, job: _Job) -> None:
        st = job.sender.stats
        assert job.result is not None  # set by _on_output before finishing
        job.result.kv_bytes = st.nbytes
        job.result.kv_blocks = st.blocks
        job.result.kv_descriptors = st.descriptors
        job.result.kv_transfer_s = st.seconds or 0.0
        job.result.kv_exposed_s = max(0.0, (st.done_at or 0.0) - job.first_token_at)
        job.result.src_blocks = list(job.src_blocks)

    def _poll_job(self, job: _Job, now: float) -> None:
        state = job.sender.poll()
        if state is SendState.DONE and job.finishing:
            if not job.future.done():
                self._fill_transfer(job)
            self._resolve(job)
        elif state in (SendState.FAILED, SendState.ABORTED):
            self._abort_job(job, f"KV transfer {state.value}: {job.sender.reason}")
        elif now > job.deadline:
            self._abort_job(job, "KV transfer timed out: the decode side's reservation expired "
                                 "(no renewal from the router)")

    def _abort_job(self, job: _Job, message: str) -> None:
        """End a job with an error: stop its sender, free its blocks, resolve its caller."""
        if self._jobs.get(job.request_id) is not job:
            return  # already resolved
        job.sender.abort(message)
        self.engine.abort(job.request_id)
        self._fail(job, "error", message)

    def _resolve(self, job: _Job) -> None:  # every request ends here, on the loop thread
        result = job.result
        if result is not None and result.kv_bytes:
            self._notify(self.observer.transfer_done, result.kv_bytes, result.kv_transfer_s)
        elif result is not None and result.finish_reason == "error" and "transfer" in (result.error or ""):
            self._notify(self.observer.transfer_failed)
        self._jobs.pop(job.request_id, None)
        self.engine.release(job.request_id)
        job.sender.close()
        if not job.future.done():
            job.future.set_result(job.result)

    def _fail(self, job: _Job, reason: str, message: str) -> None:
        job.result = PrefillResult(job.request_id, self.worker_id, reason, error=message)
        self._resolve(job)

    def _collect_events(self) -> None:
        events = self.engine.block_manager.drain_events()
        if events:
            with self._events_lock:
                self._events.extend(events)

    # ------------------------------------------------------------- status
    def take_kv_events(self) -> list[KVEvent]:
        """KV events since the last call (a block's chain hash stored or removed), for prefix-aware routing."""
        with self._events_lock:
            events, self._events = self._events, []
        return events

    def stats(self) -> WorkerStats:
        return self._base_stats(in_flight=len(self._jobs))

    def shutdown(self) -> None:
        self._loop.stop()
        for job in list(self._jobs.values()):
            job.sender.abort("prefill worker shutting down")
            self._fail(job, "error", "prefill worker shut down")
        self.agent.close()

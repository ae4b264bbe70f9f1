"""The decode service: reserves blocks for incoming KV, admits requests once their KV landed,
decodes them with continuous batching, and streams every request's new tokens in one batch
per step. It can also prefill locally when the router decides not to disaggregate.

Life of one disaggregated request here:
1. ``reserve``: blocks for the prompt are reserved and a ``KVReceiver`` waits for them
   (with a deadline); the caller gets the ``TransferParams`` for the prefill worker.
2. The prefill worker writes the blocks; the receiver sees them land (``poll`` on each tick).
3. ``start``: with the first token from the prefill worker, the request joins the running
   batch on the next step after the KV has landed.
4. Each step's tokens go to the outbox of the router that sent the request (``owner``);
   ``take_outputs`` hands that router all of its outputs at once. A worker serves several routers:
   a router that stops taking its outputs for ``owner_gone_after_s`` is gone, and its requests
   are aborted here (their blocks freed), so a dead router's streams never hold KV.
5. Finish, abort, a failed or timed-out transfer: the blocks are freed (reserved blocks only
   once no write of that request can still land in them).
"""

from __future__ import annotations

import logging
import threading
import time
from array import array
from collections import deque
from dataclasses import dataclass

from pdserve.engine.config import EngineConfig, EngineMode
from pdserve.engine.contract import RequestPhase, WorkerRole, WorkerStats
from pdserve.engine.errors import InvalidRequestError, KVTransferError
from pdserve.engine.llm_engine import LLMEngine, StepOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import Priority
from pdserve.kv_transfer import KVReceiver, RecvState
from pdserve.decode_worker.migration import MigrationMixin
from pdserve.worker.base import WorkerBase

logger = logging.getLogger(__name__)

ITL_WINDOW_S = 10.0  # the window of the inter-token latency a decode worker reports
# The owner of requests sent without one: a single router (tests, the local backend).
DEFAULT_OWNER = ""
MAX_ENDED_STREAMS = 10_000  # ended streams kept for resuming, at most (the oldest go first)


@dataclass(frozen=True, slots=True)
class _PendingStart:
    """What ``start`` asked to admit once the request's KV has landed."""

    prompt_token_ids: list[int]
    first_token_id: int
    params: SamplingParams
    priority: Priority


@dataclass(slots=True)
class StreamRecord:
    """What a decode worker knows of a stream a client may resume on another router: every token
    of the sequence (prompt, then output), and how it ended (None: it had not; "abort": it was
    cut off, e.g. its router died), so the resuming router can send the rest."""

    token_ids: list[int]   # kept as array("l") on the worker (8 bytes a token, not a list's ~36), a list when sent
    num_prompt_tokens: int
    finish_reason: str | None = None
    ended_at: float = 0.0


@dataclass(slots=True)
class _Reservation:
    request_id: str
    blocks: list[int]
    receiver: KVReceiver
    # Set by ``start``: what to admit once the KV has landed.
    pending_start: _PendingStart | None = None
    ending: bool = False  # aborted/failed: waiting until the blocks are reusable
    # A reservation whose ``start`` never comes (the router died) is dropped after this.
    expires_at: float = 0.0


class DecodeWorker(MigrationMixin, WorkerBase):
    role = WorkerRole.DECODE

    def __init__(self, worker_id: str, engine_config: EngineConfig, *, transfer_timeout_s: float = 30.0,
                 outbox_limit: int = 1_000_000, kv_quarantine_s: float = 5.0,
                 owner_gone_after_s: float = 30.0, resume_window_s: float = 120.0) -> None:
        """``kv_quarantine_s``: how long the reserved blocks of a transfer that did not land stay
        unusable when the prefill side never confirms it stopped writing (see ``KVReceiver``).
        ``owner_gone_after_s``: a router that has not taken its outputs for this long is gone.
        ``resume_window_s``: how long an ended stream's tokens are kept for a client resuming it."""
        if transfer_timeout_s <= 0 or kv_quarantine_s < 0 or owner_gone_after_s <= 0:
            raise ValueError(f"transfer_timeout_s and owner_gone_after_s must be > 0 and kv_quarantine_s >= 0 "
                             f"(got {transfer_timeout_s}, {owner_gone_after_s}, {kv_quarantine_s})")
        super().__init__(worker_id, engine_config, EngineMode.DECODE)
        self.transfer_timeout_s = transfer_timeout_s
        self.kv_quarantine_s = kv_quarantine_s
        self._reservations: dict[str, _Reservation] = {}
        # one outbox per router; every request's outputs go to the router that sent it
        self._outboxes: dict[str, list[StepOutput]] = {}
        self._owner_of: dict[str, str] = {}        # request id -> router id (until it finishes)
        self._last_take: dict[str, float] = {}     # router id -> when it last took its outputs
        self._outbox_cv = threading.Condition()
        self._outbox_limit = outbox_limit
        self.owner_gone_after_s = owner_gone_after_s
        self.owners_gone = 0  # routers whose requests were aborted because they stopped taking outputs
        # streams a client may resume through another router (``take_stream``): live ones by
        # request id, ended ones by resume key for ``resume_window_s``
        self._resume_key_of: dict[str, str] = {}           # request id -> resume key
        self._live_streams: dict[str, StreamRecord] = {}     # request id -> its tokens so far
        self._ended_streams: dict[str, StreamRecord] = {}    # resume key -> the ended stream
        self.resume_window_s = resume_window_s
        # inter-token latency as the streams see it at this worker: the gap between a request's
        # consecutive outputs with tokens, over the last ITL_WINDOW_S (stats' itl_ms, the planner)
        self._last_emit: dict[str, float] = {}
        self._itl_window: deque[tuple[float, float]] = deque(maxlen=8192)
        self._itl_lock = threading.Lock()
        # reservations that ended because their KV did not land (or their start did not come)
        # in time: a prefill thrown away, or a router gone (stats: expired_reservations)
        self.expired_reservations = 0
        self._start_loop(self._publish, self._on_tick)

    # ------------------------------------------------------------------ peers
    # ------------------------------------------------------------- handoff
    def reserve(self, request_id: str, num_prompt_tokens: int, timeout_s: float | None = None,
                owner: str = DEFAULT_OWNER) -> bytes:
        """Reserve blocks for a prompt's KV; returns ``TransferParams`` bytes for the prefill worker.
        Raises ``OutOfBlocksError`` when the cache cannot hold it now. ``owner``: the router
        whose ``take_outputs`` gets this request's outputs."""
        if num_prompt_tokens < 1:
            raise InvalidRequestError("num_prompt_tokens must be >= 1")

        def do(engine: LLMEngine) -> bytes:
            if request_id in self._reservations or engine.scheduler.get(request_id) is not None:
                raise InvalidRequestError(f"request {request_id!r} is already on this worker")
            blocks = engine.reserve(engine.block_manager.blocks_needed(num_prompt_tokens))
            try:
                receiver = KVReceiver(self.agent, request_id, blocks,
                                      timeout_s=timeout_s or self.transfer_timeout_s,
                                      quarantine_s=self.kv_quarantine_s)
            except BaseException:
                engine.release_reserved(blocks)
                raise
            self._reservations[request_id] = _Reservation(
                request_id, blocks, receiver,
                expires_at=time.monotonic() + 2 * (timeout_s or self.transfer_timeout_s))
            self._own(request_id, owner)
            return receiver.params().to_bytes()

        return self._loop.call(do)

    def start(self, request_id: str, prompt_token_ids: list[int], first_token_id: int, params: SamplingParams,
              priority: Priority = Priority.INTERACTIVE, resume_key: str = "") -> None:
        """Admit a reserved request once its KV has landed (now, or on a later tick).
        ``resume_key``: the client's stream key, for ``take_stream`` ("" : not resumable)."""
        def do(_engine: LLMEngine) -> None:
            res = self._reservations.get(request_id)
            if res is None or res.ending:
                raise KVTransferError(f"request {request_id!r} has no live KV reservation on {self.worker_id}")
            res.pending_start = _PendingStart(prompt_token_ids, first_token_id, params, priority)
            self._track(request_id, resume_key, prompt_token_ids, [first_token_id])
            self._advance(res)

        self._loop.call(do)

    def renew(self, request_id: str, timeout_s: float | None = None) -> float:
        """Keep a reservation whose prefill is still queued or running: its KV wait (and the
        wait for its ``start``) runs ``timeout_s`` (default: the transfer timeout) from now.
        Returns the new ``expires_at`` the prefill worker may write until. Raises
        ``KVTransferError`` when the reservation already ended."""
        wait = timeout_s or self.transfer_timeout_s

        def do(_engine: LLMEngine) -> float:
            res = self._reservations.get(request_id)
            if res is None or res.ending:
                raise KVTransferError(f"request {request_id!r} has no live KV reservation on {self.worker_id}")
            expires_at = res.receiver.extend(wait)
            res.expires_at = max(res.expires_at, time.monotonic() + 2 * wait)
            return expires_at

        return self._loop.call(do)

    def generate_local(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       priority: Priority = Priority.INTERACTIVE, owner: str = DEFAULT_OWNER,
                       resume_key: str = "") -> None:
        """Prefill and decode here (conditional disaggregation / migration target)."""
        arrived = time.monotonic()  # the wait for the running step counts in the request's queue time

        def do(engine: LLMEngine) -> None:
            engine.add_request(request_id, prompt_token_ids, params, priority, arrival_time=arrived)
            self._own(request_id, owner)
            self._track(request_id, resume_key, prompt_token_ids, [])

        self._loop.call(do, urgent=priority is Priority.INTERACTIVE)

    def _track(self, request_id: str, resume_key: str, prompt: list[int], first: list[int]) -> None:
        if resume_key:
            with self._outbox_cv:
                self._resume_key_of[request_id] = resume_key
                self._live_streams[request_id] = StreamRecord(array("l", prompt + first), len(prompt))

    def take_stream(self, resume_key: str) -> StreamRecord | None:
        """The stream a client resumes through another router. A live one is stopped here (the
        resuming router continues it by migration) and returned with ``finish_reason`` None; an
        ended one is returned as it ended, and stays (a client may resume it again) unless it was
        cut off (it is continued elsewhere now). None: no such stream."""
        def do(engine: LLMEngine) -> StreamRecord | None:
            with self._outbox_cv:
                self._prune_ended()
                rid = next((r for r, k in self._resume_key_of.items() if k == resume_key), None)
                if rid is None:
                    ended = self._ended_streams.get(resume_key)
                    if ended is None:
                        return None
                    if ended.finish_reason in ("abort", "error"):
                        del self._ended_streams[resume_key]
                    return StreamRecord(ended.token_ids.tolist(), ended.num_prompt_tokens, ended.finish_reason,
                                        ended.ended_at)
                record = self._live_streams.pop(rid)
                del self._resume_key_of[rid]
                self._ended_streams.pop(resume_key, None)   # an older, cut-off attempt of the same stream
                owner = self._owner_of.pop(rid, None)   # its abort output goes nowhere, but
                if owner is not None:                   # a router still streaming it learns it ended
                    self._outboxes.setdefault(owner, []).append(StepOutput(
                        rid, finished=True, finish_reason="abort"))  # as if it aborted it: no retry there
                    self._outbox_cv.notify_all()
            res = self._reservations.get(rid)
            if res is not None:
                if not res.ending:
                    self._end_reservation(res, "resumed through another router")
            else:
                engine.abort(rid)
            return StreamRecord(record.token_ids.tolist(), record.num_prompt_tokens, None, time.monotonic())

        return self._loop.call(do)

    def _end_stream(self, request_id: str, reason: str) -> None:
        """A tracked stream ended: keep it for resuming under its key (caller holds ``_outbox_cv``)."""
        stream = self._live_streams.pop(request_id, None)
        key = self._resume_key_of.pop(request_id, None)
        if stream is not None and key is not None:
            stream.finish_reason, stream.ended_at = reason, time.monotonic()
            self._ended_streams[key] = stream

    def _prune_ended(self) -> None:
        horizon = time.monotonic() - self.resume_window_s
        for key in [k for k, r in self._ended_streams.items() if r.ended_at < horizon]:
            del self._ended_streams[key]
        while len(self._ended_streams) > MAX_ENDED_STREAMS:
            del self._ended_streams[next(iter(self._ended_streams))]

    def _own(self, request_id: str, owner: str) -> None:
        with self._outbox_cv:
            self._owner_of[request_id] = owner
            self._last_take.setdefault(owner, time.monotonic())

    def abort(self, request_id: str, sender_dead: bool = False) -> bool:
        """End a request wherever it is. ``sender_dead``: its prefill worker's process is known to
        be gone, so its reserved blocks can be freed at once (no write can still land)."""
        def do(engine: LLMEngine) -> bool:
            res = self._reservations.get(request_id)
            if res is not None:
                if sender_dead:
                    res.receiver.sender_gone()
                # Started but its KV has not landed yet: the caller is draining for it, so end it.
                started = res.pending_start is not None and not res.ending
                self._end_reservation(res, "aborted by the router")
                if started:
                    self._publish([StepOutput(request_id, finished=True, finish_reason="abort")])
                return True
            return engine.abort(request_id)
        return self._loop.call(do)

    # ------------------------------------------------------------ loop hooks
    def _advance(self, res: _Reservation) -> None:
        state = res.receiver.poll()
        if res.ending:
            if res.receiver.blocks_reusable:
                self.engine.release_reserved(res.blocks)
                res.receiver.close()
                del self._reservations[res.request_id]
            return
        if state is RecvState.LANDED and res.pending_start is not None:
            start = res.pending_start
            del self._reservations[res.request_id]
            res.receiver.close()
            try:
                self.engine.add_prefilled(res.request_id, start.prompt_token_ids, start.first_token_id,
                                          start.params, res.blocks, start.priority)
            except Exception as exc:
                self.engine.release_reserved(res.blocks)
                self._emit_error(res.request_id, f"could not admit the request: {exc}")
        elif res.pending_start is None and time.monotonic() > res.expires_at:
            self.expired_reservations += 1
            self._end_reservation(res, "reservation expired: no start call arrived")
        elif state.terminal and state is not RecvState.LANDED:
            if state is RecvState.TIMED_OUT:
                self.expired_reservations += 1
            reason = res.receiver.reason or state.value
            self._end_reservation(res, reason)
            if res.pending_start is not None:
                self._emit_error(res.request_id, f"KV transfer {state.value}: {reason}")

    def _end_reservation(self, res: _Reservation, reason: str) -> None:
        res.ending = True
        res.receiver.abort(reason)
        self._advance(res)

    def _on_tick(self) -> bool:
        for res in list(self._reservations.values()):
            try:
                self._advance(res)
            except Exception:  # keep the other reservations moving; this one retries next tick
                logger.exception("request %s: polling its KV transfer failed", res.request_id)
        self._abort_for_gone_owners()
        return bool(self._reservations)

    def _abort_for_gone_owners(self) -> None:
        """Abort (and free the blocks of) every request of a router that stopped taking outputs."""
        now = time.monotonic()
        with self._outbox_cv:
            gone = {o for o, t in self._last_take.items() if now - t > self.owner_gone_after_s}
            if not gone:
                return
            orphans = [rid for rid, o in self._owner_of.items() if o in gone]
            had_requests = {self._owner_of.pop(rid) for rid in orphans}
            for owner in gone:
                del self._last_take[owner]
                self._outboxes.pop(owner, None)
        if not orphans:
            return
        self.owners_gone += len(had_requests)
        logger.warning("router(s) %s took no outputs for %.0f s: aborting their %d request(s)",
                       sorted(had_requests), self.owner_gone_after_s, len(orphans))
        for rid in orphans:
            res = self._reservations.get(rid)
            if res is not None:
                if not res.ending:
                    self._end_reservation(res, "its router is gone")
                with self._outbox_cv:  # no output will end its stream: end it here (resumable)
                    self._end_stream(rid, "abort")
            else:
                self.engine.abort(rid)

    def _emit_error(self, request_id: str, message: str) -> None:
        self._publish([StepOutput(request_id, finished=True, finish_reason="error", error=message)])

    def _publish(self, outputs: list[StepOutput]) -> None:
        self._record_itl(outputs)
        for out in outputs:
            if out.finished and isinstance(out.phase, RequestPhase):
                self._notify(self.observer.request_finished, out.phase)
        with self._outbox_cv:
            for out in outputs:
                stream = self._live_streams.get(out.request_id)
                if stream is not None:
                    stream.token_ids.extend(out.new_token_ids)
                    if out.finished:
                        self._end_stream(out.request_id, out.finish_reason or "abort")
                owner = (self._owner_of.pop(out.request_id, None) if out.finished
                         else self._owner_of.get(out.request_id))
                if owner is None:  # its router is gone (the request was aborted for that), or it ended before
                    continue
                box = self._outboxes.setdefault(owner, [])
                box.append(out)
                if len(box) == self._outbox_limit + 1:
                    logger.error("outbox of router %r over %d entries: is it taking them?", owner,
                                 self._outbox_limit)
            self._outbox_cv.notify_all()

    def _record_itl(self, outputs: list[StepOutput]) -> None:
        now = time.monotonic()
        gaps = []
        for out in outputs:
            if out.new_token_ids:
                last = self._last_emit.get(out.request_id)
                if last is not None:
                    gaps.append(now - last)
                self._last_emit[out.request_id] = now
            if out.finished:
                self._last_emit.pop(out.request_id, None)
        if gaps:
            with self._itl_lock:
                self._itl_window.extend((now, g) for g in gaps)
            self._notify(self.observer.itl_gaps, gaps)

    def recent_itl_ms(self, window_s: float = ITL_WINDOW_S) -> float | None:
        """Mean inter-token gap of the last ``window_s`` in ms; None when nothing decoded then."""
        horizon = time.monotonic() - window_s
        with self._itl_lock:
            while self._itl_window and self._itl_window[0][0] < horizon:
                self._itl_window.popleft()
            if not self._itl_window:
                return None
            return 1000.0 * sum(g for _, g in self._itl_window) / len(self._itl_window)

    # -------------------------------------------------------------- output
    def take_outputs(self, timeout_s: float = 0.05, owner: str = DEFAULT_OWNER) -> list[StepOutput]:
        """Every output for router ``owner`` since its last call (all its requests of all steps),
        waiting up to ``timeout_s``. Calling this is also how a router says it is alive."""
        deadline = time.monotonic() + timeout_s
        with self._outbox_cv:
            self._last_take[owner] = time.monotonic()
            while not self._outboxes.get(owner):
                left = deadline - time.monotonic()
                if left <= 0:
                    return []
                self._outbox_cv.wait(left)
            return self._outboxes.pop(owner)

    def stats(self) -> WorkerStats:
        return self._base_stats(reservations=len(self._reservations), itl_ms=self.recent_itl_ms(),
                                expired_reservations=self.expired_reservations)

    def reserved_blocks(self, request_id: str) -> list[int]:
        res = self._reservations.get(request_id)
        return list(res.blocks) if res is not None else []

    def shutdown(self) -> None:
        self._loop.stop()
        self.agent.close()

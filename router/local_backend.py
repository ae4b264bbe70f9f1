"""The colocated backend: one in-process ``LLMEngine`` driven by an ``EngineLoop`` thread.

Only that thread touches the engine. Callers on an asyncio loop submit commands (add, abort) to
it; after each step it hands the step's outputs back to the callers' loops with one
``call_soon_threadsafe`` per loop per step, into per-request ``asyncio.Queue`` s. A request is
registered from its add until its final output, so aborting, closing a stream early or a passed
deadline always reaches the engine and frees its blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.engine.contract import RequestPhase
from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.errors import (DeadlineExceededError, InvalidRequestError, PdserveError, WorkerUnavailableError,
                                   request_error)
from pdserve.engine.sequence import Priority
from pdserve.router.backend import Finished, GenerateRequest, ModelInfo, TokenDelta

if TYPE_CHECKING:
    from pdserve.engine.llm_engine import LLMEngine, StepOutput

logger = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)  # identity hash: used as a dict key
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    deadline: float | None
    error: PdserveError | None = None  # set when the backend itself ended the request


class LocalEngineBackend:
    def __init__(self, engine: LLMEngine, *, model_name: str | None = None, worker_id: str = "local") -> None:
        self._engine = engine
        self._worker_id = worker_id
        model_dir = str(getattr(engine, "tokenizer_dir", None) or engine.config.model_dir)
        self._info = ModelInfo(
            name=model_name or Path(model_dir).name,
            max_model_len=engine.max_model_len,
            vocab_size=engine.spec.vocab_size,
            eos_token_ids=tuple(engine.spec.eos_token_ids),
            tokenizer_dir=model_dir,
        )
        self._streams: dict[str, _Stream] = {}  # engine thread only (and close(), once it stopped)
        self._closing = False
        self._loop = EngineLoop(engine, self._dispatch, self._expire_deadlines, name="pdserve-engine")
        self._loop.start()

    # ------------------------------------------------------------ Backend API
    def model_info(self) -> ModelInfo:
        return self._info

    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenDelta | Finished]:
        if req.resume_from is not None:  # one process: there is no other router to resume on
            yield Finished("error", error=InvalidRequestError(
                "resuming a stream (Last-Event-ID) needs a pdserve cluster; this server runs one engine in-process"))
            return
        queue: asyncio.Queue = asyncio.Queue()
        stream = _Stream(asyncio.get_running_loop(), queue, req.deadline)
        arrived = time.monotonic()  # the wait for the running step counts in the request's queue time
        added = self._loop.submit(lambda _e: self._add(req, stream, arrived), urgent=req.priority is Priority.INTERACTIVE)
        added.add_done_callback(lambda fut: self._unless_added(fut, stream))
        done = False
        try:
            while True:
                item = await queue.get()
                yield item
                if isinstance(item, Finished):
                    done = True
                    return
        finally:
            if not done:
                self._loop.submit(lambda _e: self._abort(req.request_id))

    async def abort(self, request_id: str) -> None:
        self._loop.submit(lambda _e: self._abort(request_id))

    @property
    def num_active(self) -> int:
        """Requests the engine thread is tracking (added, not yet finished)."""
        return len(self._streams)

    async def health(self) -> bool:
        return self._loop.alive and not self._closing

    def close(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; requests still running end with an error."""
        self._closing = True
        self._loop.stop(timeout)
        if self._loop.alive:
            logger.error("engine thread did not stop within %.1f s", timeout)
            return
        self._fail_all(WorkerUnavailableError("the engine is shutting down"))

    # --------------------------------------------------------- engine thread
    def _unless_added(self, fut: Future, stream: _Stream) -> None:
        """The add never ran (the loop stopped first): the caller still hears the end."""
        if fut.cancelled() or fut.exception() is not None:
            self._deliver({stream: [Finished("error", error=WorkerUnavailableError("the engine is shutting down"))]})

    def _abort(self, request_id: str) -> None:
        if request_id in self._streams:
            self._engine.abort(request_id)  # its final output comes with the next step

    def _add(self, req: GenerateRequest, stream: _Stream, arrived: float) -> None:
        if self._closing:
            self._deliver({stream: [Finished("error", error=WorkerUnavailableError("the engine is shutting down"))]})
            return
        if req.request_id in self._streams:  # ids come from the router (uuid hex): a bug, not a client's
            logger.error("request id %s is already running here; refusing the second one", req.request_id)
            self._deliver({stream: [Finished("error", error=PdserveError("internal server error: duplicate id"))]})
            return
        try:
            self._engine.add_request(req.request_id, req.prompt_token_ids, req.params, priority=req.priority,
                                     arrival_time=arrived)
        except PdserveError as exc:
            self._deliver({stream: [Finished("error", error=exc)]})
            return
        self._streams[req.request_id] = stream

    def _expire_deadlines(self) -> bool:
        """Runs once per loop iteration; nothing to poll, so it never asks for a fast tick."""
        now = time.monotonic()
        for rid, stream in self._streams.items():
            if stream.deadline is not None and stream.deadline <= now and stream.error is None:
                stream.error = DeadlineExceededError("the request's deadline passed before it finished")
                self._engine.abort(rid)
        return False

    def _dispatch(self, outputs: list[StepOutput]) -> None:
        batches: dict[_Stream, list] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted and already reported, or not ours
            items = batches.setdefault(stream, [])
            if out.new_token_ids:
                items.append(TokenDelta(list(out.new_token_ids), out.new_logprobs, out.prompt_logprobs))
            if out.finished:
                del self._streams[out.request_id]
                items.append(self._finished(out, stream))
        self._deliver(batches)

    def _finished(self, out: StepOutput, stream: _Stream) -> Finished:
        phase = (out.phase or RequestPhase()).but(prefill_worker=self._worker_id, decode_worker=self._worker_id)
        error = stream.error
        if error is None and out.error:
            error = request_error(out.error_code, out.error) or PdserveError(out.error)
        reason = out.finish_reason if out.finish_reason in ("stop", "length", "abort") else "error"
        if error is not None:
            reason = "error"
        return Finished(reason, phase, error)

    def _fail_all(self, error: PdserveError) -> None:
        batches: dict[_Stream, list] = {}
        for rid, stream in list(self._streams.items()):
            try:
                self._engine.abort(rid)
            except Exception:  # the engine may be broken; the client must still hear the end
                logger.exception("abort of %s failed", rid)
            batches[stream] = [Finished("error", RequestPhase(), error)]
        self._streams.clear()
        self._deliver(batches)

    @staticmethod
    def _deliver(batches: dict[_Stream, list]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, list]]] = {}
        for stream, items in batches.items():
            if items:
                by_loop.setdefault(stream.loop, []).append((stream.queue, items))
        for loop, pairs in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, pairs)
            except RuntimeError:  # the caller's loop is closed: nobody is listening
                logger.debug("dropping outputs for a closed event loop")


def _put_all(pairs: list[tuple[asyncio.Queue, list]]) -> None:
    for queue, items in pairs:
        for item in items:
            queue.put_nowait(item)

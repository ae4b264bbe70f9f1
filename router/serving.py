"""The request pipeline both front ends share: tokenize, check, admit, stream, account.

1. ``prepare``: check the model name, tokenize (chat template for chat), check the prompt and
   ``max_tokens`` against the context length, build the ``SamplingParams``.
2. ``stream`` (an async context manager): take an admission slot (``OverloadedError`` when
   full), start the backend request, and yield ``Chunk`` s and one closing ``Final``.
   Text is detokenized here; a stop string ends the request as "stop" and the backend
   request is aborted. A passed deadline aborts it and raises ``DeadlineExceededError``.
3. Leaving the context early (client gone, task cancelled, error) aborts the backend request,
   so the engine frees its blocks; the slot is always released.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pdserve.engine.errors import DeadlineExceededError, InvalidRequestError, PdserveError
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import Priority
from pdserve.router.admission import Admission
from pdserve.router.backend import Backend, Finished, GenerateRequest, TokenDelta, complete_phase
from pdserve.router.detokenizer import OutputText
from pdserve.router.metrics_text import RouterMetrics
from pdserve.router.validation import ParsedRequest, check_model, check_prompt_tokens, resolve_max_tokens

logger = logging.getLogger(__name__)

FINISH_GRACE_S = 5.0  # how long to wait for the backend's Finished after aborting it


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: Priority = Priority.INTERACTIVE


@dataclass(slots=True)
class Chunk:
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, float]] | None = None


@dataclass(slots=True)
class Final:
    finish_reason: str
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int
    phase: dict = field(default_factory=dict)
    error: PdserveError | None = None


class Serving:
    def __init__(self, backend: Backend, *, admission: Admission | None = None,
                 metrics: RouterMetrics | None = None, tokenizer=None) -> None:
        self.backend = backend
        self.info = backend.model_info()
        self.admission = admission or Admission()
        self.metrics = metrics or RouterMetrics()
        if tokenizer is None:
            from pdserve.engine.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(self.info.tokenizer_dir)
        self.tokenizer = tokenizer
        self.metrics.add_gauge("requests_in_flight", lambda: self.admission.in_flight)
        self.metrics.add_gauge("requests_queued", lambda: self.admission.queued)
        self.metrics.add_gauge("requests_rejected_total", lambda: self.admission.rejected_total)

    # ----------------------------------------------------------------- prepare
    def _encode_text(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    def _encode_chat(self, messages: list[dict]) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError(f"model '{self.info.name}' has no chat template; use /v1/completions")
        try:
            rendered = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # jinja raises its own types for templates that reject the messages
            raise InvalidRequestError(f"the chat template rejected these messages: {exc}") from exc
        # The template writes any BOS itself, so no special tokens are added here.
        return list(self.tokenizer(rendered, add_special_tokens=False)["input_ids"])

    async def prepare(self, parsed: ParsedRequest, request_id: str, *, default_max_tokens: int | None) -> PreparedRequest:
        """Tokenize and check a parsed request; ``default_max_tokens`` None means "up to the context"."""
        check_model(parsed.model, self.info.name)
        if parsed.prompt_token_ids is not None:
            ids = list(parsed.prompt_token_ids)
        elif parsed.messages is not None:
            ids = await asyncio.to_thread(self._encode_chat, parsed.messages)
        else:
            ids = await asyncio.to_thread(self._encode_text, parsed.prompt_text or "")
        check_prompt_tokens(ids, self.info.vocab_size, self.info.max_model_len)
        max_tokens = resolve_max_tokens(parsed.max_tokens, len(ids), self.info.max_model_len, default_max_tokens)
        return PreparedRequest(request_id, ids, parsed.sampling_params(max_tokens), parsed.priority)

    def stream(self, req: PreparedRequest, *, api: str, deadline: float | None = None) -> RequestStream:
        """``deadline`` is a ``time.monotonic()`` instant."""
        return RequestStream(self, req, api, deadline)


class RequestStream:
    """One request's output. Use as ``async with serving.stream(req, api=...) as events``."""

    def __init__(self, serving: Serving, req: PreparedRequest, api: str, deadline: float | None) -> None:
        self._s = serving
        self._req = req
        self._api = api
        self._deadline = deadline
        self._gen: AsyncIterator | None = None
        self._events_gen: AsyncIterator | None = None
        self._backend_done = False
        self._outcome = "cancelled"

    async def __aenter__(self) -> AsyncIterator[Chunk | Final]:
        if self._deadline is not None and self._deadline <= time.monotonic():
            raise DeadlineExceededError("the request's deadline passed before it was admitted")
        try:
            if self._deadline is None:
                await self._s.admission.acquire()
            else:
                try:
                    async with asyncio.timeout_at(self._loop_deadline()):
                        await self._s.admission.acquire()
                except TimeoutError:
                    raise DeadlineExceededError("the request's deadline passed while it waited for a slot") from None
        except PdserveError as exc:
            self._s.metrics.observe_request(self._api, exc.error_type)
            raise
        r = self._req
        self._gen = self._s.backend.generate(
            GenerateRequest(r.request_id, r.prompt_token_ids, r.params, r.priority, self._deadline))
        self._events_gen = self._events()
        return self._events_gen

    async def __aexit__(self, exc_type, exc, tb) -> None:
        try:
            if not self._backend_done:
                await asyncio.shield(self._s.backend.abort(self._req.request_id))
            if self._events_gen is not None:
                await self._events_gen.aclose()
            if self._gen is not None:
                await self._gen.aclose()
        finally:
            self._s.admission.release()
            if isinstance(exc, PdserveError):
                self._outcome = exc.error_type
            self._s.metrics.observe_request(self._api, self._outcome)

    def _loop_deadline(self) -> float:
        """The deadline on the event loop's clock."""
        return asyncio.get_running_loop().time() + (self._deadline - time.monotonic())

    async def _next(self) -> TokenDelta | Finished:
        if self._deadline is None:
            return await anext(self._gen)
        try:
            async with asyncio.timeout_at(self._loop_deadline()):
                return await anext(self._gen)
        except TimeoutError:
            raise DeadlineExceededError("the request's deadline passed before it finished") from None

    async def _drain(self) -> Finished | None:
        """After an abort: the backend's Finished (for its phase record), or None if it is slow."""
        try:
            async with asyncio.timeout(FINISH_GRACE_S):
                while True:
                    item = await anext(self._gen)
                    if isinstance(item, Finished):
                        return item
        except (TimeoutError, StopAsyncIteration):
            logger.warning("request %s: no Finished from the backend after abort", self._req.request_id)
            return None

    async def _events(self) -> AsyncIterator[Chunk | Final]:
        req = self._req
        text = OutputText(self._s.tokenizer, req.prompt_token_ids, req.params.stop)
        completion = 0
        while True:
            try:
                item = await self._next()
            except StopAsyncIteration:
                item = Finished("error", error=PdserveError("the backend ended the stream without finishing"))
            if isinstance(item, TokenDelta):
                ids: list[int] = []
                pieces: list[str] = []
                for tok in item.token_ids:
                    ids.append(tok)
                    pieces.append(text.push(tok))
                    if text.stopped:
                        break
                lps = item.logprobs[: len(ids)] if item.logprobs else None
                completion += len(ids)
                if text.stopped:  # stop the engine before the client even sees this chunk
                    await self._s.backend.abort(req.request_id)
                if ids:
                    yield Chunk(ids, "".join(pieces), lps)
                if not text.stopped:
                    continue
                finished = await self._drain()
                self._backend_done = True
                item = Finished("stop", finished.phase if finished else {})
            self._backend_done = True
            break
        reason = "stop" if text.stopped else item.finish_reason
        tail = text.finish() if item.error is None else ""
        if tail:
            yield Chunk([], tail)
        phase = complete_phase(item.phase, finish_reason=reason)
        cached = int(phase.get("cached_prompt_tokens") or 0)
        self._outcome = item.error.error_type if item.error is not None else reason
        if item.error is None:
            self._s.metrics.observe_finished(len(req.prompt_token_ids), cached, completion,
                                             phase.get("ttft_s"), float(phase.get("total_s") or 0.0))
        yield Final(reason, len(req.prompt_token_ids), cached, completion, phase, item.error)

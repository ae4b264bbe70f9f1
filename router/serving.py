"""The request pipeline both front ends share: tokenize, check, admit, stream, account.

1. ``prepare``: check the model name, refuse prompt text too long to be worth tokenizing,
   tokenize (chat template for chat), check the prompt and ``max_tokens`` against the context
   length and ``ServingLimits.max_tokens_limit``, build the ``SamplingParams``. The request gets
   a server-generated id (uuid hex); the client's id is kept only to echo back and to log.
2. ``stream`` (an async context manager): claim the client's id in its scope (a live duplicate
   is ``DuplicateRequestIdError``: 409 / ALREADY_EXISTS), take an admission slot
   (``OverloadedError`` when full), start the backend request under the server id, and yield
   ``Chunk`` s and one closing ``Finished`` (its phase record counts the tokens the client got).
   Text is detokenized here; a stop string ends the
   request as "stop" and the backend request is aborted. The deadline is the earlier of the
   client's and ``ServingLimits.request_timeout_s``; when it passes the request is aborted and
   ``DeadlineExceededError`` raised (504 / DEADLINE_EXCEEDED). A request of several sequences
   (``n`` choices, beams: ``router/choices.py``, ``router/beam_search.py``) fixes its deadline
   once (``Serving.deadline``) and passes it to each, and names itself as their admission
   ``group``, so that the slots are shared fairly between requests, not sequences.
3. Leaving the context early (client gone, task cancelled, error) aborts the backend request,
   so the engine frees its blocks; the slot and the client id are always released.
4. Every request that reached ``stream``, refused, failed, cancelled or complete, ends as one
   ``RequestRecord`` handed to the observers (``router/request_observer.py``): the metrics and,
   in a cluster, the request log.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace

from pdserve.engine.config import StructuredLimits
from pdserve.engine.errors import DeadlineExceededError, GrammarError, InvalidRequestError, PdserveError
from pdserve.engine.sampling_params import MAX_BAD_WORD_TOKENS, SamplingParams
from pdserve.engine.sequence import Priority
from pdserve.engine.structured import StructuredOutput, check as check_structured
from pdserve.router.admission import Admission
from pdserve.engine.contract import PromptLogprobs, RequestPhase, RequestRecord
from pdserve.router.backend import Backend, Finished, GenerateRequest, TokenDelta
from pdserve.engine.output_text import OutputText
from pdserve.router.errors import DuplicateRequestIdError, InvalidParameterError
from pdserve.router.metrics_text import RouterMetrics
from pdserve.router.request_observer import RequestObserver, tell_all
from pdserve.router.tools import ToolRequest, render_messages
from pdserve.router.validation import (
    DEFAULT_MAX_CHOICES,
    ParsedRequest,
    TokenizeRequest,
    check_token_fields,
    check_model,
    check_prompt_chars,
    check_prompt_tokens,
    max_prompt_chars,
    resolve_max_tokens,
)

logger = logging.getLogger(__name__)

FINISH_GRACE_S = 5.0  # how long to wait for the backend's Finished after aborting it


@dataclass(frozen=True, slots=True)
class ServingLimits:
    """Server-wide limits on every request (``router.request_timeout_s``, ``router.max_tokens_limit``)."""

    request_timeout_s: float | None = None  # None: no default deadline
    max_tokens_limit: int | None = None     # None: only the context length bounds max_tokens
    max_choices: int = DEFAULT_MAX_CHOICES  # router.max_choices_per_request: sequences of one request
    structured: StructuredLimits = StructuredLimits()   # the `structured` section: a grammar's check
    tenant_cache_isolation: bool = True     # router.tenant_cache_isolation: a tenant's prefix cache is its own

    def __post_init__(self) -> None:
        if self.max_choices < 1:
            raise ValueError(f"max_choices must be >= 1, got {self.max_choices}")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")
        if self.max_tokens_limit is not None and self.max_tokens_limit < 1:
            raise ValueError(f"max_tokens_limit must be >= 1, got {self.max_tokens_limit}")


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    request_id: str  # the server's id (uuid hex): what the backend keys the request by
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: Priority = Priority.INTERACTIVE
    client_id: str = ""  # the client's id: echoed back and logged, never used as a key inside
    resume_from: int | None = None  # resuming a stream: the tokens the client already has (Last-Event-ID)
    owner: str = ""  # the tenant (its API key's owner id, router/auth.py), for the request log; "" anonymous


@dataclass(slots=True)
class Chunk:
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: PromptLogprobs | None = None  # the first chunk's, when asked for


class Serving:
    def __init__(self, backend: Backend, *, admission: Admission | None = None,
                 metrics: RouterMetrics | None = None, observers: Sequence[RequestObserver] = (),
                 tokenizer=None, limits: ServingLimits | None = None) -> None:
        """``metrics`` is the router's ``/metrics`` text; ``observers`` also hear of every request's end."""
        self.backend = backend
        self.info = backend.model_info()
        self.admission = admission or Admission()
        self.limits = limits or ServingLimits()
        self._live_ids: dict[tuple[str, str], str] = {}  # (scope, client id) -> server id, in flight
        self.metrics = metrics or RouterMetrics(model=self.info.name)
        self.observers: list[RequestObserver] = [self.metrics, *observers]
        if tokenizer is None:
            from pdserve.engine.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(self.info.tokenizer_dir)
        self.tokenizer = tokenizer
        self.metrics.add_gauge("num_requests_running", lambda: self.admission.in_flight,
                               "Requests admitted and not yet finished.")
        self.metrics.add_gauge("num_requests_waiting", lambda: self.admission.queued,
                               "Requests waiting for an admission slot.")
        self.metrics.add_gauge("requests_rejected_total", lambda: self.admission.rejected_total,
                               "Requests refused with 429 (admission full or the predicted TTFT over its limit).",
                               kind="counter")

    # ----------------------------------------------------------------- prepare
    def _encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def _encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                     tools: ToolRequest | None = None, continue_final_message: bool = False,
                     template_kwargs: dict | None = None, add_special_tokens: bool = False) -> list[int]:
        template = getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise InvalidRequestError(f"model '{self.info.name}' has no chat template; use /v1/completions")
        # A template that reads tools gets them (and the messages' tool calls) as they are; any
        # other gets them written into the messages (router/tools.py).
        reads_tools = isinstance(template, str) and "tools" in template and "tool_calls" in template
        extra = {"tools": list(tools.tools)} if tools is not None and reads_tools else {}
        extra.update(template_kwargs or {})
        if continue_final_message:
            extra["continue_final_message"] = True
        if not reads_tools:
            messages = render_messages(messages, tools, False)
        try:
            rendered = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                          tokenize=False, **extra)
        except Exception as exc:  # jinja raises its own types for templates that reject the messages
            raise InvalidRequestError(f"the chat template rejected these messages: {exc}") from exc
        # The template writes any BOS itself, so no special tokens are added here unless asked
        # (vLLM's add_special_tokens).
        return list(self.tokenizer(rendered, add_special_tokens=add_special_tokens)["input_ids"])

    def _bad_word_ids(self, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """vLLM's ``bad_words`` as token sequences: each word as it starts the text and, where the
        tokenizer spells it differently after a space, as it follows a space."""
        out: list[tuple[int, ...]] = []
        for word in words:
            bare = tuple(self.tokenizer(word.lstrip(), add_special_tokens=False)["input_ids"])
            spaced = tuple(self.tokenizer(" " + word.lstrip(), add_special_tokens=False)["input_ids"])
            for ids in (bare, spaced):
                if not ids or len(ids) > MAX_BAD_WORD_TOKENS:
                    raise InvalidParameterError(f"the bad word {word[:64]!r} is {len(ids)} tokens; each may be "
                                                f"1-{MAX_BAD_WORD_TOKENS}", param="bad_words")
                if ids not in out:
                    out.append(ids)
        return tuple(out)

    async def tokenize(self, req: TokenizeRequest) -> list[int]:
        """``/tokenize``: the ids a prompt (or a chat) would be served with."""
        check_model(req.model, self.info.name)
        if req.messages is not None:
            # the chat endpoint's bound on the text (its count of messages is bounded when parsed)
            check_prompt_chars(ParsedRequest(model=None, messages=req.messages), self.info.max_model_len)
            ids = await asyncio.to_thread(self._encode_chat, req.messages, req.add_generation_prompt)
            if req.add_special_tokens and self.tokenizer.bos_token_id is not None and ids[:1] != [self.tokenizer.bos_token_id]:
                ids = [self.tokenizer.bos_token_id, *ids]
            return ids
        text = req.prompt or ""
        if len(text) > max_prompt_chars(self.info.max_model_len):
            raise InvalidRequestError(f"the prompt has {len(text)} characters, more than any prompt this model "
                                      f"can take ({self.info.max_model_len} tokens); shorten it")
        return await asyncio.to_thread(
            lambda: list(self.tokenizer(text, add_special_tokens=req.add_special_tokens)["input_ids"]))

    def detokenize(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)

    async def prepare(self, parsed: ParsedRequest, client_id: str, *, default_max_tokens: int | None) -> PreparedRequest:
        """Tokenize and check a parsed request; ``default_max_tokens`` None means "up to the context"
        (both capped by ``limits.max_tokens_limit``). ``client_id`` is the id the client sees."""
        check_model(parsed.model, self.info.name)
        check_prompt_chars(parsed, self.info.max_model_len)
        if parsed.prompt_token_ids is not None:
            ids = list(parsed.prompt_token_ids)
        elif parsed.messages is not None:
            ids = await asyncio.to_thread(self._encode_chat, parsed.messages, parsed.add_generation_prompt,
                                          parsed.tools, parsed.continue_final_message, parsed.chat_template_kwargs,
                                          bool(parsed.add_special_tokens))
        else:
            ids = await asyncio.to_thread(self._encode_text, parsed.prompt_text or "",
                                          parsed.add_special_tokens is not False)
        if parsed.truncate_prompt_tokens is not None:
            ids = ids[-parsed.truncate_prompt_tokens:]   # vLLM's: the prompt's last k tokens
        check_prompt_tokens(ids, self.info.vocab_size, self.info.max_model_len)
        max_tokens = resolve_max_tokens(parsed.max_tokens, len(ids), self.info.max_model_len, default_max_tokens,
                                        limit=self.limits.max_tokens_limit, field_name=parsed.max_tokens_field)
        # max_tokens 0 (completions with echo: score the prompt only) still runs one step; the
        # response leaves its token out
        params = parsed.sampling_params(max(1, max_tokens))
        if parsed.bad_words:
            params = replace(params, bad_words=await asyncio.to_thread(self._bad_word_ids, parsed.bad_words))
        check_token_fields(params, self.info.vocab_size)
        if params.structured is not None:
            await self._check_grammar(params.structured, parsed.structured_field or "response_format")
        request_id = uuid.uuid4().hex
        logger.debug("request %s is the client's %r", request_id, client_id)
        return PreparedRequest(request_id, ids, params, parsed.priority, client_id)

    async def _check_grammar(self, s: StructuredOutput, field: str) -> None:
        """Parse the grammar (without a tokenizer: the engines compile it) on a thread, so the event
        loop runs on (xgrammar's parse releases the GIL); a parse past ``compile_timeout_s`` is
        refused, and its thread ends on its own (the depth limit bounds it)."""
        limits = self.limits.structured
        prefix = "a tool's parameters schema does not compile: " if field == "tools" else ""
        try:
            refusal = await asyncio.wait_for(asyncio.to_thread(_grammar_refusal, s.kind, s.spec, limits),
                                             limits.compile_timeout_s)
        except TimeoutError:
            raise InvalidParameterError(
                f"{prefix}the {s.kind.replace('_', ' ')} did not parse within {limits.compile_timeout_s:g} s "
                "(structured.compile_timeout_s); simplify it", param=field, code=GrammarError.code) from None
        if refusal is not None:
            raise InvalidParameterError(prefix + refusal, param=field)

    def deadline(self, client_deadline: float | None = None) -> float | None:
        """A request's deadline, fixed as it starts: the earlier of the client's
        ``time.monotonic()`` instant (None: none) and ``limits.request_timeout_s`` from now."""
        timeout = self.limits.request_timeout_s
        if timeout is None:
            return client_deadline
        server_deadline = time.monotonic() + timeout
        return server_deadline if client_deadline is None else min(client_deadline, server_deadline)

    def stream(self, req: PreparedRequest, *, api: str, deadline: float | None = None,
               scope: str = "", group: str | None = None) -> RequestStream:
        """``deadline`` is the client's ``time.monotonic()`` instant (None: none); the earlier of it
        and ``limits.request_timeout_s`` from now applies. ``scope`` is the client's tenant: client
        ids must be unique among the live requests of one scope only. ``group``: the client request
        this sequence is part of (its admission share); None: the sequence is a request alone."""
        if scope and not req.owner:  # the tenant names itself in the request log
            req = replace(req, owner=scope)
        if req.owner and self.limits.tenant_cache_isolation:
            req = replace(req, params=replace(req.params, cache_salt=tenant_salt(req.owner, req.params.cache_salt)))
        return RequestStream(self, req, api, self.deadline(deadline), scope, group)

    def server_id(self, client_id: str, scope: str = "") -> str | None:
        """The server's id of the live request the client calls ``client_id`` (operators, tests)."""
        return self._live_ids.get((scope, client_id))

    def _claim_id(self, scope: str, client_id: str, server_id: str) -> tuple[str, str]:
        key = (scope, client_id)
        if key in self._live_ids:
            raise DuplicateRequestIdError(
                f"request_id '{client_id}' is already used by a request of yours that is still running; "
                "give every concurrent request its own id (or reuse it once that request ended)")
        self._live_ids[key] = server_id
        return key


@functools.lru_cache(maxsize=256)
def _grammar_refusal(kind: str, spec: str, limits: StructuredLimits) -> str | None:
    """Why the router refuses a grammar (None: it parses), remembered per spec: an application
    sends one schema with every request, and a spec that parses slowly is parsed once (a parse that
    outlived its request's budget still ends here and is remembered for the next)."""
    try:
        check_structured(StructuredOutput(kind, spec), limits)
    except InvalidRequestError as exc:
        return str(exc)
    return None


def tenant_salt(owner: str, cache_salt: str | None) -> str:
    """The prefix-cache salt of a tenant's request: its owner id, with the request's own
    ``cache_salt`` folded in, so one tenant never hits (nor probes, by sending another's salt)
    another tenant's cached blocks, and a tenant's salts still split its own cache."""
    if cache_salt is None:
        return f"tenant:{owner}"
    return "tenant:" + hashlib.sha256(f"{owner}\0{cache_salt}".encode("utf-8", "surrogatepass")).hexdigest()[:40]


def resume_key(scope: str, client_id: str) -> str:
    """The key a decode worker files a client's stream under, for resuming it through another
    router: the client's scope and its own id together ("" without an id: not resumable). Two
    tenants using the same id never reach each other's stream."""
    if not client_id:
        return ""
    return hashlib.sha256(f"{scope}\0{client_id}".encode("utf-8", "surrogateescape")).hexdigest()[:32]


# The ``api`` of the Batch API runner's items (``router/batch_api.py``): they take no admission
# slot (the runner bounds them), so a batch never makes an interactive request wait for a slot.
# A client's own request with ``priority: batch`` is admitted like any other.
BATCH_API = "batch"


class RequestStream:
    """One request's output. Use as ``async with serving.stream(req, api=...) as events``."""

    def __init__(self, serving: Serving, req: PreparedRequest, api: str, deadline: float | None,
                 scope: str = "", group: str | None = None) -> None:
        self._s = serving
        self._req = req
        self._group = group or req.request_id  # its share of admission (router/admission.py)
        self._api = api
        self._deadline = deadline
        self._scope = scope
        self._id_key: tuple[str, str] | None = None
        self._admitted = False   # holds an admission slot (interactive requests; batch items never do)
        self._gen: AsyncIterator | None = None
        self._events_gen: AsyncIterator | None = None
        self._backend_done = False
        self._outcome = "cancelled"
        self._finished: Finished | None = None  # the backend's, or the one the client got
        self._error: PdserveError | None = None
        self._gaps: list[float] = []
        # One task reads the backend into a queue, so that neither a passed deadline nor a client
        # that leaves cancels the backend midway: the request is aborted and the backend ends it,
        # with its phase record for the log (``_close_backend``).
        self._items: asyncio.Queue = asyncio.Queue()
        self._pump_task: asyncio.Task | None = None

    async def __aenter__(self) -> AsyncIterator[Chunk | Finished]:
        if self._deadline is not None and self._deadline <= time.monotonic():
            raise DeadlineExceededError("the request's deadline passed before it was admitted")
        try:
            if self._req.client_id:
                self._id_key = self._s._claim_id(self._scope, self._req.client_id, self._req.request_id)
            if self._api == BATCH_API:
                pass   # the Batch API's items: bounded by its runner's own limit, outside admission
            elif self._deadline is None:
                await self._s.admission.acquire(self._group)
                self._admitted = True
            else:
                try:
                    async with asyncio.timeout_at(self._loop_deadline()):
                        await self._s.admission.acquire(self._group)
                    self._admitted = True
                except TimeoutError:
                    raise DeadlineExceededError(f"the request's deadline passed while it waited for a slot "
                                        f"({self._timeout_text()}); retry later") from None
        except BaseException as exc:
            self._release_id()
            if isinstance(exc, PdserveError):
                self._outcome, self._error = exc.error_type, exc
            self._tell_observers()
            raise
        r = self._req
        self._gen = self._s.backend.generate(
            GenerateRequest(r.request_id, r.prompt_token_ids, r.params, r.priority, self._deadline, r.client_id,
                            resume_key(self._scope, r.client_id), r.resume_from))
        self._pump_task = asyncio.get_running_loop().create_task(self._pump(), name=f"backend-{r.request_id}")
        self._events_gen = self._events()
        return self._events_gen

    async def __aexit__(self, exc_type, exc, tb) -> None:
        try:
            # Shielded as a whole: a cancel arriving meanwhile (a gRPC deadline that passes as the
            # server's own fires) must not cut the backend's cleanup short (its ledger steps).
            await asyncio.shield(self._close_backend())
        finally:
            if self._admitted:
                self._s.admission.release(self._group)
            self._release_id()
            if isinstance(exc, PdserveError):
                self._outcome, self._error = exc.error_type, exc
            self._tell_observers()

    def _tell_observers(self) -> None:
        r, f = self._req, self._finished
        phase = None if f is None else f.phase
        error = self._error if self._error is not None else (None if f is None else f.error)
        tell_all(self._s.observers, RequestRecord(
            request_id=r.request_id, client_request_id=r.client_id, api=self._api, outcome=self._outcome,
            priority=r.priority.name.lower(), max_tokens=r.params.max_tokens, time=time.time(),
            error=None if error is None else str(error), phase=phase, itl_s=tuple(self._gaps), owner=r.owner))

    async def _close_backend(self) -> None:
        if not self._backend_done:
            await self._s.backend.abort(self._req.request_id)
            # The aborted request's own record (its workers, what it had produced) for the log.
            finished = await self._await_finished()
            if finished is not None and self._finished is None:
                self._finished = Finished(finished.finish_reason, finished.phase.but(
                    finish_reason=finished.finish_reason), finished.error)
        if self._events_gen is not None:
            await self._events_gen.aclose()
        if self._pump_task is not None:
            self._pump_task.cancel()
            await asyncio.gather(self._pump_task, return_exceptions=True)
        if self._gen is not None:
            await self._gen.aclose()

    def _timeout_text(self) -> str:
        limit = self._s.limits.request_timeout_s
        return (f"the server allows {limit:g} s, a client deadline may be shorter" if limit is not None
                else "the client's deadline")

    def _release_id(self) -> None:
        if self._id_key is not None:
            self._s._live_ids.pop(self._id_key, None)
            self._id_key = None

    def _loop_deadline(self) -> float:
        """The deadline on the event loop's clock."""
        return asyncio.get_running_loop().time() + (self._deadline - time.monotonic())

    async def _pump(self) -> None:
        """The backend's items into ``_items``; then ``StopAsyncIteration``, or what it raised."""
        try:
            async for item in self._gen:
                self._items.put_nowait(item)
            self._items.put_nowait(StopAsyncIteration())
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._items.put_nowait(exc)

    async def _take(self) -> TokenDelta | Finished:
        item = await self._items.get()
        if isinstance(item, BaseException):
            self._items.put_nowait(item)   # the stream stays ended for any later read
            raise item
        return item

    async def _next(self) -> TokenDelta | Finished:
        if self._deadline is None:
            return await self._take()
        try:
            async with asyncio.timeout_at(self._loop_deadline()):
                return await self._take()
        except TimeoutError:
            raise DeadlineExceededError(f"the request did not finish within its deadline ({self._timeout_text()}); "
                                        "ask for fewer tokens (max_tokens) or allow a longer deadline") from None

    async def _await_finished(self) -> Finished | None:
        """After an abort: the backend's Finished (for its phase record), or None if it is slow."""
        try:
            async with asyncio.timeout(FINISH_GRACE_S):
                while True:
                    item = await self._take()
                    if isinstance(item, Finished):
                        return item
        except (TimeoutError, StopAsyncIteration):
            logger.warning("request %s: no Finished from the backend after abort", self._req.request_id)
        except Exception as exc:  # the stream already ended badly (its error was reported)
            logger.debug("request %s: no Finished after abort: %s", self._req.request_id, exc)
        return None

    async def _events(self) -> AsyncIterator[Chunk | Finished]:
        req = self._req
        p = req.params
        text = OutputText(self._s.tokenizer, req.prompt_token_ids, p.stop, skip_special_tokens=p.skip_special_tokens,
                          include_stop_str=p.include_stop_str_in_output,
                          spaces_between_special_tokens=p.spaces_between_special_tokens)
        completion = 0
        gaps = self._gaps
        last_chunk_at: float | None = None
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
                    now = time.monotonic()
                    if last_chunk_at is not None:
                        gaps.append(now - last_chunk_at)
                    last_chunk_at = now
                    yield Chunk(ids, "".join(pieces), lps, item.prompt_logprobs)
                if not text.stopped:
                    continue
                finished = await self._await_finished()
                self._backend_done = True
                item = Finished("stop", finished.phase if finished else RequestPhase())
            self._backend_done = True
            break
        reason = "stop" if text.stopped else item.finish_reason
        tail = text.finish() if item.error is None else ""
        if tail:
            yield Chunk([], tail)
        # What the client got: its prompt, and the tokens it was sent (a stop string cuts them).
        phase = item.phase.but(finish_reason=reason, prompt_tokens=len(req.prompt_token_ids), output_tokens=completion)
        self._outcome = item.error.error_type if item.error is not None else reason
        self._finished = Finished(reason, phase, item.error)
        # The request is over: its id is free before the client can read the last event, so a
        # client that reuses it at once (a resume, a retry) never meets its own finished request.
        self._release_id()
        yield self._finished

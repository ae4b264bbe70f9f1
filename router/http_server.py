"""The OpenAI-compatible HTTP API (aiohttp).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both plain JSON or SSE with
``data: [DONE]``), ``GET /v1/models``, vLLM's ``POST /tokenize``, ``POST /detokenize`` and
``GET /version``, ``GET /health``, ``GET /metrics``. Errors are OpenAI
shaped (``router.errors``). An unknown model is 404 ``model_not_found``, as OpenAI answers.
A client that disconnects mid-request cancels its handler, which aborts the backend request.
Bodies are read by ``router.http_body`` (JSON only, bounded in size and time); a wrong method on
a known path is 405 with ``Allow``. Refused requests are logged as one rate-limited INFO line
each (``router.rejection_log``), never with a traceback.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import ssl
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from pdserve.engine.errors import PdserveError
from pdserve.router import errors
from pdserve.router.auth import ApiKeyAuth
from pdserve.router.http_body import check_content_type, parse_json, read_body
from pdserve.router.openai_format import ResponseBuilder, usage_totals
from pdserve.router.header_timeout import HeaderDeadlineStats, with_header_deadline
from pdserve.router.rejection_log import RejectionLog
from pdserve.router.backend import Finished
from pdserve.router.serving import Chunk, Serving
from pdserve.router import batch_api, batch_input
from pdserve.router.batch_api import BatchStore
from pdserve.router.beam_search import beam_search
from pdserve.router.choices import ChoiceRequest, by_likelihood, collect, for_ranking, fork, run_choices
from pdserve.router.validation import (ParsedRequest, check_model, check_request_id, parse_chat_body,
                                       parse_completion_bodies, parse_detokenize_body, parse_tokenize_body)

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_BODY_TIMEOUT_S = 30.0
DEFAULT_HEADER_TIMEOUT_S = 10.0
# An idle kept-alive connection is closed after this (aiohttp's AppRunner default is an hour;
# this is its run_app default, above the 60 s idle timeout of common load balancers).
KEEPALIVE_TIMEOUT_S = 75.0
_SERVING = web.AppKey("serving", Serving)
_AUTH = web.AppKey("auth", ApiKeyAuth)
_OWNER = web.RequestKey("owner", str)  # the request's owner id, set by _check_auth
_MAX_BODY = web.AppKey("max_body", int)
_BODY_TIMEOUT = web.AppKey("body_timeout_s", float)
_REJECTIONS = web.AppKey("rejections", RejectionLog)
_BATCHES = web.AppKey("batches", object)


def error_response(exc: BaseException) -> web.Response:
    headers = {}
    retry = errors.retry_after_seconds(exc)
    if retry is not None:
        headers["Retry-After"] = str(retry)
    if isinstance(exc, errors.MethodNotAllowedError):
        headers["Allow"] = ", ".join(exc.allowed)
    return web.json_response(errors.openai_error_body(exc), status=errors.http_status(exc), headers=headers)


def _refused(request: web.Request, exc: PdserveError) -> web.Response:
    """The error response for a request the client got wrong, logged as one line."""
    resp = error_response(exc)
    if resp.status < 500:
        request.app[_REJECTIONS].refused(f"{request.method} {request.path[:100]}", resp.status, str(exc))
    return resp


@web.middleware
async def _error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status == 413:
            return _refused(request, errors.RequestTooLargeError(
                f"the request body is larger than {request.app[_MAX_BODY]} bytes"))
        if isinstance(exc, web.HTTPMethodNotAllowed):
            allowed = tuple(sorted(exc.allowed_methods))
            return _refused(request, errors.MethodNotAllowedError(
                f"{request.method[:16]} is not allowed on {request.path[:100]}; use {' or '.join(allowed)}", allowed))
        if exc.status == 404:
            return _refused(request, errors.RouteNotFoundError(
                f"{request.method[:16]} {request.path[:100]} is not an endpoint here"))
        raise
    except errors.BodyTimeoutError as exc:
        return await _answer_and_close(request, _refused(request, exc))
    except PdserveError as exc:
        return _refused(request, exc)
    except asyncio.CancelledError:
        raise  # the client is gone: nothing to answer
    except ConnectionError as exc:  # lost mid-body: nothing to answer, and no traceback for aiohttp to log
        logger.debug("%s %s: the client went away: %s", request.method, request.path[:100], exc)
        return web.Response(status=400)
    except Exception as exc:  # a bug: log it, answer 500 without internals
        return error_response(errors.as_pdserve_error(exc))


async def _answer_and_close(request: web.Request, resp: web.Response) -> web.Response:
    """Send ``resp`` and close the connection now (aiohttp would otherwise wait up to its
    lingering time for the rest of a body that is not coming)."""
    resp.force_close()
    await resp.prepare(request)
    await resp.write_eof()
    request.protocol.force_close()
    return resp


async def _read_json(request: web.Request) -> object:
    check_content_type(request)
    return parse_json(await read_body(request, request.app[_MAX_BODY], request.app[_BODY_TIMEOUT]))


def _check_auth(request: web.Request) -> str:
    """The caller's owner id (``router/auth.py``), kept on the request: it scopes the client's
    request ids and names the tenant in the request log."""
    owner = request.app[_AUTH].check(request.headers.get("Authorization"))
    request[_OWNER] = owner
    return owner


def _resume_from(request: web.Request, client_id_given: bool) -> int | None:
    """A resumed stream's ``Last-Event-ID`` (the ``id:`` of the last event the client got: its
    token count); None when the header is absent."""
    raw = request.headers.get("Last-Event-ID")
    if raw is None:
        return None
    if not raw.strip().isdigit() or len(raw.strip()) > 9:
        raise errors.InvalidParameterError(f"Last-Event-ID must be the id of the last event received (a token "
                                           f"count, a non-negative integer), got {raw[:40]!r}", param="Last-Event-ID")
    if not client_id_given:
        raise errors.InvalidParameterError("resuming a stream (Last-Event-ID) needs the X-Request-Id it was started "
                                           "with", param="X-Request-Id")
    return int(raw.strip())


def _refuse_resume(request: web.Request, what: str) -> None:
    if request.headers.get("Last-Event-ID") is not None:
        raise errors.InvalidParameterError(f"Last-Event-ID resumes one stream; it cannot be used with {what}",
                                           param="Last-Event-ID")


def _client_id(request: web.Request, parsed: ParsedRequest, default: str) -> str:
    """The client's own id: the X-Request-Id header or vLLM's ``request_id`` body field (one id if both)."""
    given = request.headers.get("X-Request-Id")
    if given is not None:
        check_request_id(given, param="X-Request-Id")
        if parsed.request_id is not None and parsed.request_id != given:
            raise errors.InvalidParameterError("'request_id' and the X-Request-Id header differ; send one id",
                                               param="request_id")
        return given
    return parsed.request_id or default


def _echo_text(parsed: ParsedRequest, prompt_ids: list[int], tokenizer) -> str:
    """What ``echo`` repeats: the prompt's text, or in a chat the final (assistant) message."""
    if not parsed.echo:
        return ""
    if parsed.messages is not None:
        return parsed.messages[-1].get("content") or ""
    return parsed.prompt_text if parsed.prompt_text is not None else tokenizer.decode(prompt_ids)


async def _generate(request: web.Request, parsed: ParsedRequest, *, chat: bool) -> web.StreamResponse:
    serving = request.app[_SERVING]
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    # The client's own id (X-Request-Id) is echoed back; a live duplicate of it is 409.
    client_id = _client_id(request, parsed, rid)
    resume_from = _resume_from(request, client_id != rid)
    prepared = await serving.prepare(parsed, client_id, default_max_tokens=None if chat else 16)
    if resume_from is not None:
        prepared = dataclasses.replace(prepared, resume_from=resume_from)
    builder = ResponseBuilder(rid, serving.info.name, serving.tokenizer, chat=chat,
                              logprobs=prepared.params.logprobs, tools=parsed.tools,
                              tokens_as_ids=parsed.tokens_as_ids, prompt_ids=prepared.prompt_token_ids,
                              prompt_logprobs=parsed.prompt_logprobs,
                              echo=_echo_text(parsed, prepared.prompt_token_ids, serving.tokenizer),
                              return_token_ids=parsed.return_token_ids)
    scope = request[_OWNER]  # ids are scoped per tenant; without keys every client shares one scope
    async with serving.stream(prepared, api="http", scope=scope) as events:
        if not parsed.stream:
            chunks: list[Chunk] = []
            async for ev in events:
                if isinstance(ev, Finished):
                    if ev.error is not None:
                        raise ev.error
                    return web.json_response(builder.full(chunks, ev), headers={"X-Request-Id": client_id})
                chunks.append(ev)
            raise PdserveError("the request ended without a final result")
        first = await anext(events)
        if isinstance(first, Finished) and first.error is not None:
            raise first.error  # nothing sent yet: answer with the error's own status
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Request-Id": client_id})
        await resp.prepare(request)
        # event ids only for clients that speak SSE itself (EventSource sends this Accept): a
        # client that reads "data:" lines alone would take an "id:" line for a broken event
        ids = "text/event-stream" in request.headers.get("Accept", "")
        await _send_events(resp, builder, first, events, parsed.include_usage,
                           first_id=(resume_from or 0) if ids else None)
        return resp


async def _send_events(resp: web.StreamResponse, builder: ResponseBuilder, first: Chunk | Finished,
                       events: AsyncIterator[Chunk | Finished], include_usage: bool,
                       first_id: int | None = None) -> None:
    """Server-sent events after the headers went out; a failure now becomes an error event.
    With ``first_id`` (not None), each event's ``id`` is the count of tokens sent so far (from
    ``first_id`` on a resumed stream): a client whose connection broke sends it back as
    ``Last-Event-ID``, with its X-Request-Id, to any router of the cluster to get the rest."""
    sent = [first_id or 0]

    async def send(body: dict) -> None:
        head = b"data: " if first_id is None else b"id: %d\ndata: " % sent[0]
        await resp.write(head + json.dumps(body, separators=(",", ":")).encode() + b"\n\n")

    try:
        for opening in (builder.first_chunk(), builder.echo_chunk()):
            if opening is not None:
                await send(opening)
        ev = first
        while not isinstance(ev, Finished):
            sent[0] += len(ev.token_ids)
            await send(builder.chunk(ev))
            ev = await anext(events)
        if ev.error is not None:
            await send(errors.openai_error_body(ev.error))
        else:
            for body in builder.closing_chunks(ev):
                await send(body)
            if include_usage:
                await send(builder.usage_chunk(ev))
    except PdserveError as exc:
        await send(errors.openai_error_body(exc))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()


async def completions(request: web.Request) -> web.StreamResponse:
    _check_auth(request)
    parsed = parse_completion_bodies(await _read_json(request),
                                     max_choices=request.app[_SERVING].limits.max_choices)
    one = parsed[0]
    if one.beam_width:
        return await _generate_beams(request, parsed, chat=False)
    if len(parsed) == 1 and one.best_of == 1 and not one.echo:
        return await _generate(request, one, chat=False)
    return await _generate_many(request, parsed, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    _check_auth(request)
    parsed = parse_chat_body(await _read_json(request), max_choices=request.app[_SERVING].limits.max_choices)
    if parsed.beam_width:
        return await _generate_beams(request, [parsed], chat=True)
    if parsed.n == 1:
        return await _generate(request, parsed, chat=True)
    return await _generate_many(request, [parsed], chat=True)


async def _generate_beams(request: web.Request, parsed: list[ParsedRequest], *, chat: bool) -> web.Response:
    """vLLM's ``use_beam_search``: each prompt's ``n`` best beams (``router/beam_search.py``) as its
    choices, ``finish_reason`` ``stop`` for a beam that ended with EOS, else ``length``."""
    serving = request.app[_SERVING]
    _refuse_resume(request, "beam search")
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    client_id = _client_id(request, parsed[0], rid)
    scope = request[_OWNER]  # ids are scoped per tenant; without keys every client shares one scope
    eos = frozenset(serving.info.eos_token_ids)
    deadline = serving.deadline()   # one for the whole response, all prompts' searches together
    out_choices, extras, prompt_tokens, completion = [], [], 0, 0
    for g, p in enumerate(parsed):
        prepared = await serving.prepare(p, client_id, default_max_tokens=None if chat else 16)
        beams = await beam_search(serving, prepared, p.beam_width, p.length_penalty, eos_token_ids=eos,
                                  api="http", scope=scope, deadline=deadline)
        prompt_tokens += len(prepared.prompt_token_ids)
        for rank, beam in enumerate(beams):
            tokens = beam.tokens[:-1] if beam.ended else beam.tokens
            text = serving.tokenizer.decode(tokens, skip_special_tokens=prepared.params.skip_special_tokens)
            index = g * p.beam_width + rank
            choice: dict = {"index": index, "logprobs": None, "finish_reason": "stop" if beam.ended else "length"}
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            out_choices.append(choice)
            extras.append({"index": index, "token_ids": beam.tokens, "cumulative_logprob": beam.logprob})
            completion += len(beam.tokens)
    body = ResponseBuilder(rid, serving.info.name, serving.tokenizer, chat=chat, logprobs=None)._envelope(stream=False)
    body.update(choices=out_choices, usage=usage_totals(prompt_tokens, 0, completion))
    body["pdserve"] = {"request_id": rid, "choices": extras}
    return web.json_response(body, headers={"X-Request-Id": client_id})


async def _generate_many(request: web.Request, parsed: list[ParsedRequest], *, chat: bool) -> web.StreamResponse:
    """Several choices (``router/choices.py``): ``n`` per prompt, several prompts, ``best_of``
    candidates of which the ``n`` most likely (highest sum of token logprobs) are returned."""
    serving = request.app[_SERVING]
    _refuse_resume(request, "several choices or prompts (n, best_of, echo, a list of prompts)")
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    client_id = _client_id(request, parsed[0], rid)
    prepared = [await serving.prepare(p, client_id, default_max_tokens=None if chat else 16) for p in parsed]
    n, best_of = parsed[0].n, parsed[0].best_of
    wanted_logprobs = prepared[0].params.logprobs
    ranked = best_of > n
    choices = []
    for g, prep in enumerate(prepared):
        if ranked:
            prep = for_ranking(prep)
        choices += [ChoiceRequest(g * best_of + j, g, fork(prep, j, g * best_of + j)) for j in range(best_of)]
    echo = [_echo_text(p, pp.prompt_token_ids, serving.tokenizer) for p, pp in zip(parsed, prepared)]
    scope = request[_OWNER]  # ids are scoped per tenant; without keys every client shares one scope
    events = run_choices(serving, choices, api="http", scope=scope)
    usage_prompt = sum(len(p.prompt_token_ids) for p in prepared)

    def builder(index: int, group: int = 0, *, full: bool = False) -> ResponseBuilder:
        """The builder of choice ``index`` (of prompt ``group``); ``full``: a whole response, which
        carries the echoed prompt itself (a stream sends it as a chunk of its own)."""
        return ResponseBuilder(rid, serving.info.name, serving.tokenizer, chat=chat, logprobs=wanted_logprobs,
                               index=index, tools=parsed[0].tools, tokens_as_ids=parsed[0].tokens_as_ids,
                               prompt_ids=prepared[group].prompt_token_ids,
                               prompt_logprobs=parsed[group].prompt_logprobs,
                               echo=echo[group] if full else "", score_only=full and parsed[group].max_tokens == 0,
                               return_token_ids=parsed[group].return_token_ids)

    if not parsed[0].stream:
        chunks, finals = await collect(events, (c.index for c in choices))
        out_choices, extras = [], []
        chat_prompt_lp = None
        for g in range(len(prepared)):
            cands = [c.index for c in choices if c.group == g]
            # the prompt's first candidate scored it (prompt_logprobs); its siblings share that
            scored = next((ch.prompt_logprobs for ch in chunks[cands[0]] if ch.prompt_logprobs is not None), None)
            if scored is not None:
                for i in cands[1:]:
                    chunks[i].insert(0, Chunk([], "", None, scored))
            if ranked:
                cands = by_likelihood(cands, chunks)
            for rank, i in enumerate(cands[:n]):
                body = builder(g * n + rank, g, full=True).full(chunks[i], finals[i])
                out_choices.append(body["choices"][0])
                chat_prompt_lp = body.get("prompt_logprobs")  # chat: one prompt, one list (vLLM's place)
                extras.append({"index": g * n + rank, "token_ids": body["pdserve"]["token_ids"],
                               "phase": body["pdserve"]["phase"]})
        cached = sum(finals[g * best_of].phase.cached_prompt_tokens for g in range(len(prepared)))  # first choices
        # max_tokens 0 (echo): the token each candidate generated is not returned, nor counted
        completion = sum(f.phase.output_tokens for i, f in finals.items()
                         if parsed[next(c.group for c in choices if c.index == i)].max_tokens != 0)
        body = builder(0)._envelope(stream=False)
        body.update(choices=out_choices, usage=usage_totals(usage_prompt, cached, completion))
        if chat_prompt_lp is not None:
            body["prompt_logprobs"] = chat_prompt_lp
        body["pdserve"] = {"request_id": rid, "choices": extras}
        return web.json_response(body, headers={"X-Request-Id": client_id})

    builders = {c.index: builder(c.index, c.group) for c in choices}
    try:
        first = await anext(events)
    except StopAsyncIteration:
        raise PdserveError("the request ended without a result") from None
    except BaseException:
        await events.aclose()
        raise
    if isinstance(first[1], Finished) and first[1].error is not None:
        await events.aclose()
        raise first[1].error  # nothing sent yet: answer with the error's own status
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "X-Request-Id": client_id})
    await resp.prepare(request)

    async def send(body: dict) -> None:
        await resp.write(b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n")

    opened: set[int] = set()
    finals: dict[int, Finished] = {}
    try:
        item = first
        while True:
            index, ev = item
            b = builders[index]
            if index not in opened:
                opened.add(index)
                opening = b.first_chunk()
                if opening is not None:
                    await send(opening)
                if echo[index // best_of]:
                    await send(b.chunk(Chunk([], echo[index // best_of])))
            if isinstance(ev, Finished):
                if ev.error is not None:
                    await send(errors.openai_error_body(ev.error))
                    break
                finals[index] = ev
                for body in b.closing_chunks(ev):
                    await send(body)
            else:
                await send(b.chunk(ev))
            try:
                item = await anext(events)
            except StopAsyncIteration:
                if parsed[0].include_usage:
                    cached = sum(f.phase.cached_prompt_tokens for i, f in finals.items() if i % best_of == 0)
                    completion = sum(f.phase.output_tokens for f in finals.values())
                    usage = builder(0)._envelope(stream=True)
                    usage.update(choices=[], usage=usage_totals(usage_prompt, cached, completion))
                    await send(usage)
                break
    except PdserveError as exc:
        await send(errors.openai_error_body(exc))
    finally:
        await events.aclose()
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def models(request: web.Request) -> web.Response:
    _check_auth(request)
    info = request.app[_SERVING].info
    return web.json_response({"object": "list", "data": [{
        "id": info.name, "object": "model", "created": 0, "owned_by": "pdserve", "max_model_len": info.max_model_len,
    }]})


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's ``/tokenize``: ``{count, max_model_len, tokens[, token_strs]}``."""
    _check_auth(request)
    serving = request.app[_SERVING]
    req = parse_tokenize_body(await _read_json(request))
    ids = await serving.tokenize(req)
    strs = await asyncio.to_thread(serving.tokenizer.convert_ids_to_tokens, ids) if req.return_token_strs else None
    # hundreds of thousands of ids take tens of ms to write out: off the event loop too
    text = await asyncio.to_thread(json.dumps, {"count": len(ids), "max_model_len": serving.info.max_model_len,
                                                "tokens": ids, "token_strs": strs})
    return web.Response(text=text, content_type="application/json")


async def detokenize(request: web.Request) -> web.Response:
    """vLLM's ``/detokenize``: ``{prompt}``, the text of the ids (special tokens included)."""
    _check_auth(request)
    serving = request.app[_SERVING]
    model, ids = parse_detokenize_body(await _read_json(request), serving.info.vocab_size)
    check_model(model, serving.info.name)
    return web.json_response({"prompt": await asyncio.to_thread(serving.detokenize, ids)})


# ----------------------------------------------------------------------- Batch API
# Every file and batch belongs to the API key that made it (``router/auth.py``'s owner id): another
# owner's is answered 404, as an unknown id, and lists hold only the caller's own. Ids are checked
# against the shape this server gives them before they reach a Redis key.
def _store(request: web.Request) -> tuple[BatchStore, str]:
    """The Batch API's store and the caller's owner id."""
    owner = request.app[_AUTH].check(request.headers.get("Authorization"))
    store = request.app[_BATCHES]
    if store is None:
        raise errors.RouteNotFoundError(f"{request.path[:64]}: the Batch API needs the cluster's Redis "
                                        "(pdserve up); this server runs without it")
    return store, owner


async def _io(fn, *args):
    return await asyncio.to_thread(fn, *args)


async def _own_file(store: BatchStore, owner: str, file_id: str) -> dict:
    meta = await _io(store.file, file_id) if batch_input.is_file_id(file_id) else None
    if not batch_api.owned_by(meta, owner):
        raise errors.ResourceNotFoundError(f"no file '{file_id[:64]}'")
    return meta


async def _own_batch(store: BatchStore, owner: str, batch_id: str) -> dict:
    b = await _io(store.batch, batch_id) if batch_input.is_batch_id(batch_id) else None
    if not batch_api.owned_by(b, owner):
        raise errors.ResourceNotFoundError(f"no batch '{batch_id[:64]}'")
    return b


async def _read_upload(request: web.Request) -> tuple[str | None, list[bytes] | None, str]:
    """The multipart form's (purpose, file content in chunks, filename); a malformed form is 400.
    The chunks are joined off the event loop (one 64 MiB copy is a stall of its own)."""
    purpose, content, filename = None, None, None
    reader = await request.multipart()
    async for part in reader:
        if part.name == "purpose":
            purpose = (await part.read(decode=True)).decode("utf-8", "replace")[:64]
        elif part.name == "file":
            filename = batch_input.check_filename(part.filename)
            content, size = [], 0
            while chunk := await part.read_chunk(1 << 20):
                content.append(chunk)
                size += len(chunk)
                if size > batch_input.MAX_FILE_BYTES:
                    raise errors.RequestTooLargeError(f"the file is larger than {batch_input.MAX_FILE_BYTES} bytes")
        else:
            raise errors.InvalidParameterError(f"unknown form field '{str(part.name)[:64]}'; send 'purpose' and 'file'",
                                               param=str(part.name)[:64])
    return purpose, content, filename or "upload.jsonl"


async def upload_file(request: web.Request) -> web.Response:
    """``POST /v1/files`` (multipart: ``purpose`` and ``file``), as OpenAI's."""
    store, owner = _store(request)
    if not request.content_type.startswith("multipart/"):
        raise errors.UnsupportedMediaTypeError("upload the file as multipart/form-data with 'purpose' and 'file'")
    try:
        purpose, content, filename = await _read_upload(request)
    except HttpProcessingError as exc:   # e.g. a part header (its filename) past aiohttp's line limit
        raise errors.InvalidParameterError(
            f"the multipart form is malformed: {str(exc.message)[:120]} (a part's header line, its filename "
            f"included, may be at most 8190 bytes; a filename at most {batch_input.MAX_FILENAME_CHARS} "
            "characters)", param="file") from None
    if content is None:
        raise errors.InvalidParameterError("the form has no 'file' part", param="file")
    content = await asyncio.to_thread(b"".join, content)
    batch_input.check_upload(purpose, content)
    await asyncio.to_thread(batch_input.check_file, content)
    meta = batch_api.new_file(content, filename, "batch", owner)
    await _io(store.put_file, meta, content)
    return web.json_response(batch_api.file_object(meta))


async def get_file(request: web.Request) -> web.Response:
    store, owner = _store(request)
    return web.json_response(batch_api.file_object(await _own_file(store, owner, request.match_info["file_id"])))


async def get_file_content(request: web.Request) -> web.StreamResponse:
    """The file's bytes, sent slice by slice as the store reads them (never the whole file at once)."""
    store, owner = _store(request)
    fid = request.match_info["file_id"]
    meta = await _own_file(store, owner, fid)
    chunks = await _io(store.file_chunks, fid)
    if chunks is None:
        raise errors.ResourceNotFoundError(f"no file '{fid[:64]}'")
    resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
    resp.content_length = meta["bytes"]
    first = await _io(next, chunks, b"")    # a store that fails before the first byte is a clean 503
    await resp.prepare(request)
    try:
        chunk = first
        while chunk:
            await resp.write(chunk)
            chunk = await _io(next, chunks, b"")
    except PdserveError as exc:   # the store failed midway: the client sees a short body (Content-Length)
        logger.warning("GET %s: cut short: %s", request.path[:100], exc)
        request.protocol.force_close()
        return resp
    await resp.write_eof()
    return resp


def _check_stored_file(store: BatchStore, file_id: str, endpoint: str) -> tuple[list[str], list[dict]]:
    chunks = store.file_chunks(file_id)
    if chunks is None:
        raise errors.ResourceNotFoundError(f"no file '{file_id[:64]}'")
    return batch_input.check_lines(chunks, endpoint)


async def create_batch(request: web.Request) -> web.Response:
    store, owner = _store(request)
    fid, endpoint, window, metadata = batch_api.check_create(await _read_json(request))
    meta = await _own_file(store, owner, fid)
    if meta["purpose"] != "batch":
        raise errors.InvalidParameterError(f"file '{fid[:64]}' is a {meta['purpose']} file, not a batch input",
                                           param="input_file_id")
    # Off the event loop and read in slices: a 64 MiB file parsed on the loop, or read from Redis
    # in one piece, would stall every stream.
    items, problems = await asyncio.to_thread(_check_stored_file, store, fid, endpoint)
    batch = batch_api.new_batch(fid, endpoint, window, metadata, len(items) if not problems else 0, owner)
    if problems:  # as OpenAI: the batch fails validation as a whole, each bad line named
        batch.update(status="failed", failed_at=batch["created_at"], in_progress_at=None,
                     errors={"object": "list", "data": problems[:1000]})
        items = []
    await _io(store.put_batch, batch, items)
    return web.json_response(batch_api.batch_object(await _io(store.batch, batch["id"])))


async def get_batch(request: web.Request) -> web.Response:
    store, owner = _store(request)
    return web.json_response(batch_api.batch_object(await _own_batch(store, owner, request.match_info["batch_id"])))


async def list_batches(request: web.Request) -> web.Response:
    store, owner = _store(request)
    try:
        limit = int(request.query.get("limit", "20"))
    except ValueError:
        raise errors.InvalidParameterError("'limit' must be an integer from 1 to 100", param="limit") from None
    if not 1 <= limit <= 100:
        raise errors.InvalidParameterError("'limit' must be an integer from 1 to 100", param="limit")
    after = request.query.get("after")
    if after is not None and not batch_input.is_batch_id(after):
        raise errors.InvalidParameterError("'after' must be the id of a batch (the last_id of the previous page)",
                                           param="after")
    page = await _io(store.batches, limit + 1, after, owner)
    data = [batch_api.batch_object(b) for b in page[:limit]]
    return web.json_response({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                              "last_id": data[-1]["id"] if data else None, "has_more": len(page) > limit})


async def cancel_batch(request: web.Request) -> web.Response:
    store, owner = _store(request)
    bid = request.match_info["batch_id"]
    b = await _own_batch(store, owner, bid)
    if b["status"] not in batch_api.ACTIVE:
        raise errors.InvalidParameterError(f"batch '{bid[:64]}' is {b['status']}; only a running batch can be "
                                           "cancelled", param="batch_id")
    if b["status"] != "cancelling":
        b = await _io(store.update_batch, bid, {"status": "cancelling", "cancelling_at": int(time.time())})
    return web.json_response(batch_api.batch_object(b))


async def version(request: web.Request) -> web.Response:
    from pdserve import __version__

    return web.json_response({"version": __version__})


async def health(request: web.Request) -> web.Response:
    ok = await request.app[_SERVING].backend.health()
    return web.json_response({"status": "ok" if ok else "unavailable"}, status=200 if ok else 503)


async def metrics(request: web.Request) -> web.Response:
    body = request.app[_SERVING].metrics.render().encode("utf-8")
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


def make_app(serving: Serving, *, auth: ApiKeyAuth | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
             body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S, batches: BatchStore | None = None) -> web.Application:
    app = web.Application(middlewares=[_error_middleware], client_max_size=max_body_bytes)
    app[_BATCHES] = batches
    app[_SERVING] = serving
    app[_AUTH] = auth or ApiKeyAuth()
    app[_MAX_BODY] = max_body_bytes
    app[_BODY_TIMEOUT] = body_timeout_s
    app[_REJECTIONS] = RejectionLog(logger)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/version", version)
    app.router.add_post("/v1/files", upload_file)
    app.router.add_get("/v1/files/{file_id}", get_file)
    app.router.add_get("/v1/files/{file_id}/content", get_file_content)
    app.router.add_post("/v1/batches", create_batch)
    app.router.add_get("/v1/batches", list_batches)
    app.router.add_get("/v1/batches/{batch_id}", get_batch)
    app.router.add_post("/v1/batches/{batch_id}/cancel", cancel_batch)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


@dataclass(slots=True)
class HttpServer:
    runner: web.AppRunner
    host: str
    port: int
    tls: bool
    listener: asyncio.Server | None = None   # accepts connections, each behind a HeaderDeadline
    header_deadlines: HeaderDeadlineStats | None = None

    @property
    def base_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.port}"

    async def stop(self) -> None:
        if self.listener is not None:
            self.listener.close()   # no new connections; the runner closes the open ones
        await self.runner.cleanup()


async def start_http_server(serving: Serving, *, host: str = "127.0.0.1", port: int = 0,
                            auth: ApiKeyAuth | None = None, ssl_context: ssl.SSLContext | None = None,
                            max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                            body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
                            header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
                            batches: BatchStore | None = None) -> HttpServer:
    """Start serving; ``port=0`` picks a free port (see ``HttpServer.port``). ``batches``: the Batch
    API's store (``cluster/state/batch_store.py``); without it the Batch API answers 404."""
    app = make_app(serving, auth=auth, max_body_bytes=max_body_bytes, body_timeout_s=body_timeout_s,
                   batches=batches)
    # auto_decompress off: router.http_body decompresses known codings itself, bounded in size.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, auto_decompress=False,
                           keepalive_timeout=KEEPALIVE_TIMEOUT_S)
    await runner.setup()
    # Listening ourselves (not a TCPSite) to put each connection behind a header-read deadline
    # (router/header_timeout.py): aiohttp has none.
    stats = HeaderDeadlineStats()
    listener = await asyncio.get_running_loop().create_server(
        with_header_deadline(runner.server, header_timeout_s, stats), host, port, ssl=ssl_context, backlog=128)
    bound = listener.sockets[0].getsockname()[1]
    logger.info("HTTP API on %s:%d%s", host, bound, " (TLS)" if ssl_context else "")
    return HttpServer(runner, host, bound, ssl_context is not None, listener, stats)

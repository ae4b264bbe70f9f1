"""The gRPC API: ``pdserve.v1.Generation`` on a grpc.aio server, plus health and reflection.

A client deadline becomes the request's deadline; a client cancel (or a lost connection)
cancels the handler, which aborts the backend request. Errors leave as the status code that
``router.errors`` assigns; an overloaded server adds ``retry-after-ms`` trailing metadata.
The standard ``grpc.health.v1.Health`` service follows the backend's health, polled every
``health_poll_s``; it and reflection need no API key, so probes and tools work without one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass, replace

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve.engine.contract import RequestPhase
from pdserve.engine.sequence import Priority
from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pb_grpc
from pdserve.router import errors
from pdserve.router.auth import ApiKeyAuth
from pdserve.router.backend import Finished
from pdserve.router.choices import ChoiceRequest, by_likelihood, collect, for_ranking, fork, run_choices
from pdserve.router.serving import Chunk, PreparedRequest, Serving
from pdserve.router.validation import (DEFAULT_MAX_CHOICES, ParsedRequest, check_request_id, max_prompt_chars,
                                       parse_generate_fields)

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name
_PRIORITY = {pb.PRIORITY_UNSPECIFIED: Priority.INTERACTIVE, pb.PRIORITY_INTERACTIVE: Priority.INTERACTIVE,
             pb.PRIORITY_BATCH: Priority.BATCH}
_FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_ABORT,
           "error": pb.FINISH_REASON_ERROR}
_OPTIONAL_SAMPLING = ("max_tokens", "temperature", "top_k", "top_p", "seed", "logprobs", "presence_penalty",
                      "frequency_penalty", "repetition_penalty", "min_p", "min_tokens", "n", "best_of", "cache_salt")


class MalformedMessage:
    """A request whose bytes are no valid message (corrupt wire format, bad UTF-8 in a string)."""

    def __init__(self, type_name: str, reason: str) -> None:
        self.type_name = type_name
        self.reason = reason

    def error(self) -> errors.InvalidParameterError:
        return errors.InvalidParameterError(f"the request is not a valid {self.type_name}: {self.reason[:200]}")


def _lenient(message_type):  # -> Callable[[bytes], message | MalformedMessage]
    def parse(data: bytes):
        try:
            return message_type.FromString(data)
        except DecodeError as exc:
            return MalformedMessage(message_type.DESCRIPTOR.full_name, str(exc))

    return parse


def add_generation_service(servicer: GenerationService, server: grpc.aio.Server) -> None:
    """``add_GenerationServicer_to_server`` whose request parsing cannot fail: a malformed request
    reaches the method as ``MalformedMessage`` and is refused with INVALID_ARGUMENT (gRPC itself
    would answer UNKNOWN and log a traceback for each one)."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate, request_deserializer=_lenient(pb.GenerateRequest),
            response_serializer=pb.GenerateResponse.SerializeToString),
        "ListModels": grpc.unary_unary_rpc_method_handler(
            servicer.ListModels, request_deserializer=_lenient(pb.ListModelsRequest),
            response_serializer=pb.ListModelsResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


def parsed_from_proto(request: pb.GenerateRequest, *, max_choices: int = DEFAULT_MAX_CHOICES) -> ParsedRequest:
    s = request.sampling
    fields: dict = {name: getattr(s, name) for name in _OPTIONAL_SAMPLING if s.HasField(name)}
    if s.stop:
        fields["stop"] = list(s.stop)
    if s.stop_token_ids:
        fields["stop_token_ids"] = list(s.stop_token_ids)
    fields["ignore_eos"] = s.ignore_eos
    fields["include_stop_str_in_output"] = s.include_stop_str_in_output
    fields["echo"] = s.echo
    if s.HasField("skip_special_tokens"):
        fields["skip_special_tokens"] = s.skip_special_tokens
    if s.logit_bias:
        fields["logit_bias"] = dict(s.logit_bias)
    if s.bad_words:
        fields["bad_words"] = list(s.bad_words)
    # The grammar, in the fields the HTTP API reads (one parser checks both).
    structured = s.WhichOneof("structured")
    if structured == "json_schema":
        fields["guided_json"] = s.json_schema
    elif structured == "json_object" and s.json_object:
        fields["response_format"] = {"type": "json_object"}
    elif structured == "regex":
        fields["guided_regex"] = s.regex
    elif structured == "choice":
        fields["guided_choice"] = list(s.choice.choices)
    elif structured == "grammar":
        fields["guided_grammar"] = s.grammar
    which = request.WhichOneof("prompt")
    return parse_generate_fields(
        request.model,
        request.text if which == "text" else None,
        list(request.token_ids.ids) if which == "token_ids" else None,
        fields,
        _PRIORITY.get(request.priority, Priority.INTERACTIVE),
        max_choices=max_choices,
    )


def _phase_message(phase: RequestPhase) -> pb.PhaseRecord:
    msg = pb.PhaseRecord()
    for f in pb.PhaseRecord.DESCRIPTOR.fields:
        value = getattr(phase, f.name)
        if value is None:
            continue
        setattr(msg, f.name, type(getattr(msg, f.name))(value))
    return msg


def _logprob_messages(tokenizer, token_ids: list[int], logprobs: list[dict[int, float]] | None,
                      ) -> list[pb.TokenLogprob]:
    if not logprobs:
        return []
    out = []
    for tok, lp in zip(token_ids, logprobs):
        top = [pb.TopLogprob(token_id=t, logprob=v, token=tokenizer.decode([t]))
               for t, v in sorted(lp.items(), key=lambda kv: -kv[1])]
        out.append(pb.TokenLogprob(token_id=tok, logprob=lp.get(tok, 0.0), top=top))
    return out


def max_message_bytes(max_model_len: int) -> int:
    """The largest request message accepted: the longest prompt text ``Serving`` still reads
    (``max_prompt_chars``) at 4 UTF-8 bytes a character, plus room for the other fields, and at
    least gRPC's default 4 MiB, so that a too-long prompt under it gets INVALID_ARGUMENT naming
    the limit (the early length check) rather than a bare RESOURCE_EXHAUSTED."""
    return max(4 * 1024 * 1024, 4 * max_prompt_chars(max_model_len) + 64 * 1024)


class GenerationService(pb_grpc.GenerationServicer):
    def __init__(self, serving: Serving, auth: ApiKeyAuth | None = None) -> None:
        self._serving = serving
        self._auth = auth or ApiKeyAuth()

    def _check_auth(self, context: grpc.aio.ServicerContext) -> str:
        """The caller's owner id (``router/auth.py``): it scopes the client's request ids."""
        return self._auth.check(self._metadata(context).get("authorization"))

    @staticmethod
    def _metadata(context: grpc.aio.ServicerContext) -> dict[str, str]:
        return {k.lower(): v for k, v in (context.invocation_metadata() or ())}

    async def _fail(self, context: grpc.aio.ServicerContext, exc: BaseException) -> None:
        context.set_trailing_metadata(errors.grpc_trailing_metadata(exc))
        err = errors.as_pdserve_error(exc)
        await context.abort(errors.grpc_status_code(err), str(err) or type(err).__name__)

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        try:
            # Ids are scoped per tenant (its owner id); without keys every client shares one scope.
            scope = self._check_auth(context)
            if isinstance(request, MalformedMessage):
                raise request.error()
            rid = check_request_id(request.request_id) if request.request_id else f"grpc-{uuid.uuid4().hex}"
            parsed = parsed_from_proto(request, max_choices=self._serving.limits.max_choices)
            prepared = await self._serving.prepare(parsed, rid, default_max_tokens=16)
            if request.HasField("resume_from"):
                if not request.request_id:
                    raise errors.InvalidParameterError("resume_from resumes the stream of a request_id: give it",
                                                       param="request_id")
                if parsed.best_of > 1 or parsed.echo:
                    raise errors.InvalidParameterError("resume_from resumes one stream; it cannot be used with "
                                                       "best_of, n or echo", param="resume_from")
                prepared = replace(prepared, resume_from=request.resume_from)
            remaining = context.time_remaining()
            deadline = time.monotonic() + remaining if remaining is not None else None
            echo = ""
            if parsed.echo:
                echo = parsed.prompt_text if parsed.prompt_text is not None else \
                    self._serving.tokenizer.decode(prepared.prompt_token_ids)
            if parsed.best_of > 1:
                async for msg in self._generate_many(rid, prepared, parsed.n, parsed.best_of, deadline, scope, echo):
                    yield msg
                return
            async with self._serving.stream(prepared, api="grpc", deadline=deadline, scope=scope) as events:
                if echo:
                    yield pb.GenerateResponse(request_id=rid, text=echo)
                async for ev in events:
                    yield self._message(rid, ev)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:  # every failure leaves as its status code; see router.errors
            await self._fail(context, exc)

    def _message(self, rid: str, ev: Chunk | Finished, index: int = 0) -> pb.GenerateResponse:
        if not isinstance(ev, Finished):
            lps = _logprob_messages(self._serving.tokenizer, ev.token_ids, ev.logprobs)
            return pb.GenerateResponse(request_id=rid, token_ids=ev.token_ids, text=ev.text, logprobs=lps, index=index)
        if ev.error is not None:
            raise ev.error
        ph = ev.phase
        usage = pb.Usage(prompt_tokens=ph.prompt_tokens, cached_prompt_tokens=ph.cached_prompt_tokens,
                         completion_tokens=ph.output_tokens)
        return pb.GenerateResponse(request_id=rid, index=index, final=pb.FinalInfo(
            finish_reason=_FINISH[ev.finish_reason], usage=usage, phase=_phase_message(ev.phase)))

    async def _generate_many(self, rid: str, prepared: PreparedRequest, n: int, best_of: int,
                             deadline: float | None, scope: str, echo: str = ""):
        """``n`` choices (``router/choices.py``), streamed interleaved; with ``best_of`` > ``n`` the
        candidates run to the end and the ``n`` most likely are sent whole, each with its final."""
        ranked = best_of > n
        asked = prepared.params.logprobs is not None
        if ranked:
            prepared = for_ranking(prepared)
        choices = [ChoiceRequest(j, 0, fork(prepared, j, j)) for j in range(best_of)]
        events = run_choices(self._serving, choices, api="grpc", scope=scope, deadline=deadline)
        if not ranked:
            try:
                opened: set[int] = set()
                async for index, ev in events:
                    if echo and index not in opened:
                        opened.add(index)
                        yield pb.GenerateResponse(request_id=rid, text=echo, index=index)
                    yield self._message(rid, ev, index)
            finally:
                await events.aclose()
            return
        chunks, finals = await collect(events, (c.index for c in choices))
        best = by_likelihood([c.index for c in choices], chunks)[:n]
        for rank, i in enumerate(best):
            whole = Chunk([t for ch in chunks[i] for t in ch.token_ids], echo + "".join(ch.text for ch in chunks[i]),
                          [lp for ch in chunks[i] for lp in (ch.logprobs or [])] if asked else None)
            yield self._message(rid, whole, rank)
            yield self._message(rid, finals[i], rank)

    async def ListModels(self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        try:
            self._check_auth(context)
            if isinstance(request, MalformedMessage):
                raise request.error()
        except Exception as exc:  # noqa: BLE001 - mapped to a status code
            await self._fail(context, exc)
        info = self._serving.info
        return pb.ListModelsResponse(models=[pb.ModelCard(id=info.name, max_model_len=info.max_model_len,
                                                          vocab_size=info.vocab_size)])


@dataclass(slots=True)
class GrpcServer:
    server: grpc.aio.Server
    host: str
    port: int
    _health: health.aio.HealthServicer
    _health_task: asyncio.Task

    @property
    def target(self) -> str:
        return f"{self.host}:{self.port}"

    async def stop(self, grace_s: float = 5.0) -> None:
        self._health_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._health_task
        await self._health.enter_graceful_shutdown()  # probes see NOT_SERVING while streams drain
        await self.server.stop(grace_s)


async def _update_health(serving: Serving, servicer: health.aio.HealthServicer, last: int | None) -> int:
    try:
        ok = await serving.backend.health()
    except Exception:  # a failing probe means "not serving", never a dead task
        logger.exception("backend health check failed")
        ok = False
    status = health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING
    if status != last:
        for name in ("", SERVICE_NAME):
            await servicer.set(name, status)
    return status


async def _follow_health(serving: Serving, servicer: health.aio.HealthServicer, every_s: float, last: int) -> None:
    while True:
        await asyncio.sleep(every_s)
        last = await _update_health(serving, servicer, last)


# Connections that do nothing are not kept forever (the HTTP side's keep-alive and header
# timeouts): an idle connection closes after 5 minutes, the server pings every minute to find
# peers that vanished (20 s to answer), and one connection carries at most 256 calls at once
# (more wait in the client's HTTP/2 flow control; generation is bounded by admission anyway).
CONNECTION_OPTIONS = (("grpc.max_connection_idle_ms", 300_000), ("grpc.keepalive_time_ms", 60_000),
                      ("grpc.keepalive_timeout_ms", 20_000), ("grpc.max_concurrent_streams", 256))


async def start_grpc_server(serving: Serving, *, host: str = "127.0.0.1", port: int = 0,
                            auth: ApiKeyAuth | None = None, credentials: grpc.ServerCredentials | None = None,
                            health_poll_s: float = 2.0) -> GrpcServer:
    """Start serving; ``port=0`` picks a free port (see ``GrpcServer.port``)."""
    limit = max_message_bytes(serving.info.max_model_len)
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", limit),
                                      *CONNECTION_OPTIONS])
    add_generation_service(GenerationService(serving, auth), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = f"{host}:{port}"
    bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"could not bind the gRPC server to {address}")
    status = await _update_health(serving, health_servicer, None)
    await server.start()
    task = asyncio.create_task(_follow_health(serving, health_servicer, health_poll_s, status), name="grpc-health")
    logger.info("gRPC API on %s:%d%s", host, bound, " (TLS)" if credentials else "")
    return GrpcServer(server, host, bound, health_servicer, task)

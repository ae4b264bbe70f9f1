"""The disaggregated backend: each request is prefilled on a prefill worker, its KV pushed into
blocks a decode worker reserved, and decoded there; failures are retried or migrated.

One attempt of one request (``{request_id}#{n}``; ``request_id`` is the router's own uuid hex,
never a client's string, and attempts are found by the exact request id they were started for):
1. Route: a decode worker (free blocks, load) and a prefill worker (longest cached prefix vs
   queued tokens), or local prefill on the decode worker (short uncached part, no prefill pool).
2. ``reserve`` on the decode worker -> ledger RESERVED; ``prefill`` on the prefill worker ->
   ledger TRANSFERRING; the prefill result -> ledger LANDED; ``start`` -> ledger DECODING.
3. Tokens arrive through the decode worker's output pump; the final one -> ledger FREED. A
   draining decode worker may move the request's KV to another one (``moved_to``): the ledger
   records the new holder (``move``) and the stream reads from it from then on.
Failures: a prefill worker lost or failing -> a new attempt elsewhere; a decode worker lost
before the first token -> a new attempt; lost mid-stream -> migration: the prompt plus the
tokens already sent are prefilled again elsewhere and the stream goes on with no duplicate and
no gap. Only when no worker can serve it does the client get an explicit error.
A failure that is the request's own (a worker reports a request error code, e.g. its sampling
gave NaN) ends it at once with its own 4xx; an engine step failure that repeats on a second
worker ends it too: the request, not the worker, is the cause, so it is not retried further.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pdserve.engine.contract import PrefillResult, RequestPhase, WorkerRole
from pdserve.engine.block_manager import chain_hashes, salt_root
from pdserve.engine.sampling_params import continuation
from pdserve.engine.sequence import Priority
from pdserve.engine.errors import (
    DeadlineExceededError,
    EngineStepError,
    InvalidRequestError,
    KVTransferError,
    OutOfBlocksError,
    OverloadedError,
    PdserveError,
    WorkerUnavailableError,
    request_error,
)
from pdserve.kv_transfer import TransferParams
from pdserve.router.ledger_port import LedgerSink, LedgerState
from pdserve.router.backend import Finished, GenerateRequest, ModelInfo, TokenDelta
from pdserve.router.errors import StreamNotFoundError
from pdserve.router.policy import RoutingDecision, RoutingPolicy
from pdserve.router.worker_pool import DEADLINE, LOST, WorkerLost, WorkerPool, is_actor_death, remote_error

logger = logging.getLogger(__name__)

# An attempt that ended early leaves its ledger entry FAILED this long: the aborts to its workers
# are fire-and-forget, so the reaper, once the lease passes, confirms both sides released.
FAILED_LEASE_S = 5.0


class _AttemptFailed(Exception):
    """This attempt failed in a way another attempt may fix (the worker is excluded next time)."""

    def __init__(self, worker_id: str, message: str, *, code: str | None = None,
                 reported: str | None = None) -> None:
        super().__init__(message)
        self.worker_id = worker_id
        self.code = code            # the worker's error code, if it gave one
        self.reported = reported    # the worker's own error message (no worker id in it)


def _repeated_failure(exc: Exception, seen: dict[str, str]) -> EngineStepError | None:
    """An error to end the request with when this attempt's engine step failed exactly as an
    earlier attempt's did on another worker (``seen``: reported error -> first worker)."""
    if not isinstance(exc, _AttemptFailed) or exc.code != EngineStepError.code or not exc.reported:
        return None
    first = seen.setdefault(exc.reported, exc.worker_id)
    if first == exc.worker_id:
        return None
    return EngineStepError(f"the request failed the same way on workers {first} and {exc.worker_id}, "
                           f"so it is not retried: {exc.reported}")


@dataclass(slots=True)
class _RequestRecord:
    """What one request's attempts learned, for its phase record and its retries."""

    attempts: int = 0
    migrations: int = 0
    kv_migrations: int = 0          # its KV moved to another decode worker (a drain), decoding went on there
    prefill_worker: str = ""        # of the latest attempt ("" before one is routed)
    decode_worker: str = ""
    prefilled: PrefillResult | None = None   # the prefill worker's result, when it prefilled
    decode_phase: RequestPhase | None = None  # the decode worker's own record, when it finished
    ended_at_prefill: str | None = None       # the request ended at its first token (EOS, max_tokens 1)


class DisaggBackend:
    def __init__(self, info: ModelInfo, pool: WorkerPool, *, policy: RoutingPolicy | None = None,
                 ledger: LedgerSink | None = None, max_attempts: int = 4, lease_s: float = 120.0,
                 reserve_wait_s: float = 30.0, call_timeout_s: float = 120.0,
                 transfer_timeout_s: float = 30.0, prefill_wait_s: float = 60.0,
                 max_predicted_ttft_s: float | None = None, failed_lease_s: float = FAILED_LEASE_S) -> None:
        """``transfer_timeout_s``: the workers' KV transfer timeout; a handoff's reservation is
        renewed every third of it while its prefill is queued or running. ``prefill_wait_s``: how
        long a prompt too long for local prefill waits for a prefill worker when none can take it
        (the policy's ``prefill_pool``) before it fails with 503. ``max_predicted_ttft_s``: a new
        request whose predicted time to first token on its prefill worker is over this is refused
        at once (429 + Retry-After) instead of queueing; None: never. ``failed_lease_s``: how long
        the ledger entry of an attempt that ended early stays FAILED before the reaper confirms that
        both sides released its blocks (the aborts are fire-and-forget) and frees it."""
        self._info = info
        self.pool = pool
        self.policy = policy or RoutingPolicy()
        self.ledger = ledger
        self.max_attempts = max_attempts
        self.lease_s = lease_s
        self.failed_lease_s = failed_lease_s
        self.reserve_wait_s = reserve_wait_s
        self.call_timeout_s = call_timeout_s
        self.renew_interval_s = transfer_timeout_s / 3
        self.prefill_wait_s = prefill_wait_s
        self.prefill_waits = 0        # requests that waited for a prefill worker
        self.max_predicted_ttft_s = max_predicted_ttft_s
        self.ttft_refusals = 0        # requests refused for their predicted TTFT
        self.renewals = 0
        self._active: dict[str, tuple[str, str | None]] = {}  # attempt -> (decode, prefill) workers
        self._lease_keepers: dict[str, asyncio.Task] = {}  # attempt -> its ledger lease renewer
        self._attempt_of: dict[str, str] = {}  # request id -> its current attempt
        self._aborted: set[str] = set()        # requests the caller aborted: never started or retried again
        self._live: set[str] = set()           # requests whose generate() is running
        self.migrations = 0
        self.retries = 0

    # ------------------------------------------------------------ Backend API
    def model_info(self) -> ModelInfo:
        return self._info

    async def health(self) -> bool:
        return any(v.routable for v in self.pool.views("decode"))

    def placement(self, request_id: str) -> tuple[str, str | None] | None:
        """The (decode, prefill) workers of the request's current attempt; None when it has none
        (not started, between attempts, or ended). ``prefill`` is None for a local prefill."""
        attempt = self._attempt_of.get(request_id)
        return None if attempt is None else self._active.get(attempt)

    async def abort(self, request_id: str) -> None:
        if request_id in self._live:
            self._aborted.add(request_id)
        attempt = self._attempt_of.get(request_id)
        workers = None if attempt is None else self._active.get(attempt)
        if workers is not None:
            self._abort_remote(attempt, *workers)

    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenDelta | Finished]:
        self._live.add(req.request_id)
        try:
            started = time.monotonic()
            emitted: list[int] = []
            excluded: set[str] = set()
            failures: dict[str, str] = {}
            acc = _RequestRecord()
            first_token_at: float | None = None
            prefer: str | None = None  # the prefill worker that holds the prompt's KV after a decode-side loss
            if req.resume_from is not None:
                try:
                    emitted, ended = await self._resume(req)
                except PdserveError as exc:
                    yield self._finish(Finished("error", error=exc), req, [], started, None, acc)
                    return
                first_token_at = time.monotonic()
                if len(emitted) > req.resume_from:
                    yield TokenDelta(emitted[req.resume_from:])
                if ended is None and len(emitted) >= req.params.max_tokens:
                    ended = "length"
                if ended is not None:
                    yield self._finish(Finished(ended), req, emitted, started, first_token_at, acc)
                    return
                self.migrations += 1
                acc.migrations += 1
            for attempt_no in range(1, self.max_attempts + 1):
                acc.attempts = attempt_no
                # A later attempt continues the output after the tokens the client already got
                # (and with them the prompt's logprobs, if any).
                prompt, params = continuation(req.prompt_token_ids, req.params, emitted,
                                              prompt_logprobs_sent=bool(emitted))
                attempt = f"{req.request_id}#{attempt_no}"
                try:
                    decision = await self._route(prompt, excluded, req.deadline, prefer, params.cache_salt)
                    if attempt_no == 1:
                        self._admit_by_predicted_ttft(decision, len(prompt))
                    async for item in self._run_attempt(attempt, decision, prompt, params, req, acc):
                        if isinstance(item, TokenDelta):
                            if first_token_at is None:
                                first_token_at = time.monotonic()
                            emitted.extend(item.token_ids)
                            yield item
                        else:
                            yield self._finish(item, req, emitted, started, first_token_at, acc)
                            return
                except (_AttemptFailed, WorkerLost) as exc:
                    if req.request_id in self._aborted:   # the caller stopped it: an attempt's end is no loss
                        yield self._finish(Finished("abort"), req, emitted, started, first_token_at, acc)
                        return
                    repeated = _repeated_failure(exc, failures)
                    if repeated is not None:
                        logger.warning("request %s: not retried: %s", req.request_id, repeated)
                        yield self._finish(Finished("error", error=repeated), req, emitted, started, first_token_at, acc)
                        return
                    excluded.add(exc.worker_id)
                    # the decode side failed after (or while) the prompt was prefilled: that prefill
                    # worker keeps the prompt's KV in its prefix cache, so the retry goes there again
                    p_prev = acc.prefill_worker
                    prefer = p_prev if p_prev and p_prev != exc.worker_id and p_prev != acc.decode_worker else None
                    if emitted:
                        self.migrations += 1
                        acc.migrations += 1
                        logger.warning("request %s: migrating after %d tokens: %s", req.request_id, len(emitted), exc)
                    else:
                        self.retries += 1
                        logger.warning("request %s: retrying: %s", req.request_id, exc)
                    continue
                except PdserveError as exc:
                    yield self._finish(Finished("error", error=exc), req, emitted, started, first_token_at, acc)
                    return
            logger.warning("request %s: no worker could serve it after %d attempts", req.request_id, self.max_attempts)
            err = WorkerUnavailableError(f"no worker could serve this request after {self.max_attempts} attempts")
            yield self._finish(Finished("error", error=err), req, emitted, started, first_token_at, acc)
        finally:
            self._live.discard(req.request_id)
            self._aborted.discard(req.request_id)

    async def _resume(self, req: GenerateRequest) -> tuple[list[int], str | None]:
        """A resumed stream's output so far and how it ended (None: it had not, or was cut off,
        and goes on by migration: its prompt and output prefilled again). The stream is taken
        from the decode worker that holds it (a live one is stopped there)."""
        if not req.resume_key:
            raise InvalidRequestError("resuming a stream (Last-Event-ID) needs the request's own id: send the "
                                      "X-Request-Id header the stream was started with")
        members = [m for m in self.pool.members.values() if m.role is WorkerRole.DECODE and m.view.alive]
        found = await asyncio.gather(*(asyncio.wait_for(m.actor.take_stream.remote(req.resume_key), self.call_timeout_s)
                                       for m in members), return_exceptions=True)
        records = [r for r in found if r is not None and not isinstance(r, BaseException)]
        if not records:
            raise StreamNotFoundError(
                f"no stream with request id {req.client_id!r} to resume: it ended too long ago, was never started "
                "with that id by this cluster, or its decode worker is gone; send the request again without "
                "Last-Event-ID")
        record = max(records, key=lambda r: len(r.token_ids))
        prompt = req.prompt_token_ids
        if record.token_ids[:len(prompt)] != prompt or record.num_prompt_tokens < len(prompt):
            raise InvalidRequestError(f"the request does not match the stream {req.client_id!r} it resumes (its "
                                      "prompt differs): send the same request body the stream was started with")
        emitted = record.token_ids[len(prompt):]
        if req.resume_from > len(emitted):
            raise InvalidRequestError(f"Last-Event-ID says {req.resume_from} tokens were received, but stream "
                                      f"{req.client_id!r} had produced {len(emitted)}")
        ended = record.finish_reason if record.finish_reason not in (None, "abort", "error") else None
        logger.info("request %s resumes the client's stream %r after %d of its %d tokens (%s)", req.request_id,
                    req.client_id, req.resume_from, len(emitted), ended or "continued by migration")
        return list(emitted), ended

    # -------------------------------------------------------------- attempts
    async def _route(self, prompt: list[int], excluded: set[str], deadline: float | None = None,
                     prefer: str | None = None, cache_salt: str | None = None) -> RoutingDecision:
        """Pick workers, avoiding those that failed this request before; when that leaves no
        decode worker (or no prefill worker for a prompt that needs one), the earlier ones are
        tried again (their failure may have been transient). A prompt that needs a prefill worker
        when none can take it waits here, in the router, for one (a replacement starting, a
        silent one answering again) up to ``prefill_wait_s`` or its deadline: a decode worker's
        running streams never stall behind its prefill."""
        hashes = chain_hashes(prompt, self.policy.block_size, salt_root(cache_salt))
        waiting_since: float | None = None
        while True:
            decision = None
            for skip in (frozenset(excluded), frozenset()):
                decision = self.policy.choose(hashes, len(prompt), self.pool.views("prefill"),
                                              self.pool.views("decode"), skip, prefer)
                if decision is not None and not decision.wait_for_prefill:
                    if waiting_since is not None:
                        logger.info("prefill worker %s available after %.1f s", decision.prefill_worker,
                                    time.monotonic() - waiting_since)
                    return decision
            if decision is None:
                raise WorkerUnavailableError("no decode worker is alive to serve this request")
            now = time.monotonic()
            if waiting_since is None:
                waiting_since = now
                self.prefill_waits += 1
                logger.info("no prefill worker can take a %d-token prompt now: waiting for one (up to %.0f s)",
                            len(prompt), self.prefill_wait_s)
            limit = waiting_since + self.prefill_wait_s
            if deadline is not None:
                limit = min(limit, deadline)
            if now >= limit:
                raise WorkerUnavailableError(
                    f"no prefill worker could take this {len(prompt)}-token prompt within {now - waiting_since:.0f} s "
                    "(the prefill pool has no live replica); retry later")
            await asyncio.sleep(0.05)

    def predicted_ttft_s(self, decision: RoutingDecision, num_prompt_tokens: int) -> float | None:
        """Seconds until this prompt's first token on the decision's prefill worker: the prompt
        tokens the router has queued there plus this prompt's uncached ones, over the worker's
        measured prefill rate. None for a local prefill or while the rate is unknown."""
        member = self.pool.members.get(decision.prefill_worker) if decision.prefill_worker else None
        rate = member.view.prefill_tokens_per_s if member is not None else None
        if not rate:
            return None
        uncached = max(1, num_prompt_tokens - decision.cached_prefix_tokens)
        return (member.view.inflight_tokens + uncached) / rate

    def _admit_by_predicted_ttft(self, decision: RoutingDecision, num_prompt_tokens: int) -> None:
        limit = self.max_predicted_ttft_s
        if limit is None:
            return
        predicted = self.predicted_ttft_s(decision, num_prompt_tokens)
        if predicted is None or predicted <= limit:
            return
        self.ttft_refusals += 1
        queued = self.pool.members[decision.prefill_worker].view.inflight_tokens
        raise OverloadedError(
            f"predicted time to first token {predicted:.1f} s is over this server's limit of {limit:g} s "
            f"({queued} prompt tokens are queued for prefill); retry later",
            retry_after_s=min(60.0, max(1.0, predicted - limit)))

    async def _call(self, worker_id: str, ref_fn, timeout_s: float | None = None):
        """Await one Ray call; a dead worker becomes ``WorkerLost``."""
        try:
            return await asyncio.wait_for(ref_fn(self.pool.actor(worker_id)), timeout_s or self.call_timeout_s)
        except asyncio.TimeoutError as exc:
            raise _AttemptFailed(worker_id, f"worker {worker_id} did not answer in time") from exc
        except Exception as exc:
            if is_actor_death(exc):
                self.pool.mark_dead(worker_id, str(exc).splitlines()[0])
                raise WorkerLost(worker_id, "died during a call") from exc
            cause = remote_error(exc)
            if cause is exc:
                raise
            logger.debug("call to %s failed remotely: %s", worker_id, exc)
            raise cause from None

    async def _reserve(self, attempt: str, d: str, num_tokens: int, deadline: float | None) -> bytes:
        wait_until = time.monotonic() + self.reserve_wait_s
        delay = 0.01
        owner = self.pool.router_id  # the decode worker streams this request's tokens to this router only
        while True:
            try:
                return await self._call(d, lambda a: a.reserve.remote(attempt, num_tokens, owner=owner))
            except OutOfBlocksError:
                now = time.monotonic()
                if now > wait_until or (deadline is not None and now > deadline):
                    raise
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.2)

    async def _run_attempt(self, attempt: str, decision: RoutingDecision, prompt: list[int], params,
                           req: GenerateRequest, acc: _RequestRecord) -> AsyncIterator[TokenDelta | Finished]:
        d, p = decision.decode_worker, decision.prefill_worker
        self._active[attempt] = (d, p)
        self._attempt_of[req.request_id] = attempt
        queue = self.pool.open_stream(attempt, d)
        finished = False
        d_view = self.pool.members[d].view
        d_view.inflight_requests += 1
        local_tokens = 0      # counted in d_view.local_prefill_tokens until the first token
        decoding = False      # counted in d_view.decoding_requests
        # One timer per attempt, not one per token: when the deadline passes it queues DEADLINE.
        deadline_timer = None
        if req.deadline is not None:
            loop = asyncio.get_running_loop()
            deadline_timer = loop.call_at(loop.time() + max(0.0, req.deadline - time.monotonic()),
                                          queue.put_nowait, DEADLINE)
        try:
            acc.decode_worker, acc.prefill_worker = d, p or d
            acc.ended_at_prefill = None
            if p is None:
                local_tokens = len(prompt)
                d_view.local_prefill_tokens += local_tokens
                await self._ledger_reserve(attempt, d, [])
                await self._call(d, lambda a: a.generate_local.remote(attempt, prompt, params, req.priority,
                                                                          owner=self.pool.router_id,
                                                                          resume_key=req.resume_key))
                await self._ledger(LedgerState.DECODING, attempt)
            else:
                first = await self._handoff(attempt, d, p, prompt, params, req, acc, queue)
                if acc.ended_at_prefill:
                    # Record FREED before handing out the last token: a caller that stops reading
                    # after it would otherwise leave the entry live until its lease runs out.
                    finished = True
                    await self._ledger(LedgerState.FREED, attempt)
                    if first is not None:
                        yield first
                    yield Finished(acc.ended_at_prefill)
                    return
                if first is not None:
                    yield first   # the client has its first token before D's start (a step boundary there)
                if req.request_id in self._aborted:   # e.g. a stop string in the first token
                    yield Finished("abort")
                    return
                await self._start_decoding(attempt, d, prompt, params, req, acc)
                decoding = True
                d_view.decoding_requests += 1
            while True:
                out = await queue.get()
                if out is DEADLINE:
                    raise DeadlineExceededError("the request did not finish within its deadline")
                if out is LOST:
                    raise WorkerLost(d, "decode worker lost mid-stream")
                if out.moved_to:
                    # the decode worker moved this request's KV to another one (it is draining):
                    # the stream goes on from there, with no token recomputed
                    moved = self.pool.members.get(out.moved_to)
                    d_view.inflight_requests -= 1
                    d_view.decoding_requests -= decoding
                    d = out.moved_to
                    acc.decode_worker = d
                    acc.kv_migrations += 1
                    self._active[attempt] = (d, p)
                    if moved is not None:
                        d_view = moved.view
                    d_view.inflight_requests += 1
                    d_view.decoding_requests += decoding
                    logger.info("request %s: its KV moved to decode worker %s", req.request_id, d)
                    if self.ledger is not None:  # the reaper must look for its blocks there now
                        await self.ledger.move(attempt, d, list(out.moved_blocks or ()))
                    continue
                if out.new_token_ids:
                    if local_tokens:
                        d_view.local_prefill_tokens -= local_tokens
                        local_tokens = 0
                        decoding = True
                        d_view.decoding_requests += 1
                    yield TokenDelta(list(out.new_token_ids), out.new_logprobs, out.prompt_logprobs)
                if out.finished:
                    finished = True
                    await self._ledger(LedgerState.FREED, attempt)
                    if out.finish_reason == "error":
                        own = request_error(out.error_code, out.error or "the request failed")
                        if own is not None:
                            raise own  # the request's own fault: no other worker would do better
                        raise _AttemptFailed(d, out.error or "decode failed", code=out.error_code,
                                             reported=out.error)
                    acc.decode_phase = out.phase
                    yield Finished(out.finish_reason or "stop")
                    return
        finally:
            if deadline_timer is not None:
                deadline_timer.cancel()
            d_view.local_prefill_tokens -= local_tokens
            d_view.decoding_requests -= decoding
            d_view.inflight_requests -= 1
            self.pool.close_stream(attempt)
            self._active.pop(attempt, None)
            if self._attempt_of.get(req.request_id) == attempt:
                del self._attempt_of[req.request_id]
            if not finished:
                self._abort_remote(attempt, d, p)
                # The reaper confirms both sides released (and moves it to FREED) once this short
                # lease passes; the workers' own timeouts free the blocks even without Redis.
                await asyncio.shield(  # a second cancel must not leave the entry live until its lease
                    self._ledger(LedgerState.FAILED, attempt, error="attempt ended early",
                                 lease_s=self.failed_lease_s))

    async def _handoff(self, attempt: str, d: str, p: str, prompt: list[int], params,
                       req: GenerateRequest, acc: _RequestRecord, queue: asyncio.Queue) -> TokenDelta | None:
        """Reserve on D, prefill on P (KV pushed over NIXL); returns the first token."""
        member = self.pool.members.get(p)
        if member is None:  # removed (dead) between routing and now: retried elsewhere, like a lost call
            raise WorkerLost(p, "left the pool before its prefill started")
        p_view = member.view
        # Counted as queued on P from the moment it was routed there (no await since): requests
        # routed together see each other's tokens (routing and the predicted-TTFT admission).
        p_view.inflight_tokens += len(prompt)
        batch_tokens = len(prompt) if req.priority is Priority.BATCH else 0
        p_view.batch_inflight_tokens += batch_tokens
        try:
            reserving_at = time.monotonic()  # D's reservation expires no sooner than a transfer timeout after this
            params_bytes = await self._reserve(attempt, d, len(prompt), req.deadline)
            await self._ledger_reserve(attempt, d, list(TransferParams.from_bytes(params_bytes).dst_blocks))
            if p not in self.pool.members:
                raise WorkerLost(p, "left the pool before its prefill started")
            await self._ledger(LedgerState.TRANSFERRING, attempt, prefill_worker_id=p)
            renewer = asyncio.ensure_future(self._renew_while_prefilling(attempt, d, p, reserving_at))
            try:
                res = await self._prefill_unless_decode_lost(
                    d, queue, self._call(p, lambda a: a.prefill.remote(attempt, prompt, params, params_bytes, req.priority)))
            except KVTransferError as exc:  # e.g. the pair is not connected: another pair may be
                await self._blame_decode_if_gone(d, str(exc))
                raise _AttemptFailed(p, f"prefill on {p} could not send KV to {d}: {exc}") from exc
            finally:
                renewer.cancel()
        finally:
            p_view.inflight_tokens -= len(prompt)
            p_view.batch_inflight_tokens -= batch_tokens
        if res.finish_reason in ("error", "abort"):
            own = request_error(res.error_code, res.error or "the request failed")
            if own is not None:
                raise own  # the request's own fault (its reservation on d is aborted on the way out)
            await self._blame_decode_if_gone(d, res.error or res.finish_reason)
            raise _AttemptFailed(p, f"prefill on {p} failed: {res.error}", code=res.error_code,
                                 reported=res.error)
        acc.prefilled = res
        first = TokenDelta([res.first_token_id],
                           [res.first_token_logprobs] if res.first_token_logprobs is not None else None,
                           res.prompt_logprobs)
        if res.finish_reason != "prefilled":
            # Ended at its first token (EOS / max_tokens 1): nothing to decode.
            self._abort_remote(attempt, d, None)
            acc.ended_at_prefill = res.finish_reason
        return first

    async def _start_decoding(self, attempt: str, d: str, prompt: list[int], params, req: GenerateRequest,
                              acc: _RequestRecord) -> None:
        """The prompt's KV landed on D: start decoding there. Runs after the first token went to
        the client (it waits for one of D's step boundaries); a failure here is a failure after
        the first token, so the request goes on by migration (prompt + that token)."""
        await self._ledger(LedgerState.LANDED, attempt)
        try:
            await self._call(d, lambda a: a.start.remote(attempt, prompt, acc.prefilled.first_token_id, params,
                                                           req.priority, resume_key=req.resume_key))
        except KVTransferError as exc:  # the reservation ended meanwhile (timeout, failed transfer)
            raise _AttemptFailed(d, f"start on {d} failed: {exc}") from exc
        await self._ledger(LedgerState.DECODING, attempt)

    async def _renew_while_prefilling(self, attempt: str, d: str, p: str, reserving_at: float) -> None:
        """A slow prefill is not a failed one: while it is queued or running, extend the decode
        side's reservation, then tell the prefill worker the new expiry (in that order, so the
        prefill side never may write later than the decode side waits). If this router dies the
        renewals stop and both sides time out as before.

        Each renewal is due a third of the timeout after the previous one was sent (the first:
        after the reservation was asked for), on this router's own clock: the ledger steps
        between the reservation and the prefill call, and slow renewal calls in a burst, use up
        none of the other two thirds."""
        due = reserving_at + self.renew_interval_s
        while True:
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            due = time.monotonic() + self.renew_interval_s
            try:
                expires_at = await self._call(d, lambda a: a.renew.remote(attempt))
                await self._call(p, lambda a: a.extend.remote(attempt, expires_at))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the attempt's own path reports what went wrong
                logger.debug("request %s: reservation not renewed: %s", attempt, exc)
                return
            self.renewals += 1

    async def _prefill_unless_decode_lost(self, d: str, queue: asyncio.Queue, prefill):
        """The prefill result, or ``WorkerLost(d)`` as soon as the decode worker dies meanwhile
        (its reserved blocks are gone, so waiting for the prefill is pointless; the caller's
        cleanup aborts it on the prefill worker). Before ``start`` only ``LOST`` or ``DEADLINE`` can be
        queued; DEADLINE is put back for the decode loop, which ends the request with it."""
        prefill_task = asyncio.ensure_future(prefill)
        early: list = []
        try:
            while not prefill_task.done():
                lost_task = asyncio.ensure_future(queue.get())
                try:
                    await asyncio.wait({prefill_task, lost_task}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    if not lost_task.done():
                        lost_task.cancel()
                if lost_task.done() and not lost_task.cancelled():
                    if lost_task.result() is LOST:
                        raise WorkerLost(d, "decode worker lost during prefill")
                    early.append(lost_task.result())
            return prefill_task.result()
        finally:
            for item in early:
                queue.put_nowait(item)
            if not prefill_task.done():
                prefill_task.cancel()
            elif not prefill_task.cancelled():
                prefill_task.exception()  # retrieved even when the decode side's loss decides

    async def _blame_decode_if_gone(self, d: str, error: str) -> None:
        """A failed prefill is the decode worker's fault when it died (its reservation went with
        it; the KV write then fails with a disconnect, often before Ray reports the death): ask
        it, so that the prefill worker is not excluded for it. Raises ``WorkerLost(d)``."""
        if self._alive(d):
            try:
                await self._call(d, lambda a: a.ping.remote(), timeout_s=5.0)
                return
            except (WorkerLost, _AttemptFailed):
                pass
        raise WorkerLost(d, f"decode worker lost during prefill ({error})")

    def _alive(self, worker_id: str) -> bool:
        member = self.pool.members.get(worker_id)
        return member is not None and member.view.alive

    def _abort_remote(self, attempt: str, d: str, p: str | None) -> None:
        """Fire-and-forget aborts (safe in ``finally`` during cancellation)."""
        p_member = self.pool.members.get(p) if p is not None else None
        sender_dead = p is not None and (p_member is None or not p_member.view.alive)
        for wid in (d, p):
            if wid is None:
                continue
            member = self.pool.members.get(wid)
            if member is not None and member.view.alive:
                if wid == d and sender_dead:
                    # The prefill process is gone, so nothing can still write into the reserved
                    # blocks: the decode worker may free them now instead of at expiry.
                    member.actor.abort.remote(attempt, sender_dead=True)
                else:
                    member.actor.abort.remote(attempt)

    # --------------------------------------------------------------- helpers
    async def _keep_ledger_lease(self, attempt: str) -> None:
        """Renew the attempt's ledger lease every third of it for as long as the attempt lives.

        On a timer, not on token flow: a live stream may go quiet for longer than the lease (its
        prompt queued on the prefill worker, its decode preempted, a client that stops reading so
        the stream waits at a ``yield``), and the reaper must never take the blocks of a request
        that is still running. Only this router's death stops the renewals. Errors are the
        writer's (Redis away: resync renews every live attempt when it returns)."""
        while True:
            await asyncio.sleep(self.lease_s / 3)
            renewal = asyncio.ensure_future(self.ledger.renew(attempt, self.lease_s))
            try:
                await asyncio.shield(renewal)
            except asyncio.CancelledError:
                # A renewal already sent lands before the attempt's last ledger step, so it cannot
                # extend a FAILED entry's short lease afterwards.
                await asyncio.wait([renewal])
                raise
            except Exception:  # never the attempt's failure: the next renewal may succeed
                logger.warning("request %s: ledger lease not renewed", attempt, exc_info=True)

    async def _stop_keeping_lease(self, attempt: str) -> None:
        keeper = self._lease_keepers.pop(attempt, None)
        if keeper is not None:
            keeper.cancel()
            await asyncio.wait([keeper])

    async def _ledger_reserve(self, attempt: str, decode_worker_id: str, blocks: list[int]) -> None:
        """Record the decode worker's reservation, and keep its lease from then on. A Redis outage
        must not fail the request: the writer fails fast while Redis is down and replays the step
        when it is back."""
        if self.ledger is not None:
            await self.ledger.reserve(attempt, decode_worker_id, blocks, self.lease_s)
            if attempt not in self._lease_keepers:
                self._lease_keepers[attempt] = asyncio.ensure_future(self._keep_ledger_lease(attempt))

    async def _ledger(self, to: LedgerState, attempt: str, *, prefill_worker_id: str | None = None,
                      error: str | None = None, lease_s: float | None = None) -> None:
        """Record the attempt's move to ``to`` (see ``_ledger_reserve`` for outages)."""
        if to in (LedgerState.FREED, LedgerState.FAILED):
            await self._stop_keeping_lease(attempt)
        if self.ledger is not None:
            await self.ledger.transition(attempt, to, prefill_worker_id=prefill_worker_id, error=error,
                                         lease_s=lease_s)

    def _finish(self, fin: Finished, req: GenerateRequest, emitted: list[int], started: float,
                first_token_at: float | None, acc: _RequestRecord) -> Finished:
        """The request's phase record: prefill from the prefill worker's result (or the decode
        worker's own record when it prefilled locally), timings as the router saw them."""
        now = time.monotonic()
        decode = acc.decode_phase or RequestPhase()
        pre = acc.prefilled
        decode_s = 0.0 if first_token_at is None else now - first_token_at
        phase = RequestPhase(
            queue_s=pre.queue_s if pre else decode.queue_s,
            prompt_tokens=len(req.prompt_token_ids),
            cached_prompt_tokens=pre.cached_prompt_tokens if pre else decode.cached_prompt_tokens,
            prefill_s=pre.prefill_s if pre else decode.prefill_s,
            ttft_s=None if first_token_at is None else first_token_at - started,
            output_tokens=len(emitted),
            decode_s=decode_s,
            decode_tokens_per_s=(len(emitted) - 1) / decode_s if len(emitted) > 1 and decode_s else None,
            total_s=now - started,
            finish_reason=fin.finish_reason,
            prefill_worker=acc.prefill_worker, decode_worker=acc.decode_worker,
            kv_bytes=pre.kv_bytes if pre else 0, kv_transfer_s=pre.kv_transfer_s if pre else 0.0,
            kv_exposed_s=pre.kv_exposed_s if pre else 0.0,
            attempts=max(1, acc.attempts), migrations=acc.migrations, kv_migrations=acc.kv_migrations,
        )
        return Finished(fin.finish_reason, phase, fin.error)

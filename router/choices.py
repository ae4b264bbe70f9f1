"""Several choices in one response: ``n`` per prompt, a list of prompts, ``best_of`` candidates.

Every choice is a request of its own through ``Serving.stream`` (its own server id, admission
slot, phase record and log entry), forked from the prompt's ``PreparedRequest``:

* a seeded request gives choice ``j`` the seed ``seed + j`` (mod 2^64), so choices differ and
  the whole response is reproducible; unseeded choices draw from the workers' generators;
* the first choice of a prompt starts alone and the others once it produced its first token,
  so they find the prompt's KV in the prefix cache (the router routes them to the worker that
  holds it) instead of computing it again;
* events of all choices come out of ``run_choices`` as ``(index, Chunk | Finished)`` in the
  order they happen; a choice that raises ends the whole response with that error, and every
  other choice is aborted (its blocks freed) on the way out;
* the response has one deadline, fixed as it starts (``Serving.deadline``: the client's and
  ``router.request_timeout_s``), shared by every choice, also those that start later: when it
  passes the response ends with ``DeadlineExceededError`` (504, as a single request) and every
  choice still running is aborted;
* all choices are one admission group (``router/admission.py``), so a response of many choices
  shares the slots fairly with other requests instead of taking each free one in turn.

Both front ends (``http_server.py``, ``grpc_server.py``) build a response of whole choices the
same way: ``for_ranking`` asks each token's logprob when ``best_of`` candidates are to be ranked,
``collect`` gathers every choice's chunks and end, and ``by_likelihood`` orders candidates.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Iterable
from dataclasses import dataclass, replace

from pdserve.router.backend import Finished
from pdserve.router.serving import Chunk, PreparedRequest, Serving

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ChoiceRequest:
    index: int                  # the candidate's place among all of this response's candidates
    group: int                  # the prompt it answers (its first candidate starts alone)
    prepared: PreparedRequest


def fork(prepared: PreparedRequest, j: int, index: int) -> PreparedRequest:
    """Candidate ``j`` of a prompt, ``index`` of the response: its own server id, a client id no
    client can send (it holds spaces), and for a seeded request its own seed (``seed + j``).
    Only a prompt's first candidate computes its ``prompt_logprobs``."""
    if index == 0:
        return prepared
    params = prepared.params
    if params.seed is not None and j:
        params = replace(params, seed=(params.seed + j) % 2**64)
    if j and params.prompt_logprobs is not None:
        # the first candidate scores the prompt; the others read its KV from the prefix cache
        params = replace(params, prompt_logprobs=None)
    return replace(prepared, request_id=uuid.uuid4().hex, params=params,
                   client_id=f"{prepared.client_id} choice {index}" if prepared.client_id else "")


async def run_choices(serving: Serving, choices: list[ChoiceRequest], *, api: str, scope: str = "",
                      deadline: float | None = None) -> AsyncIterator[tuple[int, Chunk | Finished]]:
    queue: asyncio.Queue = asyncio.Queue()
    tasks: list[asyncio.Task] = []
    deadline = serving.deadline(deadline)
    group = choices[0].prepared.request_id if choices else ""

    async def one(c: ChoiceRequest) -> None:
        try:
            async with serving.stream(c.prepared, api=api, scope=scope, deadline=deadline,
                                      group=group) as events:
                async for ev in events:
                    await queue.put((c.index, ev))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the response ends with it; the other choices are aborted
            await queue.put((c.index, exc))

    def start(c: ChoiceRequest) -> None:
        tasks.append(asyncio.get_running_loop().create_task(one(c), name=f"choice-{c.index}"))

    leaders: dict[int, ChoiceRequest] = {}
    followers: dict[int, list[ChoiceRequest]] = {}
    for c in choices:
        if c.group not in leaders:
            leaders[c.group] = c
            start(c)
        else:
            followers.setdefault(c.group, []).append(c)
    group_of = {c.index: c.group for c in choices}
    remaining = len(choices)
    try:
        while remaining:
            index, ev = await queue.get()
            if isinstance(ev, BaseException):
                raise ev
            for c in followers.pop(group_of[index], []):  # the prompt's KV is cached now
                start(c)
            yield index, ev
            if isinstance(ev, Finished):
                remaining -= 1
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def for_ranking(prepared: PreparedRequest) -> PreparedRequest:
    """``prepared`` asking each token's logprob (the ranking of ``best_of`` candidates sums them)."""
    if prepared.params.logprobs is not None:
        return prepared
    return replace(prepared, params=replace(prepared.params, logprobs=0))


async def collect(events: AsyncGenerator[tuple[int, Chunk | Finished], None], indexes: Iterable[int]
                  ) -> tuple[dict[int, list[Chunk]], dict[int, Finished]]:
    """Every chunk and the end of each choice (``indexes``) of ``run_choices``' ``events``, which
    it closes; a choice that ended with an error raises it."""
    chunks: dict[int, list[Chunk]] = {i: [] for i in indexes}
    finals: dict[int, Finished] = {}
    try:
        async for index, ev in events:
            if isinstance(ev, Finished):
                if ev.error is not None:
                    raise ev.error
                finals[index] = ev
            else:
                chunks[index].append(ev)
    finally:
        await events.aclose()
    return chunks, finals


def by_likelihood(indexes: Iterable[int], chunks: dict[int, list[Chunk]]) -> list[int]:
    """``indexes`` from the most likely choice to the least (highest sum of its tokens' logprobs;
    ties keep their order)."""
    return sorted(indexes, key=lambda i: -sum(lp[t] for ch in chunks[i] for t, lp in
                                              zip(ch.token_ids, ch.logprobs or [])))

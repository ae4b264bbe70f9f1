"""Beam search (vLLM's ``use_beam_search`` with ``length_penalty``), run over the serving path.

Each step asks the backend for one greedy token of every live beam with its top ``2 * width``
logprobs, as ordinary requests of one token (so they batch in the engine like any others, and a
beam's prompt, the request's prompt plus the beam's tokens, is read from the prefix cache: only
the newest token is computed). Every extension of every beam is a candidate: one that ends with
EOS is complete, the ``width`` most likely others live on. After ``max_tokens`` steps (or when no
beam is left) the complete and live beams are ranked by ``cumulative logprob / length **
length_penalty`` (the length counts the prompt, not the EOS), and the best ``width`` returned.

The search has one deadline, fixed as it starts (``Serving.deadline``: the client's and
``router.request_timeout_s``), which every step's requests share: when it passes, the step's
requests are aborted and ``DeadlineExceededError`` ends the search (504, as any request). The
step's requests are one admission group (the search's own id), so a search takes at most
``width`` slots and shares them fairly with other requests. A step request that fails (or a
cancelled search) cancels its siblings, which aborts them on their workers.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field, replace

from pdserve.router.backend import Finished
from pdserve.router.serving import Chunk, PreparedRequest, Serving
from pdserve.router.validation import BEAM_WIDTH_LIMIT


@dataclass(slots=True)
class Beam:
    tokens: list[int] = field(default_factory=list)  # generated so far
    logprob: float = 0.0                             # their summed logprobs
    ended: bool = False                              # its last token is EOS

    def score(self, prompt_len: int, length_penalty: float) -> float:
        length = prompt_len + len(self.tokens) - (1 if self.ended else 0)
        return self.logprob / (length ** length_penalty)


async def beam_search(serving: Serving, prepared: PreparedRequest, width: int, length_penalty: float, *,
                      eos_token_ids: frozenset[int], api: str, scope: str = "",
                      deadline: float | None = None) -> list[Beam]:
    """The ``width`` best beams for ``prepared`` (its ``params.max_tokens`` and ``ignore_eos``).
    ``deadline``: the client's ``time.monotonic()`` instant, if any (see ``Serving.deadline``)."""
    if not 1 <= width <= BEAM_WIDTH_LIMIT:
        raise ValueError(f"beam width must be 1-{BEAM_WIDTH_LIMIT}, got {width}")
    deadline = serving.deadline(deadline)
    p = prepared.params
    step = replace(p, max_tokens=1, temperature=0.0, logprobs=2 * width, ignore_eos=True, min_tokens=0)
    prompt_len = len(prepared.prompt_token_ids)
    live, done = [Beam()], []
    for _ in range(p.max_tokens):
        tops = await _all(_top_logprobs(serving, prepared, step, b, i, api, scope, deadline)
                          for i, b in enumerate(live))
        candidates = [Beam([*b.tokens, tok], b.logprob + lp, not p.ignore_eos and tok in eos_token_ids)
                      for b, top in zip(live, tops) for tok, lp in top.items()]
        done += [c for c in candidates if c.ended]
        live = sorted((c for c in candidates if not c.ended), key=lambda c: -c.logprob)[:width]
        if not live:
            break
    ranked = sorted(done + live, key=lambda b: -b.score(prompt_len, length_penalty))
    return ranked[:width]


async def _all(coros) -> list:
    """The coroutines' results in order; the first to fail cancels the others (each aborts its
    request on the way out) before its error is raised."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for t in tasks:
            t.cancel()  # none left on a normal return; all of them when we are cancelled
        await asyncio.gather(*tasks, return_exceptions=True)
    failed = next((t.exception() for t in tasks if not t.cancelled() and t.exception() is not None), None)
    if failed is not None:
        raise failed
    return [t.result() for t in tasks]


async def _top_logprobs(serving: Serving, prepared: PreparedRequest, step, beam: Beam, index: int, api: str,
                        scope: str, deadline: float | None) -> dict[int, float]:
    req = replace(prepared, request_id=uuid.uuid4().hex, params=step,
                  prompt_token_ids=[*prepared.prompt_token_ids, *beam.tokens],
                  client_id=f"{prepared.client_id} beam {index}" if prepared.client_id else "")
    top: dict[int, float] = {}
    async with serving.stream(req, api=api, scope=scope, deadline=deadline, group=prepared.request_id) as events:
        async for ev in events:
            if isinstance(ev, Finished):
                if ev.error is not None:
                    raise ev.error
            elif isinstance(ev, Chunk) and ev.logprobs:
                top = ev.logprobs[0]
    # the chosen (greedy) token is in the map besides the top 2 * width: keep exactly those
    return dict(sorted(top.items(), key=lambda kv: -kv[1])[:step.logprobs])

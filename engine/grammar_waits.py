"""Requests that wait for their grammar, outside the scheduler.

A structured output's grammar compiles off the step loop (``GrammarBook``, up to
``structured.compile_timeout_s``). Life of a request whose grammar is not compiled yet:

1. ``add_request`` / ``add_prefilled`` park it here with its compile's future and the call that
   admits it. It holds no batch slot and is never scheduled; a decode-side one keeps the blocks
   its KV was transferred into (they are the request's, freed if it ends here).
2. Each step the engine takes the parked requests whose compile is done (``ready``), makes
   their matchers and admits them, or ends them with the compile's error.
3. An abort takes a parked request out (``pop``); with nothing else to run, the engine waits on
   the compiles (``wait``) instead of spinning.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass

from pdserve.engine.sequence import Sequence


@dataclass(slots=True)
class ParkedRequest:
    seq: Sequence
    compiled: Future
    admit: Callable[[], None]   # run on the engine's thread once the grammar is attached


class GrammarWaits:
    def __init__(self) -> None:
        self._parked: dict[str, ParkedRequest] = {}

    def park(self, seq: Sequence, compiled: Future, admit: Callable[[], None]) -> None:
        self._parked[seq.request_id] = ParkedRequest(seq, compiled, admit)

    def pop(self, request_id: str) -> ParkedRequest | None:
        return self._parked.pop(request_id, None)

    def ready(self) -> list[ParkedRequest]:
        """The parked requests whose compile is done, taken out, in arrival order."""
        done = [p for p in self._parked.values() if p.compiled.done()]
        for p in done:
            del self._parked[p.seq.request_id]
        return done

    def take_all(self) -> list[ParkedRequest]:
        parked, self._parked = list(self._parked.values()), {}
        return parked

    def wait(self, timeout_s: float) -> None:
        """Block until a compile finishes or ``timeout_s`` passes."""
        if self._parked:
            wait([p.compiled for p in self._parked.values()], timeout=timeout_s, return_when=FIRST_COMPLETED)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._parked

    def __len__(self) -> int:
        return len(self._parked)

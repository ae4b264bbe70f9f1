"""Admission control: a bound on requests in flight, a fair line for the rest, refusal beyond it.

A slot is held by one sequence for its whole life (queued in the engine, prefilling,
streaming). Several sequences can belong to one client request (its ``n`` choices, its beams):
they share a *group* (the request's id), and fairness is between groups, not sequences.

1. ``acquire(group)``: a free slot with nobody waiting is taken at once. Otherwise the sequence
   waits in line; when the line already holds ``max_queued`` sequences it is refused at once
   with ``OverloadedError`` (gRPC RESOURCE_EXHAUSTED, HTTP 429 + Retry-After).
2. ``release(group)``: the freed slot goes straight to a waiter, chosen fairly: the group that
   holds the fewest slots now, and among equals the one waiting longest (max-min fair share,
   like per-flow fair queueing). A one-token request that arrives while a wide request waits
   for its tenth slot gets the next free slot; the wide request is never starved either: while
   it holds no slot its oldest waiter is first in line among the groups that hold none.
3. A waiter cancelled in line leaves it; one cancelled just as it was given a slot passes the
   slot on. No slot leaks.

How many sequences one request may have at all is capped before it gets here
(``router.max_choices_per_request``, ``router/validation.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Hashable
from dataclasses import dataclass, field

from pdserve.engine.errors import OverloadedError


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    max_in_flight: int = 256
    max_queued: int = 256
    retry_after_s: float = 1.0

    def __post_init__(self) -> None:
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {self.max_in_flight}")
        if self.max_queued < 0:
            raise ValueError(f"max_queued must be >= 0, got {self.max_queued}")
        if self.retry_after_s <= 0:
            raise ValueError(f"retry_after_s must be > 0, got {self.retry_after_s}")


@dataclass(slots=True)
class _Waiter:
    seq: int                       # arrival order, for ties between groups
    future: asyncio.Future[None] = field(repr=False)
    tracked: bool = True           # False: an anonymous group (no release will name it)


class Admission:
    """Used from one event loop only."""

    def __init__(self, config: AdmissionConfig | None = None) -> None:
        self.config = config or AdmissionConfig()
        self._in_flight = 0
        self._held: dict[Hashable, int] = {}              # group -> slots it holds now
        self._lines: dict[Hashable, list[_Waiter]] = {}  # group -> its waiters, oldest first
        self._queued = 0
        self._seq = itertools.count()
        self.rejected_total = 0

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def queued(self) -> int:
        return self._queued

    def held(self, group: Hashable) -> int:
        """Slots ``group`` holds now."""
        return self._held.get(group, 0)

    async def acquire(self, group: Hashable | None = None) -> None:
        """Take a slot for a sequence of ``group`` (None: a group of its own), waiting in line if
        needed; raise ``OverloadedError`` if the line is full."""
        tracked = group is not None   # an anonymous group's slots are not counted: no release names it
        if group is None:
            group = object()
        if self._in_flight < self.config.max_in_flight and not self._queued:
            self._take(group, tracked)
            return
        if self._queued >= self.config.max_queued:
            self.rejected_total += 1
            raise OverloadedError(
                f"server is at capacity ({self._in_flight} requests in flight, {self._queued} queued); "
                f"retry after {self.config.retry_after_s:g} s",
                retry_after_s=self.config.retry_after_s,
            )
        waiter = _Waiter(next(self._seq), asyncio.get_running_loop().create_future(), tracked)
        self._lines.setdefault(group, []).append(waiter)
        self._queued += 1
        try:
            await waiter.future  # release() hands its slot over: it is already counted for us
        except BaseException:
            if waiter.future.done() and not waiter.future.cancelled():
                self.release(group if tracked else None)  # got the slot just as we were cancelled: pass it on
            else:
                self._leave_line(group, waiter)
            raise

    def release(self, group: Hashable | None = None) -> None:
        """Give back a slot of ``group`` (the group it was acquired for; None for an anonymous one)."""
        if group is not None:
            left = self._held.get(group, 0) - 1
            if left > 0:
                self._held[group] = left
            else:
                self._held.pop(group, None)
        self._in_flight -= 1
        while self._queued and self._in_flight < self.config.max_in_flight:
            if not self._hand_over():
                break

    @contextlib.asynccontextmanager
    async def slot(self, group: Hashable | None = None) -> AsyncIterator[None]:
        if group is None:
            group = object()
        await self.acquire(group)
        try:
            yield
        finally:
            self.release(group)

    # ------------------------------------------------------------------ inside
    def _take(self, group: Hashable, tracked: bool = True) -> None:
        self._in_flight += 1
        if tracked:
            self._held[group] = self._held.get(group, 0) + 1

    def _next_group(self) -> Hashable | None:
        """The waiting group that holds the fewest slots; among equals, the longest waiting."""
        best, best_key = None, None
        for group, line in self._lines.items():
            key = (self._held.get(group, 0), line[0].seq)
            if best_key is None or key < best_key:
                best, best_key = group, key
        return best

    def _hand_over(self) -> bool:
        """Give one free slot to the fairest waiter; False when nobody is waiting."""
        while (group := self._next_group()) is not None:
            line = self._lines[group]
            waiter = line.pop(0)
            if not line:
                del self._lines[group]
            self._queued -= 1
            if waiter.future.done():  # cancelled, its task not yet out of the line: skip it
                continue
            self._take(group, waiter.tracked)
            waiter.future.set_result(None)
            return True
        return False

    def _leave_line(self, group: Hashable, waiter: _Waiter) -> None:
        line = self._lines.get(group)
        if line is None or not any(w is waiter for w in line):
            return  # release() already took it out
        line.remove(waiter)
        if not line:
            del self._lines[group]
        self._queued -= 1

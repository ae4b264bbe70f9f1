"""The router's side of the KV ledger: writes each attempt's steps through a ``RedisGuard`` and
keeps the steps an outage dropped, to replay them when Redis is back.

Life of one attempt's steps:

1. ``reserve`` / ``transition`` / ``move`` / ``renew`` run as one ledger script each, on the guard's pool.
   A refused step (``InvalidTransitionError``: the reaper got there first) is logged and done.
2. While Redis is down (the guard fails at once), a ``reserve``, ``transition`` or ``move`` is appended
   to the attempt's backlog instead; later steps of that attempt join the backlog too, so the
   order of one attempt's steps is kept. Renewals are not kept (``resync`` renews).
3. ``resync(live)`` (the router calls it once Redis is back, before the reaper's next pass):
   a. an attempt whose backlog starts with its ``reserve`` and ends with FREED lived and ended
      during the outage: its blocks were released by the workers on the happy path, so
      nothing is written;
   b. every other backlog is replayed in order (an entry that was RESERVED before the outage
      moves on to FREED or FAILED as it did meanwhile; FAILED carries a short lease, so the
      reaper then confirms both sides released and frees it);
   c. every attempt still in flight (``live``) has its lease renewed, so a lease that ran out
      during a long outage is not taken by the reaper from a request that is still decoding.
   A replay that hits Redis down again keeps the rest for the next resync.
4. The backlog is bounded (``max_backlog`` attempts); past it the oldest attempt's steps are
   dropped and counted: their entries (if any) are reclaimed by the reaper when their lease
   passes, through the workers' idempotent ``abort``.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from pdserve.cluster.state.ledger import EntryNotFoundError, InvalidTransitionError, KVLedger, LedgerState
from pdserve.cluster.state.redis_guard import RedisGuard, RedisUnavailableError

logger = logging.getLogger(__name__)

RESERVE = "reserve"
MOVE = "move"


@dataclass(frozen=True, slots=True)
class LedgerStep:
    """One ledger write of one attempt: ``reserve`` (args: worker, blocks, lease), ``move``
    (args: worker, blocks) or a transition."""

    op: LedgerState | str
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ResyncStats:
    replayed: int  # steps written late
    skipped: int  # attempts that lived and ended during the outage (nothing to write)
    renewed: int  # live attempts whose lease was renewed
    pending: int  # attempts still in the backlog (Redis went down again)


class LedgerWriter:
    """Async ledger writes for ``DisaggBackend`` that survive a Redis outage (module doc)."""

    def __init__(self, ledger: KVLedger, guard: RedisGuard, *, lease_s: float = 120.0,
                 max_backlog: int = 100_000) -> None:
        if max_backlog < 1:
            raise ValueError(f"max_backlog must be >= 1, got {max_backlog}")
        self.ledger = ledger
        self.guard = guard
        self.lease_s = lease_s
        self.max_backlog = max_backlog
        self._backlog: OrderedDict[str, list[LedgerStep]] = OrderedDict()
        self.synced_outages = 0  # the guard's outage count at the last resync
        self.overflowed = 0

    @property
    def backlog(self) -> int:
        return len(self._backlog)

    def needs_resync(self) -> bool:
        return self.guard.up and (self.synced_outages != self.guard.outages or bool(self._backlog))

    async def reserve(self, attempt: str, worker_id: str, blocks: list[int],
                      lease_s: float | None = None) -> None:
        lease = self.lease_s if lease_s is None else lease_s
        await self._record(attempt, LedgerStep(RESERVE, (worker_id, list(blocks), lease)))

    async def transition(self, attempt: str, to: LedgerState, *, prefill_worker_id: str | None = None,
                         error: str | None = None, lease_s: float | None = None) -> None:
        fields = {"prefill_worker_id": prefill_worker_id, "error": error, "lease_s": lease_s}
        await self._record(attempt, LedgerStep(LedgerState(to), (), {k: v for k, v in fields.items() if v is not None}))

    async def move(self, attempt: str, worker_id: str, blocks: list[int]) -> None:
        await self._record(attempt, LedgerStep(MOVE, (worker_id, list(blocks))))

    async def renew(self, attempt: str, lease_s: float | None = None) -> None:
        lease = self.lease_s if lease_s is None else lease_s
        try:
            await self.guard.call("ledger_renew", self.ledger.renew, attempt, lease)
        except RedisUnavailableError:
            pass  # counted by the guard; resync renews every live attempt
        except (InvalidTransitionError, EntryNotFoundError) as exc:  # finished meanwhile
            logger.info("lease renewal of %s: %s", attempt, exc)

    async def resync(self, live: Iterable[str], lease_s: float | None = None) -> ResyncStats:
        """Replay the backlog and renew ``live`` attempts' leases (module doc, step 3)."""
        lease = self.lease_s if lease_s is None else lease_s
        outages = self.guard.outages
        replayed = skipped = renewed = 0
        for attempt in list(self._backlog):
            steps = self._backlog[attempt]
            if steps[0].op == RESERVE and steps[-1].op is LedgerState.FREED:
                del self._backlog[attempt]
                skipped += 1
                continue
            while steps:
                try:
                    await self._apply(attempt, steps[0])
                except RedisUnavailableError:
                    return ResyncStats(replayed, skipped, renewed, len(self._backlog))
                steps.pop(0)
                replayed += 1
            del self._backlog[attempt]
        for attempt in live:
            try:
                await self.guard.call("ledger_renew", self.ledger.renew, attempt, lease)
                renewed += 1
            except RedisUnavailableError:
                return ResyncStats(replayed, skipped, renewed, len(self._backlog))
            except (InvalidTransitionError, EntryNotFoundError):
                pass  # never reserved (local prefill racing the outage) or already ended
        self.synced_outages = outages
        stats = ResyncStats(replayed, skipped, renewed, 0)
        logger.warning("ledger resynced after a Redis outage: %d steps written late, %d attempts "
                       "ended during the outage, %d live leases renewed",
                       stats.replayed, stats.skipped, stats.renewed)
        return stats

    # ---------------------------------------------------------------- internal
    async def _record(self, attempt: str, step: LedgerStep) -> None:
        if attempt in self._backlog:  # an earlier step is waiting: keep this attempt's order
            self._backlog[attempt].append(step)
            return
        try:
            await self._apply(attempt, step)
        except RedisUnavailableError:
            self._backlog[attempt] = [step]
            while len(self._backlog) > self.max_backlog:
                oldest, _ = self._backlog.popitem(last=False)
                self.overflowed += 1
                logger.warning("ledger backlog full: steps of %s dropped (the reaper reclaims "
                               "its entry when its lease passes)", oldest)

    async def _apply(self, attempt: str, step: LedgerStep) -> None:
        """One step through the guard; a refused step is logged and counts as done."""
        try:
            if step.op == RESERVE:
                worker_id, blocks, lease_s = step.args
                await self.guard.call("ledger", self.ledger.reserve, attempt, worker_id, blocks, lease_s)
            elif step.op == MOVE:
                await self.guard.call("ledger", self.ledger.move_decode, attempt, *step.args)
            else:
                await self.guard.call("ledger", self.ledger.transition, attempt, step.op, **step.kwargs)
        except (InvalidTransitionError, EntryNotFoundError) as exc:
            # The reaper got there first (a dead worker's entries are freed at once).
            logger.info("ledger %s for %s skipped: %s", _name(step.op), attempt, exc)
        except RedisUnavailableError:
            raise
        except Exception as exc:  # e.g. a live entry already exists (LedgerError): logged, not fatal
            logger.warning("ledger %s for %s failed: %s", _name(step.op), attempt, exc)


def _name(op: LedgerState | str) -> str:
    return op.value if isinstance(op, LedgerState) else op

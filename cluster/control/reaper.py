"""Lease reaper: gives back KV blocks whose holder stopped renewing, so none is leaked.

For each entry it acts on:

1. Claim it in the ledger (one atomic script): the entry becomes FAILED with the reason, and its
   deadline becomes now + ``claim_s``, a cleanup lease. Only one reaper can win a claim, so two
   reapers running at once never release the same blocks twice.
2. Call ``release(worker_id, request_id, side)`` for every side still holding blocks, and mark
   each side released in the ledger as soon as its callback returns True.
3. When no side holds blocks any more, move the entry FAILED -> FREED.

A callback that returns False (or raises) leaves the entry FAILED; when the cleanup lease runs
out the next ``reap_once`` claims it again and retries only the sides not yet released. So a
release happens exactly once unless a reaper dies between a release and its ledger mark, in
which case it may happen again: ``release`` must tolerate a repeat and return True when the
blocks are already gone (including when the worker itself is gone).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.cluster.state.ledger import (
    InvalidTransitionError,
    KVLedger,
    LedgerEntry,
    LedgerState,
    Side,
)

logger = logging.getLogger(__name__)

ReleaseFn = Callable[[str, str, Side], bool]


@dataclass(frozen=True, slots=True)
class ReapedEntry:
    """What one reaper pass did to one ledger entry."""

    request_id: str
    previous_state: LedgerState
    reason: str
    released: tuple[Side, ...]  # sides whose blocks this pass gave back through the callback
    pending: tuple[Side, ...]  # sides still holding blocks (callback refused or raised)
    freed: bool  # the entry reached FREED in this pass


class LeaseReaper:
    """Finds expired or orphaned ledger entries and releases their blocks through a callback."""

    def __init__(self, ledger: KVLedger, release: ReleaseFn, *, claim_s: float = 30.0) -> None:
        if not claim_s > 0:
            raise ValueError(f"claim_s must be > 0, got {claim_s}")
        self.ledger = ledger
        self.release = release
        self.claim_s = claim_s

    def reap_once(self, now: float | None = None) -> list[ReapedEntry]:
        """Handle every entry whose lease (or earlier cleanup lease) has passed."""
        reaped = []
        for entry in self.ledger.expired(now):
            reason = f"lease expired in {entry.state.value}"
            claimed = self.ledger.claim_for_cleanup(
                entry.request_id, claim_s=self.claim_s, reason=reason, now=now
            )
            if claimed is not None:
                reaped.append(self._clean(*claimed, reason=reason))
        return reaped

    def reap_worker(self, worker_id: str) -> list[ReapedEntry]:
        """Fail every entry holding blocks on a worker known dead; release the other side."""
        reaped = []
        reason = f"worker {worker_id} lost"
        for entry in self.ledger.held_by(worker_id):
            claimed = self.ledger.claim_for_cleanup(
                entry.request_id, claim_s=self.claim_s, reason=reason, dead_worker_id=worker_id
            )
            if claimed is not None:
                reaped.append(self._clean(*claimed, reason=reason))
        return reaped

    def run(self, interval_s: float, stop: Callable[[], bool]) -> None:
        """Call ``reap_once`` every ``interval_s`` until ``stop()`` returns True."""
        while not stop():
            for r in self.reap_once():
                logger.info("reaped %s (%s): released %s, freed=%s",
                            r.request_id, r.reason, [s.value for s in r.released], r.freed)
            time.sleep(interval_s)

    def _clean(self, previous: LedgerState, entry: LedgerEntry, *, reason: str) -> ReapedEntry:
        released: list[Side] = []
        pending: list[Side] = []
        for side in entry.held_sides():
            worker_id = entry.worker(side)
            if worker_id is not None and self._release(worker_id, entry.request_id, side):
                entry = self.ledger.mark_released(entry.request_id, side)
                released.append(side)
            else:
                pending.append(side)
        freed = False
        if not pending:
            try:
                self.ledger.transition(entry.request_id, LedgerState.FREED,
                                       expect_state=LedgerState.FAILED)
                freed = True
            except InvalidTransitionError:
                logger.info("entry %s was freed by someone else meanwhile", entry.request_id)
        return ReapedEntry(
            entry.request_id, previous, reason, tuple(released), tuple(pending), freed
        )

    def _release(self, worker_id: str, request_id: str, side: Side) -> bool:
        try:
            return bool(self.release(worker_id, request_id, side))
        except Exception:  # one bad worker must not stop the sweep; retried on the next claim
            logger.exception("release of %s blocks of %s on %s failed; will retry",
                             side.value, request_id, worker_id)
            return False

"""The KV ledger as the router writes it: the states of one request's KV handoff, and the writer
the disaggregated backend calls at each step. ``cluster/control/ledger_writer.py`` implements the writer
over Redis (and ``cluster/state/ledger.py`` keeps the records); the router depends on this interface
only, so ``router/`` never imports ``cluster/``.
"""

from __future__ import annotations

import enum
from typing import Protocol


class LedgerState(enum.Enum):
    RESERVED = "RESERVED"
    TRANSFERRING = "TRANSFERRING"
    LANDED = "LANDED"
    DECODING = "DECODING"
    FAILED = "FAILED"
    FREED = "FREED"


class LedgerSink(Protocol):
    """Records the steps of one attempt's handoff (an attempt id is the ledger's request id)."""

    async def reserve(self, attempt: str, worker_id: str, blocks: list[int],
                      lease_s: float | None = None) -> None:
        """Blocks reserved on the decode worker ``worker_id`` (RESERVED)."""

    async def transition(self, attempt: str, to: LedgerState, *, prefill_worker_id: str | None = None,
                         error: str | None = None, lease_s: float | None = None) -> None:
        """The attempt moved to ``to``; ``prefill_worker_id`` with TRANSFERRING, ``error`` with FAILED."""

    async def move(self, attempt: str, worker_id: str, blocks: list[int]) -> None:
        """The attempt's KV moved to the decode worker ``worker_id`` (its ``blocks`` there) while
        DECODING (live migration): that worker holds it from now on."""

    async def renew(self, attempt: str, lease_s: float | None = None) -> None:
        """Extend the attempt's lease (a long generation must never look abandoned to the reaper)."""

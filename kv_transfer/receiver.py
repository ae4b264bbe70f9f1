"""KVReceiver: the decode side of one request's KV transfer.

Life cycle (the sender's side is in ``pdserve.kv_transfer.sender``):

1. The decode worker reserves ``dst_blocks`` and creates ``KVReceiver(agent, request_id,
   dst_blocks, timeout_s=...)``; the deadline starts now. State: WAITING.
   ``params()`` is what the prefill worker needs (ship ``params().to_bytes()``).
2. ``poll()`` drains the agent's notifications for this request. Each WRITE notification
   (delivered by NIXL only after its bytes landed) marks its runs as landed; on a staged
   agent they are first copied from the host mirror into the cache (``KVAgent.land``).
3. DONE carries the sender's write, block and byte counts. When every write it counts has
   been seen and the landed blocks are exactly the reserved ones, the state is LANDED and
   the blocks hold the prompt's KV. A DONE that disagrees with what landed ends in FAILED.
4. SENDER_ABORT ends in ABORTED; no DONE by the deadline ends in TIMED_OUT; ``abort()``
   ends in ABORTED. On TIMED_OUT and ``abort()`` the sender is asked to stop
   (RECEIVER_ABORT) when its agent is a known peer.
5. Blocks of a request that did not land may still be the target of a write in flight, so
   ``blocks_reusable`` stays False until the sender confirms it stopped (SENDER_ABORT) or
   ``quarantine_s`` has passed since the end; only then may the block manager free them.
6. ``close()`` closes the mailbox; the agent then holds nothing for this request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import Enum

from pdserve.engine.errors import KVTransferError
from pdserve.kv_transfer.agent import KVAgent
from pdserve.kv_transfer.params import TransferParams, check_block_range
from pdserve.kv_transfer.wire import Notif, NotifKind

logger = logging.getLogger(__name__)


# Allowed clock difference between the sender's and the receiver's hosts.
EXPIRY_SKEW_S = 1.0


class RecvState(Enum):
    WAITING = "waiting"      # reserved, not all blocks landed yet
    LANDED = "landed"        # every reserved block holds the sender's bytes
    FAILED = "failed"        # the sender's DONE disagrees with what landed
    ABORTED = "aborted"      # abort() here, or the sender aborted
    TIMED_OUT = "timed_out"  # no complete transfer before the deadline

    @property
    def terminal(self) -> bool:
        return self is not RecvState.WAITING


@dataclass(slots=True)
class RecvStats:
    """What landed; times are ``clock()`` seconds (``time.monotonic`` by default)."""

    writes: int = 0
    blocks: int = 0
    nbytes: int = 0
    first_write_at: float | None = None
    ended_at: float | None = None


class KVReceiver:
    """Waits for one request's blocks; drive it with ``poll()``."""

    def __init__(self, agent: KVAgent, request_id: str, dst_blocks: list[int], *,
                 timeout_s: float, quarantine_s: float = 5.0, src_agent: str | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if timeout_s <= 0 or quarantine_s < 0:
            raise ValueError(f"timeout_s must be > 0 and quarantine_s >= 0 "
                             f"(got {timeout_s}, {quarantine_s})")
        # TransferParams validates ids (non-negative, unique, non-empty) once for both sides.
        # Writes are refused after ``expires_at`` (wall clock, checked by the sender), so after
        # it plus a skew margin no write of this request can land, whatever the sender does.
        self.expires_at = time.time() + timeout_s
        self._params = TransferParams(request_id=request_id, dst_agent=agent.name,
                                      dst_blocks=tuple(dst_blocks),
                                      compat_hash=agent.layout.compat_hash(),
                                      expires_at=self.expires_at)
        check_block_range("dst_blocks", dst_blocks, agent.layout.num_blocks)
        self.request_id = request_id
        self.reason = ""
        self.stats = RecvStats()
        self.src_agent = src_agent
        self._agent = agent
        self._clock = clock
        self._expected = frozenset(dst_blocks)
        self._landed: set[int] = set()
        self._done: Notif | None = None
        self._sender_quiet = False
        self._quarantine_s = quarantine_s
        self.deadline = clock() + timeout_s
        self._state = RecvState.WAITING
        self._box = agent.subscribe(request_id, to_sender=False)

    def params(self) -> TransferParams:
        """The TransferParams the prefill worker needs."""
        return self._params

    @property
    def state(self) -> RecvState:
        return self._state

    def extend(self, timeout_s: float) -> float:
        """Wait ``timeout_s`` more from now (the router renews a reservation while its prefill is
        queued or running). Returns the new ``expires_at`` for the sender; the deadline never
        moves earlier, and a receiver that already ended is not revived (``KVTransferError``)."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if self._state is not RecvState.WAITING:
            raise KVTransferError(f"request {self.request_id}: the reservation already ended ({self._state.value})")
        self.deadline = max(self.deadline, self._clock() + timeout_s)
        self.expires_at = max(self.expires_at, time.time() + timeout_s)
        self._params = replace(self._params, expires_at=self.expires_at)
        return self.expires_at

    def poll(self) -> RecvState:
        """Process this request's notifications and the deadline; non-blocking."""
        self._agent.pump()
        while self._box:
            peer, notif = self._box.popleft()
            self._handle(peer, notif)
        if self._state is RecvState.WAITING:
            self._check_complete()
        if self._state is RecvState.WAITING and self._clock() >= self.deadline:
            self._end(RecvState.TIMED_OUT, "no complete transfer before the deadline")
            self._ask_sender_to_stop()
        return self._state

    def abort(self, reason: str = "aborted by receiver") -> None:
        """Stop waiting and ask the sender to stop writing; no-op once terminal."""
        if self._state is RecvState.WAITING:
            self._end(RecvState.ABORTED, reason)
            self._ask_sender_to_stop()

    def sender_gone(self) -> None:
        """The sender's process is known to be dead (its owner saw it die): no write of it can
        still land, so the blocks become reusable once this receiver has ended."""
        self._sender_quiet = True

    @property
    def blocks_reusable(self) -> bool:
        """True once no write of this request can still land in its blocks (see step 5)."""
        if self._state is RecvState.LANDED or self._sender_quiet:
            return True
        if self._state is RecvState.WAITING or self.stats.ended_at is None:
            return False
        # A sender that never started (or never answered) may still be about to write until the
        # params expire; after that it refuses to. Keep the blocks until both have passed.
        if time.time() < self.expires_at + EXPIRY_SKEW_S:
            return False
        return self._clock() >= self.stats.ended_at + self._quarantine_s

    def close(self) -> None:
        """Abort if still waiting and close the mailbox; idempotent."""
        self.abort("receiver closed")
        self._agent.unsubscribe(self.request_id, to_sender=False)

    def _handle(self, peer: str, notif: Notif) -> None:
        if self.src_agent is None:
            self.src_agent = peer
        if notif.kind is NotifKind.SENDER_ABORT:
            self._sender_quiet = True
            if self._state is RecvState.WAITING:
                self._end(RecvState.ABORTED, f"sender aborted: {notif.reason}")
        elif self._state is not RecvState.WAITING:
            logger.debug("request %s: late %s ignored", self.request_id, notif.kind.value)
        elif notif.kind is NotifKind.WRITE:
            self._on_write(notif)
        elif notif.kind is NotifKind.DONE:
            self._done = notif

    def _on_write(self, notif: Notif) -> None:
        blocks = [start + i for start, length in notif.runs for i in range(length)]
        outside = [b for b in blocks if b not in self._expected]
        if outside:
            self._end(RecvState.FAILED, f"sender wrote unreserved blocks {outside[:8]}")
            return
        self._agent.land(notif.runs)  # a staged agent copies them from its host mirror
        now = self._clock()
        if self.stats.first_write_at is None:
            self.stats.first_write_at = now
        self._landed.update(blocks)
        self.stats.writes += 1
        self.stats.blocks += len(blocks)
        self.stats.nbytes += len(blocks) * self._agent.layout.block_bytes

    def _check_complete(self) -> None:
        done = self._done
        if done is None or self.stats.writes < done.writes:
            return  # some WRITE notifications may still be on their way
        if (self.stats.writes != done.writes or self.stats.blocks != done.blocks
                or self.stats.nbytes != done.nbytes or self._landed != self._expected):
            missing = sorted(self._expected - self._landed)
            self._end(RecvState.FAILED, (
                f"DONE says {done.writes} writes/{done.blocks} blocks/{done.nbytes} bytes, "
                f"landed {self.stats.writes}/{self.stats.blocks}/{self.stats.nbytes}, "
                f"missing blocks {missing[:8]}"))
            return
        self._sender_quiet = True
        self._end(RecvState.LANDED, "")

    def _end(self, state: RecvState, reason: str) -> None:
        self._state = state
        self.reason = reason
        self.stats.ended_at = self._clock()
        log = logger.debug if state is RecvState.LANDED else logger.info
        log("request %s: receiver %s %s", self.request_id, state.value, reason)

    def _ask_sender_to_stop(self) -> None:
        if self.src_agent is not None and self._agent.has_peer(self.src_agent):
            self._agent.send_notif(self.src_agent, Notif(
                NotifKind.RECEIVER_ABORT, self.request_id, reason=self.reason))


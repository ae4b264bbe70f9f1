"""KVSender: the prefill side of one request's KV transfer (PUSH into reserved blocks).

Life cycle of a transfer:

1. The decode worker reserves blocks, creates a ``KVReceiver`` and ships
   ``receiver.params().to_bytes()`` to the prefill worker (through the router).
2. The prefill worker builds ``KVSender(agent, TransferParams.from_bytes(...))``. The protocol
   version and layout hash are checked against the local layout, the destination agent must
   be a known, compatible peer, and every block id must be in range. Any mismatch raises
   (CompatibilityError / InvalidRequestError) before a byte moves. State: IDLE.
3. As each prefill chunk's blocks are computed, ``write(src_blocks, dst_blocks)`` coalesces
   the pairs into runs (one descriptor per run of consecutive ids on both sides) and posts
   one non-blocking NIXL WRITE that carries a WRITE notification naming the landed runs.
   Only reserved destination blocks, each at most once, may be written. State: SENDING.
4. ``finish()`` says no more writes will come. Once ``poll()`` sees every write DONE it sends
   the DONE notification (write, block and byte counts; the receiver checks them against
   what landed) and releases the handles. State: DONE.
5. A failed write (ERR) ends in FAILED; the receiver asking to stop (RECEIVER_ABORT) or
   the owner calling ``abort()`` ends in ABORTED. Either way the in-flight writes are
   released first and only then is SENDER_ABORT sent, so the receiver knows that no write
   of this request is still in flight and its blocks may be reused.
6. ``close()`` releases whatever is left and closes the mailbox; the agent then holds no
   handle or mailbox for this request.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from enum import Enum

from pdserve.engine.errors import CompatibilityError, InvalidRequestError, KVTransferError
from pdserve.kv_transfer.agent import KVAgent, PostedWrite
from pdserve.kv_transfer.layout import BlockRun, coalesce_runs
from pdserve.kv_transfer.params import TransferParams, check_block_range
from pdserve.kv_transfer.wire import Notif, NotifKind

logger = logging.getLogger(__name__)


class SendState(Enum):
    IDLE = "idle"          # created, nothing written yet
    SENDING = "sending"    # writes posted or expected; DONE not sent yet
    DONE = "done"          # every write landed and the receiver was told
    FAILED = "failed"      # a write failed; the receiver was told (if reachable)
    ABORTED = "aborted"    # stopped by abort() or by the receiver

    @property
    def terminal(self) -> bool:
        return self in (SendState.DONE, SendState.FAILED, SendState.ABORTED)


@dataclass(slots=True)
class SendStats:
    """What this transfer moved; times are ``time.perf_counter()`` seconds."""

    writes: int = 0
    descriptors: int = 0
    blocks: int = 0
    nbytes: int = 0
    first_post_at: float | None = None
    done_at: float | None = None

    @property
    def seconds(self) -> float | None:
        """First write posted to DONE sent."""
        if self.first_post_at is None or self.done_at is None:
            return None
        return self.done_at - self.first_post_at


class KVSender:
    """Writes one request's KV blocks into a peer's reserved blocks; drive it with ``poll()``."""

    def __init__(self, agent: KVAgent, params: TransferParams) -> None:
        params.check_compatible(agent.layout)
        peer = agent.peer(params.dst_agent)
        if peer.layout.compat_hash() != params.compat_hash:
            raise CompatibilityError(
                f"request {params.request_id}: params hash {params.compat_hash} != peer "
                f"{params.dst_agent}'s layout hash {peer.layout.compat_hash()}")
        params.check_blocks(peer.layout.num_blocks)
        if params.expired():
            raise KVTransferError(f"request {params.request_id}: the receiver's reservation expired "
                                  "before the transfer started")
        self.params = params
        self.stats = SendStats()
        self.reason = ""
        self._agent = agent
        self._reserved = frozenset(params.dst_blocks)
        self._written: set[int] = set()
        self._pending: list[PostedWrite] = []
        self._finishing = False
        self._abort_sent = False
        self._state = SendState.IDLE
        self._box = agent.subscribe(params.request_id, to_sender=True)

    @property
    def request_id(self) -> str:
        return self.params.request_id

    def write(self, src_blocks: list[int], dst_blocks: list[int], *, coalesce: bool = True) -> None:
        """Post one write of ``src_blocks[i]`` into ``dst_blocks[i]``.

        Returns once NIXL has the write; it never waits for the receiver. (With UCX's cma
        transport on one host the copy itself runs inside the post, in this thread.)
        ``coalesce=False`` sends one descriptor per block (for benchmarks).
        """
        if self.poll().terminal or self._finishing:
            raise KVTransferError(
                f"request {self.request_id}: cannot write, sender is {self._state.value}"
                + (" and finishing" if self._finishing else ""))
        if len(src_blocks) != len(dst_blocks) or not dst_blocks:
            raise InvalidRequestError(
                f"write needs equal, non-empty block lists (got {len(src_blocks)} src, "
                f"{len(dst_blocks)} dst)")
        check_block_range("src_blocks", src_blocks, self._agent.layout.num_blocks)
        if self.params.expired():
            self._stop(SendState.FAILED, "the receiver's reservation expired")
            raise KVTransferError(f"request {self.request_id}: reservation expired, write refused")
        outside = [b for b in dst_blocks if b not in self._reserved]
        if outside:
            raise InvalidRequestError(f"dst blocks {outside[:8]} are not reserved for "
                                      f"request {self.request_id}")
        again = [b for b in dst_blocks if b in self._written] or (
            [] if len(set(dst_blocks)) == len(dst_blocks) else ["(repeated in this write)"])
        if again:
            raise InvalidRequestError(f"dst blocks {again[:8]} already written")
        runs = (coalesce_runs(src_blocks, dst_blocks) if coalesce
                else [BlockRun(s, d, 1) for s, d in zip(src_blocks, dst_blocks)])
        seq = self.stats.writes + 1
        notif = Notif(NotifKind.WRITE, self.request_id, seq=seq,
                      runs=tuple((r.dst_start, r.length) for r in runs))
        if self.stats.first_post_at is None:
            self.stats.first_post_at = time.perf_counter()
        try:
            posted = self._agent.post_write(self.params.dst_agent, runs, notif)
        except KVTransferError as exc:
            self._stop(SendState.FAILED, str(exc))
            raise
        self._pending.append(posted)
        self._written.update(dst_blocks)
        self.stats.writes = seq
        self.stats.descriptors += posted.descriptors
        self.stats.blocks += len(dst_blocks)
        self.stats.nbytes += posted.nbytes
        self._state = SendState.SENDING

    def finish(self) -> None:
        """No more writes; DONE is sent by ``poll()`` once every write has landed."""
        if self._state.terminal:
            return
        self._finishing = True
        self._state = SendState.SENDING
        self.poll()

    def poll(self) -> SendState:
        """Advance the transfer (non-blocking) and return its state."""
        if self._state.terminal:
            self._release_all()
            return self._state
        self._agent.pump()
        while self._box:
            _peer, notif = self._box.popleft()
            if notif.kind is NotifKind.RECEIVER_ABORT:
                self._stop(SendState.ABORTED, f"receiver aborted: {notif.reason}")
                return self._state
        still: list[PostedWrite] = []
        for posted in self._pending:
            status = self._agent.xfer_state(posted.handle)
            if status == "ERR":
                self._stop(SendState.FAILED, "a NIXL write failed")
                return self._state
            if status == "PROC" or not self._agent.release_xfer(posted.handle):
                still.append(posted)
        self._pending = still
        if self._finishing and not self._pending:
            done = Notif(NotifKind.DONE, self.request_id, writes=self.stats.writes,
                         blocks=self.stats.blocks, nbytes=self.stats.nbytes)
            if self._agent.send_notif(self.params.dst_agent, done):
                self.stats.done_at = time.perf_counter()
                self._state = SendState.DONE
                logger.debug("request %s: sent %d blocks in %d descriptors", self.request_id,
                             self.stats.blocks, self.stats.descriptors)
            else:
                self._stop(SendState.FAILED, "could not send DONE to the receiver")
        return self._state

    def abort(self, reason: str = "aborted by sender") -> None:
        """Stop: release in-flight writes, then tell the receiver nothing more will land."""
        if not self._state.terminal:
            self._stop(SendState.ABORTED, reason)

    def close(self) -> None:
        """Abort if still running, release every handle and close the mailbox; idempotent."""
        self.abort("sender closed")
        self._release_all()
        self._agent.unsubscribe(self.request_id, to_sender=True)

    @property
    def state(self) -> SendState:
        return self._state

    def _stop(self, state: SendState, reason: str) -> None:
        self._state = state
        self.reason = reason
        logger.info("request %s: sender %s (%s)", self.request_id, state.value, reason)
        self._release_all()

    def _release_all(self) -> None:
        """Release finished/cancellable writes; once none is in flight, send SENDER_ABORT."""
        self._pending = [p for p in self._pending if not self._agent.release_xfer(p.handle)]
        if (self._state in (SendState.FAILED, SendState.ABORTED) and not self._pending
                and not self._abort_sent):
            self._abort_sent = True
            self._agent.send_notif(self.params.dst_agent, Notif(
                NotifKind.SENDER_ABORT, self.request_id, reason=self.reason))

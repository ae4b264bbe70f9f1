"""Live KV migration between decode workers: a draining decode worker moves its running streams'
KV blocks to other decode workers over NIXL, and decoding goes on there with nothing recomputed
and no gap in the stream.

For each running request whose prompt is fully computed (its last sampled token is the only one
not yet in the KV cache), ``migrate_out``:

1. takes it out of the batch between two steps, keeping its blocks;
2. asks a target decode worker to ``reserve`` blocks for its computed tokens (the first target
   with room; the router that owns the stream is named as the owner there);
3. writes the blocks there with a ``KVSender`` (the same PUSH a prefill worker does) and waits
   until the target has them;
4. ``start``s it on the target: prompt = the original prompt + the output so far but the last
   token, first token = the last one, the budgets less what was produced (``prior_output`` keeps
   penalties, seeded draws and grammars going on after it), so the target decodes the very next
   token as this worker would have;
5. frees its blocks here and sends its router one last output, ``moved_to`` = the target (with
   ``moved_blocks``, its blocks there, which the router records in the ledger): the router reads the request's next outputs from the target from then on (outputs of the target
   that arrive before that mark wait for it, so the stream stays in order).

When no target has room or a step fails, the request ends here with an error the router
answers by migrating it the old way (its prompt and output prefilled again elsewhere): the
fallback is a recompute, never a lost stream.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Protocol

from pdserve.engine.contract import StepOutput
from pdserve.engine.errors import OutOfBlocksError, PdserveError
from pdserve.engine.sampling_params import SamplingParams, continuation
from pdserve.engine.sequence import Priority, SequenceStatus
from pdserve.kv_transfer import KVSender, SendState, TransferParams

logger = logging.getLogger(__name__)

MIGRATION_CALL_TIMEOUT_S = 30.0


class MigrationPeer(Protocol):
    """Another decode worker as live migration calls it: each call waits for its answer and
    raises what the peer raised. Workers do not know Ray: the cluster's worker actor
    (``cluster/runtime/worker_actors.py``) provides one over Ray."""

    def reserve(self, request_id: str, num_prompt_tokens: int, owner: str) -> bytes: ...

    def start(self, request_id: str, prompt_token_ids: list[int], first_token_id: int, params: SamplingParams,
              priority: Priority, resume_key: str) -> None: ...

    def abort(self, request_id: str) -> bool: ...


@dataclass(frozen=True, slots=True)
class MigrationTarget:
    """A decode worker that may take migrated streams: its id and how to call it."""

    worker_id: str
    peer: MigrationPeer


@dataclass(frozen=True, slots=True)
class MigrationOutcome:
    """What ``migrate_out`` did: streams moved with their KV, ended for a recompute elsewhere
    (``fallbacks``), and requests left here (not movable now; they finish here)."""

    moved: int
    fallbacks: int
    left: int


class MigrationMixin:
    """``DecodeWorker``'s live migration (it provides ``_loop``, ``engine``, ``agent``, the owner
    maps and outboxes, and ``_outbox_cv``)."""

    kv_migrations_out = 0   # requests whose KV this worker moved to another decode worker
    kv_migration_fallbacks = 0  # requests it could not move (ended for a recompute-migration)

    def migrate_out(self, targets: list[MigrationTarget]) -> MigrationOutcome:
        """Move every running, fully prefilled request to ``targets`` (tried in order)."""
        candidates = self._loop.call(lambda e: [
            s.request_id for s in e.scheduler.running()
            if s.num_computed_tokens == s.num_tokens - 1 and s.request_id in self._owner_of])
        moved = fallbacks = 0
        for rid in candidates:
            outcome = self._migrate_one(rid, targets)
            moved += outcome == "moved"
            fallbacks += outcome == "fallback"
        left = self._loop.call(lambda e: e.scheduler.num_running + e.scheduler.num_waiting)
        logger.info("%s: moved %d request(s) to other decode workers, %d fell back to recompute, %d left",
                    self.worker_id, moved, fallbacks, left)
        return MigrationOutcome(moved=moved, fallbacks=fallbacks, left=left)

    def _migrate_one(self, rid: str, targets: list[MigrationTarget]) -> str:
        seq = self._loop.call(lambda e: self._detach(e, rid))
        if seq is None:
            return "skipped"
        owner = self._owner_of.get(rid, "")
        resume_key = self._resume_key_of.get(rid, "")
        done, last = list(seq.output_token_ids[:-1]), seq.output_token_ids[-1]
        prompt, params = continuation(seq.prompt_token_ids, seq.params, done, prompt_logprobs_sent=True)
        error = "no other decode worker has room for its KV"
        for target in targets:
            target_id, peer = target.worker_id, target.peer
            try:
                raw = peer.reserve(rid, len(prompt), owner=owner)
            except Exception as exc:  # OutOfBlocks (no room), or the target is gone: try the next one
                cause = getattr(exc, "cause", exc)
                if not isinstance(cause, OutOfBlocksError):
                    logger.warning("%s: %s could not reserve for %s: %s", self.worker_id, target_id, rid, cause)
                continue
            try:
                transfer = TransferParams.from_bytes(raw)
                self._send_blocks(seq, transfer)
                peer.start(rid, prompt, last, params, seq.priority, resume_key=resume_key)
            except Exception as exc:
                error = f"moving its KV to {target_id} failed: {getattr(exc, 'cause', exc)}"
                logger.warning("%s: request %s: %s", self.worker_id, rid, error)
                try:
                    peer.abort(rid)
                except Exception:  # noqa: BLE001 - its reservation expires on its own
                    pass
                break
            blocks = list(transfer.dst_blocks)
            self._loop.call(lambda e: self._hand_over(e, seq, owner, target_id, blocks))
            self.kv_migrations_out += 1
            return "moved"
        self._loop.call(lambda e: self._give_up(e, seq, owner, error))
        self.kv_migration_fallbacks += 1
        return "fallback"

    # ------------------------------------------------------------- on the engine thread
    def _detach(self, engine, rid: str):
        """Take a running request out of the batch, its blocks kept (None: not movable now)."""
        seq = engine.scheduler.get(rid)
        if seq is None or seq.status is not SequenceStatus.RUNNING or seq.num_computed_tokens != seq.num_tokens - 1:
            return None
        engine.scheduler.finish(seq, seq.finish_reason, free_blocks=False)
        engine.stopper.discard(rid)
        return seq

    def _send_blocks(self, seq, params: TransferParams, timeout_s: float = MIGRATION_CALL_TIMEOUT_S) -> None:
        """Write the request's computed blocks into the target's reserved ones and wait for DONE."""
        def begin(_e) -> KVSender:
            sender = KVSender(self.agent, params)
            try:
                dst = list(params.dst_blocks)
                sender.write(list(seq.block_table[:len(dst)]), dst)
                sender.finish()
            except BaseException:
                sender.close()
                raise
            return sender

        sender = self._loop.call(begin)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                state = self._loop.call(lambda _e: sender.poll())
                if state is SendState.DONE:
                    return
                if state.terminal:
                    raise PdserveError(f"KV send {state.value}: {sender.reason}")
                if time.monotonic() > deadline:
                    raise PdserveError(f"KV send did not finish in {timeout_s:.0f} s")
                time.sleep(0.002)
        finally:
            self._loop.call(lambda _e: sender.close())

    def _hand_over(self, engine, seq, owner: str, target_id: str, blocks: list[int]) -> None:
        engine.block_manager.free(seq)
        with self._outbox_cv:
            self._owner_of.pop(seq.request_id, None)
            self._live_streams.pop(seq.request_id, None)
            self._resume_key_of.pop(seq.request_id, None)
            self._outboxes.setdefault(owner, []).append(StepOutput(seq.request_id, moved_to=target_id,
                                                                    moved_blocks=blocks))
            self._outbox_cv.notify_all()

    def _give_up(self, engine, seq, owner: str, error: str) -> None:
        """End the request here with an error its router answers with a recompute-migration."""
        engine.block_manager.free(seq)
        self._publish([StepOutput(seq.request_id, finished=True, finish_reason="error",
                                  error=f"live migration: {error}")])

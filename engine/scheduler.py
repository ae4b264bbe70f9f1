"""Continuous-batching scheduler with chunked prefill, two priorities and preemption by recompute.

Each :meth:`Scheduler.schedule` call builds one step's batch within ``max_num_batched_tokens``:

0. batch work gives way: while an interactive sequence waits for a slot or blocks that running
   batch sequences hold, the latest of those are preempted (and none is readmitted that step);
1. running sequences that are decoding get one token each (a new block when their last one is
   full); when no block is left, the lowest-priority, latest-arrived running sequence not yet
   scheduled this step is preempted (blocks freed, back to the front of its priority class in the
   waiting queue, output tokens kept: prompt + outputs are recomputed when it is readmitted);
2. running sequences still prefilling get their next chunk;
3. waiting sequences are admitted in (priority, arrival) order while the sequence cap, the token
   budget and the free blocks allow, and no preemption happened this step (so a victim is not
   readmitted at once). Without chunked prefill a prompt is admitted only if it fits whole.

With ``prefill_pack_tokens`` set, steps 2 and 3 give a step's first prompt chunk the whole budget
but add another prompt only while the step's prompt tokens are under that many: a burst of short
prompts then finishes a prompt or two per step, so first tokens come out one after another (and
their decoding starts) instead of all at the end of one long step; a long prompt still runs in
chunks as large as the budget.

While interactive sequences decode, batch prompts never share their steps: a step that decodes
interactive streams carries at most a few batch decodes and no batch prompt tokens, and the step
after it, when a batch prompt or a batch decode was left out, is a *batch turn* of batch work
alone (every batch decode and one bounded prompt chunk). A batch-only step can be cut short by
an interactive arrival (``LLMEngine.interrupt``); a step with interactive work cannot, so an
arrival never waits out a batch prompt chunk.

Under the STATIC policy (a benchmark baseline) step 3 runs only when nothing is running, and then
ignores the token budget when admitting, so one batch forms and runs until every member finishes.

The scheduler is pure: the engine runs the chunks, then calls :meth:`Scheduler.postprocess` with
the sampled tokens and :meth:`Scheduler.finish` for sequences that stopped.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import SchedulerConfig, SchedulingPolicy
from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.sequence import FinishReason, Priority, Sequence, SequenceStatus

logger = logging.getLogger(__name__)

# Prompt tokens of batch-priority sequences one step may take (chunked prefill): a step that
# admits a burst of batch prompts stays short, so an interactive request arriving meanwhile
# waits for a short step, not a long one.
BATCH_PREFILL_TOKENS_PER_STEP = 256
# ... and while interactive sequences decode: a batch turn's chunk, which the interactive streams
# wait for between two of their steps.
BATCH_PREFILL_TOKENS_BESIDE_INTERACTIVE = 64
# Batch decodes an interactive step carries; the rest wait for the batch turn after it (say when
# interactive traffic starts while a batch runs many sequences on the idle engine).
BATCH_DECODES_BESIDE_INTERACTIVE = 4


@dataclass(slots=True)
class ScheduledChunk:
    """Compute K/V for positions ``[start, start + num_tokens)`` of ``seq`` this step.

    ``sample`` (fixed when the chunk is built) is True when the chunk ends at the newest token,
    so the step yields logits from which the next token is sampled.
    """

    seq: Sequence
    start: int
    num_tokens: int
    sample: bool = field(init=False)

    def __post_init__(self) -> None:
        self.sample = self.start + self.num_tokens == self.seq.num_tokens

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids[self.start : self.start + self.num_tokens]


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    num_batched_tokens: int = 0
    num_decode_tokens: int = 0      # one per decoding sequence
    num_prefill_tokens: int = 0     # prompt tokens (prefill chunks) in this step

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self._waiting: dict[Priority, deque[Sequence]] = {p: deque() for p in sorted(Priority)}
        self._running: dict[str, Sequence] = {}     # admission order
        self._seqs: dict[str, Sequence] = {}        # every unfinished sequence, waiting or running
        self.num_preemptions_total = 0
        # Batch prompt chunks run in batch turns of their own beside interactive decodes (the
        # module docstring); False mixes them into interactive steps (a benchmark's ablation).
        self.batch_prefill_apart = True
        self._batch_turn_due = False
        self._batch_decodes_deferred = False
        self.num_batch_turns = 0
        self._step_prompt_tokens = 0  # prompt tokens of the step being scheduled

    # ------------------------------------------------------------------ queues
    @property
    def num_waiting(self) -> int:
        return sum(len(q) for q in self._waiting.values())

    @property
    def num_running(self) -> int:
        return len(self._running)

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    def get(self, request_id: str) -> Sequence | None:
        return self._seqs.get(request_id)

    def running(self) -> list[Sequence]:
        return list(self._running.values())

    def batch_load(self) -> tuple[int, int]:
        """(batch-priority sequences running or waiting, KV blocks they hold). Safe to call from
        another thread (the stats publisher): it works on copies taken in one step each."""
        seqs = [s for s in list(self._running.values()) if s.priority is Priority.BATCH]
        waiting = list(self._waiting[Priority.BATCH])
        return len(seqs) + len(waiting), sum(len(s.block_table) for s in seqs)

    def waiting(self) -> list[Sequence]:
        """Waiting sequences in the order they would be admitted."""
        return [s for q in self._waiting.values() for s in q]

    def add(self, seq: Sequence) -> None:
        """Queue ``seq`` (at the back of its priority class). Rejects what could never be scheduled."""
        self._check_new(seq)
        if seq.num_tokens > self.config.max_model_len:
            raise InvalidRequestError(
                f"request {seq.request_id!r} has {seq.num_tokens} tokens, over max_model_len "
                f"{self.config.max_model_len}"
            )
        bm = self.block_manager
        if bm.blocks_needed(seq.num_tokens) > bm.num_blocks:
            raise InvalidRequestError(
                f"request {seq.request_id!r} needs {bm.blocks_needed(seq.num_tokens)} KV blocks, "
                f"the cache has {bm.num_blocks}"
            )
        seq.status = SequenceStatus.WAITING
        self._waiting[seq.priority].append(seq)
        self._seqs[seq.request_id] = seq

    def add_prefilled(self, seq: Sequence) -> None:
        """Join a sequence whose prompt K/V was transferred in (adopted blocks) to the running set."""
        self._check_new(seq)
        if not seq.block_table or seq.num_computed_tokens != seq.num_tokens - 1:
            raise ValueError(
                f"add_prefilled({seq.request_id!r}) needs adopted blocks and num_computed_tokens == "
                f"num_tokens - 1 (got {seq.num_computed_tokens} of {seq.num_tokens})"
            )
        seq.status = SequenceStatus.RUNNING
        self._running[seq.request_id] = seq
        self._seqs[seq.request_id] = seq

    def _check_new(self, seq: Sequence) -> None:
        if seq.request_id in self._seqs:
            raise InvalidRequestError(f"request_id {seq.request_id!r} is already scheduled")

    # ---------------------------------------------------------------- schedule
    def schedule(self, prefill_budget: int | None = None) -> SchedulerOutput:
        """One step's batch. ``prefill_budget``: when this step decodes any sequence, at most
        that many prompt tokens (chunks of running prefills and admissions) join it, so that the
        decoding streams' step stays short (a decode worker's ITL budget); None: no extra cap."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        self._step_prompt_tokens = 0
        scheduled: set[str] = set()
        yielded = self._yield_to_interactive(out)
        was_running = bool(self._running)
        order = sorted(self._running.values(), key=_rank)
        # While an interactive prompt waits or prefills, its steps carry no batch work at all:
        # batch sequences keep their blocks and simply sit those steps out.
        pause_batch = bool(self._waiting[Priority.INTERACTIVE]) or any(
            s.priority is Priority.INTERACTIVE and s.in_prefill for s in order)
        if pause_batch:
            order = [s for s in order if s.priority is not Priority.BATCH]
        interactive = any(s.priority is Priority.INTERACTIVE for s in order)
        batch_prefill = BATCH_PREFILL_TOKENS_BESIDE_INTERACTIVE if interactive else BATCH_PREFILL_TOKENS_PER_STEP
        # Beside interactive decodes, steps alternate: an interactive turn (a few batch decodes, no
        # batch prompt tokens), then a batch turn when batch work was left out (module docstring).
        interactive_turn = False
        if (interactive and not pause_batch and self.batch_prefill_apart
                and self.config.policy is not SchedulingPolicy.STATIC):
            if self._batch_turn_due and (self._batch_decodes_deferred or self._batch_prefill_pending()):
                order = [s for s in order if s.priority is Priority.BATCH]
                self._batch_turn_due = False
                self.num_batch_turns += 1
            else:
                interactive_turn = True
                self._batch_turn_due = True

        # 1) decodes, one token each.
        self._batch_decodes_deferred = False
        batch_decodes = BATCH_DECODES_BESIDE_INTERACTIVE if interactive_turn else None
        for seq in order:
            if budget == 0:
                break
            if seq.in_prefill or seq.request_id not in self._running:
                continue
            if batch_decodes is not None and seq.priority is Priority.BATCH:
                if batch_decodes == 0:
                    self._batch_decodes_deferred = True
                    continue
                batch_decodes -= 1
            if not self._make_room_for_decode(seq, scheduled, out):
                continue  # seq itself was preempted
            self.block_manager.append_slot(seq)
            budget -= self._emit(out, seq, 1, scheduled)
        out.num_decode_tokens = self.config.max_num_batched_tokens - budget
        if prefill_budget is not None and out.num_decode_tokens:
            budget = min(budget, max(0, prefill_budget))

        # 2) running sequences still prefilling.
        for seq in order:
            if budget == 0:
                break
            if not seq.in_prefill or seq.request_id not in self._running:
                continue
            if interactive_turn and seq.priority is Priority.BATCH:
                continue
            remaining = seq.num_tokens - seq.num_computed_tokens
            room = budget if seq.priority is not Priority.BATCH else min(budget, batch_prefill)
            if remaining > room and not self.config.enable_chunked_prefill:
                continue
            if room == 0:
                continue
            n = self._emit(out, seq, min(remaining, room), scheduled)
            self._step_prompt_tokens += n
            budget = self._packed(budget - n)
            if seq.priority is Priority.BATCH:
                batch_prefill -= n

        # 3) admission from the waiting queue.
        static = self.config.policy is SchedulingPolicy.STATIC
        if len(out.preempted) == yielded and not (static and was_running):
            budget = self._admit(out, budget, scheduled, ignore_budget=static,
                                 batch_too=not yielded and not pause_batch and not interactive_turn,
                                 batch_prefill=batch_prefill)
        out.num_prefill_tokens = self._step_prompt_tokens
        out.num_batched_tokens = out.num_decode_tokens + out.num_prefill_tokens
        return out

    def _batch_prefill_pending(self) -> bool:
        """Whether a batch turn would have prompt tokens to run: a running batch sequence still
        prefilling, or a waiting one that could be admitted now."""
        if any(s.priority is Priority.BATCH and s.in_prefill for s in self._running.values()):
            return True
        queue = self._waiting[Priority.BATCH]
        return (bool(queue) and len(self._running) < self.config.max_num_seqs
                and self.block_manager.can_allocate(queue[0]))

    def _admit(self, out: SchedulerOutput, budget: int, scheduled: set[str], ignore_budget: bool,
               batch_too: bool = True, batch_prefill: int | None = None) -> int:
        for priority, queue in self._waiting.items():
            if priority is Priority.BATCH:
                if not batch_too:
                    break  # batch sequences just gave way, or an interactive prompt is prefilling
                if batch_prefill is not None and not ignore_budget:
                    # batch prompts take a bounded share of a step, so no step grows long for them
                    share = min(budget, batch_prefill)
                    left, _ = self._admit_queue(out, queue, share, scheduled, ignore_budget)
                    return budget - (share - left)
            budget, blocked = self._admit_queue(out, queue, budget, scheduled, ignore_budget)
            if blocked:
                break  # strict (priority, arrival) order: nobody jumps the head
        return budget

    def _admit_queue(self, out: SchedulerOutput, queue, budget: int, scheduled: set[str],
                     ignore_budget: bool) -> tuple[int, bool]:
        """Admit from one priority's queue; (budget left, whether its head could not be admitted)."""
        bm = self.block_manager
        while queue and len(self._running) < self.config.max_num_seqs:
            if budget == 0 and not ignore_budget:
                return budget, True
            seq = queue[0]
            if not bm.can_allocate(seq):
                return budget, True
            remaining = seq.num_tokens - bm.cached_prefix_tokens(seq)
            if remaining > budget and not self.config.enable_chunked_prefill and not ignore_budget:
                return budget, True
            queue.popleft()
            bm.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            self._running[seq.request_id] = seq
            remaining = seq.num_tokens - seq.num_computed_tokens
            n = min(remaining, budget)
            if n < remaining and not self.config.enable_chunked_prefill:
                n = 0  # static baseline: prefilled whole in a later step
            if n > 0:
                budget -= self._emit(out, seq, n, scheduled)
                self._step_prompt_tokens += n
                if not ignore_budget:
                    budget = self._packed(budget)
        return budget, bool(queue)

    def _packed(self, budget: int) -> int:
        """The budget left for more prompts, now that this step holds ``_step_prompt_tokens``
        prompt tokens (``prefill_pack_tokens``; module docstring)."""
        pack = self.config.prefill_pack_tokens
        return budget if pack is None else min(budget, max(0, pack - self._step_prompt_tokens))


    def _yield_to_interactive(self, out: SchedulerOutput) -> int:
        """Batch work gives way: while an interactive request waits for a sequence slot or for
        blocks that running batch sequences hold, the latest batch sequences are preempted (by
        recompute; they run again when there is room). Returns how many were."""
        waiting = self._waiting[Priority.INTERACTIVE]
        if not waiting:
            return 0
        # Not a prefill-only sequence: its blocks may be on their way to a decode worker.
        victims = sorted((s for s in self._running.values() if s.priority is Priority.BATCH and not s.prefill_only),
                         key=_rank, reverse=True)
        need_slots = len(self._running) + len(waiting) - self.config.max_num_seqs
        n = 0
        while victims and (n < need_slots or not self.block_manager.can_allocate(waiting[0])):
            self._preempt(victims.pop(0), out)
            n += 1
        return n

    def _make_room_for_decode(self, seq: Sequence, scheduled: set[str], out: SchedulerOutput) -> bool:
        """Preempt until ``seq`` can take its next slot; False if ``seq`` itself had to go."""
        while not self.block_manager.can_append(seq):
            candidates = [s for s in self._running.values() if s.request_id not in scheduled]
            victim = max(candidates, key=_rank)
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _emit(self, out: SchedulerOutput, seq: Sequence, n: int, scheduled: set[str]) -> int:
        out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
        scheduled.add(seq.request_id)
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = time.monotonic()
        return n

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Preemption by recompute: free the blocks, requeue ahead of later arrivals of its class."""
        del self._running[seq.request_id]
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions_total += 1
        queue = self._waiting[seq.priority]
        i = 0
        while i < len(queue) and queue[i].arrival_time < seq.arrival_time:
            i += 1
        queue.insert(i, seq)
        out.preempted.append(seq)
        logger.debug("preempted %s (%d tokens, %d times)", seq.request_id, seq.num_tokens, seq.num_preemptions)

    # ------------------------------------------------------------ after a step
    def postprocess(self, out: SchedulerOutput, sampled: dict[str, int]) -> None:
        """Advance each scheduled sequence, append its sampled token, and commit full blocks."""
        for chunk in out.chunks:
            seq = chunk.seq
            if seq.is_finished or self._running.get(seq.request_id) is not seq:
                continue  # finished or aborted since schedule()
            if seq.num_computed_tokens != chunk.start:
                raise ValueError(f"{seq.request_id!r}: chunk starts at {chunk.start}, "
                                 f"but {seq.num_computed_tokens} tokens are computed")
            seq.num_computed_tokens += chunk.num_tokens
            if chunk.sample:
                if seq.request_id not in sampled:
                    raise ValueError(f"no sampled token for {seq.request_id!r}, whose chunk samples")
                seq.output_token_ids.append(sampled[seq.request_id])
            self.block_manager.commit(seq)

    def finish(self, seq: Sequence, reason: FinishReason, free_blocks: bool = True) -> None:
        """Remove ``seq`` wherever it is. With ``free_blocks=False`` its blocks stay held (the
        prefill-only hand-off to the KV sender) until ``block_manager.free(seq)``."""
        if self._seqs.get(seq.request_id) is seq:
            del self._seqs[seq.request_id]
            if self._running.pop(seq.request_id, None) is None:
                queue = self._waiting[seq.priority]
                for i, queued in enumerate(queue):
                    if queued is seq:  # identity: Sequence's dataclass __eq__ compares fields
                        del queue[i]
                        break
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if free_blocks:
            self.block_manager.free(seq)

    def abort(self, request_id: str) -> Sequence | None:
        seq = self._seqs.get(request_id)
        if seq is not None:
            self.finish(seq, FinishReason.ABORT)
        return seq


def _rank(seq: Sequence) -> tuple[int, float]:
    """Scheduling order: lower first. The preemption victim is the highest rank."""
    return (int(seq.priority), seq.arrival_time)

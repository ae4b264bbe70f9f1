"""A request's state inside one engine: tokens, blocks, progress and phase timings."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.contract import RequestPhase
from pdserve.engine.sampling_params import SamplingParams


class Priority(enum.IntEnum):
    """Lower value is scheduled first: interactive traffic before batch work."""

    INTERACTIVE = 0
    BATCH = 1


class SequenceStatus(enum.Enum):
    WAITING = "waiting"      # queued; holds no blocks (or lost them to preemption)
    RUNNING = "running"      # holds blocks; prefilling chunk by chunk, then decoding
    FINISHED = "finished"    # done; blocks freed (or handed to a KV transfer)


class FinishReason(str, enum.Enum):
    STOP = "stop"            # EOS, a stop token id or a stop string
    LENGTH = "length"        # max_tokens or the context length reached
    ABORT = "abort"          # cancelled by the client or an operator
    ERROR = "error"          # failed; see the request's error message
    PREFILLED = "prefilled"  # prefill-only mode: the prompt's KV and first token are ready


@dataclass(slots=True, eq=False)
class Sequence:
    """One request's mutable state. Only the engine (scheduler + step loop) mutates it."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: Priority = Priority.INTERACTIVE
    arrival_time: float = field(default_factory=time.monotonic)
    eos_token_ids: frozenset[int] = frozenset()

    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None

    # KV state: ``block_table[i]`` holds tokens [i*block_size, (i+1)*block_size).
    block_table: list[int] = field(default_factory=list)
    # Tokens whose K/V are in the cache (computed here, hit in the prefix cache, or transferred in).
    num_computed_tokens: int = 0
    # Prompt tokens served from the prefix cache at first admission.
    num_cached_tokens: int = 0
    # Number of leading blocks whose chain hash is registered with the block manager.
    num_hashed_blocks: int = 0
    # In prefill-only mode the sequence stops after its first token; blocks stay held for transfer.
    prefill_only: bool = False

    # Timing marks (time.monotonic()).
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    prefill_compute_s: float = 0.0
    num_preemptions: int = 0
    # Text already emitted (for stop strings and incremental detokenisation), kept by the engine.
    output_text: str = ""
    # SamplingParams.prompt_logprobs: entries and ranks of prompt tokens 1.. as their chunks compute.
    prompt_lp_entries: list[dict[int, float]] = field(default_factory=list)
    prompt_lp_ranks: list[int] = field(default_factory=list)
    # The structured output's matcher (``engine/structured.py``): advanced by each sampled token.
    grammar: Any = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def in_prefill(self) -> bool:
        """True while tokens other than the newest sampled one still need their K/V computed."""
        return self.num_computed_tokens < self.num_tokens - 1

    def token_at(self, position: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[position] if position < n else self.output_token_ids[position - n]

    def phase_record(self) -> RequestPhase:
        """Build the request's phase record from its timing marks."""
        end = self.finished_time if self.finished_time is not None else time.monotonic()
        start_sched = self.first_scheduled_time if self.first_scheduled_time is not None else end
        rec = dict(
            queue_s=max(0.0, start_sched - self.arrival_time),
            prompt_tokens=self.num_prompt_tokens,
            cached_prompt_tokens=self.num_cached_tokens,
            output_tokens=len(self.output_token_ids),
            total_s=max(0.0, end - self.arrival_time),
            preemptions=self.num_preemptions,
            finish_reason=self.finish_reason.value if self.finish_reason else None,
        )
        if self.first_token_time is not None:
            prefill_s = rec["prefill_s"] = max(0.0, self.first_token_time - start_sched)
            rec["ttft_s"] = max(0.0, self.first_token_time - self.arrival_time)
            computed = self.num_prompt_tokens - self.num_cached_tokens
            if prefill_s > 0 and computed > 0:
                rec["prefill_tokens_per_s"] = computed / prefill_s
            decode_s = rec["decode_s"] = max(0.0, end - self.first_token_time)
            decoded = len(self.output_token_ids) - 1
            if decoded > 0 and decode_s > 0:
                rec["decode_tokens_per_s"] = decoded / decode_s
        return RequestPhase(**rec)

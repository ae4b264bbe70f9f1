"""Factories for engine unit tests: small sequences, block managers and schedulers on CPU.

Every sequence gets a distinct, increasing ``arrival_time`` (a counter, not the clock) so
priority/arrival ordering is deterministic, and default prompt tokens derived from its request id
so two requests share a prefix only when a test says so.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterable

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import SchedulerConfig, SchedulingPolicy
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler, SchedulerOutput
from pdserve.engine.sequence import FinishReason, Priority, Sequence

_ids = itertools.count()
_arrivals = itertools.count(1)


def make_seq(
    request_id: str | None = None,
    prompt_len: int = 8,
    max_tokens: int = 16,
    priority: Priority = Priority.INTERACTIVE,
    *,
    prompt_token_ids: list[int] | None = None,
    arrival_time: float | None = None,
    prefill_only: bool = False,
    vocab_size: int = 1000,
) -> Sequence:
    """A waiting sequence; ``prompt_token_ids`` (if given) overrides ``prompt_len``."""
    rid = request_id if request_id is not None else f"req-{next(_ids)}"
    if prompt_token_ids is None:
        rng = random.Random(rid)
        prompt_token_ids = [rng.randrange(1, vocab_size) for _ in range(prompt_len)]
    return Sequence(
        request_id=rid,
        prompt_token_ids=list(prompt_token_ids),
        params=SamplingParams(max_tokens=max_tokens, temperature=0.0),
        priority=priority,
        arrival_time=float(next(_arrivals)) if arrival_time is None else arrival_time,
        prefill_only=prefill_only,
    )


def make_block_manager(num_blocks: int = 64, block_size: int = 4, enable_prefix_caching: bool = True) -> BlockManager:
    return BlockManager(num_blocks, block_size, enable_prefix_caching)


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    *,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 256,
    enable_chunked_prefill: bool = True,
    enable_prefix_caching: bool = True,
    policy: SchedulingPolicy = SchedulingPolicy.CONTINUOUS,
    prefill_pack_tokens: int | None = None,
) -> Scheduler:
    """A scheduler over a fresh block manager (reachable as ``scheduler.block_manager``)."""
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=enable_chunked_prefill,
        policy=policy,
        prefill_pack_tokens=prefill_pack_tokens,
    )
    return Scheduler(config, make_block_manager(num_blocks, block_size, enable_prefix_caching))


def sampled_token(seq: Sequence) -> int:
    """A made-up but deterministic 'sampled' token for ``seq``'s next position."""
    return random.Random(f"{seq.request_id}:{seq.num_tokens}").randrange(1, 1000)


def check_block_accounting(bm: BlockManager, holders: list[Sequence], reserved: Iterable[int] = ()) -> None:
    """Assert every block's refcount equals the block tables (plus reservations) that hold it."""
    counts = [0] * bm.num_blocks
    for seq in holders:
        assert len(set(seq.block_table)) == len(seq.block_table), f"{seq.request_id} holds a block twice"
        for block in seq.block_table:
            counts[block] += 1
    for block in reserved:
        counts[block] += 1
    for block in range(bm.num_blocks):
        assert bm.ref_count(block) == counts[block], f"block {block}: refcount {bm.ref_count(block)} != {counts[block]}"
    assert bm.num_used_blocks == sum(1 for c in counts if c), "used-block count disagrees with the tables"


def fake_step(
    scheduler: Scheduler, held: list[Sequence] | None = None, prefill_budget: int | None = None
) -> tuple[SchedulerOutput, list[Sequence]]:
    """One engine step without a model: schedule, check the batch, 'sample', postprocess, finish.

    Finishes a sequence with LENGTH once it has ``max_tokens`` outputs, or a prefill-only one with
    PREFILLED after its first token (blocks kept and appended to ``held``). Returns the output and
    the sequences finished this step.
    """
    decoding_before = {s.request_id for s in scheduler.running() if not s.in_prefill}
    out = scheduler.schedule(prefill_budget=prefill_budget)
    cfg = scheduler.config
    assert out.num_batched_tokens == sum(c.num_tokens for c in out.chunks)
    decodes = [c for c in out.chunks if c.seq.request_id in decoding_before]
    assert out.num_decode_tokens == len(decodes) == sum(c.num_tokens for c in decodes)
    assert out.num_prefill_tokens == out.num_batched_tokens - out.num_decode_tokens
    assert out.num_batched_tokens <= cfg.max_num_batched_tokens
    assert scheduler.num_running <= cfg.max_num_seqs
    assert len({c.seq.request_id for c in out.chunks}) == len(out.chunks), "a sequence scheduled twice"
    bs = scheduler.block_manager.block_size
    for c in out.chunks:
        assert c.num_tokens >= 1 and c.start == c.seq.num_computed_tokens
        assert len(c.seq.block_table) * bs >= c.start + c.num_tokens, "chunk runs past its blocks"
        if not cfg.enable_chunked_prefill:
            assert c.sample, "a partial prefill chunk although chunked prefill is off"
    sampled = {c.seq.request_id: sampled_token(c.seq) for c in out.chunks if c.sample}
    scheduler.postprocess(out, sampled)
    finished: list[Sequence] = []
    for c in out.chunks:
        seq = c.seq
        if not c.sample or seq.is_finished:
            continue
        if seq.prefill_only:
            scheduler.finish(seq, FinishReason.PREFILLED, free_blocks=False)
            if held is not None:
                held.append(seq)
            finished.append(seq)
        elif len(seq.output_token_ids) >= seq.params.max_tokens:
            scheduler.finish(seq, FinishReason.LENGTH)
            finished.append(seq)
    return out, finished


class UncheckedSamplingParams(SamplingParams):
    """SamplingParams whose own validation is off, so it can hold values that validation refuses
    (e.g. ``temperature=1e-300``): it stands for any value that slips past validation, to check
    that one bad request fails alone. It survives ``dataclasses.replace`` and pickling (Ray)."""

    __slots__ = ()

    def _validate(self) -> None:
        return None


def make_unchecked_params(**fields: object) -> SamplingParams:
    return UncheckedSamplingParams(**fields)


def worker_stats(worker_id: str = "w0", role: str = "prefill", **fields: object):
    """A ``WorkerStats`` of an idle worker, with ``fields`` replaced (unit tests of its readers)."""
    from pdserve.engine.contract import WorkerStats

    base = dict(worker_id=worker_id, role=role, num_running=0, num_waiting=0, num_free_blocks=100, num_blocks=100,
                kv_usage=0.0, prefix_hit_rate=0.0, generated_tokens=0, prompt_tokens_computed=0,
                prefill_compute_s=0.0, prefill_budget_tokens=None, max_prefill_tokens_with_decodes=0,
                kv_open_transfers=0, kv_mailboxes=0, started_at=0.0, niceness=0, pid=1, transfer_timeout_s=None)
    return WorkerStats(**{**base, **fields})

"""Scheduler: budgets, chunked prefill, priorities, preemption by recompute, aborts, static batching.

Lifecycles run through ``fake_step`` (schedule -> made-up sampled tokens -> postprocess -> finish)
and end by asserting that every block is free again.
"""

from __future__ import annotations

import random

import pytest

from pdserve.engine.block_manager import chain_hashes
from pdserve.engine.config import SchedulingPolicy
from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import FinishReason, Priority, SequenceStatus
from tests.factories import check_block_accounting, fake_step, make_scheduler, make_seq, sampled_token

INTERACTIVE, BATCH = Priority.INTERACTIVE, Priority.BATCH


def assert_nothing_leaked(sched: Scheduler) -> None:
    bm = sched.block_manager
    assert not sched.has_unfinished() and sched.num_running == 0 and sched.num_waiting == 0
    assert bm.all_free()
    assert bm.num_free_blocks == bm.num_blocks


def run_until_done(sched: Scheduler, max_steps: int = 10_000) -> int:
    steps = 0
    while sched.has_unfinished():
        out, _ = fake_step(sched)
        assert not out.is_empty or out.preempted, "scheduler stalled with work left"
        check_block_accounting(sched.block_manager, sched.running())
        steps += 1
        assert steps < max_steps
    return steps


# ------------------------------------------------------------------ batching basics
def test_chunked_prefill_splits_a_long_prompt_and_samples_only_at_its_end():
    sched = make_scheduler(max_num_batched_tokens=8)
    seq = make_seq(prompt_len=20, max_tokens=2)
    sched.add(seq)
    starts = []
    for _ in range(3):
        out, _ = fake_step(sched)
        (chunk,) = out.chunks
        starts.append((chunk.start, chunk.num_tokens, chunk.sample))
    assert starts == [(0, 8, False), (8, 8, False), (16, 4, True)]
    assert seq.first_scheduled_time is not None and len(seq.output_token_ids) == 1
    out, done = fake_step(sched)                # one decode step
    assert [(c.start, c.num_tokens, c.sample) for c in out.chunks] == [(20, 1, True)]
    assert done == [seq] and seq.finish_reason is FinishReason.LENGTH
    assert_nothing_leaked(sched)


def test_decodes_come_first_and_the_budget_is_never_exceeded():
    sched = make_scheduler(max_num_batched_tokens=10)
    a, b = make_seq(prompt_len=6, max_tokens=5), make_seq(prompt_len=3, max_tokens=5)
    sched.add(a)
    sched.add(b)
    out, _ = fake_step(sched)                   # a whole (6) + b whole (3)
    assert [(c.seq, c.num_tokens) for c in out.chunks] == [(a, 6), (b, 3)]
    late = make_seq(prompt_len=30, max_tokens=1)
    sched.add(late)
    out, _ = fake_step(sched)
    assert [(c.seq, c.num_tokens) for c in out.chunks] == [(a, 1), (b, 1), (late, 8)]
    assert out.num_batched_tokens == 10
    run_until_done(sched)
    assert_nothing_leaked(sched)


def test_without_chunked_prefill_a_prompt_is_admitted_only_whole():
    sched = make_scheduler(max_num_batched_tokens=16, max_model_len=16, enable_chunked_prefill=False)
    a, b = make_seq(prompt_len=10, max_tokens=3), make_seq(prompt_len=8, max_tokens=3)
    sched.add(a)
    sched.add(b)
    out, _ = fake_step(sched)
    assert [(c.seq, c.num_tokens) for c in out.chunks] == [(a, 10)]   # b (8) does not fit in 6
    out, _ = fake_step(sched)
    assert [(c.seq, c.num_tokens) for c in out.chunks] == [(a, 1), (b, 8)]
    run_until_done(sched)
    assert_nothing_leaked(sched)


def test_the_running_set_is_capped():
    sched = make_scheduler(max_num_seqs=2)
    seqs = [make_seq(prompt_len=4, max_tokens=3) for _ in range(3)]
    for s in seqs:
        sched.add(s)
    out, _ = fake_step(sched)
    assert [c.seq for c in out.chunks] == seqs[:2] and sched.num_waiting == 1
    run_until_done(sched)
    assert_nothing_leaked(sched)


def test_add_rejects_what_can_never_run():
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=64)
    with pytest.raises(InvalidRequestError):
        sched.add(make_seq(prompt_len=17))      # 5 blocks > 4
    with pytest.raises(InvalidRequestError):
        make_scheduler(max_model_len=8).add(make_seq(prompt_len=9))
    seq = make_seq("dup")
    sched.add(seq)
    with pytest.raises(InvalidRequestError):
        sched.add(make_seq("dup"))
    sched.abort("dup")
    assert_nothing_leaked(sched)


# ------------------------------------------------------------------ prefix caching
def test_no_hit_on_blocks_still_being_prefilled():
    sched = make_scheduler(block_size=4, max_num_batched_tokens=10)
    prompt = list(range(1, 17))                 # 4 full blocks
    a = make_seq("a", prompt_token_ids=prompt, max_tokens=2)
    sched.add(a)
    fake_step(sched)                            # a: 10 tokens computed -> 2 blocks committed
    b = make_seq("b", prompt_token_ids=prompt, max_tokens=2)
    sched.add(b)
    out, _ = fake_step(sched)                   # a's last chunk (blocks 2-3) and b share this step
    assert [(c.seq, c.start, c.num_tokens) for c in out.chunks] == [(a, 10, 6), (b, 8, 4)]
    assert b.num_cached_tokens == 8             # only blocks computed before the step are hit
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2] and b.block_table[3] != a.block_table[3]
    run_until_done(sched)
    assert_nothing_leaked(sched)


def test_cached_prompt_still_computes_its_last_token():
    sched = make_scheduler(block_size=4)
    prompt = list(range(1, 9))
    a = make_seq("a", prompt_token_ids=prompt, max_tokens=1)
    sched.add(a)
    run_until_done(sched)
    b = make_seq("b", prompt_token_ids=prompt, max_tokens=1)
    sched.add(b)
    out, _ = fake_step(sched)
    assert [(c.start, c.num_tokens, c.sample) for c in out.chunks] == [(4, 4, True)]
    assert b.num_cached_tokens == 4 and b.is_finished
    assert_nothing_leaked(sched)


# ------------------------------------------------------------------ priorities and preemption
def test_interactive_is_admitted_before_earlier_batch_work():
    sched = make_scheduler(max_num_seqs=1)
    batch = make_seq(priority=BATCH, max_tokens=1)
    inter = make_seq(priority=INTERACTIVE, max_tokens=1)
    sched.add(batch)
    sched.add(inter)
    assert sched.waiting() == [inter, batch]
    out, _ = fake_step(sched)
    assert [c.seq for c in out.chunks] == [inter]
    run_until_done(sched)
    assert_nothing_leaked(sched)


def test_running_batch_work_gives_its_slot_to_a_waiting_interactive_request():
    """The running set is full of batch sequences: an interactive arrival preempts the latest of
    them and is admitted in that same step; the victim waits (not readmitted in that step) and
    finishes once there is room, its outputs kept."""
    sched = make_scheduler(max_num_seqs=2, num_blocks=64)
    b1 = make_seq("b1", prompt_len=8, max_tokens=6, priority=BATCH)
    b2 = make_seq("b2", prompt_len=8, max_tokens=6, priority=BATCH)
    sched.add(b1)
    sched.add(b2)
    fake_step(sched)
    fake_step(sched)
    kept = list(b2.output_token_ids)
    inter = make_seq("i", prompt_len=8, max_tokens=2)
    sched.add(inter)
    out, _ = fake_step(sched)
    assert out.preempted == [b2]                                   # the later batch sequence
    assert [c.seq.request_id for c in out.chunks] == ["i"]          # admitted at once, and alone:
    assert b1.status is SequenceStatus.RUNNING                      # b1 sits the prefill step out
    assert b2.status is SequenceStatus.WAITING and b2.output_token_ids == kept
    run_until_done(sched)
    assert len(b2.output_token_ids) == 6 and inter.finish_reason is FinishReason.LENGTH
    assert_nothing_leaked(sched)
    # interactive work never preempts interactive work for a slot
    sched = make_scheduler(max_num_seqs=1)
    first, second = make_seq("first", max_tokens=3), make_seq("second", max_tokens=1)
    sched.add(first)
    fake_step(sched)
    sched.add(second)
    out, _ = fake_step(sched)
    assert out.preempted == [] and [c.seq for c in out.chunks] == [first]
    run_until_done(sched)
    assert_nothing_leaked(sched)


def test_preemption_prefers_a_running_batch_request_and_requeues_it_in_front():
    # 6 blocks of 4: three 8-token prompts hold 2 blocks each; the first decode needs a 3rd block.
    sched = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64)
    i1 = make_seq("i1", prompt_len=8, max_tokens=4)
    bt = make_seq("bt", prompt_len=8, max_tokens=4, priority=BATCH)
    i2 = make_seq("i2", prompt_len=8, max_tokens=4)
    sched.add(bt)
    fake_step(sched)                            # the batch request runs first ...
    for s in (i1, i2):
        sched.add(s)
    out, _ = fake_step(sched)                   # ... and sits out the interactive prefills
    assert {c.seq.request_id for c in out.chunks} == {"i1", "i2"}   # all three hold 2 blocks now
    later = make_seq("later", prompt_len=4, max_tokens=1, priority=BATCH)
    sched.add(later)
    outputs_before = list(bt.output_token_ids)
    out, _ = fake_step(sched)
    assert out.preempted == [bt]                # batch victim, though i2 arrived later
    assert bt.status is SequenceStatus.WAITING and bt.block_table == [] and bt.num_preemptions == 1
    assert bt.output_token_ids == outputs_before and len(outputs_before) == 1   # keeps its output tokens
    assert sched.waiting() == [bt, later]                 # front of its class
    assert {c.seq.request_id for c in out.chunks} == {"i1", "i2"}   # no readmission in the same step
    while bt.status is SequenceStatus.WAITING:
        out, _ = fake_step(sched)
    (chunk,) = [c for c in out.chunks if c.seq is bt]     # recompute covers prompt + outputs
    assert chunk.start + chunk.num_tokens == 8 + len(outputs_before) and chunk.sample
    run_until_done(sched)
    assert len(bt.output_token_ids) == 4 and bt.output_token_ids[0] == outputs_before[0]
    assert_nothing_leaked(sched)


def test_an_interactive_arrival_short_of_blocks_takes_them_from_batch_work():
    """Blocks, not slots: the batch request holds what an interactive arrival needs. The
    interactive request is admitted in the step that preempts the batch one (preempting for it is
    the point), and the victim is not readmitted in that step."""
    sched = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64)
    b = make_seq("b", prompt_len=12, max_tokens=4, priority=BATCH)  # 3 blocks
    a = make_seq("a", prompt_len=8, max_tokens=4)                   # 2 blocks
    sched.add(b)
    fake_step(sched)
    sched.add(a)
    fake_step(sched)                            # 5 of 6 blocks used
    c = make_seq("c", prompt_len=8, max_tokens=1)                   # needs 2: only 1 is free
    sched.add(c)
    out, _ = fake_step(sched)
    assert out.preempted == [b] and {ch.seq.request_id for ch in out.chunks} == {"a", "c"}
    assert b.status is SequenceStatus.WAITING
    run_until_done(sched)
    assert len(b.output_token_ids) == 4
    assert_nothing_leaked(sched)


def test_a_preempted_sequence_recomputes_from_its_prefix_hit():
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    a = make_seq("a", prompt_len=8, max_tokens=3)
    b = make_seq("b", prompt_len=8, max_tokens=6)
    sched.add(a)
    sched.add(b)
    fake_step(sched)                            # both prefilled: 9 tokens, 2 blocks each
    out, _ = fake_step(sched)                   # a needs a 3rd block: b (latest) preempted
    assert out.preempted == [b] and b.num_computed_tokens == 0
    # b's freed blocks went to the LRU tail first: a took b's 2nd block, b's 1st is still cached.
    assert sched.block_manager.longest_cached_prefix(chain_hashes(b.token_ids, 4)) == 1
    while b.status is not SequenceStatus.RUNNING:
        out, _ = fake_step(sched)
    (chunk,) = [c for c in out.chunks if c.seq is b]
    assert (chunk.start, chunk.num_tokens, chunk.sample) == (4, 9 - 4, True)   # prompt 8 + 1 output
    assert b.num_computed_tokens == 9 and len(b.output_token_ids) == 2
    run_until_done(sched)
    assert len(b.output_token_ids) == 6
    assert_nothing_leaked(sched)


def test_a_lone_sequence_that_cannot_grow_preempts_itself():
    sched = make_scheduler(num_blocks=2, block_size=4, max_num_batched_tokens=64)
    a = make_seq("a", prompt_len=7, max_tokens=5)   # needs a 3rd block at 9 tokens
    sched.add(a)
    fake_step(sched)
    fake_step(sched)                            # decode to 9 tokens
    out, _ = fake_step(sched)
    assert out.preempted == [a] and out.is_empty
    sched.abort("a")
    assert_nothing_leaked(sched)


# ------------------------------------------------------------------ finishing and aborts
def test_prefill_only_keeps_blocks_until_freed():
    sched = make_scheduler(max_num_batched_tokens=8)
    seq = make_seq(prompt_len=13, prefill_only=True)
    sched.add(seq)
    held = []
    while not held:
        fake_step(sched, held)
    assert held == [seq] and seq.finish_reason is FinishReason.PREFILLED
    assert not sched.has_unfinished() and len(seq.block_table) == 4
    bm = sched.block_manager
    assert not bm.all_free()
    check_block_accounting(bm, [seq])
    bm.free(seq)
    assert_nothing_leaked(sched)


@pytest.mark.parametrize("state", ["waiting", "prefilling", "decoding", "preempted", "between-steps"])
def test_abort_in_every_state_frees_everything(state):
    sched = make_scheduler(num_blocks=5, block_size=4, max_num_batched_tokens=4)
    other = make_seq("other", prompt_len=7, max_tokens=8)
    seq = make_seq("x", prompt_len=7, max_tokens=8)
    sched.add(other)
    sched.add(seq)
    if state != "waiting":
        fake_step(sched)
        fake_step(sched)                        # other prefilled; x admitted
        assert seq.status is SequenceStatus.RUNNING and seq.in_prefill
    if state in ("decoding", "preempted"):
        while seq.in_prefill:
            fake_step(sched)
        assert seq.status is SequenceStatus.RUNNING
    if state == "preempted":
        while seq.status is not SequenceStatus.WAITING:
            fake_step(sched)
        assert seq.num_preemptions == 1
    if state == "between-steps":
        out = sched.schedule()
        assert sched.abort("x") is seq
        sched.postprocess(out, {c.seq.request_id: sampled_token(c.seq) for c in out.chunks if c.sample})
    else:
        assert sched.abort("x") is seq
    assert seq.finish_reason is FinishReason.ABORT and seq.block_table == []
    assert sched.abort("x") is None
    check_block_accounting(sched.block_manager, sched.running())
    run_until_done(sched)
    assert_nothing_leaked(sched)


def test_add_prefilled_joins_the_decode_batch():
    sched = make_scheduler(num_blocks=8, block_size=4)
    bm = sched.block_manager
    seq = make_seq("d", prompt_len=9, max_tokens=3)
    blocks = bm.reserve(3)                      # KV lands here
    bm.adopt(seq, blocks)
    seq.num_computed_tokens = 9
    seq.output_token_ids.append(17)             # first token sampled by the prefill worker
    sched.add_prefilled(seq)
    out, _ = fake_step(sched)
    assert [(c.start, c.num_tokens) for c in out.chunks] == [(9, 1)]
    run_until_done(sched)
    assert_nothing_leaked(sched)


# ------------------------------------------------------------------ static baseline
def test_static_policy_admits_a_new_batch_only_when_the_running_set_is_empty():
    sched = make_scheduler(max_num_seqs=4, max_num_batched_tokens=16, policy=SchedulingPolicy.STATIC)
    first = [make_seq(prompt_len=8, max_tokens=n) for n in (1, 4)]
    for s in first:
        sched.add(s)
    fake_step(sched)
    late = make_seq(prompt_len=4, max_tokens=1)
    sched.add(late)
    while first[1].status is SequenceStatus.RUNNING:
        out, _ = fake_step(sched)
        assert late.status is SequenceStatus.WAITING and late not in [c.seq for c in out.chunks]
    out, _ = fake_step(sched)
    assert [c.seq for c in out.chunks] == [late]
    assert_nothing_leaked(sched)


# ------------------------------------------------------------------ whole lifecycles
@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("policy", list(SchedulingPolicy))
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("pack", [None, 6])
def test_random_lifecycles_finish_everything_and_free_every_block(seed, policy, chunked, pack):
    rng = random.Random(seed)
    sched = make_scheduler(num_blocks=12, block_size=4, max_num_seqs=6, max_num_batched_tokens=32,
                           max_model_len=32, enable_chunked_prefill=chunked, policy=policy,
                           prefill_pack_tokens=pack)
    shared = [rng.randrange(1, 1000) for _ in range(12)]
    seqs, held = [], []
    for i in range(40):
        plen = rng.randrange(1, 20)
        prompt = shared[:plen] if rng.random() < 0.3 else [rng.randrange(1, 1000) for _ in range(plen)]
        seqs.append(make_seq(f"s{i}", prompt_token_ids=prompt, max_tokens=rng.randrange(1, 12),
                             priority=rng.choice([INTERACTIVE, BATCH]), prefill_only=rng.random() < 0.1))
    pending = list(seqs)
    steps = 0
    while pending or sched.has_unfinished():
        for _ in range(rng.randrange(0, 3)):
            if pending:
                sched.add(pending.pop(0))
        out, _ = fake_step(sched, held)
        check_block_accounting(sched.block_manager, sched.running() + held)
        while held and rng.random() < 0.5:      # the KV sender finishes at its own pace
            sched.block_manager.free(held.pop(0))
        steps += 1
        assert steps < 5_000
    for s in held:
        sched.block_manager.free(s)
    for s in seqs:
        want = 1 if s.prefill_only else s.params.max_tokens
        assert s.is_finished and len(s.output_token_ids) == want
        # Recompute after preemption must not change what was generated.
        for k, tok in enumerate(s.output_token_ids):
            assert tok == sampled_token_at(s, k)
    assert sched.num_preemptions_total > 0      # the pool is small enough to force preemption
    assert_nothing_leaked(sched)


def sampled_token_at(seq, k: int) -> int:
    """The token fake_step samples for output k (it depends only on request id and position)."""
    return random.Random(f"{seq.request_id}:{seq.num_prompt_tokens + k}").randrange(1, 1000)


@pytest.mark.parametrize("seed", range(6))
def test_random_interleavings_keep_budget_and_refcounts_consistent(seed):
    rng = random.Random(100 + seed)
    sched = make_scheduler(num_blocks=10, block_size=4, max_num_seqs=5, max_num_batched_tokens=12,
                           max_model_len=40)
    bm = sched.block_manager
    live: list[str] = []
    reserved: list[list[int]] = []
    for i in range(400):
        op = rng.random()
        if op < 0.3:
            seq = make_seq(f"p{seed}-{i}", prompt_len=rng.randrange(1, 24), max_tokens=rng.randrange(1, 10),
                           priority=rng.choice([INTERACTIVE, BATCH]))
            sched.add(seq)
            live.append(seq.request_id)
        elif op < 0.4 and live:
            sched.abort(live.pop(rng.randrange(len(live))))
        elif op < 0.45 and bm.num_free_blocks >= 2:
            reserved.append(bm.reserve(rng.randrange(1, 3)))
        elif op < 0.5 and reserved:
            bm.release(reserved.pop(rng.randrange(len(reserved))))
        else:
            _, done = fake_step(sched)
            live = [r for r in live if sched.get(r) is not None]
        check_block_accounting(bm, sched.running(), reserved=[b for r in reserved for b in r])
        for s in sched.waiting():
            assert s.block_table == [] and s.status is SequenceStatus.WAITING
    for r in reserved:
        bm.release(r)
    for rid in list(live):
        sched.abort(rid)
    assert_nothing_leaked(sched)


def test_static_without_chunking_prefills_each_member_whole_when_the_budget_allows():
    sched = make_scheduler(max_num_seqs=3, max_num_batched_tokens=16, max_model_len=16,
                           enable_chunked_prefill=False, policy=SchedulingPolicy.STATIC)
    s1, s2, s3 = (make_seq(prompt_len=10, max_tokens=3) for _ in range(3))
    for s in (s1, s2, s3):
        sched.add(s)
    shapes = []
    for _ in range(3):
        out, _ = fake_step(sched)
        shapes.append([(c.seq, c.num_tokens) for c in out.chunks])
        if len(shapes) == 1:
            assert sched.num_running == 3       # the whole batch is admitted in the first step
    assert shapes == [[(s1, 10)], [(s1, 1), (s2, 10)], [(s1, 1), (s2, 1), (s3, 10)]]
    run_until_done(sched)
    assert_nothing_leaked(sched)


# ------------------------------------------------------------------ ITL budget (decode workers)
def test_prefill_budget_caps_prompt_tokens_only_while_sequences_decode():
    sched = make_scheduler(max_num_batched_tokens=64, num_blocks=128)
    streams = [make_seq(prompt_len=8, max_tokens=40) for _ in range(3)]
    for s in streams:
        sched.add(s)
    out, _ = fake_step(sched, prefill_budget=4)
    # Nothing decodes yet: the budget does not apply, all three prompts are prefilled whole.
    assert out.num_decode_tokens == 0 and out.num_prefill_tokens == 24
    long = make_seq(prompt_len=50, max_tokens=2)
    sched.add(long)
    chunks = []
    while not long.output_token_ids:
        out, _ = fake_step(sched, prefill_budget=12)
        assert out.num_decode_tokens == 3
        assert out.num_prefill_tokens <= 12
        chunks.append(out.num_prefill_tokens)
    assert chunks == [12, 12, 12, 12, 2]       # the 50-token prompt, 12 tokens a step
    assert len(long.output_token_ids) == 1     # sampled at the end of its last chunk
    run_until_done(sched)
    assert_nothing_leaked(sched)


def test_without_a_prefill_budget_a_prompt_takes_the_whole_step_budget():
    sched = make_scheduler(max_num_batched_tokens=64, num_blocks=128)
    stream = make_seq(prompt_len=8, max_tokens=40)
    sched.add(stream)
    fake_step(sched)
    long = make_seq(prompt_len=50, max_tokens=2)
    sched.add(long)
    out, _ = fake_step(sched)
    assert out.num_decode_tokens == 1 and out.num_prefill_tokens == 50
    run_until_done(sched)
    assert_nothing_leaked(sched)


def test_a_pack_cap_finishes_a_burst_of_short_prompts_a_few_at_a_time():
    """With prefill_pack_tokens, a burst of 8-token prompts is prefilled two a step (first tokens
    come out every step, FCFS), where without it one step takes them all."""
    burst = [make_seq(f"p{i}", prompt_len=8, max_tokens=3) for i in range(6)]
    unpacked = make_scheduler(max_num_batched_tokens=64, num_blocks=128)
    for s in [make_seq(f"p{i}", prompt_len=8, max_tokens=3) for i in range(6)]:
        unpacked.add(s)
    out, _ = fake_step(unpacked)
    assert out.num_prefill_tokens == 48
    sched = make_scheduler(max_num_batched_tokens=64, num_blocks=128, prefill_pack_tokens=16)
    for s in burst:
        sched.add(s)
    firsts = []
    for _ in range(3):
        out, _ = fake_step(sched)
        firsts.append([s.request_id for s in burst if s.output_token_ids and s.request_id not in sum(firsts, [])])
        assert out.num_prefill_tokens == 16
    assert firsts == [["p0", "p1"], ["p2", "p3"], ["p4", "p5"]]
    run_until_done(sched)
    assert_nothing_leaked(sched)


def test_a_pack_cap_leaves_a_long_prompt_its_whole_budget_and_tops_a_step_up_to_the_cap():
    sched = make_scheduler(max_num_batched_tokens=64, num_blocks=128, prefill_pack_tokens=16)
    long, short, tail = make_seq("long", prompt_len=50), make_seq("short", prompt_len=8), make_seq("tail", prompt_len=8)
    for s in (long, short, tail):
        sched.add(s)
    out, _ = fake_step(sched)
    assert [(c.seq.request_id, c.num_tokens) for c in out.chunks] == [("long", 50)]  # alone: over the cap
    out, _ = fake_step(sched)   # long decodes; short (8) and then 8 of tail fit under the cap of 16
    assert [(c.seq.request_id, c.num_tokens) for c in out.chunks] == [("long", 1), ("short", 8), ("tail", 8)]
    head = make_seq("head", prompt_len=12)
    sched.add(head)
    more = make_seq("more", prompt_len=12)
    sched.add(more)
    out, _ = fake_step(sched)   # a 12-token prompt, then 4 tokens of the next (a chunk) reach the cap
    assert [(c.seq.request_id, c.num_tokens) for c in out.chunks if c.seq.in_prefill or c.num_tokens > 1] == \
        [("head", 12), ("more", 4)]
    run_until_done(sched)
    assert_nothing_leaked(sched)


def test_batch_prompts_take_smaller_chunks_in_turns_of_their_own_beside_interactive_decodes():
    """Alone, a batch prompt takes up to 256 tokens a step. Beside interactive decodes it never
    shares their step: interactive steps (with the batch decodes) alternate with batch turns of
    batch work alone and at most 64 prompt tokens, which an interactive arrival may cut short."""
    from pdserve.engine.scheduler import BATCH_PREFILL_TOKENS_BESIDE_INTERACTIVE, BATCH_PREFILL_TOKENS_PER_STEP

    sched = make_scheduler(num_blocks=512, max_num_batched_tokens=1024, max_model_len=1024)
    alone = make_seq(priority=BATCH, prompt_len=600, max_tokens=2)
    sched.add(alone)
    out, _ = fake_step(sched)
    assert [c.num_tokens for c in out.chunks] == [BATCH_PREFILL_TOKENS_PER_STEP]
    run_until_done(sched)
    inter = make_seq("i", priority=INTERACTIVE, prompt_len=8, max_tokens=50)
    decoding = make_seq("d", priority=BATCH, prompt_len=8, max_tokens=50)
    sched.add(decoding)
    fake_step(sched)                                   # the batch prompt, alone: one step
    sched.add(inter)
    out, _ = fake_step(sched)                          # its prefill (batch work sits it out)
    assert [c.seq.request_id for c in out.chunks] == ["i"]
    beside = make_seq("b", priority=BATCH, prompt_len=200, max_tokens=2)
    sched.add(beside)
    kinds = []
    for _ in range(8):
        out, _ = fake_step(sched)
        kinds.append(sorted((c.seq.request_id, c.num_tokens) for c in out.chunks))
    turn = [("b", BATCH_PREFILL_TOKENS_BESIDE_INTERACTIVE), ("d", 1)]
    last = [("b", 200 - 3 * BATCH_PREFILL_TOKENS_BESIDE_INTERACTIVE), ("d", 1)]
    assert kinds == [[("d", 1), ("i", 1)], turn, [("d", 1), ("i", 1)], turn,
                     [("d", 1), ("i", 1)], turn, [("d", 1), ("i", 1)], last]
    assert sched.num_batch_turns == 4
    # with nothing left to prefill there are no batch turns: every step decodes all three
    out, _ = fake_step(sched)
    assert sorted(c.seq.request_id for c in out.chunks) == ["b", "d", "i"]
    run_until_done(sched)
    assert_nothing_leaked(sched)
    # the ablation: batch prompt chunks ride in the interactive steps
    sched = make_scheduler(num_blocks=512, max_num_batched_tokens=1024, max_model_len=1024)
    sched.batch_prefill_apart = False
    sched.add(make_seq("i", priority=INTERACTIVE, prompt_len=8, max_tokens=50))
    fake_step(sched)
    sched.add(make_seq("b", priority=BATCH, prompt_len=600, max_tokens=2))
    out, _ = fake_step(sched)
    assert sorted(c.num_tokens for c in out.chunks) == [1, BATCH_PREFILL_TOKENS_BESIDE_INTERACTIVE]
    run_until_done(sched)
    assert_nothing_leaked(sched)


def test_an_interactive_step_carries_a_few_batch_decodes_and_a_batch_turn_the_rest():
    """Many batch sequences decoding when interactive traffic starts: each interactive step takes
    the earliest few of them, and the batch turn after it decodes them all, interactive left out."""
    from pdserve.engine.scheduler import BATCH_DECODES_BESIDE_INTERACTIVE as CAP

    sched = make_scheduler(num_blocks=512, max_num_seqs=16, max_num_batched_tokens=1024, max_model_len=1024)
    batch = [make_seq(f"b{i}", priority=BATCH, prompt_len=8, max_tokens=40) for i in range(CAP + 4)]
    for seq in batch:
        sched.add(seq)
    fake_step(sched)                                   # every batch prompt, one step
    inter = make_seq("i", priority=INTERACTIVE, prompt_len=8, max_tokens=20)
    sched.add(inter)
    fake_step(sched)                                   # its prefill, alone
    out, _ = fake_step(sched)
    assert sorted(c.seq.request_id for c in out.chunks) == sorted(["i"] + [f"b{i}" for i in range(CAP)])
    out, _ = fake_step(sched)
    assert sorted(c.seq.request_id for c in out.chunks) == sorted(s.request_id for s in batch)
    out, _ = fake_step(sched)
    assert sorted(c.seq.request_id for c in out.chunks) == sorted(["i"] + [f"b{i}" for i in range(CAP)])
    run_until_done(sched)
    assert all(len(s.output_token_ids) == 40 for s in batch) and len(inter.output_token_ids) == 20
    assert_nothing_leaked(sched)

"""BlockManager: refcounts, prefix caching by chain hash, LRU eviction, events, reservations."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.engine.block_manager import BlockManager, chain_hashes, salt_root
from pdserve.engine.errors import OutOfBlocksError
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.kv_events import KVEvent, KVEventKind
from tests.factories import check_block_accounting, make_block_manager, make_seq

BS = 4


def computed(bm: BlockManager, seq, n: int | None = None) -> None:
    """Pretend the model computed the K/V of ``seq``'s tokens up to ``n`` (default: all), then commit."""
    seq.num_computed_tokens = seq.num_tokens if n is None else n
    bm.commit(seq)


def assert_nothing_leaked(bm: BlockManager) -> None:
    assert bm.all_free()
    assert bm.num_free_blocks == bm.num_blocks
    assert bm.num_used_blocks == 0


# ------------------------------------------------------------------ chain hashes
def test_chain_hashes_cover_full_blocks_and_chain_on_the_parent():
    tokens = list(range(1, 11))  # 2 full blocks of 4 + 2 tokens
    hs = chain_hashes(tokens, BS)
    assert len(hs) == 2
    assert chain_hashes(tokens[4:8], BS, parent=hs[0]) == [hs[1]]
    assert chain_hashes(tokens[4:8], BS) != [hs[1]]          # same tokens, different prefix
    assert chain_hashes([9, 2, 3, 4] + tokens[4:8], BS)[1] != hs[1]
    assert all(0 <= h < 2**64 for h in hs)
    assert chain_hashes(tokens[:3], BS) == []


def test_chain_hashes_are_identical_in_another_process():
    tokens = list(range(100, 140))
    code = (
        "from pdserve.engine.block_manager import chain_hashes;"
        f"print(chain_hashes(list(range(100, 140)), {BS}))"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={"PYTHONHASHSEED": "123"})
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == str(chain_hashes(tokens, BS))


# ------------------------------------------------------------------ allocation
def test_allocate_append_and_free_account_every_block():
    bm = make_block_manager(num_blocks=8, block_size=BS)
    seq = make_seq(prompt_len=6)
    assert bm.can_allocate(seq)
    bm.allocate(seq)
    assert len(seq.block_table) == 2 and seq.num_computed_tokens == 0
    assert bm.num_free_blocks == 6 and bm.usage == pytest.approx(2 / 8)
    check_block_accounting(bm, [seq])

    computed(bm, seq)
    seq.output_token_ids += [7, 8]              # 8 tokens: still 2 blocks
    assert bm.can_append(seq)
    bm.append_slot(seq)
    assert len(seq.block_table) == 2
    seq.output_token_ids.append(9)              # 9 tokens: a third block
    bm.append_slot(seq)
    assert len(seq.block_table) == 3
    check_block_accounting(bm, [seq])

    bm.free(seq)
    assert seq.block_table == [] and seq.num_computed_tokens == 0 and seq.num_hashed_blocks == 0
    assert_nothing_leaked(bm)


def test_allocate_refuses_when_blocks_run_out():
    bm = make_block_manager(num_blocks=2, block_size=BS)
    big = make_seq(prompt_len=9)
    assert not bm.can_allocate(big)
    with pytest.raises(OutOfBlocksError):
        bm.allocate(big)
    small = make_seq(prompt_len=8)
    bm.allocate(small)
    small.output_token_ids.append(1)
    assert not bm.can_append(small)
    with pytest.raises(OutOfBlocksError):
        bm.append_slot(small)
    bm.free(small)
    assert_nothing_leaked(bm)


# ------------------------------------------------------------------ prefix caching
def test_hash_is_registered_only_when_the_block_is_computed():
    bm = make_block_manager(num_blocks=16, block_size=BS)
    prompt = list(range(1, 13))                 # 3 full blocks
    a = make_seq("a", prompt_token_ids=prompt)
    bm.allocate(a)
    assert bm.drain_events() == []               # allocated, nothing computed: nothing hittable
    b = make_seq("b", prompt_token_ids=prompt)
    assert bm.cached_prefix_tokens(b) == 0

    computed(bm, a, 6)                          # chunked prefill: 1.5 blocks done
    assert a.num_hashed_blocks == 1
    hs = chain_hashes(prompt, BS)
    assert bm.drain_events() == [KVEvent(KVEventKind.STORED, hs[0])]
    assert bm.longest_cached_prefix(hs) == 1
    bm.allocate(b)
    assert b.num_computed_tokens == BS and b.block_table[0] == a.block_table[0]
    assert b.block_table[1] != a.block_table[1]  # a's second block is not computed yet
    assert bm.ref_count(a.block_table[0]) == 2
    check_block_accounting(bm, [a, b])
    bm.free(a)
    bm.free(b)
    assert_nothing_leaked(bm)


def test_full_prompt_hit_still_leaves_one_token_to_compute():
    bm = make_block_manager(num_blocks=16, block_size=BS)
    prompt = list(range(1, 9))                  # exactly 2 full blocks
    a = make_seq("a", prompt_token_ids=prompt)
    bm.allocate(a)
    computed(bm, a)
    assert a.num_hashed_blocks == 2
    b = make_seq("b", prompt_token_ids=prompt)
    bm.allocate(b)
    assert b.num_computed_tokens == BS == b.num_cached_tokens   # block 2 recomputed for the logits
    assert b.num_computed_tokens < b.num_tokens
    assert b.num_hashed_blocks == 1 and len(b.block_table) == 2
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]
    computed(bm, b)                             # b's copy of block 2 duplicates a's: stays unhashed
    assert bm.drain_events() == [KVEvent(KVEventKind.STORED, h) for h in chain_hashes(prompt, BS)]
    check_block_accounting(bm, [a, b])
    bm.free(a)
    bm.free(b)
    assert bm.num_cached_free_blocks == 2       # only a's hashed blocks stay cached
    assert_nothing_leaked(bm)


def test_freed_hashed_blocks_are_reused_from_the_cache_and_counted_as_hits():
    bm = make_block_manager(num_blocks=8, block_size=BS)
    prompt = list(range(1, 11))
    a = make_seq("a", prompt_token_ids=prompt)
    bm.allocate(a)
    computed(bm, a)
    table = list(a.block_table)
    bm.free(a)
    assert bm.num_cached_free_blocks == 2 and bm.num_free_blocks == 8
    b = make_seq("b", prompt_token_ids=prompt + [42])
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert b.block_table[:2] == table[:2] and b.num_computed_tokens == 8
    assert bm.prefix_query_tokens == 10 + 11 and bm.prefix_hit_tokens == 8
    assert bm.hit_rate == pytest.approx(8 / 21)
    bm.free(b)
    assert_nothing_leaked(bm)


def test_eviction_removes_the_hash_lru_first_before_reuse():
    bm = make_block_manager(num_blocks=4, block_size=BS)
    old = make_seq("old", prompt_token_ids=list(range(1, 9)))       # 2 blocks
    new = make_seq("new", prompt_token_ids=list(range(101, 109)))   # 2 blocks
    for s in (old, new):
        bm.allocate(s)
        computed(bm, s)
        bm.free(s)
    old_h, new_h = chain_hashes(old.prompt_token_ids, BS), chain_hashes(new.prompt_token_ids, BS)
    bm.drain_events()
    assert bm.num_free_blocks == 4 and bm.num_cached_free_blocks == 4

    x = make_seq("x", prompt_len=5)             # needs 2 blocks: evicts old's chain, tail first
    bm.allocate(x)
    assert bm.drain_events() == [KVEvent(KVEventKind.REMOVED, old_h[1]), KVEvent(KVEventKind.REMOVED, old_h[0])]
    assert bm.longest_cached_prefix(old_h) == 0
    assert bm.longest_cached_prefix(new_h) == 2
    y = make_seq("y", prompt_token_ids=old.prompt_token_ids)
    assert bm.cached_prefix_tokens(y) == 0       # evicted blocks are never hit again
    check_block_accounting(bm, [x])
    bm.free(x)
    assert_nothing_leaked(bm)


def test_hit_on_a_cached_free_block_is_not_evicted_for_the_same_allocation():
    bm = make_block_manager(num_blocks=5, block_size=BS)
    a = make_seq("a", prompt_token_ids=list(range(1, 9)))           # blocks 0, 1
    c = make_seq("c", prompt_token_ids=list(range(50, 54)))         # block 2
    for s in (a, c):
        bm.allocate(s)
        computed(bm, s)
        bm.free(s)
    other = make_seq("o", prompt_len=8)
    bm.allocate(other)                          # takes the two plain free blocks
    bm.drain_events()
    b = make_seq("b", prompt_token_ids=list(range(1, 9)) + [5])     # hits a's 2 blocks, needs 1 more
    assert bm.num_free_blocks == 3 and bm.can_allocate(b)
    bm.allocate(b)
    assert b.num_computed_tokens == 8 and b.block_table[:2] == [0, 1]
    assert bm.drain_events() == [KVEvent(KVEventKind.REMOVED, chain_hashes(c.prompt_token_ids, BS)[0])]
    check_block_accounting(bm, [other, b])
    for s in (other, b):
        bm.free(s)
    assert_nothing_leaked(bm)


def test_num_cached_tokens_is_set_only_on_first_admission():
    bm = make_block_manager(num_blocks=8, block_size=BS)
    a = make_seq("a", prompt_token_ids=list(range(1, 10)))
    bm.allocate(a)
    computed(bm, a)
    bm.free(a)
    b = make_seq("b", prompt_token_ids=list(range(1, 10)))
    b.num_preemptions = 1
    bm.allocate(b)
    assert b.num_computed_tokens == 8 and b.num_cached_tokens == 0
    bm.free(b)
    assert_nothing_leaked(bm)


def test_prefix_caching_disabled_never_hits_or_emits():
    bm = make_block_manager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    prompt = list(range(1, 10))
    a = make_seq("a", prompt_token_ids=prompt)
    bm.allocate(a)
    computed(bm, a)
    b = make_seq("b", prompt_token_ids=prompt)
    bm.allocate(b)
    assert b.num_computed_tokens == 0 and bm.drain_events() == []
    assert bm.longest_cached_prefix(chain_hashes(prompt, BS)) == 0
    bm.free(a)
    bm.free(b)
    assert bm.num_cached_free_blocks == 0
    assert_nothing_leaked(bm)


def test_pending_events_are_bounded():
    bm = BlockManager(8, BS, max_pending_events=2)
    a = make_seq("a", prompt_token_ids=list(range(1, 17)))
    bm.allocate(a)
    computed(bm, a)
    assert len(bm.drain_events()) == 2 and bm.events_dropped == 2
    bm.free(a)
    assert_nothing_leaked(bm)


# --------------------------------------------------------------- decode-side reservations
def test_reserve_release_and_adopt():
    bm = make_block_manager(num_blocks=6, block_size=BS)
    with pytest.raises(OutOfBlocksError):
        bm.reserve(7)
    r1 = bm.reserve(2)
    r2 = bm.reserve(3)
    assert not bm.all_free() and bm.num_free_blocks == 1
    check_block_accounting(bm, [], reserved=r1 + r2)
    bm.release(r1)
    with pytest.raises(ValueError):
        bm.release(r1)                          # not reserved any more
    seq = make_seq("d", prompt_len=9)
    bm.adopt(seq, r2)
    seq.num_computed_tokens = 9
    bm.commit(seq)                              # transferred-in prompt blocks become hittable
    assert seq.num_hashed_blocks == 2
    assert bm.longest_cached_prefix(chain_hashes(seq.prompt_token_ids, BS)) == 2
    with pytest.raises(ValueError):
        bm.release(r2)                          # adopted blocks belong to the sequence now
    check_block_accounting(bm, [seq])
    bm.free(seq)
    assert_nothing_leaked(bm)


def test_cache_salt_chains_every_block_from_the_salt():
    """A salted request's blocks are hashed from its salt: only the same salt hits them, and the
    KV events (which the router routes by) carry the salted hashes."""
    bm = make_block_manager(num_blocks=32, block_size=BS)
    prompt = list(range(1, 14))                 # 3 full blocks + 1
    a = make_seq("a", prompt_token_ids=prompt)
    a.params = SamplingParams(temperature=0.0, cache_salt="tenant-a")
    bm.allocate(a)
    computed(bm, a)
    salted = chain_hashes(prompt, BS, salt_root("tenant-a"))
    assert salted != chain_hashes(prompt, BS)
    assert bm.drain_events() == [KVEvent(KVEventKind.STORED, h) for h in salted]
    same, other, bare = (make_seq(n, prompt_token_ids=prompt) for n in ("same", "other", "bare"))
    same.params = SamplingParams(temperature=0.0, cache_salt="tenant-a")
    other.params = SamplingParams(temperature=0.0, cache_salt="tenant-b")
    assert bm.cached_prefix_tokens(same) == 3 * BS
    assert bm.cached_prefix_tokens(other) == 0 and bm.cached_prefix_tokens(bare) == 0
    assert salt_root(None) is None and salt_root("x") != salt_root("y")
    bm.free(a)
    assert_nothing_leaked(bm)

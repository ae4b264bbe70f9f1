"""The router's routing policy (pure logic): which decode and prefill worker a prompt goes to, when
it is prefilled on the decode worker, and when it must wait for a prefill worker instead."""

from __future__ import annotations

import pytest

from pdserve.engine.block_manager import chain_hashes
from pdserve.router.policy import RoutingPolicy, WorkerView

BS = 16


def _views() -> tuple[list[WorkerView], list[WorkerView]]:
    prefill = [WorkerView("p0", "prefill"), WorkerView("p1", "prefill")]
    decode = [WorkerView("d0", "decode", num_blocks=100, num_free_blocks=90),
              WorkerView("d1", "decode", num_blocks=100, num_free_blocks=10)]
    return prefill, decode


def _prompt(n: int) -> tuple[list[int], list[int]]:
    ids = list(range(7, 7 + n))
    return ids, chain_hashes(ids, BS)


def test_the_prefill_worker_with_the_longest_cached_prefix_wins() -> None:
    prefill, decode = _views()
    ids, hashes = _prompt(100)
    prefill[1].cached_hashes.update(hashes[:4])   # 64 tokens cached on p1
    d = RoutingPolicy(block_size=BS).choose(hashes, len(ids), prefill, decode)
    assert d.prefill_worker == "p1" and d.cached_prefix_tokens == 64 and not d.wait_for_prefill


def test_a_queue_outweighs_a_small_cache_hit() -> None:
    prefill, decode = _views()
    ids, hashes = _prompt(100)
    prefill[1].cached_hashes.update(hashes[:1])   # 16 tokens cached on p1 ...
    prefill[1].inflight_tokens = 500              # ... behind 500 queued tokens
    assert RoutingPolicy(block_size=BS).choose(hashes, len(ids), prefill, decode).prefill_worker == "p0"


def test_a_short_uncached_part_is_prefilled_locally() -> None:
    prefill, decode = _views()
    ids, hashes = _prompt(40)
    d = RoutingPolicy(block_size=BS, local_prefill_max_tokens=64).choose(hashes, len(ids), prefill, decode)
    assert d.prefill_worker is None and not d.wait_for_prefill


@pytest.mark.parametrize("how", ["excluded", "silent", "dead"])
def test_with_a_prefill_pool_a_long_prompt_waits_instead_of_running_on_a_decode_worker(how: str) -> None:
    prefill, decode = _views()
    exclude = frozenset()
    if how == "excluded":
        exclude = frozenset({"p0", "p1"})
    for w in prefill:
        if how == "silent":
            w.unresponsive_since = 1.0
        elif how == "dead":
            w.alive = False
    ids, hashes = _prompt(300)
    pooled = RoutingPolicy(block_size=BS, local_prefill_max_tokens=64, prefill_pool=True)
    d = pooled.choose(hashes, len(ids), prefill, decode, exclude)
    assert d.wait_for_prefill and d.prefill_worker is None
    # a prompt within the local budget still runs at once on the decode worker
    short_ids, short_hashes = _prompt(30)
    assert not pooled.choose(short_hashes, len(short_ids), prefill, decode, exclude).wait_for_prefill
    # without a prefill pool (prefill.min_replicas 0) the decode worker prefills everything
    alone = RoutingPolicy(block_size=BS, local_prefill_max_tokens=64)
    d = alone.choose(hashes, len(ids), prefill, decode, exclude)
    assert d.prefill_worker is None and not d.wait_for_prefill


def test_no_decode_worker_is_none() -> None:
    prefill, decode = _views()
    for w in decode:
        w.alive = False
    ids, hashes = _prompt(20)
    assert RoutingPolicy(block_size=BS, prefill_pool=True).choose(hashes, len(ids), prefill, decode) is None


def test_a_retry_prefers_the_prefill_worker_that_holds_its_kv() -> None:
    prefill, decode = _views()
    ids, hashes = _prompt(200)
    policy = RoutingPolicy(block_size=BS)
    assert policy.choose(hashes, len(ids), prefill, decode).prefill_worker == "p0"      # a tie: the first
    d = policy.choose(hashes, len(ids), prefill, decode, prefer_prefill="p1")
    assert d.prefill_worker == "p1" and "last attempt" in d.reason
    # not while it is excluded, silent or gone
    prefill[1].unresponsive_since = 1.0
    assert policy.choose(hashes, len(ids), prefill, decode, prefer_prefill="p1").prefill_worker == "p0"


def _burst(policy: RoutingPolicy, n: int, prompt_len: int) -> list[str | None]:
    """Route ``n`` prompts arriving together, counting each one where the router would (the
    queued tokens of the backend's bookkeeping), and return each one's prefill worker."""
    prefill = [WorkerView("p0", "prefill")]
    decode = [WorkerView("d0", "decode", num_blocks=100, num_free_blocks=100)]
    out = []
    for i in range(n):
        ids, hashes = _prompt(prompt_len)
        d = policy.choose(hashes, len(ids), prefill, decode)
        if d.prefill_worker is None:
            decode[0].local_prefill_tokens += len(ids)
        else:
            prefill[0].inflight_tokens += len(ids)
        out.append(d.prefill_worker)
    return out


def test_an_idle_decode_worker_takes_half_of_a_burst_the_prefill_worker_is_busy_with() -> None:
    routed = _burst(RoutingPolicy(block_size=BS, idle_local_prefill=True), 8, 128)
    assert routed[0] == "p0"                 # the first one: the prefill pool is idle
    assert routed.count(None) == 4 and routed.count("p0") == 4
    # Off (or in 'always' mode), every prompt goes through the prefill pool.
    assert _burst(RoutingPolicy(block_size=BS), 8, 128) == ["p0"] * 8


def test_an_idle_decode_worker_does_not_prefill_once_a_stream_decodes_there() -> None:
    policy = RoutingPolicy(block_size=BS, idle_local_prefill=True)
    prefill = [WorkerView("p0", "prefill", inflight_tokens=4096)]
    decode = [WorkerView("d0", "decode", num_blocks=100, num_free_blocks=100, decoding_requests=1)]
    ids, hashes = _prompt(1536)
    assert policy.choose(hashes, len(ids), prefill, decode).prefill_worker == "p0"
    decode[0].decoding_requests = 0
    assert policy.choose(hashes, len(ids), prefill, decode).prefill_worker is None


def test_measured_rates_decide_which_side_is_sooner() -> None:
    policy = RoutingPolicy(block_size=BS, idle_local_prefill=True)
    ids, hashes = _prompt(512)
    # The prefill worker prefills 4x faster: 512 queued there is sooner than 512 on the decode worker.
    prefill = [WorkerView("p0", "prefill", inflight_tokens=512, prefill_tokens_per_s=4000.0)]
    decode = [WorkerView("d0", "decode", num_blocks=100, num_free_blocks=100, prefill_tokens_per_s=1000.0)]
    assert policy.choose(hashes, len(ids), prefill, decode).prefill_worker == "p0"
    prefill[0].prefill_tokens_per_s = 1000.0
    assert policy.choose(hashes, len(ids), prefill, decode).prefill_worker is None


def test_kv_events_track_the_hashes_a_prefill_worker_holds() -> None:
    from pdserve.engine.kv_events import KVEvent, KVEventKind
    from pdserve.router.policy import apply_kv_events

    view = WorkerView("p0", "prefill")
    apply_kv_events(view, [KVEvent(KVEventKind.STORED, 11), KVEvent(KVEventKind.STORED, 12),
                           KVEvent(KVEventKind.REMOVED, 11)])
    assert view.cached_hashes == {12}

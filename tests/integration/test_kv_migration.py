"""Live KV migration on drain: a decode worker drained (as a scale-down does) while it decodes
long streams moves their KV blocks to the other decode worker over NIXL, and the streams go on
there with identical tokens, no gap, and nothing recomputed (``kv_migrations`` 1,
``migrations`` 0 in their phase records); the ledger names the new holder. When the other
worker has no room, the stream falls back to a recompute-migration (``migrations`` 1) and is
still token-identical. A real ``RouterService`` with Ray workers, the unmodified ``openai``
client over loopback HTTP."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray
from cluster_helpers import ClusterHarness, cluster_config, greedy, reference_engine, wait_until

pytestmark = pytest.mark.timeout(600)

PROMPTS = ["A drained decode worker hands its streams over:", "Nothing is recomputed when the KV moves,"]
GEN = 800


def stream(h: ClusterHarness, prompt: str, progress: list[int]) -> tuple[list[int], dict]:
    tokens: list[int] = []
    phase: dict = {}
    for chunk in h.openai(timeout_s=180).completions.create(model=h.model_name, prompt=prompt, max_tokens=GEN,
                                                            temperature=0, stream=True,
                                                            extra_body={"ignore_eos": True}):
        extra = (chunk.model_extra or {}).get("pdserve") or {}
        tokens.extend(extra.get("token_ids", []))
        phase = extra.get("phase") or phase
        progress[0] = len(tokens)
    return tokens, phase


@pytest.fixture(scope="module")
def cluster(tiny_model, ray_session, redis_server):
    """Two decode workers (each test drains one; the next adds one back); the references first."""
    config = cluster_config(tiny_model, **{"decode.initial_replicas": 2, "decode.max_replicas": 2,
                                           "decode.engine.kv_cache_memory_gb": 0.1})
    h = ClusterHarness(config, redis_server.url)
    h.begin_start()  # the workers load while the references are computed
    try:
        engine = reference_engine(config)
        tok = engine.stopper.tokenizer
        h.refs = {p: engine.generate([list(tok(p)["input_ids"])], greedy(GEN))[0] for p in PROMPTS}
        del engine
        h.wait_started()
        yield h
        h.assert_nothing_held()
    finally:
        h.stop()


def ledger_entries(h: ClusterHarness) -> list:
    """Every ledger entry of the run, the FREED ones (kept for operators) included."""
    ledger = h.service.ledger
    keys = ledger.client.scan_iter(match=f"{ledger.namespace}:ledger:req:*")
    return [ledger.get(k.decode().rsplit(":", 1)[1]) for k in keys]


def first_difference(tokens: list[int], ref: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(tokens, ref)) if a != b), None)


def test_draining_a_decode_worker_moves_its_streams_kv(cluster: ClusterHarness) -> None:
    h, refs = cluster, cluster.refs
    h.ensure_replicas("decode", 2)
    progress = [[0] for _ in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = [pool.submit(stream, h, p, prog) for p, prog in zip(PROMPTS, progress)]
        wait_until(lambda: all(p[0] >= 20 for p in progress), 60.0, "both streams under way")
        held = {m.worker_id: m.view.inflight_requests for m in h.members("decode")}
        victim = max(held, key=held.get)
        t0 = time.monotonic()
        assert h.call(h.service.manager.drain_and_remove(victim), timeout_s=120)
        drained_s = time.monotonic() - t0
        at_drain = [p[0] for p in progress]   # the victim is stopped by now
        results = [f.result(180) for f in futures]
    for prompt, (tokens, phase) in zip(PROMPTS, results):
        assert tokens == refs[prompt], \
            f"{prompt!r}: {len(tokens)} tokens, first difference at {first_difference(tokens, refs[prompt])}"
        assert phase["migrations"] == 0 and phase["attempts"] == 1, phase
        assert phase["decode_worker"] != victim
    moved = [phase["kv_migrations"] for _, phase in results]
    assert sum(moved) == held[victim] >= 1 and set(moved) <= {0, 1}, (moved, held)
    # the drain did not wait for the moved streams to end: they went on after the worker stopped
    assert all(p[0] == GEN for p in progress) and drained_s < 60.0
    assert any(n < GEN for n, k in zip(at_drain, moved) if k), (at_drain, moved)
    assert victim not in h.service.pool.members
    # the ledger recorded each move: the moved entries name the worker that held them last
    moved_entries = [e for e in ledger_entries(h) if e.kv_moves]
    assert len(moved_entries) == held[victim], ledger_entries(h)
    assert all(e.kv_moves == 1 and e.decode_worker_id != victim for e in moved_entries)
    h.assert_nothing_held()


def test_a_target_without_room_falls_back_to_recompute(cluster: ClusterHarness) -> None:
    """One stream decodes on one worker while every free block of the other is reserved (a real
    reservation on it, as a burst of handoffs would hold them) when the drain starts: the stream
    cannot move there by KV, so it is recomputed there once the reservation is gone, with the
    same tokens."""
    h, refs = cluster, cluster.refs
    block = h.config.decode.engine.block_size
    prompt = PROMPTS[0]
    h.ensure_replicas("decode", 2)
    progress = [0]
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(stream, h, prompt, progress)
        wait_until(lambda: progress[0] >= 20, 60.0, "the stream under way")
        victim = next(m.worker_id for m in h.members("decode") if m.view.inflight_requests)
        target = h.service.pool.actor(next(m.worker_id for m in h.members("decode") if m.worker_id != victim))
        free = ray.get(target.stats.remote()).num_free_blocks
        for blocks in range(free, 0, -1):  # all it will give (it may keep a few back)
            try:
                ray.get(target.reserve.remote("hog", blocks * block, timeout_s=60.0))
                break
            except Exception:  # noqa: BLE001 - OutOfBlocksError: ask for one block less
                continue
        assert ray.get(target.stats.remote()).num_free_blocks < 2  # no room for the stream's KV
        try:
            assert h.call(h.service.manager.drain_and_remove(victim), timeout_s=120)
        finally:
            # no sender will ever write into it: its blocks are free at once
            assert ray.get(target.abort.remote("hog", sender_dead=True))
        tokens, phase = future.result(180)
    assert tokens == refs[prompt], f"{len(tokens)} tokens, first difference at {first_difference(tokens, refs[prompt])}"
    assert (phase["kv_migrations"], phase["migrations"]) == (0, 1), phase
    assert phase["decode_worker"] != victim
    h.assert_nothing_held()

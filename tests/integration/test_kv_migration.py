"""Live KV migration on drain: a decode worker drained (as a scale-down does) while it decodes
long streams moves their KV blocks to the other decode worker over NIXL, and the streams go on
there with identical tokens, no gap, and nothing recomputed (``kv_migrations`` 1,
``migrations`` 0 in their phase records). A real ``RouterService`` with Ray workers, the
unmodified ``openai`` client over loopback HTTP."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from cluster_helpers import ClusterHarness, cluster_config, greedy, reference_engine, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

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


def test_draining_a_decode_worker_moves_its_streams_kv(tiny_model, ray_session, redis_server) -> None:
    config = cluster_config(tiny_model, **{"decode.initial_replicas": 2, "decode.max_replicas": 2,
                                           "decode.engine.kv_cache_memory_gb": 0.1})
    engine = reference_engine(config)
    tok = engine.stopper.tokenizer
    refs = {p: engine.generate([list(tok(p)["input_ids"])], greedy(GEN))[0] for p in PROMPTS}
    del engine
    h = ClusterHarness(config, redis_server.url)
    h.start()
    try:
        h.wait_routable("decode", 2, 60.0)
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
            assert tokens == refs[prompt], f"{prompt!r}: {len(tokens)} tokens, first difference at " \
                f"{next((i for i, (a, b) in enumerate(zip(tokens, refs[prompt])) if a != b), None)}"
            assert phase["migrations"] == 0 and phase["attempts"] == 1, phase
            assert phase["decode_worker"] != victim
        moved = [phase["kv_migrations"] for _, phase in results]
        assert sum(moved) == held[victim] >= 1 and set(moved) <= {0, 1}, (moved, held)
        # the drain did not wait for the moved streams to end: they went on after the worker stopped
        assert all(p[0] == GEN for p in progress) and drained_s < 60.0
        assert any(n < GEN for n, k in zip(at_drain, moved) if k), (at_drain, moved)
        assert victim not in h.service.pool.members
        h.assert_nothing_held()
    finally:
        h.stop()

"""A pool whose ``max_replicas`` is not set grows while Ray has room, and no further.

The session's Ray advertises 8 CPUs (fewer may be free when this module starts). The prefill
worker takes 1 and each decode replica ``c``, chosen so that Ray has room for exactly one more
decode replica after the first (3 of 8 free CPUs: 1 + 3 + 3, one left). Under rounds of streams the
planner adds that replica (no ``max_replicas`` in the config), then holds at two: its reason names
the CPUs that a third would need. Every stream is checked against the engine alone.
"""

from __future__ import annotations

import threading

import pytest

from cluster_helpers import cluster_config, greedy, reference_engine, running_cluster, wait_until

from pdserve.engine.contract import WorkerRole

pytestmark = pytest.mark.timeout(360)

GEN = 192
PROMPTS = [f"Stream {i} keeps the decode pool busy with a long answer about" for i in range(8)]
START_S = 180.0

AUTO = {
    "planner.enabled": True, "planner.interval_s": 1.0, "planner.warmup_s": 0.0,
    "planner.scale_up_cooldown_s": 1.0, "planner.scale_down_cooldown_s": 600.0,
    "decode.min_replicas": 1, "decode.initial_replicas": 1,
    "decode.engine.max_num_seqs": 2,
    "prefill.min_replicas": 1, "prefill.initial_replicas": 1, "prefill.max_replicas": 1, "prefill.num_cpus": 1,
}


@pytest.fixture(scope="module")
def cluster(tiny_model, ray_session, redis_server):
    free = ray_cpus_free()
    assert free >= 5, f"the session's Ray has {free} CPUs free; this test needs 5"
    cpus = int((free - 1) // 2)              # room for exactly one more after prefill + one decode
    assert cpus <= free - 1 - cpus < 2 * cpus
    config = cluster_config(tiny_model, **AUTO, **{"decode.num_cpus": cpus})
    assert config.decode.max_replicas is None   # the default under test
    engine = reference_engine(config)
    tok = engine.stopper.tokenizer
    ids = [list(tok(p)["input_ids"]) for p in PROMPTS]
    ref = dict(zip(PROMPTS, engine.generate(ids, greedy(GEN))))
    del engine
    with running_cluster(config, redis_server.url) as h:
        h.ref, h.decode_cpus, h.free_before = ref, cpus, free
        yield h


def test_decode_pool_grows_into_rays_room_and_holds_when_it_is_used(cluster) -> None:
    h = cluster
    svc = h.service
    c = h.decode_cpus
    assert ray_cpus_free() == h.free_before - 1 - c
    (state,) = [p for p in svc.manager.pool_states() if str(p.role) == "decode"]
    assert state.max_replicas == 2, state       # one running, room for one more
    results: dict[str, list[int]] = {}
    errors: list[str] = []

    def stream(prompt: str) -> None:
        client = h.openai(timeout_s=120.0)
        tokens: list[int] = []
        try:
            for chunk in client.completions.create(model=h.model_name, prompt=prompt, max_tokens=GEN, temperature=0,
                                                   stream=True, extra_body={"ignore_eos": True}):
                tokens.extend(((chunk.model_extra or {}).get("pdserve") or {}).get("token_ids", []))
        except Exception as exc:  # recorded: the test fails on it
            errors.append(f"{type(exc).__name__}: {exc}")
        results[prompt] = tokens

    rounds = 0
    # Streams round after round until the planner has grown the pool and then held it.
    while rounds < 6:
        threads = [threading.Thread(target=stream, args=(p,), daemon=True) for p in PROMPTS]
        for t in threads:
            t.start()
        for t in threads:
            t.join(150.0)
        assert not errors, errors[:3]
        assert all(results[p] == h.ref[p] for p in PROMPTS), "a stream differs from the engine alone"
        rounds += 1
        if len(svc.manager.pools["decode"].handles) == 2 and held_at_two(svc):
            break
    wait_until(lambda: len(svc.manager.pools["decode"].handles) == 2, START_S, "a second decode replica")
    assert svc.manager.planner.last_scale_up_at.get(WorkerRole.DECODE) is not None
    (state,) = [p for p in svc.manager.pool_states() if str(p.role) == "decode"]
    left = h.free_before - 1 - 2 * c
    assert state.max_replicas == 2, state       # two running; what is left fits no third
    import ray

    total = ray.cluster_resources()["CPU"]
    assert f"another decode replica needs {c:g} CPU ({left:g} of {total:g} free)" in state.headroom, state.headroom
    assert ray_cpus_free() == left


def ray_cpus_free() -> float:
    import ray

    return float(ray.available_resources().get("CPU", 0.0))


def held_at_two(svc) -> bool:
    return any(str(d.role) == "decode" and "at max_replicas 2" in d.reason for d in svc.manager.decisions)

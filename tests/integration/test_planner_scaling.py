"""The planner scaling a real cluster: a ``RouterService`` (Ray actors, NIXL, ledger in Redis)
with the planner on, ticking every second with short cooldowns and no warm-up.

The decode pool runs between one and two replicas of at most four sequences each, so a burst
of eight concurrent streams puts it well above its target: a second replica is added; a decode
worker killed in the middle of that burst has its streams migrated to the survivor and the
planner adds a replica again; once the load is light, one replica is drained (it finishes what
it holds first) and removed. The prefill pool is fixed at one: its worker killed mid-prefill is
replaced by the pool manager while the request is retried. Every request of every phase is
checked token for token against the engine alone, so none is lost, cut or duplicated.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import pytest

from cluster_helpers import ClusterHarness, cluster_config, greedy, reference_engine, wait_until

from pdserve.engine.contract import WorkerRole

pytestmark = pytest.mark.timeout(420)

GEN = 64
# Burst requests run ~4x longer than the light-load ones.
BURST_GEN = 256
# The stream whose decode worker the test kills: long enough to be mid-stream at the kill.
MIGRATED_PROMPT = "The stream that outlives its decode worker keeps telling the story of"
MIGRATED_GEN = 768
PROMPTS = [f"Request {i} of the burst asks the decode pool for a long answer about" for i in range(4)]
# Long enough that its chunked prefill (64 tokens a step) lasts while the test kills the worker.
LONG_PROMPT = "Twelve cooks read the whole ticket at once, then each one starts a different dish. " * 60
LONG_GEN = 8
START_S = 180.0  # a new worker process loads the model: generous on 2 shared cores

PLANNER = {
    "planner.enabled": True, "planner.interval_s": 1.0, "planner.warmup_s": 0.0,
    "planner.scale_up_cooldown_s": 1.0, "planner.scale_down_cooldown_s": 2.0,
    "planner.scale_down_stable_s": 3.0,
    "decode.min_replicas": 1, "decode.initial_replicas": 1, "decode.max_replicas": 2,
    "decode.engine.max_num_seqs": 4,
    "prefill.min_replicas": 1, "prefill.initial_replicas": 1, "prefill.max_replicas": 1,
}


@dataclass(slots=True)
class Outcome:
    prompt: str
    tokens: list[int]
    phase: dict
    error: str | None = None


class Load:
    """``n`` client threads, each streaming greedy completions back to back until stopped."""

    def __init__(self, h: ClusterHarness, n: int, prompts: list[str], max_tokens: int, *,
                 repeat: bool = True) -> None:
        """``repeat=False``: each thread sends one request only."""
        self.h, self.prompts, self.max_tokens, self.repeat = h, prompts, max_tokens, repeat
        self.current_rid = ""  # the id of the latest request whose first chunk arrived
        self.outcomes: list[Outcome] = []
        self.started = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(n)]

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self, timeout_s: float = 120.0) -> None:
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.1, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in self._threads), "a client thread did not finish in time"

    def served_by(self, worker_id: str) -> int:
        with self._lock:
            return sum(o.phase.get("decode_worker") == worker_id for o in self.outcomes)

    def _run(self, i: int) -> None:
        client = self.h.openai(timeout_s=120.0)
        k = i
        while not self._stop.is_set():
            prompt = self.prompts[k % len(self.prompts)]
            k += 1
            with self._lock:
                self.started += 1
            tokens: list[int] = []
            phase: dict = {}
            error = None
            try:
                stream = client.completions.create(model=self.h.model_name, prompt=prompt, max_tokens=self.max_tokens,
                                                   temperature=0, stream=True, extra_body={"ignore_eos": True})
                for chunk in stream:
                    self.current_rid = chunk.id
                    ext = (chunk.model_extra or {}).get("pdserve") or {}
                    tokens.extend(ext.get("token_ids", []))
                    phase = ext.get("phase") or phase
            except Exception as exc:  # recorded, and the test fails on it
                error = f"{type(exc).__name__}: {exc}"
            with self._lock:
                self.outcomes.append(Outcome(prompt, tokens, phase, error))
            if not self.repeat:
                return

    def check(self, ref: dict[str, list[int]]) -> None:
        """Every request that started finished, with exactly the engine's tokens."""
        assert len(self.outcomes) == self.started
        errors = [o.error for o in self.outcomes if o.error]
        assert not errors, errors[:3]
        wrong = [(o.prompt[:30], o.phase) for o in self.outcomes if o.tokens != ref[o.prompt][:self.max_tokens]]
        assert not wrong, f"{len(wrong)} of {len(self.outcomes)} requests differ from the engine: {wrong[:2]}"


@pytest.fixture(scope="module")
def cluster(tiny_model, ray_session, redis_server):
    config = cluster_config(tiny_model, **PLANNER)
    engine = reference_engine(config)
    tok = engine.stopper.tokenizer
    ids = [list(tok(p)["input_ids"]) for p in PROMPTS]
    ref = dict(zip(PROMPTS, engine.generate(ids, greedy(BURST_GEN))))  # GEN requests: its prefix
    long_ids = list(tok(LONG_PROMPT)["input_ids"])
    assert len(long_ids) > 900
    ref[LONG_PROMPT] = engine.generate([long_ids], greedy(LONG_GEN))[0]
    ref[MIGRATED_PROMPT] = engine.generate([list(tok(MIGRATED_PROMPT)["input_ids"])], greedy(MIGRATED_GEN))[0]
    del engine
    h = ClusterHarness(config, redis_server.url)
    try:
        h.start()
        h.ref = ref
        yield h
    finally:
        h.stop()


def handles(h: ClusterHarness, role: str) -> set[str]:
    return set(h.service.manager.pools[role].handles)


def holder_of(h: ClusterHarness, load: Load, timeout_s: float):
    """The decode worker streaming ``load``'s single request, once its first tokens arrived."""
    found = []

    def streaming() -> bool:
        rid = load.current_rid
        server_id = h.service.serving.server_id(rid) if rid else None  # the router's own id
        workers = h.service.backend.placement(server_id) if server_id else None
        member = h.service.pool.members.get(workers[0]) if workers else None
        found[:] = [member] if member is not None and member.view.alive else []
        return bool(found)

    wait_until(streaming, timeout_s, "the long stream's decode worker", 0.01)
    return found[0]


def test_decode_pool_scales_up_under_load_survives_a_kill_and_drains_when_quiet(cluster: ClusterHarness) -> None:
    h = cluster
    (first,) = handles(h, "decode")
    svc = h.service
    with Load(h, 8, PROMPTS, BURST_GEN) as burst:
        # 8 streams on one replica of max_num_seqs 4: utilisation ~2 -> the planner adds one.
        wait_until(lambda: len(handles(h, "decode")) == 2, START_S, "a second decode replica")
        (second,) = handles(h, "decode") - {first}
        assert svc.manager.planner.last_scale_up_at.get(WorkerRole.DECODE) is not None
        wait_until(lambda: burst.served_by(second) > 0, 60.0, "the new replica serving requests")

        # Kill the replica streaming a long request (and whatever else it holds): its streams
        # move to the other one. (Choosing by load alone raced with streams ending: a worker
        # whose streams had all finished, their last tokens still queued in the router, died
        # with nothing left to migrate.)
        before = svc.backend.migrations + svc.backend.retries
        with Load(h, 1, [MIGRATED_PROMPT], MIGRATED_GEN, repeat=False) as migrated:
            victim = holder_of(h, migrated, timeout_s=60.0)
            h.kill(victim)
            migrated.stop()
        migrated.check(h.ref)
        (outcome,) = migrated.outcomes
        assert outcome.phase["migrations"] >= 1 and outcome.phase["decode_worker"] != victim.worker_id, outcome.phase
        wait_until(lambda: victim.worker_id not in handles(h, "decode"), 30.0, "the dead worker forgotten")
        # Still overloaded on one replica: the planner brings the pool back to two.
        wait_until(lambda: len(handles(h, "decode")) == 2, START_S, "the pool back at two replicas")
        assert victim.worker_id not in handles(h, "decode")
        assert svc.backend.migrations + svc.backend.retries > before
    burst.check(h.ref)
    assert len(burst.outcomes) >= 8

    # Light load (two streams, ~25% utilisation): one replica is drained and removed; the
    # streams it held finish first.
    with Load(h, 2, PROMPTS, GEN) as light:
        wait_until(lambda: len(handles(h, "decode")) == 1, 90.0, "the decode pool drained back to one")
        assert not svc.manager.pools["decode"].draining
        done = len(light.outcomes)
        wait_until(lambda: len(light.outcomes) >= done + 2, 60.0, "requests served after the drain")
    light.check(h.ref)
    assert len(h.members("decode")) == 1 and len(svc.pool.members) == 2  # the removed ones are gone
    h.assert_nothing_held()


def test_killed_prefill_worker_is_replaced_and_its_request_retried(cluster: ClusterHarness) -> None:
    h = cluster
    (old,) = handles(h, "prefill")
    retries = h.service.backend.retries
    with Load(h, 1, [LONG_PROMPT], LONG_GEN) as load:
        victim = h.wait_busy("prefill", timeout_s=30.0, poll_s=0.001)
        assert victim.worker_id == old
        h.kill(victim)
        # The pool fell below its minimum of one: the pool manager starts a replacement.
        wait_until(lambda: len(handles(h, "prefill")) == 1 and old not in handles(h, "prefill"), START_S,
                   "a replacement prefill worker")
        (new,) = handles(h, "prefill")
        h.wait_routable("prefill", 1, 30.0)
        wait_until(lambda: any(o.phase.get("prefill_worker") == new for o in list(load.outcomes)), 60.0,
                   "a request prefilled on the replacement")
    load.check(h.ref)
    assert h.service.backend.retries > retries
    retried = [o.phase for o in load.outcomes if o.phase.get("attempts", 1) > 1]
    assert retried and all(old not in (p["prefill_worker"], p["decode_worker"]) for p in retried), retried
    h.assert_nothing_held()

"""The planner's pure decisions: signals, hysteresis, cooldowns, clamps, warm-up, drain choice."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.engine.contract import WorkerRole
from pdserve.capacity.planner import (Planner, PlannerPolicy, PoolState, ScaleAction,
                                     WorkerMetrics, decide_pool, pick_drain_target)

NOW = 10_000.0
POLICY = PlannerPolicy(ttft_slo_ms=1000.0, itl_slo_ms=100.0, scale_up_utilization=0.8,
                       scale_down_utilization=0.4, scale_up_cooldown_s=30.0,
                       scale_down_cooldown_s=120.0, warmup_s=20.0, max_step=2)


def make_worker(worker_id: str, role: WorkerRole = WorkerRole.DECODE, *, age_s: float = 600.0, warm: bool = True,
                **load: float) -> WorkerMetrics:
    return WorkerMetrics(worker_id=worker_id, role=role, warm=warm, started_at=NOW - age_s, **load)


def make_pool(role: WorkerRole = WorkerRole.DECODE, replicas: int = 2, lo: int = 1, hi: int = 8, **kw: object) -> PoolState:
    return PoolState(role=role, replicas=replicas, min_replicas=lo, max_replicas=hi, max_num_seqs=10, **kw)


def prefill(worker_id: str, **kw: float) -> WorkerMetrics:
    return make_worker(worker_id, WorkerRole.PREFILL, **kw)


# (name, pool, workers, expected action, expected target)
CASES = [
    ("prefill TTFT breach scales up",
     make_pool(WorkerRole.PREFILL, 2), [prefill("p0", predicted_ttft_ms=1200), prefill("p1", predicted_ttft_ms=1000)],
     ScaleAction.SCALE_UP, 3),  # mean ratio 1.1 x 2 warm = 2.2 replicas at target; ceil(2.2 / 0.8) = 3
    ("prefill TTFT predicted from queue and throughput",
     make_pool(WorkerRole.PREFILL, 1), [prefill("p0", queued_prompt_tokens=9000, prefill_tokens_per_s=10000)],
     ScaleAction.SCALE_UP, 2),
    ("prefill idle queue predicts zero even without throughput",
     make_pool(WorkerRole.PREFILL, 2), [prefill("p0"), prefill("p1")],
     ScaleAction.SCALE_DOWN, 1),
    ("prefill with an empty queue but busy all the time is not idle",
     make_pool(WorkerRole.PREFILL, 2), [prefill("p0", prefill_busy=0.9), prefill("p1", prefill_busy=0.95)],
     ScaleAction.SCALE_UP, 3),   # busy 0.925 x 2 = 1.85 replicas at target; ceil(1.85 / 0.8) = 3
    ("prefill half busy with an empty queue holds",
     make_pool(WorkerRole.PREFILL, 2), [prefill("p0", prefill_busy=0.5), prefill("p1", prefill_busy=0.5)],
     ScaleAction.HOLD, 2),
    ("prefill queue without measured throughput gives no signal",
     make_pool(WorkerRole.PREFILL, 1), [prefill("p0", queued_prompt_tokens=500)],
     ScaleAction.HOLD, 1),
    ("decode KV pressure scales up",
     make_pool(WorkerRole.DECODE, 2), [make_worker("d0", kv_usage=0.95), make_worker("d1", kv_usage=0.85)],
     ScaleAction.SCALE_UP, 3),
    ("decode sequences over capacity scale up",
     make_pool(WorkerRole.DECODE, 1), [make_worker("d0", running_seqs=10, waiting_seqs=5)],
     ScaleAction.SCALE_UP, 2),
    ("decode ITL breach scales up",
     make_pool(WorkerRole.DECODE, 1), [make_worker("d0", itl_ms=150, running_seqs=2)],
     ScaleAction.SCALE_UP, 2),
    ("inside the hysteresis band holds",
     make_pool(WorkerRole.DECODE, 2), [make_worker("d0", kv_usage=0.6), make_worker("d1", kv_usage=0.7)],
     ScaleAction.HOLD, 2),
    ("just under the scale-up threshold holds",
     make_pool(WorkerRole.DECODE, 2), [make_worker("d0", kv_usage=0.8), make_worker("d1", kv_usage=0.8)],
     ScaleAction.HOLD, 2),
    ("low load scales down by one",
     make_pool(WorkerRole.DECODE, 3), [make_worker(f"d{i}", kv_usage=0.1) for i in range(3)],
     ScaleAction.SCALE_DOWN, 2),
    ("low load scales down when one fewer stays under the scale-up threshold",
     make_pool(WorkerRole.DECODE, 2), [make_worker("d0", kv_usage=0.39), make_worker("d1", kv_usage=0.39)],
     ScaleAction.SCALE_DOWN, 1),  # 0.78 on one replica <= 0.8
    ("at max_replicas holds",
     make_pool(WorkerRole.DECODE, 2, hi=2), [make_worker("d0", kv_usage=0.99), make_worker("d1", kv_usage=0.99)],
     ScaleAction.HOLD, 2),
    ("max_step caps a big jump",
     make_pool(WorkerRole.DECODE, 1, hi=10), [make_worker("d0", itl_ms=800, running_seqs=5)],
     ScaleAction.SCALE_UP, 3),
    ("max_replicas caps the jump",
     make_pool(WorkerRole.DECODE, 2, hi=3), [make_worker("d0", itl_ms=300), make_worker("d1", itl_ms=300)],
     ScaleAction.SCALE_UP, 3),
    ("below min_replicas repairs at once",
     make_pool(WorkerRole.DECODE, 0, lo=2), [],
     ScaleAction.SCALE_UP, 2),
    ("above max_replicas drains one",
     make_pool(WorkerRole.DECODE, 4, hi=2), [make_worker(f"d{i}", kv_usage=0.9) for i in range(4)],
     ScaleAction.SCALE_DOWN, 3),
    ("never below min_replicas",
     make_pool(WorkerRole.DECODE, 1, lo=1), [make_worker("d0")],
     ScaleAction.HOLD, 1),
    ("prefill pool may scale to zero when idle",
     make_pool(WorkerRole.PREFILL, 1, lo=0), [prefill("p0")],
     ScaleAction.SCALE_DOWN, 0),
    ("empty metrics hold",
     make_pool(WorkerRole.DECODE, 2), [],
     ScaleAction.HOLD, 2),
    ("other roles' metrics are ignored",
     make_pool(WorkerRole.DECODE, 2), [prefill("p0", predicted_ttft_ms=99_000)],
     ScaleAction.HOLD, 2),
    ("warming workers are not signals",
     make_pool(WorkerRole.DECODE, 1), [make_worker("d0", warm=False, kv_usage=1.0)],
     ScaleAction.HOLD, 1),
    ("workers younger than warmup_s are not signals",
     make_pool(WorkerRole.DECODE, 1), [make_worker("d0", age_s=5, kv_usage=1.0)],
     ScaleAction.HOLD, 1),
    ("warming workers count as capacity",
     make_pool(WorkerRole.DECODE, 2), [make_worker("d0", kv_usage=1.0), make_worker("d1", warm=False)],
     ScaleAction.HOLD, 2),
    ("pending replicas count as capacity",
     make_pool(WorkerRole.DECODE, 1, pending=1), [make_worker("d0", kv_usage=1.0)],
     ScaleAction.HOLD, 2),
    ("no scale-down while a drain is in progress",
     make_pool(WorkerRole.DECODE, 3), [make_worker("d0", kv_usage=0.1), make_worker("d1", kv_usage=0.1),
                                 make_worker("d2", kv_usage=0.1), make_worker("d3", draining=True)],
     ScaleAction.HOLD, 3),
    ("scale-up still allowed while a drain is in progress",
     make_pool(WorkerRole.DECODE, 1), [make_worker("d0", kv_usage=0.95), make_worker("d1", draining=True)],
     ScaleAction.SCALE_UP, 2),
    ("no scale-down while replicas are pending",
     make_pool(WorkerRole.DECODE, 3, pending=1), [make_worker(f"d{i}") for i in range(3)],
     ScaleAction.HOLD, 4),
]

@pytest.mark.parametrize(("name", "pool", "workers", "action", "target"), CASES, ids=[c[0] for c in CASES])
def test_decide_pool(name: str, pool: PoolState, workers: list[WorkerMetrics], action: ScaleAction,
                     target: int) -> None:
    decision = decide_pool(NOW, pool, workers, POLICY)
    assert (decision.action, decision.target_replicas) == (action, target), decision.reason
    assert decision.role is pool.role
    assert decision.current_replicas == pool.replicas + pool.pending
    assert decision.reason
    if action is ScaleAction.SCALE_DOWN:
        assert decision.target_replicas == decision.current_replicas - 1
    else:
        assert decision.drain_worker_id is None


def test_one_fewer_replica_that_would_rebreach_holds() -> None:
    # Utilisation 0.3 is below both policies' scale-down threshold; on one replica it becomes 0.6,
    # over a 0.5 scale-up threshold (would flap) but under 0.8 (safe).
    tight = dataclasses.replace(POLICY, scale_up_utilization=0.5, scale_down_utilization=0.35)
    pool = make_pool(WorkerRole.DECODE, 2)
    workers = [make_worker("d0", kv_usage=0.3), make_worker("d1", kv_usage=0.3)]
    held = decide_pool(NOW, pool, workers, tight)
    assert held.action is ScaleAction.HOLD
    assert "one replica fewer" in held.reason
    assert decide_pool(NOW, pool, workers, POLICY).action is ScaleAction.SCALE_DOWN


def test_drain_target_is_least_loaded_warm_worker() -> None:
    workers = [
        make_worker("busy", running_seqs=5, kv_usage=0.2),
        make_worker("idle-but-warming", warm=False),
        make_worker("light", running_seqs=1, kv_usage=0.05),
        make_worker("lighter-kv", running_seqs=1, kv_usage=0.01),
        make_worker("draining", draining=True),
    ]
    assert pick_drain_target(workers, NOW, POLICY.warmup_s) == "lighter-kv"
    not_draining = [w for w in workers if not w.draining]
    decision = decide_pool(NOW, make_pool(WorkerRole.DECODE, 4), not_draining, POLICY)
    assert decision.action is ScaleAction.SCALE_DOWN
    assert decision.drain_worker_id == "lighter-kv"


def test_prefill_drain_target_uses_queued_tokens_and_ties_break_by_id() -> None:
    workers = [prefill("p2", queued_prompt_tokens=10), prefill("p1"), prefill("p0", queued_prompt_tokens=3)]
    assert pick_drain_target(workers, NOW, POLICY.warmup_s) == "p1"
    assert pick_drain_target([prefill("b"), prefill("a")], NOW, POLICY.warmup_s) == "a"
    assert pick_drain_target([prefill("w", warm=False)], NOW, POLICY.warmup_s) is None


def test_scale_up_cooldown_respected_then_released() -> None:
    planner = Planner(POLICY)
    pool = make_pool(WorkerRole.DECODE, 1, hi=8)
    hot = [make_worker("d0", kv_usage=0.95)]
    first = planner.decide(NOW, [pool], hot)[0]
    assert first.action is ScaleAction.SCALE_UP
    # The new replica came up but the signal is still hot: cooldown holds it.
    pool = make_pool(WorkerRole.DECODE, 2, hi=8)
    hot = [make_worker("d0", kv_usage=0.95), make_worker("d1", kv_usage=0.95)]
    during = planner.decide(NOW + POLICY.scale_up_cooldown_s - 1, [pool], hot)[0]
    assert during.action is ScaleAction.HOLD
    assert "cooldown" in during.reason
    after = planner.decide(NOW + POLICY.scale_up_cooldown_s, [pool], hot)[0]
    assert after.action is ScaleAction.SCALE_UP


def test_scale_down_waits_for_cooldown_after_any_action() -> None:
    planner = Planner(POLICY)
    idle = [make_worker(f"d{i}") for i in range(3)]
    pool = make_pool(WorkerRole.DECODE, 3)
    planner.last_scale_up_at[WorkerRole.DECODE] = NOW - 10
    held = planner.decide(NOW, [pool], idle)[0]
    assert held.action is ScaleAction.HOLD and "scale-down cooldown" in held.reason
    down = planner.decide(NOW - 10 + POLICY.scale_down_cooldown_s, [pool], idle)[0]
    assert down.action is ScaleAction.SCALE_DOWN
    # Right after a scale-down, the next one waits again (one drain at a time, then cooldown).
    pool = make_pool(WorkerRole.DECODE, 2)
    again = planner.decide(NOW - 10 + POLICY.scale_down_cooldown_s + 1, [pool], idle[:2])[0]
    assert again.action is ScaleAction.HOLD


def test_a_recent_scale_up_passed_in_counts_as_cooldown() -> None:
    pool = make_pool(WorkerRole.DECODE, 1)
    decision = decide_pool(NOW, pool, [make_worker("d0", kv_usage=0.99)], POLICY, last_scale_up_at=NOW - 1)
    assert decision.action is ScaleAction.HOLD and "cooldown" in decision.reason


def test_no_flapping_over_a_load_sweep() -> None:
    """Load oscillating inside the band never changes the replica count."""
    planner = Planner(dataclasses.replace(POLICY, scale_up_cooldown_s=0, scale_down_cooldown_s=0))
    pool = make_pool(WorkerRole.DECODE, 2)
    for step, kv in enumerate([0.45, 0.79, 0.5, 0.7, 0.41, 0.8, 0.6] * 3):
        workers = [make_worker("d0", kv_usage=kv), make_worker("d1", kv_usage=kv)]
        decision = planner.decide(NOW + step, [pool], workers)[0]
        assert decision.action is ScaleAction.HOLD, (kv, decision.reason)


def test_planner_decides_each_pool_and_keeps_times_per_role() -> None:
    planner = Planner(POLICY)
    pools = [make_pool(WorkerRole.PREFILL, 1), make_pool(WorkerRole.DECODE, 2)]
    metrics = [prefill("p0", predicted_ttft_ms=5000), make_worker("d0", kv_usage=0.5),
               make_worker("d1", kv_usage=0.5)]
    decisions = planner.decide(NOW, pools, metrics)
    assert [(d.role, d.action) for d in decisions] == [(WorkerRole.PREFILL, ScaleAction.SCALE_UP),
                                                       (WorkerRole.DECODE, ScaleAction.HOLD)]
    assert planner.last_scale_up_at == {WorkerRole.PREFILL: NOW}
    assert planner.last_scale_down_at == {}
    assert planner.decide(NOW, [], metrics) == []


def test_string_roles_are_accepted() -> None:
    worker = WorkerMetrics(worker_id="d0", role="decode", warm=True, started_at=0.0)  # type: ignore[arg-type]
    assert worker.role is WorkerRole.DECODE
    assert PoolState(role="prefill", replicas=1, min_replicas=0, max_replicas=1).role is WorkerRole.PREFILL  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [
    lambda: make_worker("d0", kv_usage=1.5),
    lambda: make_worker("d0", running_seqs=-1),
    lambda: make_pool(lo=3, hi=2),
    lambda: make_pool(replicas=-1),
    lambda: WorkerMetrics(worker_id="x", role="mixed", warm=True, started_at=0.0),  # type: ignore[arg-type]
    lambda: PlannerPolicy(scale_up_utilization=0.5, scale_down_utilization=0.5),
    lambda: PlannerPolicy(max_step=0),
    lambda: PlannerPolicy(ttft_slo_ms=0),
])
def test_invalid_inputs_raise_value_error(bad) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError):
        bad()


def test_scale_down_needs_utilisation_low_on_every_decision_for_the_stable_window() -> None:
    policy = dataclasses.replace(POLICY, scale_down_cooldown_s=0.0, scale_down_stable_s=30.0)
    planner = Planner(policy)
    pool = make_pool(WorkerRole.DECODE, 3)
    idle = [make_worker(f"d{i}") for i in range(3)]
    busy = [make_worker(f"d{i}", running_seqs=6) for i in range(3)]  # 60% of max_num_seqs: in band

    def action(t: float, workers: list[WorkerMetrics]) -> ScaleAction:
        return planner.decide(t, [pool], workers)[0].action

    first = planner.decide(NOW, [pool], idle)[0]
    assert first.action is ScaleAction.HOLD and "low for 0 s of the 30 s" in first.reason
    assert action(NOW + 20, idle) is ScaleAction.HOLD
    assert action(NOW + 25, busy) is ScaleAction.HOLD        # load came back: the quiet spell restarts
    assert action(NOW + 40, idle) is ScaleAction.HOLD
    assert action(NOW + 69, idle) is ScaleAction.HOLD        # low for 29 s
    assert action(NOW + 70, idle) is ScaleAction.SCALE_DOWN  # low for 30 s
    pool = make_pool(WorkerRole.DECODE, 2)
    assert action(NOW + 71, idle[:2]) is ScaleAction.HOLD    # the next drain needs a new quiet spell
    assert action(NOW + 101, idle[:2]) is ScaleAction.SCALE_DOWN


def test_above_max_replicas_is_repaired_without_waiting_for_a_quiet_spell() -> None:
    planner = Planner(dataclasses.replace(POLICY, scale_down_stable_s=3600.0))
    pool = make_pool(WorkerRole.DECODE, 3, hi=2)
    busy = [make_worker(f"d{i}", running_seqs=6) for i in range(3)]
    assert planner.decide(NOW, [pool], busy)[0].action is ScaleAction.SCALE_DOWN


def test_at_max_replicas_the_reason_says_which_resource_is_missing() -> None:
    from pdserve.cluster.control.pool_manager import headroom, replica_needs

    full = headroom("decode", replica_needs(1.0, 0.0, {}), {"CPU": 0.0}, {"CPU": 2.0})
    assert full == ("another decode replica needs 1 CPU (0 of 2 free): add a node (or free those resources) "
                    "before raising max_replicas")
    auto = headroom("decode", replica_needs(1.0, 0.0, {}), {"CPU": 0.0}, {"CPU": 2.0}, auto=True)
    assert auto == "another decode replica needs 1 CPU (0 of 2 free): add a node (or free those resources)"
    gpu = headroom("prefill", replica_needs(4.0, 1.0, {"prefill": 1.0}), {"CPU": 12.0, "prefill": 1.0},
                   {"CPU": 16.0, "prefill": 1.0})
    assert "1 GPU (0 of 0 free)" in gpu and "CPU" not in gpu.split(":")[0]
    room = headroom("decode", replica_needs(2.0, 0.0, {}), {"CPU": 6.0}, {"CPU": 8.0})
    assert room == "Ray has room for 3 more decode replicas: raise decode.max_replicas"
    assert headroom("decode", replica_needs(1.0, 0.0, {}), {}, {}) == ""       # Ray not reachable: nothing said
    pool = make_pool(WorkerRole.DECODE, 2, hi=2, headroom=full)
    workers = [make_worker("d0", kv_usage=0.99), make_worker("d1", kv_usage=0.99)]
    decision = decide_pool(NOW, pool, workers, POLICY)
    assert decision.action is ScaleAction.HOLD
    assert decision.reason.endswith(f"at max_replicas 2 ({full})")


def test_an_unset_max_replicas_is_what_ray_has_room_for() -> None:
    """max_replicas unset: a pool may grow while Ray's free resources hold one more replica (every
    resource it needs), never below what it started with, and not at all when Ray cannot say."""
    from pdserve.cluster.control.pool_manager import auto_max_replicas, fits, replica_needs

    one_cpu = replica_needs(1.0, 0.0, {})
    assert fits(one_cpu, {"CPU": 3.5}) == 3
    assert fits(replica_needs(2.0, 0.0, {"prefill": 1.0}), {"CPU": 8.0, "prefill": 1.0}) == 1   # custom binds
    assert fits(replica_needs(1.0, 1.0, {}), {"CPU": 8.0}) == 0                                  # no GPU at all
    h100 = replica_needs(1.0, 1.0, {}, accelerator_type="H100")
    assert fits(h100, {"CPU": 8.0, "GPU": 4.0, "accelerator_type:A100": 1.0}) == 0   # free GPUs of another type
    assert fits(h100, {"CPU": 8.0, "GPU": 2.0, "accelerator_type:H100": 1.0}) == 2
    assert fits(one_cpu, {}) == 0                                                                 # Ray cannot say
    assert auto_max_replicas(current=1, initial=1, min_replicas=1, room=fits(one_cpu, {"CPU": 2.0})) == 3
    assert auto_max_replicas(current=1, initial=1, min_replicas=1, room=0) == 1    # a full host: fixed at 1
    assert auto_max_replicas(current=0, initial=2, min_replicas=1, room=0) == 2    # never below its start
    # The planner grows a busy pool whose limit is Ray's room, one step at a time.
    pool = make_pool(WorkerRole.DECODE, 1, hi=auto_max_replicas(1, 1, 1, room=2))
    workers = [make_worker("d0", running_seqs=10, waiting_seqs=10)]
    assert decide_pool(NOW, pool, workers, POLICY).action is ScaleAction.SCALE_UP
    full = make_pool(WorkerRole.DECODE, 1, hi=auto_max_replicas(1, 1, 1, room=0))
    assert decide_pool(NOW, full, workers, POLICY).action is ScaleAction.HOLD


def test_batch_work_scales_the_decode_pool_only_within_its_budget() -> None:
    """Decode workers full of batch sequences (56 of 64 each; 8 interactive, one replica's worth
    at most): with no budget the planner sees only the interactive load, so it never scales up
    for the batch (here it may even scale down); with a budget of 1 it holds at 1 + 1 replicas,
    where all of it interactive would scale to 3; a budget larger than the batch needs gives what
    the whole load needs, no more."""
    now = 1000.0
    busy = [WorkerMetrics(f"d{i}", WorkerRole.DECODE, warm=True, started_at=0.0, running_seqs=60, waiting_seqs=4,
                          kv_usage=0.9, batch_seqs=56, batch_kv_usage=0.8) for i in range(2)]
    pool = PoolState(WorkerRole.DECODE, replicas=2, min_replicas=1, max_replicas=8, max_num_seqs=64)
    none = decide_pool(now, pool, busy, PlannerPolicy(batch_budget_replicas=0))
    assert none.action is not ScaleAction.SCALE_UP and "without batch work" in none.reason
    one = decide_pool(now, pool, busy, PlannerPolicy(batch_budget_replicas=1))
    assert one.action is ScaleAction.HOLD and one.target_replicas == 2
    assert decide_pool(now, pool, busy, PlannerPolicy(batch_budget_replicas=6)).target_replicas == 3
    # the same load, all of it interactive, scales as it always did
    inter = [WorkerMetrics(f"d{i}", WorkerRole.DECODE, warm=True, started_at=0.0, running_seqs=60, waiting_seqs=4,
                           kv_usage=0.9) for i in range(2)]
    assert decide_pool(now, pool, inter, PlannerPolicy()).target_replicas == 3


# ------------------------------------------------------------------ the capacity model's targets
def test_the_capacity_model_scales_a_busy_pool_to_its_target_with_the_arithmetic_in_the_reason() -> None:
    pool = make_pool(WorkerRole.DECODE, 2, hi=8)
    within_band = [make_worker("d0", kv_usage=0.6), make_worker("d1", kv_usage=0.6)]
    plain = decide_pool(NOW, pool, within_band, POLICY)
    assert plain.action is ScaleAction.HOLD
    d = decide_pool(NOW, pool, within_band, POLICY, model_target=(5, "9 requests/s -> 5 decode"))
    assert d.action is ScaleAction.SCALE_UP and d.target_replicas == 4      # within max_step
    assert "capacity model wants 5: 9 requests/s -> 5 decode" in d.reason


def test_the_capacity_model_never_starts_workers_for_an_idle_pool_and_never_shrinks_a_hot_one() -> None:
    pool = make_pool(WorkerRole.DECODE, 2, hi=8)
    idle = [make_worker("d0", kv_usage=0.1), make_worker("d1", kv_usage=0.1)]
    d = decide_pool(NOW, pool, idle, POLICY, model_target=(6, "stale"))
    assert d.action is ScaleAction.HOLD and "capacity model wants 6" in d.reason
    hot = [make_worker("d0", kv_usage=0.95), make_worker("d1", kv_usage=0.95)]
    d = decide_pool(NOW, pool, hot, POLICY, model_target=(1, "says one"))
    assert d.action is ScaleAction.SCALE_UP and d.target_replicas == 3       # the threshold rule wins
    # the threshold's own target is raised to the model's when the model asks for more
    d = decide_pool(NOW, make_pool(WorkerRole.DECODE, 2, hi=8), hot, dataclasses.replace(POLICY, max_step=4),
                    model_target=(6, "six"))
    assert d.action is ScaleAction.SCALE_UP and d.target_replicas == 6


def test_a_scale_down_needs_the_capacity_models_agreement() -> None:
    pool = make_pool(WorkerRole.DECODE, 3, hi=8)
    idle = [make_worker(f"d{i}", kv_usage=0.05) for i in range(3)]
    assert decide_pool(NOW, pool, idle, POLICY).action is ScaleAction.SCALE_DOWN
    held = decide_pool(NOW, pool, idle, POLICY, model_target=(3, "3 needed at 40 requests/s"))
    assert held.action is ScaleAction.HOLD and "capacity model wants 3" in held.reason
    down = decide_pool(NOW, pool, idle, POLICY, model_target=(1, "1 is enough"))
    assert down.action is ScaleAction.SCALE_DOWN and "capacity model wants 1: 1 is enough" in down.reason


def test_a_busy_prefill_signal_names_itself_and_bad_busy_values_are_refused() -> None:
    d = decide_pool(NOW, make_pool(WorkerRole.PREFILL, 1), [prefill("p0", prefill_busy=0.97)], POLICY)
    assert d.action is ScaleAction.SCALE_UP and "prefill busy 97% of the time" in d.reason
    with pytest.raises(ValueError, match="prefill_busy"):
        prefill("p0", prefill_busy=1.5)

"""The live planner inside the simulator: it scales the simulated pools up under a surge and back
down after it, with the same decisions (and reasons) it makes on a real cluster."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from pdserve.capacity.sim_planner import PlannerSetup, PoolBounds, SimPlanner
from pdserve.capacity_cmd import load_planner_setup
from pdserve.capacity.simulate import ClusterShape, simulate
from pdserve.capacity.planner import PlannerPolicy
from tests.unit.test_capacity import profile

POLICY = PlannerPolicy(ttft_slo_ms=2000, itl_slo_ms=100, scale_up_cooldown_s=10, scale_down_cooldown_s=20,
                       warmup_s=5, scale_down_stable_s=20, max_step=2)


def surge(seed: int = 0) -> tuple[np.ndarray, ...]:
    """2 requests/s for 60 s, 40/s for 120 s, 2/s for 400 s: 64 prompt tokens, 50 out."""
    rng = np.random.default_rng(seed)
    parts, t = [], 0.0
    for rate, span in ((2, 60), (40, 120), (2, 400)):
        gaps = rng.exponential(1 / rate, int(rate * span * 1.5))
        times = t + np.cumsum(gaps)
        parts.append(times[times < t + span])
        t += span
    arrivals = np.concatenate(parts)
    n = len(arrivals)
    return arrivals, np.full(n, 64), np.zeros(n, dtype=int), np.full(n, 50)


def setup(decode=(1, 1, 8), prefill=(1, 1, 4), use_model: bool = False, start_s: float = 5.0) -> PlannerSetup:
    return PlannerSetup(POLICY, PoolBounds(*prefill), PoolBounds(*decode), interval_s=5.0,
                        worker_start_s=start_s, use_model=use_model, window_s=30.0)


def test_the_planner_scales_the_decode_pool_up_for_a_surge_and_back_down_after_it() -> None:
    prof = profile(max_seqs=32)
    arrays = surge()
    shape = ClusterShape("disaggregated", 1, 1, itl_target_s=None)
    fixed = simulate(prof, shape, *arrays)
    planned = simulate(prof, shape, *arrays, planner=SimPlanner(setup(), prof, "disaggregated", 32))
    assert planned.queued_at_end == 0 and len(planned.e2e_s) == len(arrays[0])
    run = planned.planner
    ups = [d for d in run["decisions"] if d["pool"] == "decode" and d["action"] == "scale_up"]
    downs = [d for d in run["decisions"] if d["pool"] == "decode" and d["action"] == "scale_down"]
    assert ups and 60 <= ups[0]["t"] <= 90                       # soon after the surge starts
    assert "sequences" in ups[0]["reason"] or "KV" in ups[0]["reason"] or "ITL" in ups[0]["reason"]
    assert run["most_replicas"]["decode"] > 2
    # back to one decode worker once the surge is over, and paid for far less than the peak
    peak = run["most_replicas"]["decode"]
    assert downs and downs[-1]["to"] == 1 and downs[-1]["t"] > 180
    span = arrays[0][-1] - arrays[0][0]
    assert run["worker_seconds"]["decode"] < 0.8 * peak * span
    # more workers through the surge: end-to-end latency far better than the fixed shape's
    assert np.percentile(planned.e2e_s, 90) < 0.5 * np.percentile(fixed.e2e_s, 90)


def prefill_flaps(decisions: list[dict]) -> bool:
    """Whether the prefill pool scaled up again after scaling down."""
    actions = [d["action"] for d in decisions if d["pool"] == "prefill"]
    return "scale_down" in actions and "scale_up" in actions[actions.index("scale_down"):]


class TtftOnlyPlanner(SimPlanner):
    """The planner as it was before the busy signal: prefill workers report no busy share."""

    def decide(self, now, replicas, pending, metrics):
        return super().decide(now, replicas, pending, [dataclasses.replace(m, prefill_busy=None) for m in metrics])


def test_the_prefill_pool_holds_through_a_surge_because_busy_workers_do_not_read_idle() -> None:
    """A prefill worker that has just emptied its queue predicts a TTFT of 0 however busy it is: on
    that signal alone the planner scaled the prefill pool down in the middle of the surge and up
    again once the queue had grown back. With the share of time the workers spend computing
    prompts in the signal, the pool holds until the surge is over."""
    prof = profile(max_seqs=32)
    arrays = surge()
    shape = ClusterShape("disaggregated", 1, 1, itl_target_s=None)
    before = simulate(prof, shape, *arrays, planner=TtftOnlyPlanner(setup(), prof, "disaggregated", 32))
    now = simulate(prof, shape, *arrays, planner=SimPlanner(setup(), prof, "disaggregated", 32))
    assert before.queued_at_end == now.queued_at_end == 0
    assert prefill_flaps(before.planner["decisions"]) and not prefill_flaps(now.planner["decisions"])
    downs = [d for d in now.planner["decisions"] if d["pool"] == "prefill" and d["action"] == "scale_down"]
    assert downs and min(d["t"] for d in downs) > 180 and downs[-1]["to"] == 1
    assert any("prefill busy" in d["reason"] for d in now.planner["decisions"])
    assert np.percentile(now.ttft_s, 90) <= np.percentile(before.ttft_s, 90)


def test_with_the_capacity_model_every_scale_down_has_its_agreement() -> None:
    prof = profile(max_seqs=32)
    arrays = surge(1)
    shape = ClusterShape("disaggregated", 1, 1, itl_target_s=None)
    res = simulate(prof, shape, *arrays, planner=SimPlanner(setup(use_model=True), prof, "disaggregated", 32))
    assert res.queued_at_end == 0
    downs = [d for d in res.planner["decisions"] if d["action"] == "scale_down"]
    assert downs and all("capacity model wants" in d["reason"] and "requests/s" in d["reason"] for d in downs)
    for d in downs:   # the model wanted fewer than the pool had
        assert int(d["reason"].split("capacity model wants ")[1].split(":")[0]) < d["from"]


def test_a_colocated_pool_scales_alone_and_slow_starts_delay_relief() -> None:
    prof = profile(max_seqs=32)
    arrays = surge(2)
    shape = ClusterShape("colocated", 0, 1, itl_target_s=None)
    fast = simulate(prof, shape, *arrays, planner=SimPlanner(setup(prefill=(0, 0, 0)), prof, "colocated", 32))
    slow = simulate(prof, shape, *arrays,
                    planner=SimPlanner(setup(prefill=(0, 0, 0), start_s=60.0), prof, "colocated", 32))
    assert {d["pool"] for d in fast.planner["decisions"]} == {"decode"}
    assert fast.queued_at_end == slow.queued_at_end == 0
    assert np.percentile(slow.ttft_s, 90) > np.percentile(fast.ttft_s, 90)


def test_setup_comes_from_a_cluster_config_and_refuses_what_it_cannot_simulate(tmp_path: Path) -> None:
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text("model: {path: /models/x}\nprefill: {min_replicas: 0, initial_replicas: 1, max_replicas: 3}\n"
                   "decode: {min_replicas: 1, max_replicas: 6}\n"
                   "router: {disaggregation: {mode: always}}\nslo: {ttft_ms: 1500, itl_ms: 80}\n"
                   "planner: {interval_s: 7, scale_up_cooldown_s: 11}\n")
    s, mode = load_planner_setup(cfg, worker_start_s=12.0)
    assert mode == "disaggregated" and s.interval_s == 7 and s.worker_start_s == 12.0 and not s.use_model
    assert (s.prefill.min_replicas, s.prefill.initial, s.prefill.max_replicas) == (0, 1, 3)
    assert (s.decode.min_replicas, s.decode.initial, s.decode.max_replicas) == (1, 1, 6)
    assert s.policy.ttft_slo_ms == 1500 and s.policy.scale_up_cooldown_s == 11
    cfg.write_text("model: {path: /models/x}\ndecode: {min_replicas: 1}\n")
    with pytest.raises(ValueError, match="max_replicas to simulate"):
        load_planner_setup(cfg, worker_start_s=1.0)
    with pytest.raises(ValueError, match="initial"):
        PoolBounds(2, 1, 3)

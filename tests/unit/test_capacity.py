"""The capacity model: profile costs, the traffic file, the simulator against closed forms, and
the plan's arithmetic (the seeds' worked example)."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import numpy as np
import pytest

from pdserve.capacity.plan import estimate, format_plan, make_plan
from pdserve.capacity.profile import (PROFILE_VERSION, EngineProfile, Profile, ProfileError, ServingProfile,
                                      TransferProfile)
from pdserve.capacity.simulate import ClusterShape, simulate
from pdserve.capacity.traffic import Traffic, TrafficError


def engine(threads: int = 1, *, prefill=(0.02, 0.1, 0.4), decode=(0.02, 0.03, 0.06), per_ctx: float = 0.0,
           attn: float = 0.0) -> EngineProfile:
    return EngineProfile(threads=threads, prefill_tokens=[16, 128, 512], prefill_s=list(prefill),
                         decode_batch=[1, 8, 32], decode_s=list(decode), decode_ctx=64,
                         decode_s_per_ctx_token=per_ctx, attn_s_per_token_ctx=attn)


def profile(*, per_ctx: float = 0.0, kv_blocks: int = 10_000, max_seqs: int = 32, transfer=(0.001, 1e9),
            serving: dict | None = None, engines: dict | None = None) -> Profile:
    return Profile(host={"cpu_model": "test"}, model={"name": "m", "dtype": "float32", "kv_bytes_per_token": 1000},
                   engine={"block_size": 16, "max_num_seqs": max_seqs, "max_num_batched_tokens": 512,
                           "num_kv_blocks": kv_blocks},
                   engines=engines or {"1": engine(per_ctx=per_ctx), "2": engine(2, per_ctx=per_ctx)},
                   roles={"prefill": 1, "decode": 1, "colocated": 2},
                   transfer=TransferProfile(*transfer), serving=serving or {})


def run(prof: Profile, mode: str, arrivals, prompt, output, prefill: int = 1, decode: int = 1, cached=None):
    a = np.array(arrivals, dtype=float)
    p = np.array(prompt)
    return simulate(prof, ClusterShape(mode, 0 if mode == "colocated" else prefill, decode, itl_target_s=None),
                    a, p, np.zeros_like(p) if cached is None else np.array(cached), np.array(output))


# ------------------------------------------------------------------------------------ profile
def test_costs_interpolate_between_and_extend_past_the_measured_points() -> None:
    e = engine(per_ctx=1e-6, attn=1e-7)
    assert e.prefill_step_s(128) == pytest.approx(0.1)
    assert e.prefill_step_s(320) == pytest.approx(0.25)          # halfway 128..512
    assert e.prefill_step_s(896) == pytest.approx(0.7)           # extended along the last segment
    assert e.prefill_step_s(128, ctx=1000) == pytest.approx(0.1 + 1e-7 * 128 * 1000)
    assert e.decode_step_s(8, 8 * 64) == pytest.approx(0.03)     # at the measured context
    assert e.decode_step_s(8, 8 * 64 + 500) == pytest.approx(0.03 + 500e-6)
    # a mixed step: the decodes plus what the prefill costs beyond one sampled token
    assert e.mixed_step_s(8, 8 * 64, 128) == pytest.approx(0.03 + 0.1 - 0.02)


def test_prompts_packed_in_one_step_cost_the_attention_pairs_between_them_less() -> None:
    e = engine(attn=1e-7)
    one = e.prefill_step_s(256)                       # one 256-token prompt: 256 * 256 / 2 pairs
    two = e.prefill_step_s(256, parts=[128, 128])     # two of 128: 2 * 128 * 128 / 2 pairs
    assert one - two == pytest.approx(1e-7 * (256 * 256 - 2 * 128 * 128) / 2)
    assert e.prefill_step_s(256, parts=[256]) == pytest.approx(one)
    # beside decodes too, and the cached context still costs every new token
    assert e.mixed_step_s(8, 8 * 64, 256, [128, 128]) == pytest.approx(e.mixed_step_s(8, 8 * 64, 256) - (one - two))
    assert e.prefill_step_s(256, 100, [128, 128]) == pytest.approx(two + 1e-7 * 256 * 100)
    # the simulator packs two prompts that queued behind a third into one step, at that price
    prof = profile(engines={"1": e, "2": engine(2, attn=1e-7)})
    res = run(prof, "disaggregated", [0.0, 0.01, 0.01], [128, 128, 128], [1, 1, 1])
    first = e.prefill_step_s(128)
    assert list(res.ttft_s) == pytest.approx([first, first - 0.01 + two, first - 0.01 + two])


def test_a_bucketed_engines_batch_is_priced_at_its_row_bucket_and_an_older_profile_along_the_line() -> None:
    kw = dict(threads=1, prefill_tokens=[16], prefill_s=[0.01], decode_batch=[32, 36, 40, 48],
              decode_s=[0.030, 0.031, 0.033, 0.036], decode_ctx=64, decode_s_per_ctx_token=1e-6)
    stairs, line = EngineProfile(**kw, decode_row_buckets=True), EngineProfile(**kw)
    # 33-36 streams run their matmuls at 36 rows, 37-40 at 40, 41-44 at 44 (halfway 40..48)
    assert [stairs.decode_step_s(b, b * 64) for b in (32, 33, 36, 37, 40, 41)] == pytest.approx(
        [0.030, 0.031, 0.031, 0.033, 0.033, 0.0345])
    assert line.decode_step_s(33, 33 * 64) == pytest.approx(0.03025)
    # context is per real stream, not per padded row
    assert stairs.decode_step_s(33, 33 * 64 + 1000) == pytest.approx(0.031 + 1000e-6)
    assert Profile.from_dict(profile(engines={"1": stairs, "2": stairs}).to_dict()).engines["1"].decode_row_buckets


def test_profile_round_trips_and_refuses_what_it_cannot_use(tmp_path: Path) -> None:
    prof = profile(serving={"disaggregated": ServingProfile(0.05, 0.002)})
    path = tmp_path / "p.json"
    prof.save(path)
    back = Profile.load(path)
    assert back.to_dict() == prof.to_dict()
    assert back.serving_for("conditional").itl_overhead_s == 0.002
    assert back.serving_for("colocated") == ServingProfile()
    d = json.loads(path.read_text())
    d["version"] = PROFILE_VERSION + 1
    path.write_text(json.dumps(d))
    with pytest.raises(ProfileError, match="run `pdserve profile` again"):
        Profile.load(path)
    d["version"] = PROFILE_VERSION
    d["roles"]["colocated"] = 4
    path.write_text(json.dumps(d))
    with pytest.raises(ProfileError, match="4 threads, which were not profiled"):
        Profile.load(path)
    path.write_text("[1, 2]")
    with pytest.raises(ProfileError, match="expected a JSON object"):
        Profile.load(path)
    with pytest.raises(ProfileError, match="sizes must increase"):
        EngineProfile(1, [128, 16], [0.1, 0.2], [1], [0.01], 64)
    d = prof.to_dict()
    d["serving"]["colocated"] = {"arrival_s": -0.004}
    path.write_text(json.dumps(d))
    with pytest.raises(ProfileError, match=r"arrival_s .* must be >= 0 seconds, got -0.004"):
        Profile.load(path)
    d["serving"]["colocated"] = {"ttft_overhead_queued_s": -0.01}
    path.write_text(json.dumps(d))
    with pytest.raises(ProfileError, match=r"ttft_overhead_queued_s must be >= 0 seconds, got -0.01"):
        Profile.load(path)


# ------------------------------------------------------------------------------------ traffic
def test_traffic_errors_name_the_field_and_lengths_stay_in_bounds(tmp_path: Path) -> None:
    with pytest.raises(TrafficError, match="exactly one of rate"):
        Traffic.parse({"prompt_len": {"mean": 10}, "output_len": {"mean": 5}})
    with pytest.raises(TrafficError, match=r"prompt_len: .*mean \(5000.0\) must lie within"):
        Traffic.parse({"rate": 1, "prompt_len": {"mean": 5000, "max": 100}, "output_len": {"mean": 5}})
    with pytest.raises(TrafficError, match="slo.ttft_ms: Extra inputs"):
        Traffic.parse({"rate": 1, "prompt_len": {"mean": 10}, "output_len": {"mean": 5}, "slo": {"ttft_ms": 3}})
    bad = tmp_path / "t.yaml"
    bad.write_text("rate: [")
    with pytest.raises(TrafficError, match="does not parse"):
        Traffic.load(bad)
    t = Traffic.parse({"rate": 50, "prompt_len": {"mean": 100, "dist": "lognormal", "min": 10, "max": 400},
                       "output_len": {"mean": 20, "dist": "exponential", "max": 80}, "prefix_share": 0.5,
                       "requests": 20_000})
    arr, p, c, o = t.draw()
    assert len(arr) == 20_000 and np.all(np.diff(arr) >= 0)
    assert 45 < len(arr) / arr[-1] < 55                    # Poisson at 50/s
    assert p.min() >= 10 and p.max() <= 400 and o.min() >= 1 and o.max() <= 80
    assert abs(p.mean() - 100) < 5
    assert np.all(c == np.floor(p * 0.5)) and np.all(c < p)


def test_a_daily_curve_sends_more_at_its_peak() -> None:
    t = Traffic.parse({"daily": [[0, 0.1], [12, 0.9], [24, 0.1]], "prompt_len": {"mean": 10},
                       "output_len": {"mean": 5}, "requests": 50_000})   # a little over one day
    arr = t.draw()[0]
    hours = (arr % 86400) / 3600
    near_noon = np.sum((hours > 11) & (hours < 13))
    near_midnight = np.sum((hours < 1) | (hours > 23))
    assert near_noon > 4 * near_midnight
    assert t.peak_rate == 0.9


# ---------------------------------------------------------------------------------- simulator
def test_one_request_disaggregated_is_prefill_handoff_then_its_decode_steps() -> None:
    prof = profile(per_ctx=1e-5, serving={"disaggregated": ServingProfile(ttft_overhead_s=0.05, itl_overhead_s=0.001)})
    res = run(prof, "disaggregated", [1.0], [128], [5])
    e = prof.role("decode")
    ttft = prof.role("prefill").prefill_step_s(128) + 0.05
    assert res.ttft_s[0] == pytest.approx(ttft)
    handoff = prof.transfer.transfer_s(128 * 1000)
    steps = [e.decode_step_s(1, 129 + j) for j in range(4)]   # context grows one token a step
    assert res.e2e_s[0] == pytest.approx(ttft - 0.05 + handoff + sum(steps) + 0.05)
    assert res.output_tokens == 5
    # gaps: the first includes the handoff; the other three are steps (+ the served overhead)
    assert res.itl_percentile(100) == pytest.approx(handoff + steps[0] + 0.001)
    assert res.itl_percentile(1) == pytest.approx(np.mean(steps[1:]) + 0.001)


def test_one_request_colocated_has_no_handoff() -> None:
    prof = profile()
    res = run(prof, "colocated", [0.0], [100], [3])
    e = prof.role("colocated")
    assert res.ttft_s[0] == pytest.approx(e.prefill_step_s(100))
    assert res.e2e_s[0] == pytest.approx(e.prefill_step_s(100) + 2 * e.decode_step_s(1, 0))
    assert res.span_s == pytest.approx(res.e2e_s[0])


def test_a_request_joins_a_running_batch_at_the_next_step_boundary() -> None:
    prof = profile(transfer=(0.0, 1e15))
    e, pre = prof.role("decode"), prof.role("prefill")
    first_ready = pre.prefill_step_s(16)
    # the second arrives while the first decodes alone, a third of the way into its second step
    d1 = e.decode_step_s(1, 0)
    t2 = first_ready + 1.33 * d1 - pre.prefill_step_s(16)
    res = run(prof, "disaggregated", [0.0, t2], [16, 16], [10, 3])
    join = first_ready + 2 * d1                       # the boundary after the second arrival
    d2 = e.decode_step_s(2, 0)
    assert res.e2e_s[1] == pytest.approx(join + 2 * d2 - t2)
    # the first: 2 steps alone, 2 beside the second, then 5 alone again
    assert res.e2e_s[0] == pytest.approx(first_ready + 2 * d1 + 2 * d2 + 5 * d1)


def test_everything_finishes_when_the_kv_cache_holds_one_sequence_at_a_time() -> None:
    prof = profile(kv_blocks=10)                      # 160 tokens: one 100 + 20 sequence at a time
    n = 30
    res = run(prof, "disaggregated", np.linspace(0, 1, n), [100] * n, [20] * n)
    assert len(res.e2e_s) == n and res.output_tokens == 20 * n
    e = prof.role("decode")
    # decoding is serial: at least n sequences x 19 batch-1 steps
    assert res.span_s >= n * 19 * e.decode_step_s(1, 0)


def test_saturated_decode_runs_at_the_profiled_batch_rate() -> None:
    prof = profile(max_seqs=8)
    n = 400
    res = run(prof, "disaggregated", np.zeros(n), [16] * n, [200] * n, prefill=4)
    e = prof.role("decode")
    assert res.output_tokens_per_s == pytest.approx(8 / e.decode_step_s(8, 0), rel=0.03)


def test_the_router_admits_decode_replicas_times_max_num_seqs_and_holds_the_rest_in_arrival_order() -> None:
    # disaggregated, max_num_seqs 2: the third request is not prefilled until one of the first two
    # ends (the router's in-flight cap, as `pdserve up` sets it), where without the cap the prefill
    # worker takes it at once and only its decode waits for a slot
    prof = profile(max_seqs=2, transfer=(0.0, 1e15))
    arrivals, prompt = np.zeros(4), np.full(4, 16)
    output = np.array([50, 40, 10, 10])

    def sim(admission: bool):
        shape = ClusterShape("disaggregated", 1, 1, itl_target_s=None, admission=admission)
        return simulate(prof, shape, arrivals, prompt, np.zeros_like(prompt), output)

    capped, open_ = sim(True), sim(False)
    first_end = capped.e2e_s[1]                       # the shorter of the first two ends first
    assert capped.ttft_s[2] > first_end
    assert capped.ttft_s[3] > capped.ttft_s[2]        # arrival order: the fourth waits for the next slot
    assert open_.ttft_s[2] < open_.e2e_s[1] and open_.ttft_s[3] < open_.e2e_s[1]
    assert capped.output_tokens == open_.output_tokens == int(output.sum())


def test_more_workers_split_the_load() -> None:
    prof = profile()
    t = Traffic.parse({"rate": 40, "prompt_len": {"mean": 64}, "output_len": {"mean": 32}, "requests": 2000})
    one = simulate(prof, ClusterShape("disaggregated", 2, 1, itl_target_s=None), *t.draw())
    four = simulate(prof, ClusterShape("disaggregated", 8, 4, itl_target_s=None), *t.draw())
    assert four.itl_percentile(50) < one.itl_percentile(50)
    assert np.percentile(four.ttft_s, 99) < np.percentile(one.ttft_s, 99)
    assert four.output_tokens == one.output_tokens == int(t.draw()[3].sum())


def test_shapes_that_cannot_run_are_refused() -> None:
    with pytest.raises(ValueError, match="give --prefill 0"):
        ClusterShape("colocated", 1, 1)
    with pytest.raises(ValueError, match="at least one prefill worker"):
        ClusterShape("disaggregated", 0, 1)


# ---------------------------------------------------------------------------------------- plan
def seeds_profile() -> Profile:
    """A worker that decodes 2,000 tokens/s at its full batch of 64 (the seeds' figure)."""
    e = EngineProfile(threads=1, prefill_tokens=[512, 2048], prefill_s=[0.02, 0.08],
                      decode_batch=[1, 64], decode_s=[0.01, 0.032], decode_ctx=0)
    return Profile(host={}, model={"name": "seeds", "kv_bytes_per_token": 1000},
                   engine={"block_size": 16, "max_num_seqs": 64, "max_num_batched_tokens": 2048,
                           "num_kv_blocks": 100_000}, engines={"1": e}, roles={"prefill": 1, "decode": 1, "colocated": 1},
                   transfer=TransferProfile(0.0, 1e12))


def test_plan_reproduces_the_seeds_worked_example() -> None:
    traffic = Traffic.parse({"rate": 400, "prompt_len": {"mean": 500}, "output_len": {"mean": 250},
                             "slo": {"ttft_s": 2.0, "itl_s": 0.05}})
    est = estimate(seeds_profile(), traffic)
    text = "\n".join(est["steps"])
    assert "=  2,000 tokens/s" in text
    assert "2,000 / 250  =  8" in text
    assert "400 / 8  =  50" in text
    assert est["decode"] == 50
    assert est["seeds_estimate"]["total"] == 65           # +30% for prefill and headroom
    assert est["decode_batch"] == 64 and est["decode_batch_limit"] == "max_num_seqs"


def test_plan_names_the_itl_slo_when_it_caps_the_batch_and_its_shape_meets_the_slos_in_simulation() -> None:
    prof = profile(per_ctx=1e-6)
    traffic = Traffic.parse({"rate": 20, "prompt_len": {"mean": 128}, "output_len": {"mean": 32},
                             "slo": {"ttft_s": 0.5, "itl_s": 0.04, "percentile": 90}})
    plan = make_plan(prof, traffic, sim_requests=3000)
    assert plan["estimate"]["decode_batch_limit"] == "ITL SLO"
    sim = plan["simulation"]
    assert sim["met"]
    assert sim["result"]["ttft_at_slo_percentile"] <= 0.5 and sim["result"]["itl_at_slo_percentile"] <= 0.04
    p, d = plan["answer"]["prefill"], plan["answer"]["decode"]
    # one worker fewer in either pool misses an SLO (the search shrank until it did)
    arrays = traffic.draw(3000)
    for shape in (ClusterShape("disaggregated", p - 1, d, itl_target_s=0.04) if p > 1 else None,
                  ClusterShape("disaggregated", p, d - 1, itl_target_s=0.04) if d > 1 else None):
        if shape is None:
            continue
        res = simulate(prof, shape, *arrays)
        assert np.percentile(res.ttft_s, 90) > 0.5 or res.itl_percentile(90) > 0.04
    assert plan["colocated"]["workers"] >= 1 and plan["colocated_simulation"]["met"]


def test_a_daily_curve_is_planned_for_its_peak_and_sized_at_every_point() -> None:
    traffic = Traffic.parse({"daily": [[0, 40], [12, 400], [24, 40]], "prompt_len": {"mean": 500},
                             "output_len": {"mean": 250}, "slo": {"ttft_s": 2.0, "itl_s": 0.05}})
    plan = make_plan(seeds_profile(), traffic, verify=False)
    assert plan["answer"]["decode"] == 50
    assert [d["decode"] for d in plan["daily"]] == [5, 50, 5]
    assert "Through the day" in format_plan(plan)


def test_plan_reports_memory_as_binding_when_the_kv_cache_caps_the_batch() -> None:
    prof = profile(kv_blocks=40)                       # 640 tokens: 3 sequences of 200
    traffic = Traffic.parse({"rate": 1, "prompt_len": {"mean": 150}, "output_len": {"mean": 50},
                             "slo": {"ttft_s": 5, "itl_s": 1}})
    est = estimate(prof, traffic)
    assert est["decode_batch"] == 3 and est["decode_batch_limit"] == "KV memory"
    assert any("KV memory" in b for b in est["binding"])
    assert math.isfinite(est["decode_tokens_per_s_per_worker"])


def test_a_prefill_and_a_decode_worker_sharing_a_host_slow_each_other_by_the_profiled_factors() -> None:
    prof = profile(transfer=(0.0, 1e15))
    prof.corun = {"prefill_x": 1.5, "decode_x": 1.25}
    pre, dec = prof.role("prefill"), prof.role("decode")
    args = ([0.0, 2.0], [16, 128], [200, 2])
    apart = simulate(prof, ClusterShape("disaggregated", 1, 1, itl_target_s=None), *map(np.array, (args[0], args[1])),
                     np.zeros(2, dtype=int), np.array(args[2]))
    shared = simulate(prof, ClusterShape("disaggregated", 1, 1, itl_target_s=None, shared_host=True),
                      *map(np.array, (args[0], args[1])), np.zeros(2, dtype=int), np.array(args[2]))
    # the second prompt is prefilled while the first decodes on the same host
    assert apart.ttft_s[1] == pytest.approx(pre.prefill_step_s(128))
    assert shared.ttft_s[1] == pytest.approx(1.5 * pre.prefill_step_s(128))
    # the first prompt was prefilled on an idle host; its decode steps slow down only while the
    # prefill worker computes
    assert shared.ttft_s[0] == apart.ttft_s[0]
    extra = shared.e2e_s[0] - apart.e2e_s[0]
    # at most a quarter longer for as long as the prefill ran, plus the step it ends in
    assert 0 < extra <= 0.25 * 1.5 * pre.prefill_step_s(128) + 2 * dec.decode_step_s(2, 0)
    # the served one-host factors, where measured, stand for the offline ones
    served = prof.with_serving("disaggregated", ServingProfile(corun_prefill_x=2.0, corun_decode_x=1.25))
    again = simulate(served, ClusterShape("disaggregated", 1, 1, itl_target_s=None, shared_host=True),
                     *map(np.array, (args[0], args[1])), np.zeros(2, dtype=int), np.array(args[2]))
    assert again.ttft_s[1] == pytest.approx(2.0 * pre.prefill_step_s(128))
    apart_again = simulate(served, ClusterShape("disaggregated", 1, 1, itl_target_s=None),
                           *map(np.array, (args[0], args[1])), np.zeros(2, dtype=int), np.array(args[2]))
    assert apart_again.ttft_s[1] == pytest.approx(pre.prefill_step_s(128))   # only on a shared host


def test_a_measured_or_assumed_link_becomes_the_handoff_term(tmp_path: Path) -> None:
    prof = profile(transfer=(0.002, 5e9))
    slow = prof.with_link(gbps=1.0)
    assert slow.transfer.bytes_per_s == pytest.approx(1.25e8) and slow.transfer.overhead_s == 0.002
    assert "assumed 1 Gbit/s" in slow.transfer.how and prof.transfer.bytes_per_s == 5e9
    links = tmp_path / "links.json"
    links.write_text(json.dumps({"links": {"1gbit": {"link_gbps": 1.0, "transfer_gbps": 0.8},
                                           "10gbit": {"link_gbps": 10.0, "transfer_gbps": 7.5}}}))
    ten = prof.with_link(link_json=links, rate="10gbit")
    assert ten.transfer.bytes_per_s == pytest.approx(7.5e9 / 8)
    with pytest.raises(ProfileError, match="measured several links"):
        prof.with_link(link_json=links)
    with pytest.raises(ProfileError, match="no transfer figure for link '25gbit'"):
        prof.with_link(link_json=links, rate="25gbit")
    # a slower link delays the second token, not the first
    t = Traffic.parse({"rate": 5, "prompt_len": {"mean": 512}, "output_len": {"mean": 8}, "requests": 200})
    fast_run = simulate(prof, ClusterShape("disaggregated", 2, 1, itl_target_s=None), *t.draw())
    slow_run = simulate(slow, ClusterShape("disaggregated", 2, 1, itl_target_s=None), *t.draw())
    assert np.allclose(fast_run.ttft_s, slow_run.ttft_s)
    assert slow_run.itl_percentile(100) > fast_run.itl_percentile(100) + 512 * 1000 / 1.25e8 * 0.9


def test_the_served_step_factor_stretches_that_modes_engine_steps_only() -> None:
    plain = profile()
    served = profile(serving={"colocated": ServingProfile(step_x=2.0)})
    a = run(plain, "colocated", [0.0], [100], [3])
    b = run(served, "colocated", [0.0], [100], [3])
    assert b.e2e_s[0] == pytest.approx(2 * a.e2e_s[0]) and b.ttft_s[0] == pytest.approx(2 * a.ttft_s[0])
    d1 = run(plain, "disaggregated", [0.0], [100], [3])
    d2 = run(served, "disaggregated", [0.0], [100], [3])
    assert d1.e2e_s[0] == d2.e2e_s[0]


def test_served_figures_measured_again_replace_only_that_modes_and_leave_the_profile_as_it_was() -> None:
    prof = profile(serving={"colocated": ServingProfile(step_x=2.0), "disaggregated": ServingProfile(0.05)})
    again = prof.with_serving("colocated", ServingProfile(ttft_overhead_s=0.01, step_x=1.5))
    assert again.serving["colocated"].step_x == 1.5 and again.serving["colocated"].ttft_overhead_s == 0.01
    assert again.serving["disaggregated"].ttft_overhead_s == 0.05
    assert prof.serving["colocated"].step_x == 2.0                          # a copy, not the profile changed
    a = run(prof, "colocated", [0.0], [100], [3])
    b = run(again, "colocated", [0.0], [100], [3])
    assert b.e2e_s[0] == pytest.approx(0.75 * a.e2e_s[0] + 0.01)           # the new factor and overhead
    with pytest.raises(ProfileError, match="colocated or disaggregated"):
        prof.with_serving("conditional", ServingProfile())


def test_a_served_prefill_factor_scales_prefill_steps_and_the_step_factor_decode_steps() -> None:
    plain = profile()
    both = profile(serving={"disaggregated": ServingProfile(step_x=2.0, prefill_x=0.5)})
    a = run(plain, "disaggregated", [0.0], [128], [5])
    b = run(both, "disaggregated", [0.0], [128], [5])
    assert b.ttft_s[0] - 0.5 * plain.role("prefill").prefill_step_s(128) == pytest.approx(
        a.ttft_s[0] - plain.role("prefill").prefill_step_s(128))             # the handoff unchanged
    handoff = plain.transfer.transfer_s(128 * plain.kv_bytes_per_token)   # before the first decode step
    assert b.e2e_s[0] - b.ttft_s[0] - handoff == pytest.approx(2.0 * (a.e2e_s[0] - a.ttft_s[0] - handoff))
    e = plain.scaled(2.0, 0.5).role("decode")
    assert e.prefill_step_s(128) == pytest.approx(0.05) and e.decode_step_s(8, 8 * 64) == pytest.approx(0.06)
    with pytest.raises(ProfileError, match="> 0"):
        plain.scaled(1.0, 0.0)


def test_a_first_token_beside_decoding_streams_pays_the_busy_served_overhead() -> None:
    for mode in ("disaggregated", "colocated"):
        prof = profile(serving={mode: ServingProfile(ttft_overhead_s=0.01, ttft_overhead_busy_s=0.04)})
        res = run(prof, mode, [0.0, 1.0], [128, 128], [200, 3])   # the second comes while the first decodes
        first = prof.role("prefill" if mode == "disaggregated" else "colocated").prefill_step_s(128)
        assert res.ttft_s[0] == pytest.approx(first + 0.01), mode
        assert res.ttft_s[1] > first + 0.04 - 1e-9, mode        # its step, plus the busy overhead
        if mode == "disaggregated":                               # the prefill worker was idle for it
            assert res.ttft_s[1] == pytest.approx(first + 0.04)
        unmeasured = profile(serving={mode: ServingProfile(ttft_overhead_s=0.01)})
        again = run(unmeasured, mode, [0.0, 1.0], [128, 128], [200, 3])
        assert again.ttft_s[1] == pytest.approx(res.ttft_s[1] - 0.03), mode   # the lone figure stands in


def test_a_colocated_step_taking_a_prompt_beside_decodes_pays_the_measured_extra() -> None:
    plain = profile()
    extra = profile(serving={"colocated": ServingProfile(mixed_extra_s=0.02)})
    arrivals, prompts, outputs = [0.0, 1.0], [128, 128], [200, 3]      # the second comes while the first decodes
    a = run(plain, "colocated", arrivals, prompts, outputs)
    b = run(extra, "colocated", arrivals, prompts, outputs)
    assert b.ttft_s[0] == pytest.approx(a.ttft_s[0])                   # a lone prompt's step: no extra
    assert b.ttft_s[1] == pytest.approx(a.ttft_s[1] + 0.02)            # its step beside the decodes
    assert b.e2e_s[0] == pytest.approx(a.e2e_s[0] + 0.02)              # which the decoding stream waited for too
    # disaggregated decode workers are not affected by a colocated figure
    d = profile(serving={"disaggregated": ServingProfile(mixed_extra_s=0.02)})
    assert run(d, "disaggregated", arrivals, prompts, outputs).e2e_s[0] == pytest.approx(
        run(plain, "disaggregated", arrivals, prompts, outputs).e2e_s[0])


def test_prompts_beside_decodes_take_their_own_factor_on_the_profiled_prefill() -> None:
    lone = profile(serving={"colocated": ServingProfile(prefill_x=0.8)})
    mixed = profile(serving={"colocated": ServingProfile(prefill_x=0.8, mixed_prefill_x=1.1, mixed_extra_s=0.004)})
    # two prompts arrive together while the first request decodes: one step takes both
    arrivals, prompts, outputs = [0.0, 0.99, 0.99], [128, 128, 128], [400, 3, 3]
    a = run(lone, "colocated", arrivals, prompts, outputs)
    b = run(mixed, "colocated", arrivals, prompts, outputs)
    pre = lone.role("colocated").prefill_step_s
    assert b.ttft_s[0] == pytest.approx(a.ttft_s[0])                        # a lone prompt: prefill_x
    assert b.ttft_s[1] == pytest.approx(a.ttft_s[1] + 0.3 * pre(256) + 0.004)   # their 256 tokens at x1.1
    assert b.ttft_s[2] == pytest.approx(b.ttft_s[1])
    # the disaggregated decode path has no colocated prompt steps
    d = profile(serving={"disaggregated": ServingProfile(prefill_x=0.8, mixed_prefill_x=1.1)})
    plain_d = profile(serving={"disaggregated": ServingProfile(prefill_x=0.8)})
    assert run(d, "disaggregated", arrivals, prompts, outputs).ttft_s[1] == pytest.approx(
        run(plain_d, "disaggregated", arrivals, prompts, outputs).ttft_s[1])


def test_a_request_arriving_while_its_worker_computes_lengthens_that_step() -> None:
    plain = profile()
    busy = profile(serving={"colocated": ServingProfile(arrival_s=0.006)})
    # the second arrives while the first decodes, the third while the second's prompt computes
    arrivals, prompts, outputs = [0.0, 1.0, 1.05], [128, 128, 128], [400, 3, 3]
    a = run(plain, "colocated", arrivals, prompts, outputs)
    b = run(busy, "colocated", arrivals, prompts, outputs)
    assert b.ttft_s[0] == pytest.approx(a.ttft_s[0])               # it came to an idle worker
    # the decode step it came in, and its own prompt's step, in which the third came
    assert b.ttft_s[1] == pytest.approx(a.ttft_s[1] + 0.012)
    assert b.ttft_s[2] == pytest.approx(a.ttft_s[2] + 0.012)       # it waited for both
    assert b.e2e_s[0] == pytest.approx(a.e2e_s[0] + 0.012)         # the stream waited for both
    # the lengthened steps' token gaps are longer by it: the first stream's gap in the second's
    # prompt step (one decode beside a 128-token prompt: the prefill step) is the longest now
    step = plain.role("colocated").prefill_step_s(128)
    assert a.itl_values.max() < step + 0.006
    assert b.itl_values.max() == pytest.approx(step + 0.006)
    # not measured for disaggregated: nothing changes there
    d = profile(serving={"disaggregated": ServingProfile()})
    assert run(d, "disaggregated", arrivals, prompts, outputs).ttft_s[2] == pytest.approx(
        run(plain, "disaggregated", arrivals, prompts, outputs).ttft_s[2])


def test_a_probe_step_is_read_against_the_decode_steps_of_the_same_streams_then() -> None:
    from types import SimpleNamespace

    from pdserve.capacity.profile_fit import _probe_steps

    # three streams decode in 40 ms steps; each probe's prompt step (ending with its first
    # token) takes 130 ms at 128 tokens and 290 at 384, while the host is 25% slower for one of them
    def streams_with(steps):
        t, out = 0.0, []
        for d in steps:
            t += d
            out.append(t)
        return out

    steps = [0.04] * 20 + [0.13] + [0.04] * 20 + [0.05] * 10 + [0.05 + 0.11 * 1.25] + [0.05] * 10 \
        + [0.04] * 10 + [0.29] + [0.04] * 20
    tt = streams_with(steps)
    background = [SimpleNamespace(token_times=[x + 0.001 * k for x in tt]) for k in range(3)]
    probes = [SimpleNamespace(prompt_len=n, sent=tt[i - 2] + 0.01, token_times=[tt[i] + 0.002])
              for n, i in ((128, 20), (128, 51), (384, 72))]
    got = _probe_steps(probes, background)
    assert got[128] == pytest.approx([0.09, 0.1375], abs=1e-9)
    assert got[384] == pytest.approx([0.25], abs=1e-9)


def test_a_first_tokens_overhead_beside_decoding_streams_is_what_the_simulators_wait_leaves_out() -> None:
    from types import SimpleNamespace

    from pdserve.capacity.profile_fit import _probe_wait_overhead

    # three streams decode in 40 ms steps; eight probes are sent 2.5-37.5 ms before a step
    # boundary, reach the engine 4 ms later (the one sent 2.5 ms before misses that boundary and
    # takes the next), prefill in a 130 ms step, and every token reaches the client 6 ms after
    # its step. The simulator waits the rest of the step running (20 ms on average) and then the
    # probe's step: beyond those a probe pays 6 ms, plus one step in eight for the missed boundary.
    step, own, pre, emit = 0.04, 0.13, 0.004, 0.006
    t, ends, probes = 0.0, [], []
    for k in range(8):
        for _ in range(20):
            t += step
            ends.append(t)
        sent = t - (0.0025 + 0.005 * k)
        if t - sent < pre:                    # reached the engine after this boundary
            t += step
            ends.append(t)
        t += own
        ends.append(t)
        probes.append(SimpleNamespace(prompt_len=128, sent=sent, token_times=[t + emit]))
    for _ in range(20):
        t += step
        ends.append(t)
    background = [SimpleNamespace(token_times=[x + emit + 0.0001 * j for x in ends]) for j in range(3)]
    want = emit + step / 8
    assert _probe_wait_overhead(probes, background, None) == pytest.approx(want, abs=2e-4)
    # an arrival's own cost to the step it comes in is simulated already: not counted twice
    assert _probe_wait_overhead(probes, background, 0.002) == pytest.approx(want - 0.002, abs=2e-4)
    assert _probe_wait_overhead(probes[:2], background, None) is None     # too few probes to read


def test_a_disaggregated_decode_gap_beside_another_streams_first_token_is_kept() -> None:
    from types import SimpleNamespace

    from pdserve.capacity.profile_fit import _staggered_gaps

    # 40 ms steps; a stream decoding from 1.42 s, another whose first token comes at 1.80 s, in
    # the middle of one of the first one's gaps, and one sent at 2.5 s (the readings end there)
    def req(start: float, n: int, sent: float):
        return SimpleNamespace(ok=True, sent=sent, token_times=[start + 0.04 * k for k in range(n)], phase=None)

    records = [req(1.0, 20, 0.8), req(1.82, 30, 1.77), req(1.02, 10, 0.8), req(1.42, 40, 1.41), req(2.6, 10, 2.5)]
    colocated = {(a, b) for a, b, _, _ in _staggered_gaps(records, engine())}
    disaggregated = {(a, b): n for a, b, _, n in _staggered_gaps(records, engine(), prompt_steps=False)}
    # colocated leaves out the gaps holding another stream's first token (its prompt's step: the
    # first stream's at 1.42 s, the second's at 1.82 s); disaggregated keeps them, each a decode
    # step of the one stream decoding then (the new one joins after it)
    extra = sorted(set(disaggregated) - colocated)
    assert colocated < set(disaggregated)
    assert extra == [pytest.approx((1.40, 1.44)), pytest.approx((1.78, 1.82))]
    assert [disaggregated[g] for g in extra] == [1, 1]


def test_the_prompt_step_line_is_read_from_two_prompt_lengths() -> None:
    from pdserve.capacity.profile_fit import mixed_step_fit

    pre = engine().prefill_step_s                  # 0.1 s at 128 tokens, 0.4 s at 512
    line = {n: [0.95 * pre(n) + 0.012 + e for e in (-0.003, 0.0, 0.05)] for n in (128, 512)}
    factor, fixed = mixed_step_fit(line, pre)      # medians: the outlying step does not tilt the line
    assert factor == pytest.approx(0.95) and fixed == pytest.approx(0.012)
    assert mixed_step_fit({128: line[128]}, pre) is None                    # one length: no line
    assert mixed_step_fit({128: line[128], 512: line[512][:2]}, pre) is None   # too few at the other
    assert mixed_step_fit({128: [0.1] * 3, 512: [0.1] * 3}, pre) is None    # flat: noise, not a factor


def test_two_calibrations_around_a_load_are_averaged_figure_by_figure() -> None:
    from pdserve.bench.sim_accuracy import mean_served

    a = ServingProfile(ttft_overhead_s=0.01, step_x=1.0, prefill_x=0.8, mixed_extra_s=None, itl_jitter=[1.0, 2.0],
                       how="a")
    b = ServingProfile(ttft_overhead_s=0.03, step_x=1.2, prefill_x=None, mixed_extra_s=0.01, itl_jitter=[3.0, 4.0],
                       how="b")
    m = mean_served(a, b)
    assert m.ttft_overhead_s == pytest.approx(0.02) and m.step_x == pytest.approx(1.1)
    assert m.prefill_x == 0.8 and m.mixed_extra_s == 0.01            # one side's figure where the other lacks it
    assert m.itl_jitter == [2.0, 3.0] and m.corun_decode_x is None
    assert m.ttft_jitter is None
    assert mean_served(ServingProfile(ttft_jitter=[0.5, 1.5]), ServingProfile(ttft_jitter=[0.7, 2.5])).ttft_jitter \
        == pytest.approx([0.6, 2.0])
    assert mean_served(ServingProfile(ttft_jitter=[0.5, 1.5]), ServingProfile()).ttft_jitter == [0.5, 1.5]
    assert "a" in m.how and "b" in m.how
    # the first-token overhead split by a wait at the prefill worker: both averaged, or one side's pair
    split = ServingProfile(ttft_overhead_busy_s=0.06, ttft_overhead_queued_s=0.12)
    both = mean_served(split, ServingProfile(ttft_overhead_busy_s=0.08, ttft_overhead_queued_s=0.14))
    assert (both.ttft_overhead_busy_s, both.ttft_overhead_queued_s) == (pytest.approx(0.07), pytest.approx(0.13))
    for one in (mean_served(split, ServingProfile(ttft_overhead_busy_s=0.09)),
                mean_served(ServingProfile(ttft_overhead_busy_s=0.09), split)):
        assert (one.ttft_overhead_busy_s, one.ttft_overhead_queued_s) == (0.06, 0.12)
    # a prompt step's factor and fixed part go together: one side's line, or both lines averaged
    fitted = ServingProfile(mixed_prefill_x=1.0, mixed_extra_s=0.002)
    single = ServingProfile(mixed_extra_s=0.03)
    assert (mean_served(single, fitted).mixed_prefill_x, mean_served(single, fitted).mixed_extra_s) == (1.0, 0.002)
    both = mean_served(fitted, ServingProfile(mixed_prefill_x=0.8, mixed_extra_s=0.01))
    assert both.mixed_prefill_x == pytest.approx(0.9) and both.mixed_extra_s == pytest.approx(0.006)
    # the arrival cost averages like the rest; a reading is a calibration's own, not the mean's
    x = mean_served(ServingProfile(arrival_s=0.004, arrival_read_s=0.001),
                    ServingProfile(arrival_s=0.006, arrival_read_s=0.006))
    assert (x.arrival_s, x.arrival_read_s) == (pytest.approx(0.005), None)


def test_every_calibration_around_a_loads_repeats_weighs_alike() -> None:
    from pdserve.bench.sim_accuracy import mean_served

    four = [ServingProfile(step_x=x, itl_jitter=[x, 2 * x], how=f"c{i}") for i, x in enumerate((1.2, 1.4, 1.3, 1.1))]
    m = mean_served(*four)
    assert m.step_x == pytest.approx(1.25) and m.itl_jitter == pytest.approx([1.25, 2.5])
    assert "4 calibrations" in m.how and all(f"c{i}" in m.how for i in range(4))
    # some fitted the prompt-step line, some did not: the fitted ones' lines are averaged alone
    lines = [ServingProfile(mixed_prefill_x=1.1, mixed_extra_s=0.004), ServingProfile(mixed_extra_s=0.05),
             ServingProfile(mixed_prefill_x=0.9, mixed_extra_s=0.002)]
    assert (mean_served(*lines).mixed_prefill_x, mean_served(*lines).mixed_extra_s) == \
        (pytest.approx(1.0), pytest.approx(0.003))
    # quantiles of another resolution do not mix with the first one's
    assert mean_served(ServingProfile(itl_jitter=[1.0, 3.0]), ServingProfile(itl_jitter=[1.0, 2.0, 3.0]),
                       ServingProfile(itl_jitter=[2.0, 5.0])).itl_jitter == pytest.approx([1.5, 4.0])
    assert mean_served(four[0]).step_x == 1.2 and mean_served(four[0]).how == "c0"
    with pytest.raises(ValueError):
        mean_served()


def test_the_example_traffic_file_loads() -> None:
    t = Traffic.load(Path(__file__).resolve().parents[2] / "examples" / "traffic.yaml")
    assert t.peak_rate == 3 and t.slo.percentile == 99 and t.num_requests() == 5000


def test_bench_simulate_loads_each_mode_at_a_fraction_of_what_its_profile_can_serve() -> None:
    from pdserve.bench.sim_accuracy import capacity_rate

    prof = profile()
    for mode in ("colocated", "disaggregated"):
        cap = capacity_rate(prof, mode, 128, 64, itl_target_s=0.1, requests=1500)
        n = 1500
        gaps = np.random.default_rng(1).exponential(1.0, n)
        shape = ClusterShape(mode, 0 if mode == "colocated" else 1, 1, itl_target_s=0.1, shared_host=True)

        def delivered(rate: float) -> float:
            res = simulate(prof, shape, np.cumsum(gaps) / rate, np.full(n, 128), np.zeros(n, dtype=int),
                           np.full(n, 64))
            return res.output_tokens_per_s / (rate * 64)

        assert 1.0 < cap < 100.0, (mode, cap)
        assert delivered(0.8 * cap) > 0.97, mode      # below capacity the output keeps up with the load
        assert delivered(1.5 * cap) < 0.9, mode       # well above it, it does not


def test_bench_simulate_records_keep_each_load_and_its_profile_to_simulate_again(tmp_path: Path) -> None:
    from pdserve.bench.serve_load import RequestRecord
    from pdserve.bench.sim_accuracy import METRICS, real_figures, save_records, sim_figures
    from pdserve.capacity.profile import Profile

    recs = [RequestRecord("load", i, 128, 4, sent=0.1 * i, token_times=[0.1 * i + 0.2 + 0.03 * k for k in range(4)],
                          phase={"queue_s": 0.01, "prefill_s": 0.05}) for i in range(5)]
    recs.append(RequestRecord("load", 5, 128, 4, sent=0.5, error="HTTP 503"))
    prof = profile()
    save_records(tmp_path / "colocated-0.58-0", recs, prof)
    lines = (tmp_path / "colocated-0.58-0.jsonl").read_text().splitlines()
    back = [RequestRecord(**json.loads(line)) for line in lines]
    assert back == recs and real_figures(back) == real_figures(recs)
    again = Profile.load(tmp_path / "colocated-0.58-0.profile.json")
    a, b = sim_figures(again, "colocated", back, 0.1), sim_figures(prof, "colocated", recs, 0.1)
    assert {m: a[m] for m in METRICS} == {m: b[m] for m in METRICS}


def test_the_served_jitter_spreads_the_simulated_gaps_in_the_itl_percentiles_only() -> None:
    plain = profile()
    jitter = [1.0] * 90 + [3.0] * 10          # one gap in ten three times its median
    shaky = plain.with_serving("disaggregated", ServingProfile(itl_jitter=jitter))
    args = ([0.0], [128], [200])
    a = run(plain, "disaggregated", *args)
    b = run(shaky, "disaggregated", *args)
    assert b.e2e_s[0] == a.e2e_s[0] and b.output_tokens == a.output_tokens     # the timeline is the same
    step = a.itl_percentile(50)
    assert b.itl_percentile(50) == pytest.approx(step, rel=1e-6)
    assert b.itl_percentile(95) == pytest.approx(3 * step, rel=1e-6)
    assert a.itl_percentile(95) == pytest.approx(step, rel=1e-6)


def test_the_served_step_is_measured_at_the_batch_the_load_keeps_decoding() -> None:
    from pdserve.bench.sim_accuracy import capacity_rate, load_shape, operating_streams, seen_batch
    from pdserve.capacity.simulate import simulate

    def poisson(rate: float, n: int) -> np.ndarray:
        return np.cumsum(np.random.default_rng(54_321).exponential(1.0, n)) / rate

    prof = profile(max_seqs=24)
    for mode in ("colocated", "disaggregated"):
        cap = capacity_rate(prof, mode, 128, 64, itl_target_s=0.1, requests=1500)
        batches = [operating_streams(prof, mode, poisson(f * cap, 600), 128, 64, 0.1) for f in (0.05, 0.3, 0.8, 3.0)]
        assert batches[0] == 2, (mode, batches)                   # a trickle: the fewest a measurement needs
        assert batches == sorted(batches) and batches[1] < batches[2], (mode, batches)   # more load, more streams
        assert batches[-1] <= 24, (mode, batches)                 # never past the engine's max_num_seqs
    # by hand: [0, 2) and [1, 3) are open 1, 2 and 1 at a time for a second each: 6 / 4
    assert seen_batch(np.array([0.0, 1.0]), np.array([2.0, 3.0])) == pytest.approx(1.5)
    # decode steps of 30 ms at any batch: each request decodes for 63 x 30 ms; at 4 requests/s that
    # is 7.56 streams at once on average (Little's law), Poisson-spread, so a decoding request sees
    # itself and 7.56 others on average: 8.56
    flat = {str(t): engine(t, decode=(0.03, 0.03, 0.03)) for t in (1, 2)}
    arrivals = poisson(4.0, 2000)
    n = len(arrivals)
    res = simulate(profile(engines=flat), load_shape("disaggregated", 0.1), arrivals, np.full(n, 128),
                   np.zeros(n, dtype=int), np.full(n, 64))
    assert seen_batch(arrivals + res.ttft_s, arrivals + res.e2e_s) == pytest.approx(8.56, abs=0.35)
    assert operating_streams(profile(engines=flat), "disaggregated", arrivals, 128, 64, 0.1) == 9


def _staggered_closed_loop() -> tuple[list, EngineProfile]:
    """A closed loop of 4 streams of varied lengths, each replaced just after it ends (the test
    below says how its steps are timed): its records and the profiled engine."""
    from types import SimpleNamespace

    eng = engine(2, decode=(0.02, 0.03, 0.06))
    lengths = iter([20, 25, 30, 35] + [22, 31, 27, 24, 36, 29, 21, 33] * 3)
    t, records, live, waiting, sent = 0.0, [], [], [], []

    def send(now: float, to: list) -> None:
        n = next(lengths, None)
        if n is not None:
            rec = SimpleNamespace(ok=True, sent=now, token_times=[], n=n)
            records.append(rec)
            to.append(rec)

    for _ in range(4):
        send(0.0, waiting)
    while live or waiting or sent:
        # requests sent during the last step are prefilled in this one; those sent in this one
        # lengthen it
        joining, waiting[:] = list(waiting), []
        decoding = list(live)
        arriving = len(sent)
        waiting.extend(sent)
        sent.clear()
        t += 1.2 * eng.decode_step_s(len(decoding) + len(joining), 0) + (0.1 if joining else 0.0) + 0.006 * arriving
        for rec in decoding + joining:
            rec.token_times.append(t)
        live[:] = decoding + joining
        for rec in [r for r in live if len(r.token_times) == r.n]:
            live.remove(rec)
            send(t + 0.001, sent)
    return records, eng


def test_staggered_streams_give_the_decode_step_factor_from_the_gaps_without_a_prompt() -> None:
    """A closed loop of 4 streams of varied lengths, each replaced just after it ends: decode
    steps 1.2x the profiled ones, a request sent during a step 6 ms longer for it, a step that
    takes a new prompt 0.1 s longer. The factor is read from the decode steps without a send, at
    the batch decoding in each, and the send's cost from those with one."""
    from pdserve.capacity.profile_fit import _staggered_steps

    records, eng = _staggered_closed_loop()
    ratios, batch, arrival, with_send = _staggered_steps(records, eng, arrival_prior=0.006)
    # not the prompts' steps (0.1 s longer) nor those a request was sent in: enough steps without
    # a send, so the earlier reading of a send's cost is not needed
    assert ratios == pytest.approx([1.2] * len(ratios), rel=1e-6)
    assert len(ratios) >= 50 and 3.0 <= batch <= 4.0 and with_send == 0
    assert arrival == pytest.approx(0.006, rel=1e-6)
    # too few steps to read: nothing
    assert _staggered_steps(records[:2], eng) is None


def test_staggered_streams_with_few_steps_free_of_sends_read_those_with_one_less_its_known_cost(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """At 40-50 streams nearly every step has a send in it: the steps with one join the reading,
    less what an earlier reading on the server put a send at, and only where one is known."""
    import pdserve.capacity.profile_fit as prof

    records, eng = _staggered_closed_loop()
    free, _, _, _ = prof._staggered_steps(records, eng)
    monkeypatch.setattr(prof, "MIN_FREE_STEPS", 10_000)
    ratios, _, arrival, with_send = prof._staggered_steps(records, eng, arrival_prior=0.006)
    assert with_send >= 10 and len(ratios) == len(free) + with_send
    assert ratios == pytest.approx([1.2] * len(ratios), rel=1e-6)
    assert arrival == pytest.approx(0.006, rel=1e-6)   # still read from this run's own gaps
    # a send's cost read wrong (none) prices those steps dear, and only those
    dear, _, _, _ = prof._staggered_steps(records, eng, arrival_prior=0.0)
    assert sum(1 for x in dear if x > 1.2 * 1.01) == with_send
    # no earlier reading: the free steps alone, as before
    alone, _, _, n = prof._staggered_steps(records, eng)
    assert n == 0 and len(alone) == len(free)


def test_staggered_streams_give_each_step_that_took_prompts_once_from_the_phase_records() -> None:
    """A closed loop of 4 streams, each replaced just after it ends: a step that takes new prompts
    costs 50 ms more a prompt, 6 ms more for each request sent during it. The engine's phase record
    gives each prompt its share of its step (its tokens over the step's, the prompts' and one per
    decoding stream). Each step after the first stream ended is read once: its length, its prompt
    tokens, the streams decoding beside them and the requests sent during it."""
    from types import SimpleNamespace

    from pdserve.capacity.profile_fit import _staggered_prompt_steps

    eng = engine(2, decode=(0.02, 0.03, 0.06))
    lengths = iter([20, 25, 30, 35] + [22, 31, 27, 24, 36, 29, 21, 33] * 3)
    t, records, live, waiting, sent, truth = 0.0, [], [], [], [], []

    def send(now: float, to: list) -> None:
        n = next(lengths, None)
        if n is not None:
            rec = SimpleNamespace(ok=True, sent=now, token_times=[], n=n, phase=None)
            records.append(rec)
            to.append(rec)

    for _ in range(4):
        send(0.0, waiting)
    while live or waiting or sent:
        joining, waiting[:] = list(waiting), []
        decoding = list(live)
        arriving = len(sent)
        waiting.extend(sent)
        sent.clear()
        step = 1.2 * eng.decode_step_s(len(decoding) + len(joining), 0) + 0.05 * len(joining) + 0.006 * arriving
        t += step
        for rec in joining:
            rec.phase = {"prefill_s": step * 128 / (128 * len(joining) + len(decoding)), "prompt_tokens": 128,
                         "cached_prompt_tokens": 0}
        if joining and all(r.sent > 0 for r in joining):
            truth.append((step, 128 * len(joining), len(decoding), arriving))
        for rec in decoding + joining:
            rec.token_times.append(t)
        live[:] = decoding + joining
        for rec in [r for r in live if len(r.token_times) == r.n]:
            live.remove(rec)
            send(t + 0.001, sent)
    got = _staggered_prompt_steps(records)
    assert len(truth) >= 15 and any(k > 128 for _, k, _, _ in truth) and any(n for *_, n in truth)
    assert sorted((round(g, 9), k, b, n) for g, k, b, n in got) == sorted((round(g, 9), *rest) for g, *rest in truth)
    # (the first round, sent at once into an empty engine, is left out: truth holds none of it)
    assert _staggered_prompt_steps([]) == []


def test_disaggregated_staggered_streams_split_their_steps_by_the_prefill_beside_them() -> None:
    """A closed loop of 4 disaggregated streams: each replacement's prompt is prefilled for 0.1 s
    on the other worker before its first token; a decode step that overlaps such a prefill takes
    1.5x the profiled step, any other 1.2x."""
    from types import SimpleNamespace

    from pdserve.capacity.profile_fit import _beside_prefills

    eng = engine(1, decode=(0.02, 0.03, 0.06))
    lengths = iter([20, 25, 30, 35] + [22, 31, 27, 24, 36, 29, 21, 33] * 3)
    prefill = 0.1
    t, records, live, pending = 0.0, [], [], []

    def send(now: float) -> None:
        n = next(lengths, None)
        if n is not None:
            start = max([now] + [r.token_times[0] for r in pending])      # one prefill at a time
            rec = SimpleNamespace(ok=True, sent=now, token_times=[start + prefill], n=n,
                                  phase={"prefill_s": prefill, "queue_s": start - now})
            records.append(rec)
            pending.append(rec)

    for _ in range(4):
        send(0.0)
    t = 0.4
    while live or pending:
        joining = [r for r in pending if r.token_times[0] <= t]
        for r in joining:
            pending.remove(r)
        live.extend(joining)
        if not live:
            t = min(r.token_times[0] for r in pending)
            continue
        plain = 1.2 * eng.decode_step_s(len(live), 0)
        busy = any(r.token_times[0] - prefill < t + plain and r.token_times[0] > t for r in pending)
        t += 1.5 * plain / 1.2 if busy else plain
        for rec in live:
            rec.token_times.append(t)
        for rec in [r for r in live if len(r.token_times) == r.n]:
            live.remove(rec)
            send(t)
    beside, apart, later = _beside_prefills(records, eng)
    assert len(beside) >= 20 and len(apart) >= 20
    # a stream counts in the batch from its first token; here it joins at the next step, so a
    # few steps read the batch one too high
    assert sum(x == pytest.approx(1.5) for x in beside) >= 0.9 * len(beside)
    assert sum(x == pytest.approx(1.2) for x in apart) >= 0.9 * len(apart)
    assert statistics.median(beside) == pytest.approx(1.5) and statistics.median(apart) == pytest.approx(1.2)
    assert later == [(prefill, 1)] * len(later) and 0 < len(later) < len(records)   # not the first round


def test_prompts_packed_in_one_prefill_step_read_the_whole_step() -> None:
    """A phase record's prefill_s is the request's share of its step: two prompts packed in one
    step carry the same share, half the step each, and were scheduled together; the same share
    in a step far apart is another step."""
    from types import SimpleNamespace

    from pdserve.capacity.profile_fit import _prefill_steps

    def rec(sent: float, queue: float, share: float) -> SimpleNamespace:
        return SimpleNamespace(ok=True, sent=sent, token_times=[sent + queue + 2 * share + 0.05, sent + 3.0],
                               phase={"queue_s": queue, "prefill_s": share})

    alone, a, b, later_same_share = rec(0.0, 0.0, 0.08), rec(1.0, 0.04, 0.059), rec(1.03, 0.04, 0.059), \
        rec(5.0, 0.0, 0.059)
    failed = SimpleNamespace(ok=False, sent=2.0, token_times=[], phase=None)
    steps = _prefill_steps([alone, a, b, later_same_share, failed])
    assert steps[id(alone)] == (0.08, 1) and steps[id(later_same_share)] == (0.059, 1)
    assert steps[id(a)] == steps[id(b)] == (pytest.approx(0.118), 2)
    assert id(failed) not in steps


def test_a_long_disaggregated_gap_is_kept_as_the_token_gap_tail() -> None:
    """Colocated, a gap longer than a decode step by half a prefill is the step that computed a
    prompt, which the simulator runs itself: left out. Disaggregated the decode worker runs no
    prompts: such a gap is a late delivery or a stalled step, the tail the jitter must carry."""
    from types import SimpleNamespace

    from pdserve.capacity.profile_fit import _staggered_gaps

    eng = engine(1, decode=(0.02, 0.03, 0.06))         # its 128-token prefill 0.1 s: half is 0.05
    def ticks(start: float, end: float, hiccup: float) -> list[float]:
        out, t = [], start
        while t < end:
            out.append(round(t, 6))
            t += 0.12 if abs(t - hiccup) < 0.015 else 0.03
        return out
    early = SimpleNamespace(ok=True, sent=0.0, token_times=ticks(0.1, 1.0, -1.0))
    streams = [SimpleNamespace(ok=True, sent=0.0, token_times=ticks(0.1, 5.0, 2.0)) for _ in range(3)]
    late = SimpleNamespace(ok=True, sent=4.9, token_times=[4.95, 4.98, 5.01])
    records = [early, *streams, late]
    kept = _staggered_gaps(records, eng, prompt_steps=False)
    left = _staggered_gaps(records, eng, prompt_steps=True)
    long_kept = [g for g in kept if g[1] - g[0] > 0.1]
    assert len(long_kept) == 3 and not [g for g in left if g[1] - g[0] > 0.1]
    assert len(kept) == len(left) + 3


def test_disaggregated_staggered_streams_give_the_first_token_overhead_beyond_queue_and_prefill() -> None:
    """The first round (all sent at once) is left out; each later stream's wait beyond its phase
    record's queue and prefill is the overhead, whatever those two were."""
    from types import SimpleNamespace

    from pdserve.capacity.profile_fit import _staggered_first_token_overhead

    def rec(sent: float, queue: float, prefill: float, over: float, end: float) -> SimpleNamespace:
        first = sent + queue + prefill + over
        return SimpleNamespace(ok=True, sent=sent, token_times=[first, end],
                               phase={"queue_s": queue, "prefill_s": prefill})

    first_round = [rec(0.0, 0.1 * i, 0.07, 0.5, 2.0 + i) for i in range(3)]   # queued together, slow
    later = [rec(2.0 + i, q, p, o, 9.0) for i, (q, p, o) in
             enumerate([(0.0, 0.07, 0.08), (0.03, 0.08, 0.09), (0.01, 0.06, 0.085)])]
    failed = SimpleNamespace(ok=False, sent=2.5, token_times=[], phase=None)
    got = _staggered_first_token_overhead(first_round + later + [failed])
    assert got.count == 3 and got.median_s == pytest.approx(0.085)
    assert got.jitter is None and got.queued_s is None      # too few to read a spread or a split from
    assert _staggered_first_token_overhead([failed]) is None
    # enough of them: their quantiles over the median (one in four twice the median)
    many = [rec(2.0 + i, 0.0, 0.07, 0.2 if i % 4 == 3 else 0.1, 9.0) for i in range(40)]
    got = _staggered_first_token_overhead(first_round + many)
    assert (got.count, got.median_s, got.queued_s) == (40, pytest.approx(0.1), None)
    assert got.jitter == pytest.approx([1.0] * 6 + [2.0] * 2)


def test_the_first_token_overhead_is_read_apart_for_prompts_that_waited_at_the_prefill_worker() -> None:
    """A prompt that waited at the prefill worker (its phase record's queue over QUEUED_S) sends
    its first token while the next prompt computes: each kind gets its own median, and the spread
    is each over its own kind's median, pooled."""
    from types import SimpleNamespace

    from pdserve.capacity.profile_fit import QUEUED_S, TTFT_QUANTILES, _staggered_first_token_overhead

    def rec(sent: float, queue: float, over: float, end: float = 60.0) -> SimpleNamespace:
        return SimpleNamespace(ok=True, sent=sent, token_times=[sent + queue + 0.07 + over, end],
                               phase={"queue_s": queue, "prefill_s": 0.07})

    first_round = [rec(0.0, 0.0, 0.5, end=0.9)]
    direct = [rec(1.0 + i, QUEUED_S / 2, 0.06 if i % 2 else 0.04) for i in range(20)]
    waited = [rec(1.5 + i, 0.03, 0.144 if i % 2 else 0.096) for i in range(12)]
    got = _staggered_first_token_overhead(first_round + direct + waited)
    assert (got.count, got.queued) == (32, 12)
    assert got.median_s == pytest.approx(0.05) and got.queued_s == pytest.approx(0.12)
    assert got.jitter == pytest.approx([0.8] * 4 + [1.2] * 4) and len(got.jitter) == TTFT_QUANTILES
    # too few of one kind to read it apart: one figure for all, as before
    few = _staggered_first_token_overhead(first_round + direct + waited[:TTFT_QUANTILES - 1])
    assert few.queued_s is None and few.count == 20 + TTFT_QUANTILES - 1
    assert few.median_s == pytest.approx(statistics.median([0.04, 0.06] * 10 + [0.096, 0.144] * 3 + [0.096]))


def test_a_prompt_that_waited_at_its_prefill_worker_pays_the_queued_first_token_overhead() -> None:
    """Pairs sent at once beside a busy decode worker: the second of each pair waits for the first
    one's prefill and pays ttft_overhead_queued_s, the first the busy figure (the very first
    request, with no stream decoding yet, the lone one in both)."""
    arrivals = np.repeat(np.arange(12) * 3.0, 2)
    p, o = np.full(24, 128), np.full(24, 400)
    shape = ClusterShape("disaggregated", 1, 1, itl_target_s=None)
    one = ServingProfile(ttft_overhead_s=0.01, ttft_overhead_busy_s=0.05)
    split = ServingProfile(ttft_overhead_s=0.01, ttft_overhead_busy_s=0.05, ttft_overhead_queued_s=0.2)
    go = lambda served: simulate(profile(serving={"disaggregated": served}), shape, arrivals, p,  # noqa: E731
                                 np.zeros_like(p), o).ttft_s
    diff = np.round(go(split) - go(one), 9)
    assert diff[0] == 0                                   # the lone figure: nothing decoding yet
    assert np.all(diff[2::2] == 0) and np.allclose(diff[3::2], 0.15)


def test_the_first_token_overhead_is_drawn_per_request_from_its_spread_in_drawn_histories() -> None:
    """A constant overhead left the simulated TTFT p99 19-20% early where the real overheads of
    a load spread from half to twice their median: drawn histories take each request's overhead
    from the measured spread; one deterministic history keeps the figure."""
    spread = [0.5] * 4 + [1.0] * 8 + [2.0] * 4
    plain = profile(serving={"disaggregated": ServingProfile(ttft_overhead_busy_s=0.05)})
    spread_out = profile(serving={"disaggregated": ServingProfile(ttft_overhead_busy_s=0.05, ttft_jitter=spread)})
    arrivals = np.cumsum(np.random.default_rng(4).exponential(0.5, 150))
    p, o = np.full(150, 128), np.full(150, 40)
    shape = ClusterShape("disaggregated", 1, 1, itl_target_s=None)
    go = lambda prof, seed: simulate(prof, shape, arrivals, p, np.zeros_like(p), o, noise_seed=seed)  # noqa: E731
    assert np.array_equal(go(plain, None).ttft_s, go(spread_out, None).ttft_s)    # one history: the figure
    a, b = go(plain, 1), go(spread_out, 1)
    diff = np.round(b.ttft_s - a.ttft_s, 9)      # no step spread here: only the overheads differ
    busy = diff != 0
    assert busy.sum() > 50                       # half the draws are 1.0: no change
    assert set(np.round(diff[busy], 9)) <= {round(0.05 * (x - 1.0), 9) for x in spread}
    assert np.percentile(b.ttft_s, 95) > np.percentile(a.ttft_s, 95) + 0.03   # a heavier tail
    assert np.array_equal(go(spread_out, 1).ttft_s, b.ttft_s)                       # reproducible per seed
    with pytest.raises(ProfileError, match="ttft_jitter"):
        ServingProfile(ttft_jitter=[1.0, 0.0])


def test_the_jitter_quantiles_are_read_over_their_median() -> None:
    from pdserve.capacity.profile_fit import JITTER_QUANTILES, _jitter_quantiles

    values = [0.04] * 90 + [0.12] * 10          # one gap in ten three times the median
    q = _jitter_quantiles(values)
    assert len(q) == JITTER_QUANTILES and q[0] == pytest.approx(1.0) and q[-1] == pytest.approx(3.0)
    assert sum(x == pytest.approx(3.0) for x in q) == JITTER_QUANTILES // 10
    assert _jitter_quantiles(values[:2 * JITTER_QUANTILES - 1]) is None      # too few to read


def test_the_jitter_spreads_every_gap_a_step_that_took_a_prompt_too() -> None:
    """The served gaps' spread is the host's and the delivery path's: a prompt step's gap reaches
    the client the same way, so it is spread as a decode step's is."""
    jitter = [1.0] * 90 + [3.0] * 10          # one gap in ten three times its median
    plain = profile()
    shaky = plain.with_serving("colocated", ServingProfile(itl_jitter=jitter))
    args = ([0.0, 1.0], [128, 128], [200, 3])  # the second prompt's step lands among the first's decodes
    a = run(plain, "colocated", *args)
    b = run(shaky, "colocated", *args)
    prompt_gap = a.itl_percentile(100)         # the longest gap: the step that took the second prompt
    assert prompt_gap > 3 * a.itl_percentile(50)
    assert b.itl_percentile(100) == pytest.approx(3 * prompt_gap, rel=1e-6)     # spread as well
    assert b.itl_percentile(95) == pytest.approx(3 * a.itl_percentile(50), rel=1e-3)   # decode gaps are spread
    assert b.itl_percentile(50) == pytest.approx(a.itl_percentile(50), rel=1e-6)


def test_drawn_steps_are_reproducible_per_seed_and_take_the_profiles_time_on_average() -> None:
    jitter = [1.0] * 80 + [1.5] * 20           # one gap in five half as long again
    shaky = profile().with_serving("colocated", ServingProfile(itl_jitter=jitter))
    rng = np.random.default_rng(3)
    arrivals = np.cumsum(rng.exponential(0.05, 200))
    args = (arrivals, [128] * 200, [32] * 200)

    def go(seed):
        p = np.array(args[1])
        return simulate(shaky, ClusterShape("colocated", 0, 1, itl_target_s=None), np.array(args[0]), p,
                        np.zeros_like(p), np.array(args[2]), noise_seed=seed)

    steady, a, again, b = go(None), go(1), go(1), go(2)
    assert np.array_equal(a.ttft_s, again.ttft_s) and a.span_s == again.span_s       # one seed, one history
    assert not np.array_equal(a.ttft_s, b.ttft_s)                                    # another seed, another
    assert np.array_equal(steady.ttft_s, go(None).ttft_s)
    # drawn around the profile's step (the spread over its mean), the load takes its time
    assert a.span_s == pytest.approx(steady.span_s, rel=0.03)
    assert float(np.mean([go(k).ttft_s.mean() for k in range(8)])) == pytest.approx(steady.ttft_s.mean(), rel=0.1)
    assert np.std(a.ttft_s - steady.ttft_s) > 0.005                                 # but each step varies
    no_spread = profile()   # nothing measured to draw from: the profile's steps as they are
    p = np.array(args[1])
    res = simulate(no_spread, ClusterShape("colocated", 0, 1, itl_target_s=None), np.array(args[0]), p,
                   np.zeros_like(p), np.array(args[2]), noise_seed=1)
    assert np.array_equal(res.ttft_s, run(no_spread, "colocated", *args).ttft_s)


def test_bench_simulate_averages_each_figure_over_the_drawn_histories() -> None:
    from pdserve.bench.serve_load import RequestRecord
    from pdserve.bench.sim_accuracy import METRICS, sim_figures

    shaky = profile().with_serving("colocated", ServingProfile(itl_jitter=[0.8] * 30 + [1.0] * 40 + [1.4] * 30))
    sent = 100.0 + np.cumsum(np.random.default_rng(5).exponential(0.06, 120))
    records = [RequestRecord("load", i, 128, 32, sent=float(t)) for i, t in enumerate(sent)]
    steady = sim_figures(shaky, "colocated", records, 0.1)
    drawn = sim_figures(shaky, "colocated", records, 0.1, seeds=4)
    assert "sim_spread" not in steady and set(drawn["sim_spread"]) == set(METRICS)
    assert drawn["ttft_p99"] != steady["ttft_p99"] and drawn["sim_spread"]["ttft_p99"] > 0
    assert drawn["throughput"] == pytest.approx(steady["throughput"], rel=0.05)
    one = [sim_figures(shaky, "colocated", records, 0.1, seeds=k + 1) for k in range(2)]
    # seeds=2 is the mean of seed 0's and seed 1's figures: seeds=1 is seed 0 alone
    assert 2 * one[1]["ttft_p50"] - one[0]["ttft_p50"] == pytest.approx(
        simulate(shaky, ClusterShape("colocated", 0, 1, itl_target_s=0.1, shared_host=True), sent - sent[0],
                 np.full(120, 128), np.zeros(120, dtype=int), np.full(120, 32), noise_seed=1).summary()["ttft_s"]["p50"])


def test_bench_simulate_takes_each_figure_of_a_load_as_the_median_of_its_repeats() -> None:
    from pdserve.bench.sim_accuracy import METRICS, repeat_figures

    def figures(ttft_p99: float, itl_p50: float) -> dict[str, float]:
        return {"ttft_p50": 0.1, "ttft_p99": ttft_p99, "itl_p50": itl_p50, "itl_p99": 0.08, "throughput": 90.0}

    # one repeat a host stall put 40% high on its TTFT p99; the other two agree
    runs = [figures(0.30, 0.040), figures(0.42, 0.041), figures(0.31, 0.039)]
    median = repeat_figures(runs)
    assert set(median) == set(METRICS)
    assert median["ttft_p99"] == pytest.approx(0.31)
    assert median["itl_p50"] == pytest.approx(0.040)
    # each metric on its own: the median TTFT p99 and the median ITL p50 come from different repeats
    assert repeat_figures([figures(0.30, 0.050), figures(0.42, 0.041), figures(0.31, 0.039)])["itl_p50"] \
        == pytest.approx(0.041)
    assert repeat_figures(runs, np.mean)["ttft_p99"] == pytest.approx((0.30 + 0.42 + 0.31) / 3)
    # two repeats: the median is their mean
    assert repeat_figures(runs[:2])["ttft_p99"] == pytest.approx(0.36)


def test_a_load_whose_first_real_repeats_disagree_runs_more_and_the_rule_reads_only_real_runs() -> None:
    from pdserve.bench.sim_accuracy import METRICS, real_spread, repeats_wanted

    def figs(itl_p50: float, throughput: float = 100.0) -> dict:
        return {m: 0.1 for m in METRICS} | {"itl_p50": itl_p50, "throughput": throughput}

    agree = [figs(0.050), figs(0.052), figs(0.055)]
    apart = [figs(0.049), figs(0.067), figs(0.079)]   # a colocated 0.8 load's three (2026-12-06)
    assert real_spread(apart)["itl_p50"] == pytest.approx((0.079 - 0.049) / 0.067)
    assert repeats_wanted(agree, 7, 0.25) == 3
    assert repeats_wanted(apart, 7, 0.25) == 7
    assert repeats_wanted(apart, 7, 0.5) == 3        # the limit is the one given
    assert repeats_wanted(apart, 3, 0.25) == 3       # no more than --max-repeats
    assert repeats_wanted(apart[:1], 7, 0.25) == 1   # one run has no spread to read
    # the throughput's spread is not a latency figure's: tokens/s apart alone runs no more
    assert repeats_wanted([figs(0.05, 100), figs(0.05, 140), figs(0.05, 100)], 7, 0.25) == 3


def test_bench_simulate_refuses_a_negative_number_of_drawn_histories(capsys) -> None:
    import argparse

    from pdserve.bench.sim_accuracy import add_args, run

    parser = argparse.ArgumentParser()
    add_args(parser)
    assert run(parser.parse_args(["--json", "/nonexistent/sim.json", "--sim-seeds", "-1"])) == 2
    assert "--sim-seeds must be >= 0" in capsys.readouterr().out
    assert run(parser.parse_args(["--json", "/nonexistent/sim.json", "--repeats", "0"])) == 2
    assert "--repeats must be >= 1" in capsys.readouterr().out
    assert run(parser.parse_args(["--json", "/nonexistent/sim.json", "--repeats", "5", "--max-repeats", "4"])) == 2
    assert "--max-repeats (4) must be >= --repeats (5)" in capsys.readouterr().out
    assert run(parser.parse_args(["--json", "/nonexistent/sim.json", "--spread-limit", "0"])) == 2
    assert "--spread-limit must be > 0" in capsys.readouterr().out


def test_bench_simulate_refuses_records_where_a_file_stands(capsys, tmp_path: Path) -> None:
    import argparse

    from pdserve.bench.sim_accuracy import add_args, run

    parser = argparse.ArgumentParser()
    add_args(parser)
    (tmp_path / "taken").write_text("")
    assert run(parser.parse_args(["--json", str(tmp_path / "sim.json"), "--records", str(tmp_path / "taken")])) == 2
    assert "--records" in capsys.readouterr().out and not (tmp_path / "sim.json").exists()


def test_the_served_handoff_extra_delays_the_second_token_not_the_first() -> None:
    plain = profile()
    slow = profile(serving={"disaggregated": ServingProfile(handoff_extra_s=0.02)})
    a = run(plain, "disaggregated", [0.0], [128], [5])
    b = run(slow, "disaggregated", [0.0], [128], [5])
    assert b.ttft_s[0] == pytest.approx(a.ttft_s[0])
    assert b.e2e_s[0] == pytest.approx(a.e2e_s[0] + 0.02)
    assert b.itl_percentile(100) == pytest.approx(a.itl_percentile(100) + 0.02)   # the gap after the handoff
    # a colocated worker hands nothing off
    co = profile(serving={"colocated": ServingProfile(handoff_extra_s=0.02)})
    assert run(co, "colocated", [0.0], [128], [5]).e2e_s[0] == pytest.approx(run(plain, "colocated", [0.0], [128], [5]).e2e_s[0])


def test_staggered_streams_run_enough_rounds_to_read_the_jitter_tail() -> None:
    from pdserve.capacity.profile_fit import BUSY_OUT, STAGGER_MIN_GAPS, STAGGER_ROUNDS, _stagger_rounds

    assert _stagger_rounds(8) == STAGGER_ROUNDS == _stagger_rounds(32, STAGGER_MIN_GAPS)
    assert _stagger_rounds(3, STAGGER_MIN_GAPS) == 6
    for streams in (2, 3, 4, 7, 8, 15):
        rounds = _stagger_rounds(streams, STAGGER_MIN_GAPS)
        # the gaps read: a round's streams * BUSY_OUT, less two and a half rounds
        assert (rounds - 2.5) * streams * BUSY_OUT >= STAGGER_MIN_GAPS
        assert (rounds - 3.5) * streams * BUSY_OUT < STAGGER_MIN_GAPS or rounds == STAGGER_ROUNDS

"""``pdserve plan``: prefill and decode replicas for a traffic description, with the arithmetic.

The estimate follows the seeds' serving estimate step by step, with every figure taken from the
profile instead of a rule of thumb:

1. Decode batch per worker: the largest batch whose step (at the mean context of a running
   sequence, prompt + half the output) meets the ITL SLO, no larger than ``max_num_seqs`` and than
   the KV cache holds at the mean sequence length. Whichever limit sets it is named.
2. Decode tokens/s per worker at that batch; 3. completions per worker per second (over the mean
   output length); 4. the peak completions per second needed; 5. decode workers = 4 / 3.
6. Prefill: the uncached prompt tokens per second needed over one prefill worker's throughput at
   its chunk size (``max_num_batched_tokens``), at most 80% busy so a queue does not build; and the
   TTFT a lone prompt already costs (prefill + KV handoff) against the SLO.
7. KV handoff: bytes per second into each decode worker against the profiled bandwidth.
8. Cross-check against memory: concurrent sequences per decode worker (Little's law: completions
   per second x seconds per completion) against what its KV cache holds.

The arithmetic is then checked by simulation (``capacity/simulate.py``) at the peak rate: a pool
is grown while its SLO percentile is missed (TTFT: prefill; ITL: decode), and shrunk while the
SLOs still hold with one worker fewer. The colocated alternative (every worker doing both
phases, on the colocated thread count) is sized the same way, for comparison in cores.

The seeds' own back-of-envelope (decode workers, then about +30% for prefill and headroom) is
printed beside it.
"""

from __future__ import annotations

import math

import numpy as np

from pdserve.capacity.profile import Profile
from pdserve.capacity.simulate import ClusterShape, simulate
from pdserve.capacity.traffic import Traffic

PREFILL_MAX_BUSY = 0.8
SEEDS_HEADROOM = 0.30
SIM_REQUESTS = 20_000
SEARCH_STEPS = 40


def _fmt(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:,.3g}"


def decode_batch(profile: Profile, traffic: Traffic, role: str = "decode") -> tuple[int, str, float]:
    """(batch, the limit that set it, the step time in s there)."""
    eng = profile.role(role)
    ctx = traffic.prompt_len.mean + traffic.output_len.mean / 2
    max_seqs = int(profile.engine["max_num_seqs"])
    per_seq = traffic.prompt_len.mean + traffic.output_len.mean
    b_mem = max(1, int(profile.kv_capacity_tokens // per_seq))
    b_itl = 0
    for b in range(1, max_seqs + 1):
        if eng.decode_step_s(b, b * ctx) <= traffic.slo.itl_s:
            b_itl = b
    if b_itl == 0:
        return 1, "ITL SLO (not met even at batch 1)", eng.decode_step_s(1, ctx)
    b = min(b_itl, b_mem, max_seqs)
    why = "ITL SLO" if b == b_itl and b_itl < min(b_mem, max_seqs) else \
          "KV memory" if b == b_mem and b_mem < max_seqs else "max_num_seqs"
    return b, why, eng.decode_step_s(b, b * ctx)


def estimate(profile: Profile, traffic: Traffic) -> dict:
    """The arithmetic (no simulation): the seeds' sequence with measured figures."""
    R = traffic.peak_rate
    P, O = traffic.prompt_len.mean, traffic.output_len.mean
    uncached = P * (1 - traffic.prefix_share)
    steps: list[str] = []
    b, why, step_s = decode_batch(profile, traffic)
    tok_s = b / step_s
    per_worker = tok_s / O
    decode = max(1, math.ceil(R / per_worker - 1e-9))
    steps += [
        f"1. Decode throughput per worker, batched: batch {b} (set by {why}), one step {step_s * 1e3:.1f} ms "
        f"at {P + O / 2:.0f} tokens of context each  =  {_fmt(tok_s)} tokens/s",
        f"2. Average completion length                  {_fmt(O)} tokens",
        f"3. Completions per worker per second          {_fmt(tok_s)} / {_fmt(O)}  =  {_fmt(per_worker)}",
        f"4. Peak completions per second needed         {_fmt(R)}",
        f"5. Workers for decode                         {_fmt(R)} / {_fmt(per_worker)}  =  {decode}"
        + (f" (rounded up from {R / per_worker:.2f})" if abs(R / per_worker - decode) > 1e-9 else ""),
    ]
    pe = profile.role("prefill")
    chunk = int(profile.engine["max_num_batched_tokens"])
    p_tok_s = pe.prefill_tokens_per_s(chunk)
    need = R * uncached
    prefill = max(1, math.ceil(need / (p_tok_s * PREFILL_MAX_BUSY) - 1e-9))
    lone = pe.prefill_step_s(max(1, round(uncached)), round(P - uncached))
    xfer_s = profile.transfer.transfer_s(P * profile.kv_bytes_per_token)
    steps += [
        f"6. Prefill: {_fmt(R)} requests/s x {_fmt(uncached)} uncached prompt tokens = {_fmt(need)} tokens/s; "
        f"one prefill worker does {_fmt(p_tok_s)} tokens/s at {chunk}-token chunks; at most "
        f"{PREFILL_MAX_BUSY:.0%} busy  =  {prefill} prefill workers",
        f"   a lone prompt's first token: prefill {lone * 1e3:.0f} ms + KV handoff {xfer_s * 1e3:.1f} ms "
        f"vs TTFT SLO {traffic.slo.ttft_s * 1e3:.0f} ms",
    ]
    xfer_load = R / decode * P * profile.kv_bytes_per_token / profile.transfer.bytes_per_s
    steps.append(f"7. KV handoff into each decode worker: {_fmt(R / decode)} prompts/s x "
                 f"{P * profile.kv_bytes_per_token / 1e6:.2f} MB = {xfer_load:.1%} of its "
                 f"{profile.transfer.bytes_per_s / 1e9:.2f} GB/s link")
    e2e = O * step_s
    concurrent = R / decode * e2e
    kv_tokens = concurrent * (P + O)
    steps.append(f"8. Memory: {_fmt(R / decode)} completions/s x {e2e:.1f} s each = {concurrent:.1f} sequences "
                 f"per decode worker x {_fmt(P + O)} tokens = {_fmt(kv_tokens)} of {_fmt(profile.kv_capacity_tokens)} "
                 f"KV tokens ({kv_tokens / profile.kv_capacity_tokens:.0%})")
    binding = []
    if lone + xfer_s > traffic.slo.ttft_s:
        binding.append("SLO: a lone prompt's prefill and handoff already exceed the TTFT SLO")
    if why.startswith("ITL"):
        binding.append("SLO (ITL) sets the decode batch")
    if why == "KV memory" or kv_tokens > profile.kv_capacity_tokens:
        binding.append("KV memory")
    if xfer_load > 1:
        binding.append("transfer: the handoffs exceed the link")
        decode = max(decode, math.ceil(R * P * profile.kv_bytes_per_token / profile.transfer.bytes_per_s))
    if not binding:
        binding.append("compute (decode throughput at the batch max_num_seqs allows)")
    seeds_total = math.ceil(decode * (1 + SEEDS_HEADROOM))
    return {"prefill": prefill, "decode": decode, "decode_batch": b, "decode_batch_limit": why,
            "chunk_tokens": chunk, "decode_tokens_per_s_per_worker": tok_s, "completions_per_s_per_worker": per_worker,
            "prefill_tokens_per_s_per_worker": p_tok_s, "steps": steps, "binding": binding,
            "seeds_estimate": {"decode": decode, "total": seeds_total,
                               "line": f"Seeds' rule: {decode} decode workers + ~{SEEDS_HEADROOM:.0%} for prefill and "
                                       f"headroom = ~{seeds_total} workers"}}


def colocated_estimate(profile: Profile, traffic: Traffic) -> dict:
    R = traffic.peak_rate
    P, O = traffic.prompt_len.mean, traffic.output_len.mean
    uncached = P * (1 - traffic.prefix_share)
    b, why, step_s = decode_batch(profile, traffic, "colocated")
    eng = profile.role("colocated")
    chunk = int(profile.engine["max_num_batched_tokens"])
    busy_per_request = uncached / eng.prefill_tokens_per_s(chunk) + O * step_s / b
    per_worker = 1.0 / busy_per_request
    workers = max(1, math.ceil(R / (per_worker * PREFILL_MAX_BUSY) - 1e-9))
    return {"workers": workers, "decode_batch": b, "requests_per_s_per_worker": per_worker,
            "line": f"Colocated: each worker spends {uncached / eng.prefill_tokens_per_s(chunk) * 1e3:.0f} ms "
                    f"prefilling and {O * step_s / b * 1e3:.0f} ms of decode steps per request (batch {b}): "
                    f"{per_worker:.2f} requests/s; at most {PREFILL_MAX_BUSY:.0%} busy = {workers} workers"}


def _meets(profile: Profile, traffic: Traffic, shape: ClusterShape, n: int) -> tuple[bool, bool, dict]:
    """(TTFT met, ITL met, the simulation's summary) at the traffic's peak rate."""
    arrays = traffic.at_rate(traffic.peak_rate).draw(n)
    res = simulate(profile, shape, *arrays)
    s = res.summary()
    q = traffic.slo.percentile
    ttft = float(np.percentile(res.ttft_s, q)) if len(res.ttft_s) else math.inf
    itl = res.itl_percentile(q) or 0.0
    s.update(ttft_at_slo_percentile=ttft, itl_at_slo_percentile=itl)
    return ttft <= traffic.slo.ttft_s, itl <= traffic.slo.itl_s, s


def _search(profile: Profile, traffic: Traffic, mode: str, prefill: int, decode: int, n: int,
            max_workers: int) -> tuple[int, int, dict, list[str], bool]:
    """Grow the pool whose SLO is missed until both are met; then try one worker fewer of each."""
    log: list[str] = []
    for _ in range(SEARCH_STEPS):
        shape = ClusterShape(mode, prefill, decode, itl_target_s=traffic.slo.itl_s)
        ttft_ok, itl_ok, s = _meets(profile, traffic, shape, n)
        log.append(f"simulated {prefill} prefill + {decode} decode: TTFT p{traffic.slo.percentile:g} "
                   f"{s['ttft_at_slo_percentile'] * 1e3:.0f} ms, ITL p{traffic.slo.percentile:g} "
                   f"{s['itl_at_slo_percentile'] * 1e3:.0f} ms")
        if ttft_ok and itl_ok:
            break
        if prefill + decode >= max_workers:
            return prefill, decode, s, log + ["stopped at --max-workers without meeting the SLOs"], False
        if mode == "colocated":
            decode += max(1, decode // 10)
        else:
            if not ttft_ok:
                prefill += max(1, prefill // 10)
            if not itl_ok:
                decode += max(1, decode // 10)
    else:
        return prefill, decode, s, log + [f"no shape met the SLOs within {SEARCH_STEPS} steps"], False
    # shrink while still met
    for pool in ("prefill", "decode"):
        while True:
            p2, d2 = (prefill - 1, decode) if pool == "prefill" else (prefill, decode - 1)
            if (p2 < 1 and mode != "colocated") or d2 < 1 or (pool == "prefill" and mode == "colocated"):
                break
            ttft_ok, itl_ok, s2 = _meets(profile, traffic, ClusterShape(mode, p2, d2, itl_target_s=traffic.slo.itl_s), n)
            if not (ttft_ok and itl_ok):
                break
            prefill, decode, s = p2, d2, s2
            log.append(f"simulated {prefill} prefill + {decode} decode: still meets the SLOs")
    return prefill, decode, s, log, True


def make_plan(profile: Profile, traffic: Traffic, *, verify: bool = True, max_workers: int = 100_000,
              sim_requests: int = SIM_REQUESTS) -> dict:
    est = estimate(profile, traffic)
    col = colocated_estimate(profile, traffic)
    plan: dict = {"traffic": {"peak_rate": traffic.peak_rate, "prompt_mean": traffic.prompt_len.mean,
                              "output_mean": traffic.output_len.mean, "prefix_share": traffic.prefix_share,
                              "slo": traffic.slo.model_dump()},
                  "profile": {"host": profile.host.get("cpu_model"), "model": profile.model.get("name"),
                              "dtype": profile.model.get("dtype")},
                  "estimate": est, "colocated_estimate": col}
    prefill, decode = est["prefill"], est["decode"]
    workers = col["workers"]
    n = min(sim_requests, max(2_000, int(traffic.peak_rate * 120)))
    if verify:
        prefill, decode, sim, log, ok = _search(profile, traffic, "disaggregated", prefill, decode, n, max_workers)
        plan["simulation"] = {"requests": n, "log": log, "met": ok, "result": sim}
        _, workers, csim, clog, cok = _search(profile, traffic, "colocated", 0, workers, n, max_workers)
        plan["colocated_simulation"] = {"requests": n, "log": clog, "met": cok, "result": csim}
    if traffic.daily is not None:
        # the arithmetic at every point of the daily curve: what the planner would run through the day
        plan["daily"] = [{"hour": h, "rate": r, **({"prefill": 0, "decode": 0} if r <= 0 else
                          {k: estimate(profile, traffic.at_rate(r))[k] for k in ("prefill", "decode")})}
                         for h, r in traffic.daily]
    p_threads, d_threads, c_threads = (profile.roles[r] for r in ("prefill", "decode", "colocated"))
    plan["answer"] = {"prefill": prefill, "decode": decode, "decode_batch": est["decode_batch"],
                      "max_num_seqs": est["decode_batch"], "max_num_batched_tokens": est["chunk_tokens"],
                      "cores": prefill * p_threads + decode * d_threads, "binding": est["binding"]}
    plan["colocated"] = {"workers": workers, "cores": workers * c_threads}
    return plan


def format_plan(plan: dict) -> str:
    est, ans, col = plan["estimate"], plan["answer"], plan["colocated"]
    t = plan["traffic"]
    lines = [f"Traffic: {t['peak_rate']:g} requests/s at peak, prompts {t['prompt_mean']:g} tokens "
             f"({t['prefix_share']:.0%} cached), outputs {t['output_mean']:g}; SLO p{t['slo']['percentile']:g} "
             f"TTFT {t['slo']['ttft_s'] * 1e3:.0f} ms, ITL {t['slo']['itl_s'] * 1e3:.0f} ms",
             f"Profile: {plan['profile']['model']} ({plan['profile']['dtype']}) on {plan['profile']['host']}", ""]
    lines += est["steps"]
    lines += ["", f"Arithmetic: {est['prefill']} prefill + {est['decode']} decode workers. "
                  f"{est['seeds_estimate']['line']}.",
              "Binding: " + "; ".join(ans["binding"])]
    for key, title in (("simulation", "Disaggregated"), ("colocated_simulation", "Colocated")):
        if key in plan:
            lines += ["", f"{title}, checked by simulation ({plan[key]['requests']} requests at the peak rate):"]
            lines += [f"  {x}" for x in plan[key]["log"]]
    if "daily" in plan:
        lines += ["", "Through the day (the arithmetic at each point of the curve; the plan is for the peak):"]
        lines += [f"  {d['hour']:5.1f} h  {d['rate']:g} requests/s: {d['prefill']} prefill + {d['decode']} decode"
                  for d in plan["daily"]]
    lines += ["", f"Plan: {ans['prefill']} prefill + {ans['decode']} decode workers ({ans['cores']} cores); "
                  f"decode max_num_seqs {ans['max_num_seqs']}, max_num_batched_tokens {ans['max_num_batched_tokens']}",
              f"Colocated alternative: {col['workers']} workers ({col['cores']} cores). {plan['colocated_estimate']['line']}"]
    return "\n".join(lines)

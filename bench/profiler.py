"""``pdserve profile``: measure one model on this host into a capacity profile (``capacity/profile.py``;
what the served records say is fitted by ``capacity/profile_fit.py``).

    pdserve profile --model DIR --json FILE [--dtype auto] [--threads 1,2] [--quick]

For each thread count (default: what a worker computes on here: a disaggregated worker's share of
the cores, and all of them for the colocated worker), one ``LLMEngine`` with the workers' engine
settings is built (its construction time is the worker start time) and measured, every figure
the median of repeated real engine steps:

* prefill steps of one prompt of 16 ... 2,048 tokens (``max_num_batched_tokens``: a step never
  takes more), and of 128 new tokens after 1,024 cached ones (the attention cost of context);
* decode steps at batch 1 ... 64 (``max_num_seqs``) on 64-token prompts, and at batch 8 on
  512-token prompts (the cost of context per token);
* a KV handoff: NIXL writes between two processes (UCX, as the workers use it) of 8 and 128 of
  this model's KV blocks, one descriptor per block; fitted as overhead + bytes / bandwidth;
* a disaggregated pair on one host: this engine's prefill (256 tokens) and decode (batch 16) steps
  while a second engine in another process, on another core, decodes or prefills beside it;
* served overheads (``--no-served`` skips them): a real ``pdserve up`` of each mode (colocated;
  disaggregated, one prefill and one decode worker) on 127.0.0.1 answers lone streamed requests
  (128 prompt tokens, 16 out) one at a time; what the quickest of them take beyond the profiled
  engine steps (first token; median token gap) is the path's overhead (HTTP, router, Ray calls,
  the handoff's control messages), and ``pdserve up``'s time is the cluster's start time; then
  8 streams at once (disaggregated, two waves in lockstep; colocated, streams of varied lengths
  each replaced as it ends, as under a load): their token gaps against the profiled decode step
  at that batch say how much slower the engine steps when served on this host (the router, Ray
  and the client share its cores), a factor the simulator applies to that mode's steps; requests
  beside decoding streams (colocated: their step's cost beyond its parts; disaggregated: their KV
  handoff as served); and, disaggregated, streams of varied lengths each replaced as it ends, so
  the prefill worker takes prompts while the decode worker decodes: the two workers' steps
  beside each other as served.

Bounded: about 3-4 minutes for the ``small`` model on 2 cores (``--quick``: fewer points, ~1 minute
without the served part).
"""

from __future__ import annotations

import argparse
import bisect
import datetime as _dt
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from pdserve.bench.engine import EngineDecode, engine_prefill
from pdserve.capacity.profile import PROFILE_VERSION, EngineProfile, Profile, ServingProfile, TransferProfile
from pdserve.capacity.profile_fit import (BESIDE_BACKGROUND_OUT, BESIDE_DELAY_S, BESIDE_PROBES, BUSY_OUT,
                                          BUSY_STREAMS, MIN_PROMPT_STEPS, MIXED_BACKGROUND_OUT,
                                          MIXED_LONG_PROMPT, MIXED_PROBES, SERVED_OUT, SERVED_PROMPT,
                                          SERVED_REQUESTS, STAGGER_MIN_GAPS, _beside_prefills,
                                          _jitter_quantiles, _probe_steps, _probe_wait_overhead,
                                          _served_prompts, _stagger_rounds, _staggered_first_token_overhead,
                                          _staggered_prompt_steps, _staggered_steps, _timed_after_first_round,
                                          format_profile, mixed_step_fit)

logger = logging.getLogger(__name__)

# every 64 tokens from 128 to 384: a step that packs two or three of a load's 128-token prompts is
# priced between them, and one noisy point bends that octave (2026-12-05: the profile's 128 read 48
# ms where 256 read 64, a ratio of 1.34 against the engine's 1.6 then, so the second prompt of a
# packed step was priced at 21 ms where it cost 41-51 served)
PREFILL_TOKENS = (16, 64, 128, 192, 256, 320, 384, 512, 1024, 2048)
PREFILL_PASSES = 5
# every 2-4 streams through the batches a load runs at: the simulator interpolates between them,
# and one point 10% off bends the curve over a whole octave (2026-12-05: the profile's step at 16
# read x0.78 of this host's speed then where 8-12 read x0.70)
# Above 32 streams, every row bucket (engine/row_buckets.py): the engine pads a step's rows up to
# its bucket, so its cost rises in stairs there (2026-12-06, Intel AMX: 30.8 ms a step at 32-36
# streams, 33.3 at 37-40), and a line between 32 and 48 priced 36 streams 2% high and 37 5% low.
DECODE_BATCHES = (1, 2, 4, 6, 8, 10, 12, 16, 20, 24, 32, 36, 40, 44, 48, 52, 56, 60, 64)
QUICK_PREFILL = (16, 128, 512)
QUICK_BATCHES = (1, 8, 32)
SHORT_PROMPT, LONG_PROMPT, CTX_BATCH = 64, 512, 8
CORUN_PROMPT, CORUN_BATCH = 256, 16
CTX_CACHED, CTX_NEW = 1024, 128


def default_threads() -> tuple[int, ...]:
    """A disaggregated worker's threads on this host (one prefill and one decode worker share the
    cores) and the colocated worker's (all of them)."""
    cores = len(os.sched_getaffinity(0))
    return tuple(sorted({max(1, cores // 2), cores}))


def _engine(model_dir: str, dtype: str, threads: int, max_seqs: int, max_batched: int, kv_gb: float):
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model_dir, dtype=dtype, kv_cache_memory_gb=kv_gb, max_num_seqs=max_seqs,
                                  max_num_batched_tokens=max_batched, num_threads=threads))


def _prompt(gen, vocab: int, n: int) -> list[int]:
    import torch

    return torch.randint(3, vocab, (n,), generator=gen).tolist()


def _decode_step_s(engine, prompts: list[list[int]], steps: int) -> float:
    run = EngineDecode(engine, prompts, steps + 1)
    try:
        run.step()   # the first full-batch step
        return statistics.median(run.step()[0] for _ in range(steps))
    finally:
        run.close()


def profile_engine(engine, vocab: int, *, quick: bool, max_seqs: int, max_batched: int, seed: int = 0) -> EngineProfile:
    import torch

    gen = torch.Generator().manual_seed(seed)
    repeats = 1 if quick else 3
    lens = [n for n in (QUICK_PREFILL if quick else PREFILL_TOKENS) if n <= max_batched]
    engine_prefill(engine, _prompt(gen, vocab, 32))   # warm
    # whole passes over the lengths, not repeats of one length in a row: a slow spell of this
    # shared host then lands on one sample of several lengths, and the medians drop it
    passes = [[engine_prefill(engine, _prompt(gen, vocab, n)) for n in lens]
              for _ in range(1 if quick else PREFILL_PASSES)]
    pre = [statistics.median(p[j] for p in passes) for j in range(len(lens))]
    # attention over cached context: the same 1,024 tokens, then 128 more after them
    base = _prompt(gen, vocab, CTX_CACHED)
    engine_prefill(engine, base)
    with_ctx = engine_prefill(engine, base + _prompt(gen, vocab, CTX_NEW))
    plain = statistics.median(engine_prefill(engine, _prompt(gen, vocab, CTX_NEW)) for _ in range(repeats))
    attn = max(0.0, (with_ctx - plain) / (CTX_NEW * CTX_CACHED))
    batches = [b for b in (QUICK_BATCHES if quick else DECODE_BATCHES) if b <= max_seqs]
    steps = 3 if quick else 8
    # whole passes over the batches, as over the prompt lengths above
    dec_passes = [[_decode_step_s(engine, [_prompt(gen, vocab, SHORT_PROMPT) for _ in range(b)], steps)
                   for b in batches] for _ in range(repeats)]
    dec = [statistics.median(p[j] for p in dec_passes) for j in range(len(batches))]
    b_ctx = min(CTX_BATCH, max_seqs)
    long = _decode_step_s(engine, [_prompt(gen, vocab, LONG_PROMPT) for _ in range(b_ctx)], steps)
    short = _decode_step_s(engine, [_prompt(gen, vocab, SHORT_PROMPT) for _ in range(b_ctx)], steps)
    per_ctx = max(0.0, (long - short) / (b_ctx * (LONG_PROMPT - SHORT_PROMPT)))
    # the timed steps run a few tokens past the prompt
    return EngineProfile(threads=engine.runner.num_threads, prefill_tokens=lens, prefill_s=pre,
                         decode_batch=batches, decode_s=dec, decode_ctx=SHORT_PROMPT + 2,
                         decode_s_per_ctx_token=per_ctx, attn_s_per_token_ctx=attn,
                         decode_row_buckets=bool(engine.runner.bucket_rows))


def _corun_main(conn, model_dir: str, dtype: str, threads: int, core: int | None, kind: str) -> None:
    """A second engine on another core, stepping prefills or a decoding batch until told to stop."""
    import torch

    if core is not None:
        os.sched_setaffinity(0, {core})
    engine = _engine(model_dir, dtype, threads, 64, 2048, 0.5)
    vocab = int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])
    gen = torch.Generator().manual_seed(1)
    from pdserve.engine.sampling_params import SamplingParams

    conn.send("ready")
    if kind == "decode":
        params = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
        for i in range(CORUN_BATCH):
            engine.add_request(f"bg-{i}", _prompt(gen, vocab, SHORT_PROMPT), params)
    while not conn.poll(0):
        if kind == "decode":
            engine.step()
        else:
            engine_prefill(engine, _prompt(gen, vocab, CORUN_PROMPT))
    conn.send("stopped")


def measure_corun(engine, model_dir: str, dtype: str, threads: int, vocab: int, quick: bool) -> dict:
    """How much slower this engine's prefill and decode steps run while a second engine (another
    process, another core, as a disaggregated pair runs on one host) decodes or prefills beside it."""
    import multiprocessing as mp

    import torch

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2 * threads:
        return {}
    gen = torch.Generator().manual_seed(2)
    repeats = 3 if quick else 5
    own = set(cores[:threads])
    other = cores[threads] if threads == 1 else None
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, own)
    out: dict = {}
    try:
        def prefill_s() -> float:
            return statistics.median(engine_prefill(engine, _prompt(gen, vocab, CORUN_PROMPT)) for _ in range(repeats))

        def decode_s() -> float:
            return _decode_step_s(engine, [_prompt(gen, vocab, SHORT_PROMPT) for _ in range(CORUN_BATCH)], repeats)

        for mine, theirs, measure in (("prefill", "decode", prefill_s), ("decode", "prefill", decode_s)):
            alone = measure()
            ctx = mp.get_context("spawn")
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_corun_main, args=(child, model_dir, dtype, threads, other, theirs), daemon=True)
            proc.start()
            try:
                if not parent.poll(180):
                    raise RuntimeError("the co-running engine did not start")
                parent.recv()
                time.sleep(0.5)
                beside = measure()
                parent.send("stop")
                parent.poll(60)
            finally:
                proc.join(30)
                if proc.is_alive():
                    proc.kill()
            out[f"{mine}_x"] = max(1.0, beside / alone)
            out[f"{mine}_alone_s"], out[f"{mine}_beside_s"] = alone, beside
    finally:
        os.sched_setaffinity(0, before)
    return out


def profile_transfer(block_bytes: int, quick: bool) -> TransferProfile:
    """NIXL writes of 8 and 128 KV blocks between two processes; one descriptor per block."""
    from pdserve.bench.transfer_pair import measure_raw

    points = []
    for blocks in (8, 128):
        res = measure_raw(block_bytes * blocks, [blocks], repeats=2 if quick else 4)
        if res.error or not res.patterns:
            raise RuntimeError(f"the NIXL transfer could not be measured: {res.error}")
        points.append({"bytes": block_bytes * blocks, "seconds": statistics.median(res.patterns[0].seconds),
                       "backend": res.backend})
    (b0, s0), (b1, s1) = [(p["bytes"], p["seconds"]) for p in points]
    bw = (b1 - b0) / max(s1 - s0, 1e-9)
    overhead = max(0.0, s0 - b0 / bw)
    return TransferProfile(overhead_s=overhead, bytes_per_s=bw, measured=points,
                           how="raw NIXL write between two processes on this host (UCX), one descriptor per "
                               "block; the workers' handoff adds its control messages")


def measure_serving(model_dir: str, dtype: str, engines: dict[str, EngineProfile], roles: dict[str, int],
                    port: int = 8000, corun: dict | None = None, transfer: TransferProfile | None = None,
                    kv_bytes_per_token: int = 0) -> dict[str, ServingProfile]:
    """Each mode's served overheads (``measure_served``) through a real ``pdserve up`` of it."""
    from pdserve.bench.servers import Server

    out: dict[str, ServingProfile] = {}
    for mode, kind in (("colocated", "pdserve-colocated"), ("disaggregated", "pdserve")):
        sets = ["planner.enabled=false", f"model.dtype={dtype}"]
        if mode == "disaggregated":
            sets.append("router.disaggregation.mode=always")
        with Server(kind, model_dir, port=port, extra_set=sets) as server:
            out[mode] = measure_served(server, mode, model_dir, engines, roles, corun, transfer=transfer,
                                       kv_bytes_per_token=kv_bytes_per_token)
    return out


def _staggered_group(streams: int, seed: int, min_gaps: int = 0):
    """``streams`` streams of 24-72 tokens, ``_stagger_rounds`` per slot, each replaced as it ends:
    they decode out of step while new prompts keep arriving, as under a load."""
    from pdserve.bench.serve_load import GroupSpec

    return GroupSpec("busy", _stagger_rounds(streams, min_gaps) * streams, prompt_len=SERVED_PROMPT,
                     output_len=(BUSY_OUT // 2, 3 * BUSY_OUT // 2), concurrency=streams, seed=seed)


def measure_served(server, mode: str, model_dir: str, engines: dict[str, EngineProfile], roles: dict[str, int],
                   corun: dict | None = None, seed: int = 7_777, streams: int = BUSY_STREAMS,
                   transfer: TransferProfile | None = None, kv_bytes_per_token: int = 0,
                   arrival_readings: Sequence[float] = ()) -> ServingProfile:
    """A running ``pdserve up`` of ``mode`` against the profiled engine steps
    (``arrival_readings``: this server's earlier readings of ``arrival_s``, pooled with this one's):

    * lone requests, one at a time: the engines' own prefill times in their phase records against
      the profiled prefill step (``prefill_x``), and what the client waits beyond them for a first
      token (``ttft_overhead_s``);
    * ``streams`` streams at once, their token gaps against the profiled decode step at that
      batch (``step_x``: the serving stack's CPU on the workers' cores, and any drift of the host
      since the profile). Disaggregated, two waves in lockstep, their steady gaps; the gaps in
      which no stream arrived, started or ended, over their median, are the token-gap jitter
      (``itl_jitter``); both stand only where the staggered streams below give too few gaps,
      which give them as a load has them. Colocated, streams of varied lengths each replaced as it ends
      (``_staggered_steps``: the gaps without a prompt or a request sent in their step, each
      against the step at the batch decoding then; their median is ``step_x``, the same ratios
      over it the jitter; the gaps with one request sent in them, less that, what an arrival adds
      to the step it comes in: ``arrival_s`` is the median of this reading and
      ``arrival_readings``, a cost of the serving path per request, not of the batch, which one
      reading at 33-50 streams, where nearly every gap has a send or a prompt, put at 0-3 ms where
      the rest read 4-9; and the steps that took the replacements' prompts, from their phase
      records (``_staggered_prompt_steps``), beyond the probes' prompt factor and the decodes:
      ``mixed_extra_s``, where 12 or more).
      ``itl_overhead_s`` is 0 then, and the lone requests' gaps beyond one sequence's decode step
      only when no busy gap was measured;
    * requests one at a time beside ``streams - 1`` decoding streams: what a first token pays
      beyond its step when the cores and the decode side are busy (``ttft_overhead_busy_s``;
      colocated, their waits before their own steps beyond the rest of the decode step running
      when they came, ``_probe_wait_overhead``); colocated, also
      their own step less a decode step of the same streams then, against the profiled prefill
      at two prompt lengths (``_probe_steps``: ``mixed_prefill_x`` and ``mixed_extra_s``, whose
      fixed part the staggered streams' prompt steps above give instead where they are enough);
      disaggregated, also the
      one-host factors as served (``corun_decode_x``, ``corun_prefill_x``);
    * disaggregated, the same requests' KV handoff as their phase records time it (exposed:
      from the first token until the last block was sent), pooled with the staggered streams'
      replacements' below, beyond the profiled raw transfer of those bytes (``handoff_extra_s``);
    * disaggregated, ``streams`` streams of varied lengths, each replaced as it ends (a load's
      pattern: the prefill worker takes the replacements' prompts while the others decode): their
      token gaps against the profiled step at the batch then: those while no prompt was
      prefilled give ``step_x`` (where 50 or more; else the waves'), those while one was, over
      it, ``corun_decode_x``; both kinds over their own medians the jitter (``_stagger_rounds``
      rounds, enough to read about ``STAGGER_MIN_GAPS`` gaps); those prompts'
      prefill times against the
      lone ones' ``corun_prefill_x`` (the single probes' figures when these could not be read:
      a probe's prefill read 1.2-1.45x the lone one where the loads' own phase records said
      1.0-1.1x).

    ``pdserve profile`` calls it once per mode with ``BUSY_STREAMS`` streams; ``bench simulate``
    again on the server under test, before and after each load, with a fresh ``seed`` (new
    prompts, so no prefix is cached) and as many ``streams`` as a decoding request of the load
    sees beside it (served steps do not grow with the batch as the engine's own do, so a factor
    read at 8 streams does not hold at 16)."""
    import asyncio

    from pdserve.bench.serve_load import GroupSpec, Target, run_load
    from pdserve.bench.serve_stats import gaps

    if streams < 2:
        raise ValueError(f"measure_served: streams must be >= 2 (a probe beside at least one stream), got {streams}")
    vocab = int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])
    first_role = "colocated" if mode == "colocated" else "prefill"
    target = Target("openai", server.url, server.served_model, vocab_size=vocab)
    warm = GroupSpec("warm", 2, prompt_len=SERVED_PROMPT, output_len=4, concurrency=1, seed=seed)
    asyncio.run(run_load(target, [warm], time_limit_s=120))
    group = GroupSpec("lone", SERVED_REQUESTS, prompt_len=SERVED_PROMPT, output_len=SERVED_OUT,
                      concurrency=1, seed=seed + 1)
    res = asyncio.run(run_load(target, [group], time_limit_s=180))
    lone_ttfts = [r.token_times[0] - r.sent for r in res.records if r.ok]
    # the background's prompts are all prefilled by then: the probes queue behind none of them
    ramp_s = (streams - 1) * (statistics.median(lone_ttfts) if lone_ttfts else 0.2)
    if mode == "colocated":
        # streams of varied lengths, each replaced as it ends, so they decode out of step, prompts
        # keep arriving and the batch stays near ``streams``, as under a load. Their decode steps
        # ran x1.06-1.08 slower than lockstep waves of the same batch (engine step records,
        # 2026-12-04): the replacements' arrivals, each lengthening the step it came in (2026-12-05)
        busy_group = _staggered_group(streams, seed + 2)
    else:
        busy_group = GroupSpec("busy", 2 * streams, prompt_len=SERVED_PROMPT, output_len=BUSY_OUT,
                               concurrency=streams, seed=seed + 2)
    busy = asyncio.run(run_load(target, [busy_group], time_limit_s=300))
    colocated = mode == "colocated"
    background_out = MIXED_BACKGROUND_OUT if colocated else BESIDE_BACKGROUND_OUT
    background = GroupSpec("background", streams - 1, prompt_len=SERVED_PROMPT, output_len=background_out,
                           concurrency=streams - 1, seed=seed + 3)
    with tempfile.TemporaryDirectory(prefix="pdserve-served-") as tmp:
        trace = None
        if colocated:   # prompts of two lengths, alternating
            trace = Path(tmp) / "probes.jsonl"
            trace.write_text("".join(json.dumps({"prompt_len": n, "output_len": 4}) + "\n"
                                     for n in (SERVED_PROMPT, MIXED_LONG_PROMPT)))
        probes = GroupSpec("beside", MIXED_PROBES if colocated else BESIDE_PROBES, prompt_len=SERVED_PROMPT,
                           output_len=4, concurrency=1, start_delay_s=ramp_s + BESIDE_DELAY_S, seed=seed + 4,
                           trace=trace)
        beside = asyncio.run(run_load(target, [background, probes], time_limit_s=300))
    saturated = None
    if mode == "disaggregated":
        # streams of varied lengths, each replaced as it ends: decoding out of step while the
        # prefill worker takes the replacements' prompts, as under a load
        saturated = asyncio.run(run_load(target, [_staggered_group(streams, seed + 5, STAGGER_MIN_GAPS)],
                                         time_limit_s=300))
    ok = [r for r in res.records if r.ok]
    if len(ok) < SERVED_REQUESTS // 2:
        raise RuntimeError(f"served {mode}: only {len(ok)} of {SERVED_REQUESTS} requests completed: "
                           f"{res.errors[:3]}")
    first = engines[str(roles[first_role])].prefill_step_s(SERVED_PROMPT)
    dec_eng = engines[str(roles["colocated" if mode == "colocated" else "decode"])]
    # prefill: the engines' own record of each lone prompt's step, and the client's wait beyond it
    ttfts = [r.token_times[0] - r.sent for r in ok]
    timed = [r for r in ok if r.phase and (r.phase.get("prefill_s") or 0) > 0]
    prefill_x, ttft_over, pre_how = None, max(0.0, min(ttfts) - first), ""
    if len(timed) >= SERVED_REQUESTS // 2:
        served_prefill = statistics.median(r.phase["prefill_s"] for r in timed)
        prefill_x = served_prefill / first
        ttft_over = max(0.0, statistics.median(r.token_times[0] - r.sent - r.phase["prefill_s"] for r in timed))
        pre_how = f" (served prefill {served_prefill * 1e3:.0f} ms: x{prefill_x:.2f})"
    # decode: the steady gaps of ``streams`` streams at once are decode steps at that batch
    steady = [g for r in busy.records if r.ok for g in gaps(r.token_times)[1:]]
    lone_gap = statistics.median(statistics.median(gaps(r.token_times)) for r in ok if len(r.token_times) > 1)
    step = dec_eng.decode_step_s(1, SERVED_PROMPT + SERVED_OUT / 2)
    step_x, busy_how = 1.0, ""
    # the jitter: steady gaps in which no stream of the run arrived, got its first token or
    # ended (the simulator runs those steps itself), over their median (colocated: the staggered
    # streams' decode steps over the profiled ones at their batch, over their median)
    prior = statistics.median(arrival_readings) if arrival_readings else None
    staggered = _staggered_steps(busy.records, dec_eng, prior) if mode == "colocated" else None
    if staggered is not None:
        clean = staggered[0]
    else:
        marks = sorted(t for r in busy.records if r.ok for t in (r.sent, r.token_times[0], r.token_times[-1]))
        clean = [b - a for r in busy.records if r.ok for a, b in zip(r.token_times[1:], r.token_times[2:])
                 if bisect.bisect_right(marks, b) == bisect.bisect_right(marks, a - 0.005)]
    itl_jitter = _jitter_quantiles(clean)
    arrival = arrival_read = None
    if staggered is not None:
        step_x, n_gaps, batch, arrival_read = statistics.median(clean), len(clean), staggered[1], staggered[2]
        readings = [*arrival_readings, *([arrival_read] if arrival_read is not None else [])]
        arrival = statistics.median(readings) if readings else None
        with_send = staggered[3]
        busy_how = (f"; {streams} staggered streams: {n_gaps - with_send} token gaps without a prompt or a send "
                    f"in their step" + (f" and {with_send} with one send, less the earlier readings' "
                                        f"+{prior * 1e3:.1f} ms" if with_send else "")
                    + f", at {batch:.1f} streams on average: decode steps x{step_x:.2f} served")
        if arrival is not None:
            busy_how += (f"; a request sent during a step +{arrival * 1e3:.1f} ms to it"
                         + (f" (the median of {len(readings)} readings on this server; here "
                            + (f"+{arrival_read * 1e3:.1f} ms)" if arrival_read is not None else "too few)")
                            if arrival_readings else ""))
    elif steady:
        busy_gap = statistics.median(steady)
        busy_step = dec_eng.decode_step_s(streams, streams * (SERVED_PROMPT + BUSY_OUT / 2))
        step_x = busy_gap / busy_step
        busy_how = (f"; {streams} streams at once: token gap median {busy_gap * 1e3:.1f} ms against a "
                    f"{busy_step * 1e3:.1f} ms decode step at that batch: decode steps x{step_x:.2f} served")
    # a per-token overhead beyond the steps only where no busy measurement gave the step factor:
    # with one, the busy gaps (where loads run) are matched by the steps alone, and a lone stream's
    # own gaps (on this host sometimes slower than eight streams' at once) would only add to them
    itl_over = max(0.0, lone_gap - step_x * step) if not steady else 0.0
    p_x = step_x if prefill_x is None else prefill_x
    over_busy, beside_how = None, ""
    # the probes that arrived while the whole background was still decoding
    bg = [r for r in beside.records if r.group == "background" and r.ok]
    bg_end = min((r.token_times[-1] for r in bg), default=0.0)
    probes_in = [r for r in beside.records if r.group == "beside" and r.ok and r.token_times[-1] < bg_end]
    probe_ttfts = [r.token_times[0] - r.sent for r in probes_in if r.prompt_len == SERVED_PROMPT]
    corun_prefill_x = corun_decode_x = None
    corun_how = ""
    if mode == "disaggregated" and len(bg) == streams - 1 and prefill_x is not None:
        # one host, as served: the background's token gaps while a probe's prefill computed on
        # the other core (its engine's prefill time before its first token) against the gaps of
        # the same streams while it did not; and the probes' prefills against the lone ones
        busy_spans = [(r.token_times[0] - r.phase["prefill_s"], r.token_times[0]) for r in probes_in
                      if r.phase and (r.phase.get("prefill_s") or 0) > 0]
        first_probe = min((r.sent for r in probes_in), default=bg_end)
        beside_gaps, apart_gaps = [], []
        for r in bg:
            for a, b in zip(r.token_times[1:], r.token_times[2:]):
                if a < first_probe or b > bg_end:
                    continue
                (beside_gaps if any(a < hi and b > lo for lo, hi in busy_spans) else apart_gaps).append(b - a)
        if len(busy_spans) >= BESIDE_PROBES // 2 and len(beside_gaps) >= 20 and len(apart_gaps) >= 20:
            corun_decode_x = statistics.median(beside_gaps) / statistics.median(apart_gaps)
            corun_prefill_x = statistics.median(hi - lo for lo, hi in busy_spans) / (prefill_x * first)
            corun_how = (f"; on one host: decode gaps {statistics.median(beside_gaps) * 1e3:.1f} ms while the "
                         f"prefill worker computed, {statistics.median(apart_gaps) * 1e3:.1f} ms while not "
                         f"(x{corun_decode_x:.2f}), prefills beside decoding x{corun_prefill_x:.2f}")
    handoff_extra = None
    exposed = [r.phase["kv_exposed_s"] for r in probes_in if r.phase and r.phase.get("kv_exposed_s")]
    # and the staggered streams' replacements', handed off as a load's are: one handoff's exposed
    # time ranges widely (a 0.3-of-capacity load's p10-p90 1.5-28 ms), and the 8 probes' median
    # alone read 10.6-15.7 ms at 3 streams where the loads' own records read 11.8-13.7 ms, and
    # 13.4-15.5 ms at 7 streams where those read 15.6-21.8 ms (2026-12-06/07)
    n_probes = len(exposed)
    if saturated is not None:
        exposed += [r.phase["kv_exposed_s"] for r in _timed_after_first_round(saturated.records)
                    if r.phase.get("kv_exposed_s")]
    if mode == "disaggregated" and n_probes >= BESIDE_PROBES // 2:
        # the handoff beside decoding streams, as the phase records time it, beyond the raw
        # NIXL transfer of those bytes the profile measured
        raw = transfer.transfer_s(SERVED_PROMPT * kv_bytes_per_token) if transfer is not None else 0.0
        handoff_extra = statistics.median(exposed) - raw
        corun_how += (f"; KV handoff beside decoding streams {statistics.median(exposed) * 1e3:.1f} ms exposed "
                      f"(the median of {n_probes} probes' and {len(exposed) - n_probes} staggered streams') "
                      f"against {raw * 1e3:.1f} ms raw ({handoff_extra * 1e3:+.1f} ms)")
    stag_over = None   # the staggered streams' first-token overhead (FirstTokenOverhead)
    if saturated is not None and steady and prefill_x is not None:
        # one host, under a load's pattern: staggered streams' token gaps against the profiled
        # step at the batch then, while the prefill worker was idle (step_x, where there are
        # enough of them; else the waves') and while it computed a replacement's prompt (its
        # phase record's prefill before its first token): over step_x, corun_decode_x (the
        # simulator runs such a step at step_x * corun_decode_x). Those prompts' prefills against
        # the lone ones are corun_prefill_x; the first round's, all queued at once, are left out.
        # Lockstep waves beside one-token requests that kept the prefill worker busy read x0.92
        # of these loads' own decode steps (engine step records, 2026-12-05), as lockstep
        # colocated waves did against staggered streams.
        beside_x, apart_x, later = _beside_prefills(saturated.records, dec_eng)
        if len(beside_x) >= 20 and len(later) >= streams // 2 + 1:
            probes_x, probes_px = corun_decode_x, corun_prefill_x
            waves_x = step_x
            if len(apart_x) >= 50:
                # the decode steps while the prefill worker is idle, in the same pattern: at 10
                # streams x0.78 here where the lockstep waves read x0.64 (at 3 streams, alike)
                step_x = statistics.median(apart_x)
            corun_decode_x = statistics.median(beside_x) / step_x
            # the prefill worker's time in those steps over the price of the same steps (one
            # prompt each at first's length, or several packed) at the served prefill
            prefill_of = engines[str(roles[first_role])].prefill_step_s
            corun_prefill_x = (sum(t / k for t, k in later)
                               / sum(prefill_x * prefill_of(k * SERVED_PROMPT, parts=[SERVED_PROMPT] * k) / k
                                     for _, k in later))
            packed = sum(1 for _, k in later if k > 1)
            # the jitter as a load has it: each kind of gap over its own median (the simulator
            # applies the two factors itself); the waves' clean gaps were narrower, and the
            # simulated token-gap p99 at 0.8 of capacity 30-40% short with them (2026-12-05)
            spread = [x / statistics.median(beside_x) for x in beside_x]
            if apart_x:
                spread += [x / statistics.median(apart_x) for x in apart_x]
            itl_jitter = _jitter_quantiles(spread) or itl_jitter
            # The first token beside a load's pattern: the probes, sent one at a time while the
            # prefill worker was otherwise idle, read 57-65 ms beyond their prefill where the
            # staggered streams and a 0.55-of-capacity load both read 83-88 (Intel host,
            # 2026-12-05; simulated TTFT p50 19-29% early at 0.55 of capacity with the probes')
            stag_over = _staggered_first_token_overhead(saturated.records)
            corun_how += (f"; {streams} staggered streams: {len(beside_x)} token gaps while the prefill worker "
                          f"computed x{statistics.median(beside_x):.2f} of the profiled step"
                          + (f", {len(apart_x)} while not x{statistics.median(apart_x):.2f}" if apart_x else "")
                          + f" (the waves x{waves_x:.2f}): decode steps x{step_x:.2f}, x{corun_decode_x:.2f} "
                          f"beside prefills; {len(later)} of their prefills, {packed} of them packed with another "
                          f"prompt, steps {statistics.median(t for t, _ in later) * 1e3:.0f} ms: "
                          f"x{corun_prefill_x:.2f} beside decoding"
                          + (f" (single probes: decode x{probes_x:.2f}, prefill x{probes_px:.2f})"
                             if probes_x is not None and probes_px is not None else ""))
    mixed_extra = mixed_prefill_x = None
    # colocated: each probe's own step less a decode step of the background then (their token
    # gaps: _probe_steps), against the profiled prefill of its prompt (two lengths: a factor and a
    # fixed part), and what the client waited beyond its engine's TTFT (the phase records); the
    # TTFT below is the fallback
    timed_in = [r for r in probes_in if r.phase and r.phase.get("ttft_s") is not None]
    by_len = _probe_steps(probes_in, bg) if mode == "colocated" else {}
    if mode == "colocated" and len(bg) == streams - 1 and len(by_len.get(SERVED_PROMPT, [])) >= 3:
        prefill_of = engines[str(roles[first_role])].prefill_step_s
        fit = mixed_step_fit(by_len, prefill_of)
        short = statistics.median(by_len[SERVED_PROMPT])
        # the simulator's prompt step is its decodes plus mixed_prefill_x times the prefill, less
        # one sequence's decode, plus mixed_extra_s (EngineProfile.mixed_step_s): that decode is
        # added back here, so the step less its decodes comes out as measured
        one_decode = step_x * dec_eng.decode_step_s(1, dec_eng.decode_ctx)
        if fit is not None:
            mixed_prefill_x, fixed = fit
            mixed_extra = fixed + one_decode
            long = max(by_len)
            beside_how = (f"; {sum(map(len, by_len.values()))} requests beside {streams - 1} decoding streams: "
                          f"their steps less a decode step then {short * 1e3:.0f} ms at {SERVED_PROMPT} prompt "
                          f"tokens, {statistics.median(by_len[long]) * 1e3:.0f} ms at {long}: "
                          f"x{mixed_prefill_x:.2f} of the profiled prefill {fixed * 1e3:+.0f} ms")
        else:
            mixed_extra = short - p_x * first + one_decode
            beside_how = (f"; {len(by_len[SERVED_PROMPT])} requests beside {streams - 1} decoding streams: their "
                          f"steps less a decode step then {short * 1e3:.0f} ms at {SERVED_PROMPT} prompt tokens "
                          f"against a {p_x * first * 1e3:.0f} ms served prefill")
        # what the client waits beyond the simulator's wait and step: the probes' waits before
        # their own steps against the rest of a decode step (the engine's own TTFT, sent to
        # first token, left out the request's way in: simulated TTFT p50 6-9% short at 0.3-0.55
        # of capacity over nine runs, 2026-12-05; the waits read 4-11 ms more)
        over_busy = _probe_wait_overhead(probes_in, bg, arrival)
        if over_busy is not None:
            beside_how += f", +{over_busy * 1e3:.0f} ms beyond the rest of a decode step and their own"
        elif timed_in:
            over_busy = max(0.0, statistics.median(r.token_times[0] - r.sent - r.phase["ttft_s"] for r in timed_in))
            beside_how += f", +{over_busy * 1e3:.0f} ms beyond their engine's TTFT"
    elif len(bg) == streams - 1 and len(probe_ttfts) >= BESIDE_PROBES // 2:
        ctx = (streams - 1) * (SERVED_PROMPT + background_out / 2)
        if mode == "colocated":
            # a mixed step (the batch's decode plus the prompt beyond one token), after the rest of
            # the decode step running when the request came: half of one, on average. The simulator
            # runs both itself, so neither is overhead.
            running = step_x * dec_eng.decode_step_s(streams - 1, ctx)
            extra = max(0.0, p_x * first - step_x * dec_eng.decode_step_s(1, dec_eng.decode_ctx))
            busy_first = running / 2 + running + extra
        else:
            busy_first = p_x * first * (corun_prefill_x if corun_prefill_x is not None
                                        else float((corun or {}).get("prefill_x", 1.0)))
        over_busy = max(0.0, statistics.median(probe_ttfts) - busy_first)
        beside_how = (f"; {len(probe_ttfts)} requests beside {streams - 1} decoding streams: TTFT median "
                      f"{statistics.median(probe_ttfts) * 1e3:.0f} ms against a {busy_first * 1e3:.0f} ms "
                      f"first step there")
    if colocated and mixed_extra is not None:
        # the fixed part read again from the staggered streams' own steps that took prompts (1-3
        # of them beside a full batch, requests arriving: a load's pattern), against the probes'
        # line less its fixed part; the probes keep the factor on the prompt tokens. A probe comes
        # alone beside lockstep streams: one-prompt steps among staggered streams at 42 streams
        # ran 87-88 ms where the probes' line priced 76-77, two- and three-prompt steps 7-12% over
        # it (engine step records, 2026-12-06). Each step less the arrivals in it (the simulator
        # adds those itself); its time is the engine's compute, without the 1-2 ms of scheduling
        # and output around it
        prompt_steps = _staggered_prompt_steps(busy.records) if staggered is not None else []
        if len(prompt_steps) >= MIN_PROMPT_STEPS:
            prefill_of = engines[str(roles[first_role])].prefill_step_s
            mpx = mixed_prefill_x if mixed_prefill_x is not None else p_x
            one_decode = step_x * dec_eng.decode_step_s(1, dec_eng.decode_ctx)
            probes_extra = mixed_extra
            mixed_extra = statistics.median(
                seconds - (arrival or 0.0) * sent
                - step_x * dec_eng.decode_step_s(batch, batch * (SERVED_PROMPT + BUSY_OUT / 2))
                - max(0.0, mpx * prefill_of(tokens, parts=_served_prompts(tokens)) - one_decode)
                for seconds, tokens, batch, sent in prompt_steps)
            packed = sum(1 for _, tokens, _, _ in prompt_steps if tokens > SERVED_PROMPT)
            beside_how += (f"; {len(prompt_steps)} steps of the staggered streams that took prompts ({packed} "
                           f"packing more than one): {mixed_extra * 1e3:+.0f} ms beyond that line's prompt "
                           f"tokens and decodes (the probes' {probes_extra * 1e3:+.0f} ms)")
    ttft_jitter = over_queued = None
    if stag_over is not None and stag_over.count >= streams // 2 + 1:
        probes_over = over_busy
        over_busy = max(0.0, stag_over.median_s)
        # how it varies by request: a load's TTFT p99 is its queue's tail plus this one's
        # (disaggregated TTFT p99 simulated 19-20% early at 0.55-0.8 of capacity with a constant,
        # p50 within 3%; a 0.8 load's overheads read p10 51, p50 105, p99 213 ms; 2026-12-05), and
        # whether it waited at the prefill worker: drawn around one figure for both, a 0.55 load's
        # simulated TTFT p50 read 16% late, the unqueued half's first tokens spread above its floor
        ttft_jitter = stag_over.jitter
        if stag_over.queued_s is not None:
            over_queued = max(0.0, stag_over.queued_s)
            beside_how += (f"; {stag_over.count} staggered streams' first tokens beyond their queue and prefill: "
                           f"+{over_busy * 1e3:.0f} ms the {stag_over.count - stag_over.queued} that did not wait "
                           f"at the prefill worker, +{over_queued * 1e3:.0f} ms the {stag_over.queued} that did: "
                           "the busy first-token overheads")
        else:
            beside_how += (f"; {stag_over.count} staggered streams' first tokens +{over_busy * 1e3:.0f} ms beyond "
                           "their queue and prefill: the busy first-token overhead")
        if probes_over is not None:
            beside_how += f" (the single probes' +{probes_over * 1e3:.0f} ms)"
    served = ServingProfile(
        ttft_overhead_s=ttft_over, itl_overhead_s=itl_over, ttft_overhead_busy_s=over_busy,
        ttft_overhead_queued_s=over_queued,
        step_x=step_x, prefill_x=prefill_x, mixed_prefill_x=mixed_prefill_x, mixed_extra_s=mixed_extra,
        handoff_extra_s=handoff_extra, arrival_s=arrival,
        arrival_read_s=arrival_read,
        corun_decode_x=corun_decode_x, corun_prefill_x=corun_prefill_x,
        itl_jitter=itl_jitter, ttft_jitter=ttft_jitter,
        start_s=server.start_s,
        how=f"{len(ok)} lone requests ({SERVED_PROMPT} in, {SERVED_OUT} out) through `pdserve up`: TTFT median "
            f"{statistics.median(ttfts) * 1e3:.0f} ms against a {first * 1e3:.0f} ms profiled prefill step{pre_how}; "
            f"median token gap {lone_gap * 1e3:.1f} ms against a {step * 1e3:.1f} ms decode step{busy_how}{beside_how}"
            f"{corun_how}")
    logger.info("served %s: %s", mode, served.how)
    return served


def speed_probe(repeats: int = 7) -> float:
    """Median seconds of a fixed one-thread workload: fp32 matmuls (compute) and a 64 MB copy
    (memory bandwidth), the two things engine steps are made of. Run where nothing else of ours
    computes; the ratio of two probes says how much faster or slower this host is now."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gen = torch.Generator().manual_seed(0)
        a = torch.randn(64, 1024, generator=gen)
        w = torch.randn(1024, 1024, generator=gen)
        src = torch.empty(16 << 20)
        dst = torch.empty_like(src)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(8):
                torch.mm(a, w)
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    finally:
        torch.set_num_threads(threads)


def _host() -> dict:
    from pdserve.bench.hw import cpu_model

    flags: list[str] = []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                flags = sorted(have & {"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile"})
                break
    except OSError:
        pass
    return {"cpu_model": cpu_model(), "cores": len(os.sched_getaffinity(0)), "machine": platform.machine(),
            "flags": flags}


def run_profile(model_dir: str, *, dtype: str = "auto", threads: tuple[int, ...] | None = None,
                quick: bool = False, max_seqs: int = 64, max_batched: int = 2048,
                kv_cache_memory_gb: float = 2.0, transfer: bool = True, served: bool = True,
                port: int = 8000, corun: bool = True) -> Profile:
    t_start = time.perf_counter()
    probe = speed_probe()
    threads = threads or default_threads()
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    vocab = int(cfg["vocab_size"])
    engines: dict[str, EngineProfile] = {}
    corun_figures: dict = {}
    start_s = 0.0
    runner_info: dict = {}
    for t in threads:
        t0 = time.perf_counter()
        engine = _engine(model_dir, dtype, t, max_seqs, max_batched, kv_cache_memory_gb)
        if not start_s:
            start_s = time.perf_counter() - t0
        runner_info = {"dtype": engine.runner.dtype_name, "kv_block_bytes": engine.runner.kv_block_bytes,
                       "num_kv_blocks": engine.runner.num_blocks, "block_size": engine.runner.block_size,
                       "num_layers": engine.runner.spec.num_layers}
        logger.info("profiling %s on %d threads", model_dir, t)
        engines[str(t)] = profile_engine(engine, vocab, quick=quick, max_seqs=max_seqs, max_batched=max_batched)
        if t == max(1, len(os.sched_getaffinity(0)) // 2) and corun:
            corun_figures = measure_corun(engine, model_dir, dtype, t, vocab, quick)
        del engine
    cores = len(os.sched_getaffinity(0))
    split = str(max(1, cores // 2)) if str(max(1, cores // 2)) in engines else str(min(threads))
    whole = str(cores) if str(cores) in engines else str(max(threads))
    block_bytes = int(runner_info["kv_block_bytes"])
    kv_per_token = block_bytes // int(runner_info["block_size"])
    xfer = profile_transfer(block_bytes, quick) if transfer else TransferProfile(
        overhead_s=0.0, bytes_per_s=1e12, how="not measured (--no-transfer): free")
    roles = {"prefill": int(split), "decode": int(split), "colocated": int(whole)}
    serving = measure_serving(model_dir, runner_info["dtype"], engines, roles, port, corun_figures, xfer,
                              kv_per_token) if served else {}
    return Profile(
        host=_host(),
        model={"path": str(model_dir), "name": Path(model_dir).name, "dtype": runner_info["dtype"],
               "kv_bytes_per_token": kv_per_token, "num_layers": runner_info["num_layers"],
               "vocab_size": vocab},
        engine={"block_size": runner_info["block_size"], "max_num_seqs": max_seqs,
                "max_num_batched_tokens": max_batched, "num_kv_blocks": runner_info["num_kv_blocks"],
                "kv_cache_memory_gb": kv_cache_memory_gb},
        engines=engines, roles=roles, transfer=xfer, worker_start_s=start_s, serving=serving, corun=corun_figures,
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        profile_wall_s=time.perf_counter() - t_start, speed_probe_s=(probe + speed_probe()) / 2,
        version=PROFILE_VERSION)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="model directory (Hugging Face format)")
    p.add_argument("--json", type=Path, required=True, help="write the profile here")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--threads", help="comma-separated thread counts (default: a disaggregated worker's share "
                   "of this host's cores, and all of them)")
    p.add_argument("--quick", action="store_true", help="fewer points and repeats (tests)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-memory-gb", type=float, default=2.0, help="KV cache per worker, as the workers run")
    p.add_argument("--no-transfer", action="store_true", help="skip the NIXL handoff measurement (counted free)")
    p.add_argument("--no-served", action="store_true", help="skip the served overheads (no `pdserve up`; counted 0)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port of the served measurement (127.0.0.1)")


def run(args: argparse.Namespace) -> int:
    from pdserve.engine.errors import InvalidRequestError

    if not (Path(args.model) / "config.json").is_file():
        raise InvalidRequestError(f"--model {args.model}: no config.json there (a Hugging Face model directory)")
    try:
        threads = tuple(int(x) for x in args.threads.split(",")) if args.threads else None
    except ValueError:
        raise InvalidRequestError(f"--threads takes comma-separated integers, got {args.threads!r}") from None
    if threads and min(threads) < 1:
        raise InvalidRequestError("--threads: every count must be >= 1")
    if not args.kv_cache_memory_gb > 0:
        raise InvalidRequestError("--kv-cache-memory-gb must be > 0")
    if args.max_num_seqs < 1 or args.max_num_batched_tokens < args.max_num_seqs:
        raise InvalidRequestError("need --max-num-seqs >= 1 and --max-num-batched-tokens >= --max-num-seqs")
    prof = run_profile(args.model, dtype=args.dtype, threads=threads, quick=args.quick,
                       max_seqs=args.max_num_seqs, max_batched=args.max_num_batched_tokens,
                       kv_cache_memory_gb=args.kv_cache_memory_gb, transfer=not args.no_transfer,
                       served=not args.no_served, port=args.port)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    prof.save(args.json)
    print(format_profile(prof))
    print(f"wrote {args.json}", file=sys.stderr)
    return 0

"""The capacity profile's fits of what ``pdserve profile`` measured on a served cluster: the
pure half of the profiler (``bench/profiler.py`` starts the engines, the NIXL pair and the
served clusters and hands their records here). Each function takes measured records (phase
records, token gaps, probes' timings) and the profiled engine steps and returns the figures a
``ServingProfile`` holds; the constants are the measurement protocol those records come from.
No engine, Ray or Redis: testable on synthetic records (``tests/unit/test_capacity.py``).
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import defaultdict
from collections.abc import Callable
from typing import Any, NamedTuple

from pdserve.capacity.profile import EngineProfile, Profile

SERVED_PROMPT, SERVED_OUT, SERVED_REQUESTS = 128, 16, 8
BUSY_STREAMS, BUSY_OUT = 8, 48
STAGGER_ROUNDS = 3      # requests per stream in the staggered busy measurements, at least
BESIDE_BACKGROUND_OUT, BESIDE_PROBES, BESIDE_DELAY_S = 240, 8, 0.5
# colocated: the probes beside decoding streams alternate prompts of SERVED_PROMPT and of this
# many tokens, so a step's prompt tokens get their own factor and its fixed cost is read apart
# (steps that packed two to four queued prompts, 256-512 tokens, cost about the profiled prefill
# of their tokens, where a lone prompt's step is read x0.76-0.9 of it: engine step records, 2026-12-05)
MIXED_LONG_PROMPT, MIXED_PROBES, MIXED_BACKGROUND_OUT = 384, 12, 320
JITTER_QUANTILES = 50   # of the busy waves' token gaps over their median (ServingProfile.itl_jitter)
TTFT_QUANTILES = 8      # of the staggered streams' first-token overheads (ServingProfile.ttft_jitter)
QUEUED_S = 0.005        # a phase record's queue beyond this: the prompt waited at its first worker
PACKED_WINDOW_S = 0.06  # prompts with one prefill share scheduled this close together shared a step (the
                        # router's hop put a packed pair's sends plus queues up to 46 ms apart, 2026-12-05)
# disaggregated: the staggered streams beside the prefill worker run enough rounds to read about
# this many token gaps, so the top of the JITTER_QUANTILES jitter quantiles is the gaps' p99.
# Three rounds at 3 streams read 106 gaps, whose top quantile is their second largest (about
# their p98): the low loads' jitter read p99 x1.44-1.59 where the loads' own gaps, split and read
# the same way, had x1.55-1.74, and the simulated token-gap p99 at 0.3 of capacity came 10-20%
# short in ten full runs of 2026-12-06/07, the one figure past 0.15 in most of them
STAGGER_MIN_GAPS = 10 * JITTER_QUANTILES
MIN_RATIO = 0.01        # the smallest quantile ratio kept (ServingProfile requires them > 0)
MIN_PROMPT_STEPS = 12   # colocated: staggered steps that took prompts needed to read mixed_extra_s from
MIN_FREE_STEPS = 8      # colocated: steps without a send that make a step-factor reading on their own


def mixed_step_fit(steps: dict[int, list[float]], prefill_s: Callable[[int], float],
                   min_each: int = 3) -> tuple[float, float] | None:
    """Colocated steps that took one prompt beside decoding streams, less those decodes, by the
    prompt's length: the line through the medians of the shortest and the longest length against
    the profiled prefill of that many tokens. Returns (factor on the prefill, fixed seconds), or
    None without ``min_each`` steps at two lengths or with a factor outside 0.25-4 (noise)."""
    lengths = sorted(n for n, xs in steps.items() if len(xs) >= min_each)
    if len(lengths) < 2:
        return None
    lo, hi = lengths[0], lengths[-1]
    x_lo, x_hi = statistics.median(steps[lo]), statistics.median(steps[hi])
    p_lo, p_hi = prefill_s(lo), prefill_s(hi)
    if p_hi <= p_lo:
        return None
    factor = (x_hi - x_lo) / (p_hi - p_lo)
    if not 0.25 <= factor <= 4.0:
        return None
    return factor, x_lo - factor * p_lo


def _staggered_steps(records: list, dec_eng: EngineProfile, arrival_prior: float | None = None
                     ) -> tuple[list[float], float, float | None, int] | None:
    """Staggered streams' decode steps against the profiled ones: the token gaps from the first
    stream's end to the last stream's start (streams out of step, the batch full) in whose step no
    stream got its first token (a prompt's step, which the simulator runs itself), each over the
    profiled step at the batch decoding then (the streams started and not yet ended).

    A request sent during a step lengthens it (its HTTP request, tokenization and stream on the
    same cores: +6 ms on a 42 ms step here, engine step records of 2026-12-05), so the gaps are
    split by whether a request was sent within them. Returns (the ratios of the gaps without one,
    the mean batch, what one request sent within a gap added to it in seconds: the median over
    the gaps with exactly one, less ``step_x`` times the profiled step, how many gaps with one
    send the ratios hold), or None with fewer than 50 gaps. The cost is None with fewer than 20
    gaps with one.

    Every stream decoding in a step gives a gap of it, so at 40-50 streams the gaps without a send
    came from 2-8 steps, and once from too few, where the fallback (every token gap) read x1.87
    where the calibrations on either side read x1.41 and x1.45 (2026-12-06). Where those gaps span
    fewer than ``MIN_FREE_STEPS`` steps and an earlier reading of the cost of a send
    (``arrival_prior``) is known, the gaps with one send, less it, join them."""
    steps = _staggered_gaps(records, dec_eng)
    sends = sorted(r.sent for r in records if r.sent is not None)
    free, one = [], []
    for a, b, x, batch in steps:
        n = bisect.bisect_right(sends, b) - bisect.bisect_right(sends, a)
        if n == 0:
            free.append((x, batch))
        elif n == 1:
            one.append((b - a, batch))

    def profiled(batch: float) -> float:
        return dec_eng.decode_step_s(batch, batch * (SERVED_PROMPT + BUSY_OUT / 2))

    arrival = None
    if len(free) >= 50:
        step_x = statistics.median(x for x, _ in free)
        if len(one) >= 20:
            arrival = max(0.0, statistics.median(g - step_x * profiled(b) for g, b in one))
    added: list[tuple[float, float]] = []
    few_steps = not free or len(free) / statistics.fmean(b for _, b in free) < MIN_FREE_STEPS
    if few_steps and arrival_prior is not None:
        added = [((g - arrival_prior) / profiled(b), b) for g, b in one]
    ratios = free + added
    if len(ratios) < 50:
        return None
    return [x for x, _ in ratios], statistics.fmean(b for _, b in ratios), arrival, len(added)


def _probe_readings(probes: list, background: list, window_s: float = 0.5,
                    tol_s: float = 0.02) -> list[tuple[Any, float, list[float]]]:
    """Colocated probes beside decoding streams: for each probe that can be read, its own step
    (the background streams' token gap, their median, that ends with the probe's first token) and
    the decode steps of the same streams then (their gaps ending within ``window_s`` of it that
    hold no probe's first token and no probe's send)."""
    marks = sorted(t for r in probes for t in (r.sent, r.token_times[0]))
    out = []
    for p in probes:
        tf = p.token_times[0]
        steps, near = [], []
        for r in background:
            tt = r.token_times
            k = bisect.bisect_left(tt, tf - tol_s)
            if 1 <= k < len(tt) and tt[k] <= tf + tol_s:
                steps.append(tt[k] - tt[k - 1])
            for a, b in zip(tt, tt[1:]):
                if abs(b - tf) <= window_s and not abs(b - tf) <= tol_s \
                        and bisect.bisect_right(marks, b + tol_s / 4) == bisect.bisect_right(marks, a + tol_s / 4):
                    near.append(b - a)
        if len(steps) >= len(background) // 2 and len(near) >= 5:
            out.append((p, statistics.median(steps), near))
    return out


def _probe_steps(probes: list, background: list, window_s: float = 0.5, tol_s: float = 0.02) -> dict[int, list[float]]:
    """Colocated probes beside decoding streams: each probe's step less a decode step of the same
    streams then (the median of the near gaps, ``_probe_readings``), by prompt length. Both come
    from the same streams at the same moment, so the host's speed then and the batch's decodes
    cancel."""
    out: dict[int, list[float]] = {}
    for p, own, near in _probe_readings(probes, background, window_s, tol_s):
        out.setdefault(p.prompt_len, []).append(own - statistics.median(near))
    return out


def _probe_wait_overhead(probes: list, background: list, arrival_s: float | None) -> float | None:
    """Colocated probes beside decoding streams: what a first token pays beyond what the simulator
    gives it. The simulator's wait is the rest of the step running when the request comes (the
    length-biased mean of the decode steps then: E[d^2] / 2 E[d]), that step lengthened by
    ``arrival_s``, then the prompt's own step; a probe's client wait before its own step is its
    TTFT less that step. The mean excess over probes covers what neither step shows: the request
    reaching the engine after it was sent (it misses a step boundary it came just before) and its
    first token reaching the client after the step. None with fewer than 3 probes read."""
    read = _probe_readings(probes, background)
    if len(read) < 3:
        return None
    waits = [p.token_times[0] - p.sent - own for p, own, _ in read]
    near = [d for _, _, ns in read for d in ns]
    residual = sum(d * d for d in near) / (2 * sum(near))
    return max(0.0, statistics.mean(waits) - residual - (arrival_s or 0.0))


def _jitter_quantiles(values: list[float], quantiles: int = JITTER_QUANTILES) -> list[float] | None:
    """``quantiles`` equal-weight quantiles of ``values`` over their median (the simulator's
    token-gap jitter by default), or None with fewer than twice that many values or a median <= 0."""
    if len(values) < 2 * quantiles:
        return None
    mid = statistics.median(values)
    if mid <= 0:
        return None
    # an overhead that read at or below zero stays a small positive ratio
    ratios = sorted(max(v / mid, MIN_RATIO) for v in values)
    return [ratios[min(len(ratios) - 1, int((k + 0.5) / quantiles * len(ratios)))] for k in range(quantiles)]


def _prefill_steps(records: list) -> dict[int, tuple[float, int]]:
    """The prefill step each timed record's prompt ran in: (seconds, prompts in it), by ``id``.
    A phase record's ``prefill_s`` is the request's share of its step's compute (its tokens over
    the step's), so two prompts packed in one step read half of it each, and the prompts of one
    step carry bit-identical shares. For prompts of one length, as the calibration sends, the step
    is the share times how many carry it. (A prefill worker's steps at 45 decoding streams took 80
    ms with one prompt and 118 with two, engine step records, where the shares read 51-97 ms; the
    staggered streams packed two prompts in 50 of 85 steps, a load at 0.8 of capacity in 17 of 83.)"""
    timed = [r for r in records if r.ok and r.phase and (r.phase.get("prefill_s") or 0) > 0]
    by_share: dict[float, list] = defaultdict(list)
    for r in timed:
        by_share[r.phase["prefill_s"]].append(r)
    out = {}
    for share, same in by_share.items():
        # and one step's: scheduled together (sent plus queue within the router's hop of each other)
        for r in same:
            start = r.sent + (r.phase.get("queue_s") or 0.0)
            k = sum(1 for o in same if abs(o.sent + (o.phase.get("queue_s") or 0.0) - start) < PACKED_WINDOW_S)
            out[id(r)] = (share * k, k)
    return out


def _beside_prefills(records: list, dec_eng: EngineProfile
                     ) -> tuple[list[float], list[float], list[tuple[float, int]]]:
    """Disaggregated staggered streams: their decode steps against the profiled ones
    (``_staggered_gaps``) split by whether a prompt was being prefilled meanwhile (its prefill
    step, ``_prefill_steps``, before its first token), and the prefill steps of the prompts sent
    after the first stream ended (the first round's all queue at once). Returns (beside, apart,
    (step seconds, prompts in it) of each of those prompts)."""
    done = [r for r in records if r.ok]
    steps = _prefill_steps(done)
    spans = [(r.token_times[0] - steps[id(r)][0], r.token_times[0]) for r in done if id(r) in steps]
    beside, apart = [], []
    for a, b, x, _ in _staggered_gaps(done, dec_eng, prompt_steps=False):
        (beside if any(lo < b and hi > a for lo, hi in spans) else apart).append(x)
    return beside, apart, [steps[id(r)] for r in _timed_after_first_round(records)]


def _timed_after_first_round(records: list) -> list:
    """Staggered streams with a prefill in their phase record, sent after the first stream ended
    (the first round's were all sent at once and queue behind each other)."""
    done = [r for r in records if r.ok and r.token_times]
    first_end = min((r.token_times[-1] for r in done), default=0.0)
    return [r for r in done if r.sent >= first_end and r.phase and (r.phase.get("prefill_s") or 0) > 0]


class FirstTokenOverhead(NamedTuple):
    """The staggered streams' first tokens beyond their queue and prefill (``measure_served``)."""

    median_s: float              # of those that did not wait at the prefill worker (all, without a split)
    count: int                   # how many were read, both kinds
    jitter: list[float] | None   # TTFT_QUANTILES quantiles, each over its kind's median; None: too few
    queued_s: float | None       # of those that waited (queue_s > QUEUED_S); None: too few of either kind
    queued: int                  # how many waited


def _staggered_first_token_overhead(records: list) -> FirstTokenOverhead | None:
    """Disaggregated staggered streams after the first round: what each waited for its first
    token beyond its phase record's queue and prefill, which the simulator runs itself, split by
    whether it waited at the prefill worker, where both kinds number ``TTFT_QUANTILES`` or more.
    The rest is the KV handoff and the router's and Ray's hops with the prefill worker as busy as
    a load keeps it: a prompt that waited there sends its first token while the next one's
    prefill holds the cores (4-20 ms more beyond the whole step at 45 streams; 44-60 ms more beyond
    the prefill shares, which left half a packed prompt's step in it; Intel host, 2026-12-05)."""
    timed = _timed_after_first_round(records)
    if not timed:
        return None
    steps = _prefill_steps(records)   # the first token leaves after its whole step, not its share
    queues = [r.phase.get("queue_s") or 0.0 for r in timed]
    over = [r.token_times[0] - r.sent - q - steps[id(r)][0] for r, q in zip(timed, queues)]
    waited = [o for o, q in zip(over, queues) if q > QUEUED_S]
    direct = [o for o, q in zip(over, queues) if q <= QUEUED_S]
    if min(len(waited), len(direct)) < TTFT_QUANTILES:
        return FirstTokenOverhead(statistics.median(over), len(over), _jitter_quantiles(over, TTFT_QUANTILES),
                                  None, len(waited))
    mid_w, mid_d = statistics.median(waited), statistics.median(direct)
    ratios = None
    if mid_w > 0 and mid_d > 0:
        ratios = _jitter_quantiles([o / mid_w for o in waited] + [o / mid_d for o in direct], TTFT_QUANTILES)
    return FirstTokenOverhead(mid_d, len(over), ratios, mid_w, len(waited))


def _staggered_gaps(records: list, dec_eng: EngineProfile,
                    prompt_steps: bool = True) -> list[tuple[float, float, float, int]]:
    """``_staggered_steps``' gaps one by one: (start, end, over the profiled step, batch).
    ``prompt_steps``: leave out the gaps in which another stream got its first token, and gaps
    longer than a decode step by half a prefill or more (colocated, the step that computed a
    prompt, which the simulator runs itself); disaggregated, such a gap is a decode step like the
    others, beside the router's work for that token and the new stream's admission to the decode
    worker, which the simulator does not run, and a long one is a late delivery or a stalled step
    of the decode worker, which runs no prompts: kept, it is the token-gap tail. Leaving those
    out too, the simulated token-gap p99 at 0.55 of capacity came 20-25% short in two runs
    (2026-12-05: 94-101 ms real, 74-75 simulated); the decode worker's own steps then had a p99 of
    1.45x their median where the client's gaps had 2.1x."""
    done = [r for r in records if r.ok and len(r.token_times) > 2]
    if not done:
        return []
    firsts = sorted(r.token_times[0] for r in done)
    lasts = sorted(r.token_times[-1] for r in done)
    lo, hi = lasts[0], max(r.sent for r in done)
    tol = 0.003   # a token of the same step reaches the client a little before or after another
    # a prompt's step is longer than a decode step by about its prefill: a gap past half of that
    # is one even where its first token reached the client late
    half_prefill = dec_eng.prefill_step_s(SERVED_PROMPT) / 2
    out = []
    for r in done:
        for a, b in zip(r.token_times[1:], r.token_times[2:]):
            if a < lo or b > hi or (prompt_steps and bisect.bisect_right(firsts, b + tol)
                                    > bisect.bisect_right(firsts, a + tol)):
                continue
            # the streams decoding in this step: started before it (a stream whose first token
            # came during it, disaggregated, joins the decode worker later) and not ended
            batch = max(1, bisect.bisect_left(firsts, a + tol) - bisect.bisect_left(lasts, b))
            step = dec_eng.decode_step_s(batch, batch * (SERVED_PROMPT + BUSY_OUT / 2))
            if prompt_steps and b - a > step + half_prefill:
                continue
            out.append((a, b, (b - a) / step, batch))
    return out


def _staggered_prompt_steps(records: list) -> list[tuple[float, int, int, int]]:
    """Colocated staggered streams' steps that took the replacements' prompts, one entry per step:
    (seconds, prompt tokens in it, streams decoding beside them, requests sent during it).

    Read from the engine's phase records, not the client's token gaps: a replacement's first token
    reached the client a step late often enough that the gaps put half the steps' prompt counts
    wrong (engine step records, 2026-12-06). A phase record's ``prefill_s`` is the request's share
    of its step, its prompt tokens over the step's tokens (the prompts' and one per decoding
    stream); the prompts of one step carry bit-identical shares and get their first tokens
    together, so the step is a share times (its prompt tokens + the streams decoding) over the
    request's own. The streams decoding are those started before the first tokens and not ended
    (from the client's times). Only the prompts sent after the first stream ended: the first
    round's all come at once, into an empty engine."""
    done = [r for r in records if r.ok]
    if not done:
        return []
    firsts = sorted(r.token_times[0] for r in done)
    lasts = sorted(r.token_times[-1] for r in done)
    sends = sorted(r.sent for r in records if r.sent is not None)
    first_end = lasts[0]
    tol = 0.003   # as in _staggered_gaps
    by_share: dict[float, list] = defaultdict(list)
    for r in done:
        ph = r.phase or {}
        if r.sent >= first_end and (ph.get("prefill_s") or 0) > 0:
            by_share[ph["prefill_s"]].append(r)
    out = []
    for share, same in by_share.items():
        same.sort(key=lambda r: r.token_times[0])
        # one share, one step: their first tokens came together (a share repeated far apart is
        # another step that happened to time the same)
        groups = [[same[0]]]
        for r in same[1:]:
            if r.token_times[0] - groups[-1][-1].token_times[0] <= PACKED_WINDOW_S:
                groups[-1].append(r)
            else:
                groups.append([r])
        for group in groups:
            own = [(r.phase.get("prompt_tokens") or 0) - (r.phase.get("cached_prompt_tokens") or 0) for r in group]
            if min(own) <= 0:
                continue
            tf = group[0].token_times[0]
            batch = max(0, bisect.bisect_left(firsts, tf - tol) - bisect.bisect_left(lasts, tf - tol))
            seconds = share * (sum(own) + batch) / own[0]
            sent = bisect.bisect_left(sends, tf) - bisect.bisect_left(sends, tf - seconds)
            out.append((seconds, sum(own), batch, sent))
    return out


def _served_prompts(tokens: int) -> list[float]:
    """The prompts a calibration step of ``tokens`` prompt tokens packed: its requests all send
    ``SERVED_PROMPT`` tokens."""
    k = max(1, round(tokens / SERVED_PROMPT))
    return [tokens / k] * k


def _stagger_rounds(streams: int, min_gaps: int = 0) -> int:
    """Requests per stream for ``streams`` staggered streams to read about ``min_gaps`` steady
    token gaps: those from the first stream's end to the last send, about ``streams * BUSY_OUT``
    a round less two and a half rounds (106 gaps read at 3 streams and 3 rounds, 594 at 7, 1430
    at 15), and at least ``STAGGER_ROUNDS``."""
    return max(STAGGER_ROUNDS, math.ceil(2.5 + min_gaps / (streams * BUSY_OUT)))


def format_profile(p: Profile) -> str:
    lines = [f"host {p.host.get('cpu_model')} x{p.host.get('cores')}  model {p.model['name']} {p.model['dtype']}  "
             f"KV {p.kv_bytes_per_token} B/token, {p.kv_capacity_tokens} tokens per worker",
             f"roles: prefill {p.roles['prefill']} threads, decode {p.roles['decode']}, colocated "
             f"{p.roles['colocated']}; worker start {p.worker_start_s:.1f} s; profiled in {p.profile_wall_s:.0f} s"]
    for key, e in p.engines.items():
        pre = "  ".join(f"{n}:{1e3 * s:.0f}" for n, s in zip(e.prefill_tokens, e.prefill_s))
        dec = "  ".join(f"{b}:{1e3 * s:.1f}" for b, s in zip(e.decode_batch, e.decode_s))
        lines += [f"{key} threads  prefill ms by tokens  {pre}",
                  f"          decode step ms by batch  {dec}",
                  f"          context: decode +{e.decode_s_per_ctx_token * 1e9:.1f} ns per context token, "
                  f"prefill +{e.attn_s_per_token_ctx * 1e9:.2f} ns per new x cached token"]
    t = p.transfer
    lines.append(f"KV handoff: {t.overhead_s * 1e3:.2f} ms + bytes at {t.bytes_per_s / 1e9:.2f} GB/s ({t.how})")
    if p.corun:
        c = p.corun
        lines.append(f"one host, two engines: prefill steps x{c['prefill_x']:.2f} while the other core decodes, "
                     f"decode steps x{c['decode_x']:.2f} while it prefills")
    for mode, sp in p.serving.items():
        busy = (f" (+{sp.ttft_overhead_busy_s * 1e3:.0f} ms beside decoding streams"
                + (f", +{sp.ttft_overhead_queued_s * 1e3:.0f} ms after a wait at the prefill worker"
                   if sp.ttft_overhead_queued_s is not None else "") + ")"
                if sp.ttft_overhead_busy_s is not None else "")
        steps = f"decode steps x{sp.step_x:.2f}" + (f", prefill x{sp.prefill_x:.2f}" if sp.prefill_x else "")
        if sp.handoff_extra_s is not None:
            steps += f", {sp.handoff_extra_s * 1e3:+.1f} ms to a KV handoff"
        if sp.mixed_prefill_x is not None:
            steps += f", prompts beside decodes x{sp.mixed_prefill_x:.2f}"
        if sp.mixed_extra_s is not None:
            steps += f", {sp.mixed_extra_s * 1e3:+.0f} ms to a step taking a prompt beside decodes"
        if sp.arrival_s is not None:
            steps += f", +{sp.arrival_s * 1e3:.1f} ms to the step a request arrives in"
        if sp.corun_decode_x is not None:
            steps += f" (one host: decode x{sp.corun_decode_x:.2f} beside a prefill, prefill x{sp.corun_prefill_x:.2f})"
        lines.append(f"served {mode}: {steps}, +{sp.ttft_overhead_s * 1e3:.0f} ms to a first token{busy}, "
                     f"+{sp.itl_overhead_s * 1e3:.1f} ms to a token gap; pdserve up {sp.start_s:.0f} s ({sp.how})")
    return "\n".join(lines)

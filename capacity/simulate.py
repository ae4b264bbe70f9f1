"""A discrete-event simulation of a pdserve cluster, from a profile and a traffic description.

What it models, as pdserve runs (``docs/capacity.md`` says what it leaves out):

* The router's admission: at most decode replicas x ``max_num_seqs`` requests in flight (from
  arrival to last token, as ``pdserve up`` sets it); the rest wait at the router in arrival order.
* The router: each request goes to the prefill worker with the fewest uncached prompt tokens
  queued (the prefix share is assumed cached wherever the prompt lands) and to the decode worker
  with the fewest requests routed to it and not finished; in ``conditional`` mode a prompt whose
  uncached part is at most ``local_prefill_max_tokens`` is prefilled on its decode worker.
* Engine steps: a worker with prompt tokens queued runs one step at a time, taking up to
  ``max_num_batched_tokens`` (less its decoding sequences, and on a disaggregated decode worker
  less than the ITL budget allows) of them, chunking a long prompt across steps (a prefill
  worker adds another prompt only under ``prefill_pack_tokens``); the step costs
  the profile's mixed step. A prompt's first token comes at the end of the step that finished it.
* The KV handoff: the decode worker receives the request ``transfer_s(prompt KV bytes)`` (plus
  the served ``handoff_extra_s`` where measured) after the first token and admits it at its next
  step boundary.
* Continuous batching: a decode worker admits waiting sequences at every step boundary while it
  has fewer than ``max_num_seqs`` running and KV blocks for the sequence's whole length; each
  step gives every running sequence a token. Between two events (an arrival, a finish) nothing
  changes but the context, so a worker jumps over all the steps between them at once: the step
  time grows linearly with the summed context, and the time of the k-th step has a closed form.
  This keeps the event count near five per request, whatever the output lengths.

The result holds the percentiles ``pdserve bench serve`` reports: TTFT, ITL (every gap between
two tokens of a stream, pooled), end-to-end latency, and output tokens/s over the run.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np

from pdserve.capacity.profile import EngineProfile, Profile


class SimPlanner(Protocol):
    """What the simulator needs of a planner (``capacity/sim_planner.py``'s ``SimPlanner``: the
    live planner on simulated state; it lives in ``cluster/``, which this package may not import)."""

    setup: Any      # interval_s, worker_start_s, policy.warmup_s, prefill / decode (initial, max_replicas)
    run: Any        # .summary()

    def prefill_metrics(self, index: int, started_at: float, queued_tokens: int, queued_prompts: int,
                        tokens_per_s: float, busy: float | None, draining: bool) -> Any: ...

    def decode_metrics(self, index: int, started_at: float, running: int, waiting: int, kv_usage: float,
                       itl_s: float | None, draining: bool) -> Any: ...

    def request_ended(self, t: float, prompt: int, cached: int, output: int) -> None: ...

    def decide(self, now: float, replicas: dict[str, int], pending: dict[str, int], metrics: list) -> list: ...

    def account(self, dt: float, live: dict[str, int]) -> None: ...

Mode = Literal["disaggregated", "conditional", "colocated"]

_ARRIVE, _BOUNDARY, _READY, _TICK, _UP, _ADMIT = 0, 1, 2, 3, 4, 5
_OFF, _STARTING, _ON, _DRAINING = 0, 1, 2, 3
_AWAY = 1 << 40   # added to a worker's routing load while it takes no new request


@dataclass(frozen=True, slots=True)
class ClusterShape:
    """What is simulated: ``prefill`` and ``decode`` replicas (``colocated``: ``decode`` workers
    that do both phases, ``prefill`` must be 0) and the engine limits each replica runs with."""

    mode: Mode
    prefill: int
    decode: int
    max_num_seqs: int | None = None              # default: the profile's
    max_num_batched_tokens: int | None = None    # default: the profile's
    local_prefill_max_tokens: int = 64           # conditional mode
    itl_target_s: float | None = 0.1             # decode workers' ITL budget for local prefills
    # prefill workers add another prompt to a step only under this many prompt tokens (the engine's
    # prefill_pack_tokens; 'auto' gives 256 there); None: up to the step budget
    prefill_pack_tokens: int | None = 256
    # prefill worker i and decode worker i share one host: their steps slow each other down by the
    # profile's co-run factors (``Profile.corun``), as a disaggregated pair on one machine does
    shared_host: bool = False
    # the router's admission: at most (decode replicas, at the planner's largest) x max_num_seqs
    # requests in flight, from arrival to last token, as ``pdserve up`` sets it; the rest wait at
    # the router in arrival order. A request waiting for its prompt step (or, disaggregated, at a
    # prefill worker) holds a slot, so near the cap the decode batch runs below max_num_seqs
    # (2026-12-06: colocated at 0.8 of capacity, the real loads reached 64 in flight and requests
    # waited 0.3-2 s at the router, where the simulator, capping only the batch, kept up). False:
    # no cap at the router
    admission: bool = True

    def __post_init__(self) -> None:
        if self.mode not in ("disaggregated", "conditional", "colocated"):
            raise ValueError(f"mode must be disaggregated, conditional or colocated, got {self.mode!r}")
        if self.decode < 1:
            raise ValueError("at least one decode (or colocated) worker")
        if self.mode == "colocated" and self.prefill:
            raise ValueError("colocated: every worker does both phases; give --prefill 0")
        if self.mode != "colocated" and self.prefill < 1:
            raise ValueError(f"{self.mode}: at least one prefill worker")


@dataclass(slots=True)
class SimResult:
    requests: int
    span_s: float
    output_tokens: int
    ttft_s: np.ndarray
    e2e_s: np.ndarray
    itl_values: np.ndarray
    itl_weights: np.ndarray
    wall_s: float
    events: int
    queued_at_end: int = 0
    notes: list[str] = field(default_factory=list)
    planner: dict | None = None     # what the simulated planner did (``--planner``)
    # served token gaps over their median at a steady batch (equal-weight quantiles, the profile's
    # ``ServingProfile.itl_jitter``): each simulated gap is spread by them in the ITL percentiles,
    # a step that took a prompt too (its tokens reach the client by the same path: left unspread,
    # the colocated token-gap p99 at 0.3 of capacity came 10-17% short in six full runs of
    # 2026-12-05, within 0.03 spread)
    itl_jitter: np.ndarray | None = None

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.span_s if self.span_s > 0 else 0.0

    def itl_percentile(self, q: float) -> float | None:
        if not len(self.itl_values):
            return None
        order = np.argsort(self.itl_values, kind="stable")
        v, w = self.itl_values[order], self.itl_weights[order]
        cum = np.cumsum(w)
        if self.itl_jitter is None or not len(self.itl_jitter):
            idx = int(np.searchsorted(cum, q / 100.0 * cum[-1], side="left"))
            return float(v[min(idx, len(v) - 1)])
        # the mixture of every gap times each jitter ratio: the smallest x whose share of gaps at
        # or below it reaches q, by bisection
        j = np.asarray(self.itl_jitter, dtype=float)
        total = float(cum[-1])

        def below(x: float) -> float:
            k = np.searchsorted(v, x / j, side="right")
            return float(np.mean(np.where(k > 0, cum[np.maximum(k - 1, 0)], 0.0))) / total

        lo, hi, target = float(v[0] * j.min()) * 0.999, float(v[-1] * j.max()), q / 100.0
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if below(mid) >= target else (mid, hi)
        return hi

    def summary(self) -> dict:
        def pct(xs: np.ndarray, q: float) -> float | None:
            return float(np.percentile(xs, q)) if len(xs) else None

        return {
            "requests": self.requests, "span_s": round(self.span_s, 3), "output_tokens": self.output_tokens,
            "output_tokens_per_s": round(self.output_tokens_per_s, 3),
            "ttft_s": {f"p{q}": pct(self.ttft_s, q) for q in (50, 90, 99)},
            "itl_s": {f"p{q}": self.itl_percentile(q) for q in (50, 90, 99)},
            "e2e_s": {f"p{q}": pct(self.e2e_s, q) for q in (50, 90, 99)},
            "sim_wall_s": round(self.wall_s, 3), "events": self.events, "notes": self.notes,
            **({"planner": self.planner} if self.planner is not None else {}),
        }


def _mean_gap(b: int, joined: int, m: int, D0: float, g: float) -> float:
    """Mean token gap of an interval of ``m`` steps (the j-th lasting ``D0 + g * j``) of ``b``
    sequences, ``joined`` of which have their first gap recorded apart (they miss step 0)."""
    n = b * m - joined
    if n <= 0:
        return D0
    elapsed = m * D0 + g * m * (m - 1) / 2
    return (b * elapsed - joined * D0) / n


class _StepNoise:
    """Step times drawn around the profile's (``Simulator.run(noise_seed=...)``). A served engine's
    steps vary by ~10% from one to the next; with every step at its median a simulated load is one
    deterministic history, in which a few milliseconds decide whether two prompts share a step, so
    its tail figures jump with small changes of the profile. Drawn steps give a history like one
    real run; figures averaged over several seeds are the expectation over such runs.

    The spread is the served token gaps' (``ServingProfile.itl_jitter``: quantiles over their
    median), taken over their mean, so that a drawn load's steps take the profile's time on
    average. Drawn around the median instead, they take the spread's mean, 1-4% more, and the
    simulated loads at 0.8 of capacity came later still: TTFT p99 30% and 17% late where every
    step at its median gave 21% and 0% (two runs, 2026-12-05). A step with prompt tokens varies
    half as much (engine step records, 2026-12-05: p10-p90 of 128-token prompt steps beside
    decodes x0.93-1.08 of their median, decode steps x0.86-1.16). A decode interval of ``m`` steps
    draws once, its deviation shrunk by sqrt(m), as a sum of ``m`` independent steps'."""

    PROMPT_SHARE = 0.5
    BLOCK = 4096

    def __init__(self, jitter: np.ndarray, seed: int) -> None:
        q = np.asarray(jitter, dtype=float)
        self.dev = (q / float(q.mean()) - 1.0).tolist()
        self.rng = np.random.default_rng(seed)
        self.draws: list[int] = []

    def _dev(self) -> float:
        if not self.draws:
            self.draws = self.rng.integers(0, len(self.dev), self.BLOCK).tolist()
        return self.dev[self.draws.pop()]

    def step(self) -> float:
        return 1.0 + self.PROMPT_SHARE * self._dev()

    def interval(self, m: int) -> float:
        return 1.0 + self._dev() / math.sqrt(max(1, m))


class _Worker:
    __slots__ = ("idx", "role", "T", "S", "b", "C", "fin", "wait", "pq", "version",
                 "next_t", "next_kind", "m", "D0", "g", "nf", "kv_free", "joined", "busy", "step_chunks", "rec",
                 "rec_n", "work_s", "work_seen")

    def __init__(self, idx: int, role: str, kv_tokens: int) -> None:
        self.idx, self.role = idx, role
        self.T = 0.0          # time of the last step boundary processed
        self.S = 0            # steps done by then
        self.b = 0            # running (decoding) sequences
        self.C = 0.0          # their contexts, summed
        self.fin: list = []   # heap of (finish step, request)
        self.wait: deque = deque()   # decode sequences waiting for a slot or KV
        self.pq: deque = deque()     # prompts to prefill: [request, tokens left]
        self.version = 0
        self.next_t = math.inf       # the one valid boundary event scheduled, if any
        self.next_kind = ""          # "interval" or "step"
        self.m = 0                   # interval: steps until next_t
        self.D0 = 0.0                # interval: first step's time, and its growth per step
        self.g = 0.0
        self.nf = 1.0                # interval: its drawn time factor (``noise_seed``); D0 and g include it
        self.kv_free = kv_tokens
        self.joined: list = []       # sequences admitted at the last boundary (their first gap)
        self.busy = False
        self.step_chunks: list = []  # the running step's prefill chunks: (queue item, tokens, last, done before)
        self.rec = -1                # index of the running interval's ITL record (a step's first)
        self.rec_n = 0               # a step's ITL records from ``rec`` on
        self.work_s = 0.0            # prefill steps' time so far, and as the planner last saw it
        self.work_seen = 0.0


class Simulator:
    """One run: ``Simulator(profile, shape).run(arrivals, prompt, cached, output)``."""

    def __init__(self, profile: Profile, shape: ClusterShape) -> None:
        self.profile, self.shape = profile, shape
        eng = profile.engine
        self.max_seqs = int(shape.max_num_seqs or eng["max_num_seqs"])
        self.max_batched = int(shape.max_num_batched_tokens or eng["max_num_batched_tokens"])
        self.block = int(eng["block_size"])
        self.kv_tokens = profile.kv_capacity_tokens
        self.kv_bytes = profile.kv_bytes_per_token
        colocated = shape.mode == "colocated"
        self.pe = profile.role("prefill")
        self.de = profile.role("colocated" if colocated else "decode")
        served = profile.serving_for(shape.mode)
        corun = profile.corun if shape.shared_host and shape.mode != "colocated" else {}
        self.prefill_x = float(corun.get("prefill_x", 1.0))
        self.decode_x = float(corun.get("decode_x", 1.0))
        if shape.shared_host and shape.mode != "colocated":   # as served, where measured
            if served.corun_prefill_x is not None:
                self.prefill_x = served.corun_prefill_x
            if served.corun_decode_x is not None:
                self.decode_x = served.corun_decode_x
        self.ttft_over = served.ttft_overhead_s
        # a first token while its decode worker has streams running pays the busy figure
        self.ttft_over_busy = (served.ttft_overhead_busy_s if served.ttft_overhead_busy_s is not None
                               else served.ttft_overhead_s)
        # the busy figure for a prompt that waited at its first worker, where measured apart
        self.ttft_over_queued = served.ttft_overhead_queued_s
        self.itl_over = served.itl_overhead_s
        self.itl_jitter = np.array(served.itl_jitter, dtype=float) if served.itl_jitter else None
        # the busy first-token overhead's spread by request (quantiles over its median), drawn
        # with the steps (``noise_seed``); a constant in one deterministic history
        self.ttft_jitter = np.array(served.ttft_jitter, dtype=float) if served.ttft_jitter else None
        # a request's arrival lengthens the step its first worker is running (colocated, measured)
        self.arrival_s = float(served.arrival_s or 0.0)
        # engine steps as served (the profile's served measurement under load; 1 without one)
        if served.step_x != 1.0 or served.prefill_x not in (None, 1.0):
            profile = profile.scaled(served.step_x, served.prefill_x)
            self.pe = profile.role("prefill")
            self.de = profile.role("colocated" if colocated else "decode")
        # a colocated step that takes prompts beside decoding streams: its prompt tokens at their
        # own factor where measured, and its cost beyond its parts
        self.mixed_extra = float(served.mixed_extra_s or 0.0) if colocated else 0.0
        self.de_mixed = self.de
        if colocated and served.mixed_prefill_x is not None:
            self.de_mixed = self.profile.scaled(served.step_x, served.mixed_prefill_x).role("colocated")
        # the handoff as served: its control messages and a busy prefill worker's sends
        self.handoff_extra = max(0.0, float(served.handoff_extra_s or 0.0)) if not colocated else 0.0
        # decode step time = A[b] + kc * C (C: contexts summed over the batch)
        self.kc = self.de.decode_s_per_ctx_token
        self.A = [0.0] + [self.de.decode_step_s(b, b * self.de.decode_ctx) - self.kc * b * self.de.decode_ctx
                          for b in range(1, self.max_seqs + 1)]

    # ------------------------------------------------------------------ costs
    @staticmethod
    def _prefill_cost(eng: EngineProfile, chunks: list, b: int, C: float) -> float:
        n = sum(c[1] for c in chunks)  # c: (queue item, tokens, last, tokens done before)
        attn = eng.attn_s_per_token_ctx * sum(c[1] * c[3] for c in chunks)
        return eng.mixed_step_s(b, C, n, [c[1] for c in chunks]) + attn

    def _itl_budget(self, w: _Worker) -> int | None:
        """A disaggregated decode worker's prompt tokens per step beside its decodes (ItlBudget)."""
        if w.role != "decode" or self.shape.itl_target_s is None or w.b == 0:
            return None
        spare = self.shape.itl_target_s - (self.A[w.b] + self.kc * w.C)
        rate = self.de.prefill_tokens_per_s(self.max_batched)
        return max(self.block, min(self.max_batched, int(spare * rate)))

    # ------------------------------------------------------------------ run
    def run(self, arrivals: np.ndarray, prompt: np.ndarray, cached: np.ndarray, output: np.ndarray,
            planner: SimPlanner | None = None, noise_seed: int | None = None) -> SimResult:
        """``planner``: the live planner scales the pools (``capacity/sim_planner.py``); the shape's
        replica counts are then ignored for its pools' bounds (initial, min and max replicas).

        ``noise_seed``: steps take the time the profile gives them (None), or each is drawn around
        it from the served spread (``_StepNoise``), reproducibly for one seed; a profile without a
        served spread (``ServingProfile.itl_jitter``) has nothing to draw from, and its steps stay
        the profile's."""
        t_wall = time.perf_counter()
        shape = self.shape
        if planner is not None and shape.shared_host:
            raise ValueError("the simulated planner cannot pair workers on shared hosts (--shared-host)")
        n = len(arrivals)
        if not (len(prompt) == len(cached) == len(output) == n):
            raise ValueError("arrivals, prompt, cached and output must have one entry per request")
        arr = arrivals.tolist()
        pl = prompt.tolist()
        cl = cached.tolist()
        ol = output.tolist()
        ttft = [math.nan] * n
        first_t = [0.0] * n
        e2e = [math.nan] * n
        dworker = [0] * n
        itl_v: list[float] = []
        itl_w: list[float] = []
        colocated = shape.mode == "colocated"
        n_p = planner.setup.prefill.max_replicas if planner is not None else shape.prefill
        n_d = planner.setup.decode.max_replicas if planner is not None else shape.decode
        pw = [_Worker(i, "prefill", 1 << 62) for i in range(n_p)]
        dw = [_Worker(i, "colocated" if colocated else "decode", self.kv_tokens) for i in range(n_d)]
        p_load = np.zeros(max(1, n_p), dtype=np.int64)
        d_load = np.zeros(n_d, dtype=np.int64)
        # with a planner: each worker's state, when it came up, and _AWAY on its routing load while
        # it is not serving (off, starting or draining)
        p_state = [_OFF] * n_p
        d_state = [_OFF] * n_d
        first_up = (arrivals[0] if n else 0.0) - (planner.setup.policy.warmup_s if planner is not None else 0.0)
        p_up = [first_up] * n_p   # the initial workers count as warm from the start
        d_up = [first_up] * n_d
        p_away = np.zeros(max(1, n_p), dtype=np.int64)
        d_away = np.zeros(n_d, dtype=np.int64)
        if planner is not None:
            p_away[:] = _AWAY
            for states, away, k in ((p_state, p_away, planner.setup.prefill.initial),
                                    (d_state, d_away, planner.setup.decode.initial)):
                for j in range(len(states)):
                    states[j] = _ON if j < k else _OFF
                    away[j] = 0 if j < k else _AWAY
        open_requests = 0
        # the router's admission (ClusterShape.admission): requests in flight (d_load's sum, kept as a
        # count so an arrival does not sum every decode worker's), and those waiting
        admit_cap = n_d * self.max_seqs if shape.admission else math.inf
        in_flight = 0
        held: deque = deque()
        heap: list = []
        push, pop = heapq.heappush, heapq.heappop
        seq = 0
        events = 0
        local_max = shape.local_prefill_max_tokens if shape.mode == "conditional" else -1
        max_seqs, max_batched, block = self.max_seqs, self.max_batched, self.block
        A, kc, itl_over = self.A, self.kc, self.itl_over
        de, pe, de_mixed, mixed_extra = self.de, self.pe, self.de_mixed, self.mixed_extra
        kv_bytes, transfer_s, handoff_extra = self.kv_bytes, self.profile.transfer.transfer_s, self.handoff_extra
        ttft_over, ttft_over_busy, ttft_over_queued = self.ttft_over, self.ttft_over_busy, self.ttft_over_queued
        arrival_s = self.arrival_s
        noise = _StepNoise(self.itl_jitter, noise_seed) if noise_seed is not None and self.itl_jitter is not None \
            else None
        # each request's busy first-token overhead: the figure for how it arrived (waiting at a
        # computing first worker, where measured apart, or not) times, with noise_seed, one of the
        # served quantiles over it drawn for the request
        over_ratio = None
        if noise_seed is not None and self.ttft_jitter is not None:
            pick = np.random.default_rng([noise_seed, 1]).integers(0, len(self.ttft_jitter), n)
            over_ratio = self.ttft_jitter[pick].tolist()
        busy_over = [ttft_over_busy] * n if over_ratio is None else [ttft_over_busy * x for x in over_ratio]
        prefill_x, decode_x = self.prefill_x, self.decode_x
        paired = shape.shared_host and (prefill_x != 1.0 or decode_x != 1.0)
        out_tokens = 0
        last_end = 0.0

        def schedule(w: _Worker, t: float, kind: str) -> None:
            nonlocal seq
            w.version += 1
            w.next_t, w.next_kind = t, kind
            seq += 1
            push(heap, (t, seq, _BOUNDARY, w.role == "prefill", w.idx, w.version))

        def kv_need(r: int) -> int:
            return -(-(pl[r] + ol[r]) // block) * block

        def start(w: _Worker, t: float) -> None:
            """At a boundary at ``t``: admit, then schedule the next step or interval."""
            w.T = t
            # admit waiting decode sequences (FIFO; the head blocks the rest, as the scheduler does)
            joined = w.joined
            joined.clear()
            while w.wait and w.b < max_seqs:
                r = w.wait[0]
                need = kv_need(r)
                if need > w.kv_free:
                    break
                w.wait.popleft()
                w.kv_free -= need
                w.b += 1
                w.C += pl[r] + 1
                push(w.fin, (w.S + ol[r] - 1, r))
                joined.append(r)
            if w.pq:
                # one step with prompt chunks beside the running decodes
                budget = max_batched - w.b
                cap = self._itl_budget(w)
                if cap is not None:
                    budget = min(budget, cap)
                chunks = []
                slots = max_seqs - w.b
                pack = self.shape.prefill_pack_tokens if w.role == "prefill" else None
                taken = 0
                for item in w.pq:
                    if budget <= 0 or slots <= 0:
                        break
                    r, left = item[0], item[1]
                    if w.role != "prefill" and left == pl[r] - cl[r]:
                        # a new prompt needs its slot and KV before it starts
                        need = kv_need(r)
                        if need > w.kv_free:
                            break
                        w.kv_free -= need
                        item.append(need)
                    k = min(left, budget)
                    done_before = pl[r] - left
                    chunks.append((item, k, k == left, done_before))
                    budget -= k
                    taken += k
                    if pack is not None:
                        budget = min(budget, pack - taken)
                    slots -= 1
                eng = pe if w.role == "prefill" else de_mixed if w.b else de
                if chunks:
                    d = self._prefill_cost(eng, chunks, w.b, w.C)
                    if w.b and mixed_extra:
                        d = max(1e-6, d + mixed_extra)
                    if paired:
                        d *= slowdown(w)
                    if noise is not None:
                        d *= noise.step()
                    w.work_s += d
                    w.step_chunks = chunks
                    w.rec = len(itl_v)
                    for r in joined:
                        itl_v.append(t - first_t[r] + d + itl_over)
                        itl_w.append(1.0)
                    if w.b - len(joined) > 0:
                        itl_v.append(d + itl_over)
                        itl_w.append(float(w.b - len(joined)))
                    w.rec_n = len(itl_v) - w.rec
                    w.busy = True
                    schedule(w, t + d, "step")
                    if paired:
                        nudge(w, t)
                    return
            w.step_chunks = []
            if w.b == 0:
                w.busy = False
                w.next_t = math.inf
                w.version += 1
                if paired:
                    nudge(w, t)
                return
            # decode-only: jump to the next finish
            D0 = A[w.b] + kc * w.C
            g = kc * w.b
            if paired:
                x = slowdown(w)
                D0, g = D0 * x, g * x
            m = w.fin[0][0] - w.S
            # the ITL records keep the steps' own time: the jitter spreads them in the percentiles
            for r in joined:
                itl_v.append(t - first_t[r] + D0 + itl_over)
                itl_w.append(1.0)
            w.rec = len(itl_v)
            itl_v.append(_mean_gap(w.b, len(joined), m, D0, g) + itl_over)
            itl_w.append(float(max(0, w.b * m - len(joined))))
            w.nf = noise.interval(m) if noise is not None else 1.0
            D0, g = D0 * w.nf, g * w.nf
            w.D0, w.g, w.m = D0, g, m
            w.busy = True
            schedule(w, t + m * D0 + g * m * (m - 1) / 2, "interval")

        def slowdown(w: _Worker) -> float:
            """A step's factor while the worker sharing this one's host computes (shared_host)."""
            if w.role == "prefill":
                other = dw[w.idx] if w.idx < len(dw) else None
                return prefill_x if other is not None and other.busy else 1.0
            other = pw[w.idx] if w.idx < len(pw) else None
            return decode_x if other is not None and other.busy else 1.0

        def nudge(w: _Worker, t: float) -> None:
            """A prefill worker started or stopped computing: its host partner's decode interval
            ends at its running step, so the next one is timed with the new neighbour."""
            if w.role == "prefill" and w.idx < len(dw) and dw[w.idx].busy:
                wake(dw[w.idx], t)

        def wake(w: _Worker, t: float) -> None:
            """Work arrived at ``t``: an idle worker starts now; a worker inside a decode interval
            stops at the end of the step running at ``t``."""
            if not w.busy:
                start(w, t)
                return
            if w.next_kind != "interval":
                return   # a single step runs: its end is the next boundary
            # steps of the interval finished by t: E(j) <= t - T
            el = t - w.T
            D0, g = w.D0, w.g
            if g > 0:
                j = int((-(D0 - g / 2) + math.sqrt((D0 - g / 2) ** 2 + 2 * g * el)) / g)
            else:
                j = int(el / D0)
            j = min(j + 1, w.m)
            tb = w.T + j * D0 + g * j * (j - 1) / 2
            if tb < w.next_t - 1e-12:
                # the interval's ITL record assumed m steps of this batch: it ran j of them
                itl_v[w.rec] = _mean_gap(w.b, len(w.joined), j, D0 / w.nf, g / w.nf) + itl_over
                itl_w[w.rec] = float(max(0, w.b * j - len(w.joined)))
                w.m = j
                schedule(w, tb, "interval")

        def lengthen(w: _Worker, c: float) -> None:
            """A request arrived while ``w`` computed (``wake`` has ended its decode interval at the
            step running then): that step takes ``c`` longer, and so do its token gaps."""
            if w.next_kind == "interval":
                itl_v[w.rec] += c / w.m   # the interval's mean gap: one of its m steps is longer
            else:
                for j in range(w.rec, w.rec + w.rec_n):
                    itl_v[j] += c
                w.work_s += c
            schedule(w, w.next_t + c, w.next_kind)

        def boundary(w: _Worker, t: float) -> None:
            nonlocal out_tokens, last_end, seq
            if w.next_kind == "interval":
                m = w.m
                w.S += m
                w.C += w.b * m
            else:
                w.S += 1
                w.C += w.b
                for item, k, last, _ in w.step_chunks:
                    r = item[0]
                    item[1] -= k
                    if w.role == "prefill":
                        p_load[w.idx] -= k
                    if last:
                        if w.pq[0] is item:
                            w.pq.popleft()
                        else:
                            w.pq.remove(item)
                        # served overheads: the busy figure while r's decode worker has streams running
                        home = dw[dworker[r]] if w.role == "prefill" else w
                        ttft[r] = t - arr[r] + (busy_over[r] if home.b else ttft_over)
                        first_t[r] = t
                        if ol[r] <= 1:
                            e2e[r] = ttft[r]
                            out_tokens += 1
                            last_end = max(last_end, t)
                            d_load[dworker[r]] -= 1
                            released(t)
                            if planner is not None:
                                ended(t, r)
                            if w.role != "prefill":
                                w.kv_free += item[2]
                            continue
                        if w.role == "prefill":
                            seq += 1
                            push(heap, (t + transfer_s(pl[r] * kv_bytes) + handoff_extra, seq, _READY, False,
                                        dworker[r], r))
                        else:
                            # prefilled here: decodes from the next step; its KV is already reserved
                            w.kv_free += item[2]
                            w.wait.appendleft(r)
            # finishes at this boundary
            fin = w.fin
            while fin and fin[0][0] <= w.S:
                _, r = pop(fin)
                w.b -= 1
                w.C -= pl[r] + ol[r]
                w.kv_free += kv_need(r)
                e2e[r] = ttft[r] + (t - first_t[r])
                out_tokens += ol[r]
                last_end = max(last_end, t)
                d_load[dworker[r]] -= 1
                released(t)
                if planner is not None:
                    ended(t, r)
            if w.b == 0:
                w.C = 0.0
            start(w, t)

        def released(t: float) -> None:
            """A request ended: its admission slot passes to the first one waiting at the router, at
            ``t`` (an event, as a boundary may be iterating its worker's queues now)."""
            nonlocal in_flight, seq
            in_flight -= 1
            if held:
                seq += 1
                push(heap, (t, seq, _ADMIT, False, 0, 0))

        def dispatch(r: int, t: float) -> None:
            """Route admitted request ``r`` at ``t``: its decode worker and the worker that prefills it."""
            if planner is None:
                d = int(d_load.argmin()) if len(d_load) > 1 else 0
            else:
                d = int((d_load + d_away).argmin())
            d_load[d] += 1
            dworker[r] = d
            uncached = pl[r] - cl[r]
            if planner is not None and not colocated and p_away.min() >= _AWAY:
                w = dw[d]   # no prefill worker serving: the decode worker prefills it
            elif colocated or uncached <= local_max:
                w = dw[d]
            else:
                if planner is None:
                    p = int(p_load.argmin()) if len(p_load) > 1 else 0
                else:
                    p = int((p_load + p_away).argmin())
                p_load[p] += uncached
                w = pw[p]
            w.pq.append([r, uncached])
            busy = w.busy
            if ttft_over_queued is not None and w.role == "prefill" and (busy or len(w.pq) > 1):
                busy_over[r] = ttft_over_queued * (1.0 if over_ratio is None else over_ratio[r])
            wake(w, t)
            if busy and arrival_s:
                lengthen(w, arrival_s)

        def ended(t: float, r: int) -> None:
            nonlocal open_requests
            open_requests -= 1
            planner.request_ended(t, pl[r], cl[r], ol[r])

        def idle(w: _Worker) -> bool:
            return not w.busy and not w.pq and not w.wait and w.b == 0

        def metrics(now: float, since: float) -> list:
            out = []
            rate = pe.prefill_tokens_per_s(max_batched)
            for j, w in enumerate(pw):
                busy = min(1.0, (w.work_s - w.work_seen) / (now - since)) if now > since else None
                w.work_seen = w.work_s
                if p_state[j] in (_ON, _DRAINING):
                    out.append(planner.prefill_metrics(j, p_up[j], int(p_load[j]), len(w.pq), rate, busy,
                                                       p_state[j] == _DRAINING))
            for j, w in enumerate(dw):
                if d_state[j] in (_ON, _DRAINING):
                    step = (A[w.b] + kc * w.C + itl_over) if w.b else None
                    out.append(planner.decode_metrics(j, d_up[j], w.b, len(w.wait) + len(w.pq),
                                                      1.0 - w.kv_free / self.kv_tokens, step,
                                                      d_state[j] == _DRAINING))
            return out

        def counts() -> tuple[dict, dict, dict]:
            serving, pending, live = {}, {}, {}
            for name, states in (("prefill", p_state), ("decode", d_state)):
                serving[name] = sum(1 for x in states if x == _ON)
                pending[name] = sum(1 for x in states if x == _STARTING)
                live[name] = sum(1 for x in states if x != _OFF)
            return serving, pending, live

        def tick(t: float, since: float) -> None:
            nonlocal seq
            planner.account(t - since, counts()[2])   # what ran since the last tick
            # drained workers with nothing left stop
            for states, workers, load in ((p_state, pw, p_load), (d_state, dw, d_load)):
                for j, w in enumerate(workers):
                    if states[j] == _DRAINING and idle(w) and load[j] == 0:
                        states[j] = _OFF
            serving, pending, _ = counts()
            for d in planner.decide(t, serving, pending, metrics(t, since)):
                prefill_pool = d.role.value == "prefill"
                states = p_state if prefill_pool else d_state
                away = p_away if prefill_pool else d_away
                if d.action.value == "scale_up":
                    add = d.target_replicas - d.current_replicas
                    for j in range(len(states)):
                        if add <= 0:
                            break
                        if states[j] == _OFF:
                            states[j] = _STARTING
                            seq += 1
                            push(heap, (t + planner.setup.worker_start_s, seq, _UP, prefill_pool, j, 0))
                            add -= 1
                elif d.action.value == "scale_down":
                    if d.drain_worker_id is not None:
                        j = int(d.drain_worker_id.rsplit("-", 1)[1])
                        states[j] = _DRAINING
                        away[j] = _AWAY
                    else:   # nothing warm to drain: cancel a start
                        for j in range(len(states) - 1, -1, -1):
                            if states[j] == _STARTING:
                                states[j] = _OFF
                                break
            if i < n or open_requests > 0:
                seq += 1
                push(heap, (t + planner.setup.interval_s, seq, _TICK, False, 0, 0))

        i = 0
        t_next_arrival = arr[0] if n else math.inf
        t_acc = arr[0] if n else 0.0
        if planner is not None and n:
            seq += 1
            push(heap, (arr[0], seq, _TICK, False, 0, 0))
        while True:
            if heap and heap[0][0] <= t_next_arrival:
                t, _, kind, is_p, idx, extra = pop(heap)
                events += 1
                if kind == _TICK:
                    tick(t, t_acc)
                    t_acc = t
                    continue
                if kind == _UP:
                    states = p_state if is_p else d_state
                    if states[idx] == _STARTING:
                        states[idx] = _ON
                        (p_up if is_p else d_up)[idx] = t
                        (p_away if is_p else d_away)[idx] = 0
                    continue
                if kind == _BOUNDARY:
                    w = pw[idx] if is_p else dw[idx]
                    if extra != w.version:
                        continue
                    boundary(w, t)
                elif kind == _ADMIT:
                    while held and in_flight < admit_cap:
                        in_flight += 1
                        dispatch(held.popleft(), t)
                else:   # _READY: KV arrived at decode worker idx for request extra
                    w = dw[idx]
                    w.wait.append(extra)
                    wake(w, t)
                continue
            if i >= n:
                break
            # an arrival
            t = t_next_arrival
            r = i
            i += 1
            t_next_arrival = arr[i] if i < n else math.inf
            events += 1
            if planner is not None:
                open_requests += 1
            if in_flight >= admit_cap or held:
                held.append(r)
                continue
            in_flight += 1
            dispatch(r, t)

        done = [r for r in range(n) if not math.isnan(e2e[r])]
        notes = []
        if len(done) < n:
            notes.append(f"{n - len(done)} requests never finished (a prompt longer than the KV cache?)")
        ttft_a = np.array([ttft[r] for r in done])
        e2e_a = np.array([e2e[r] for r in done])
        span = last_end - (arr[0] if n else 0.0)
        return SimResult(requests=n, span_s=span, output_tokens=out_tokens, ttft_s=ttft_a, e2e_s=e2e_a,
                         itl_values=np.array(itl_v), itl_weights=np.array(itl_w),
                         wall_s=time.perf_counter() - t_wall, events=events, queued_at_end=n - len(done),
                         notes=notes, planner=planner.run.summary() if planner is not None else None,
                         itl_jitter=self.itl_jitter)


def simulate(profile: Profile, shape: ClusterShape, arrivals: np.ndarray, prompt: np.ndarray,
             cached: np.ndarray, output: np.ndarray, planner: SimPlanner | None = None,
             noise_seed: int | None = None) -> SimResult:
    return Simulator(profile, shape).run(arrivals, prompt, cached, output, planner, noise_seed)

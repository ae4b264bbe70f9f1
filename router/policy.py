"""Routing policies: pure decisions over snapshots of worker state (no Ray, no I/O).

* Prefill: the worker with the longest cached prefix of the prompt wins, weighed against the
  prompt tokens already queued there (a cached token saves one token of compute; a queued
  token delays us by one).
* Decode: the worker with the most free KV blocks relative to its running batch.
* Conditional disaggregation: prefill on the decode worker itself when the uncached part is
  short, or when no prefill worker is available.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from pdserve.engine.contract import WorkerRole, WorkerStats, as_role
from pdserve.engine.kv_events import KVEvent, KVEventKind


@dataclass(slots=True)
class WorkerView:
    """What the router knows of one worker, refreshed from its stats."""

    worker_id: str
    role: WorkerRole
    alive: bool = True
    draining: bool = False
    num_blocks: int = 1
    num_free_blocks: int = 1
    num_running: int = 0
    num_waiting: int = 0
    # Prompt tokens the router has sent there and not yet seen finish (its own view of the queue).
    inflight_tokens: int = 0
    inflight_requests: int = 0
    # Of inflight_tokens, those of batch-priority requests (the planner lets them wait).
    batch_inflight_tokens: int = 0
    # Decode workers, as the router counts them: attempts there past their first token (streams
    # decoding), and prompt tokens it has sent there to prefill locally, not yet at a first token.
    decoding_requests: int = 0
    local_prefill_tokens: int = 0
    cached_hashes: set[int] = field(default_factory=set)
    # prompt tokens per second while prefilling, measured from the worker's stats (None: not yet)
    prefill_tokens_per_s: float | None = None
    started_at: float = 0.0                              # wall clock, from the worker
    stats: WorkerStats | None = None                     # the worker's latest report

    unresponsive_since: float | None = None              # monotonic time its polls began to fail

    def __post_init__(self) -> None:
        self.role = as_role(self.role)

    @property
    def responsive(self) -> bool:
        return self.alive and self.unresponsive_since is None

    @property
    def routable(self) -> bool:
        return self.responsive and not self.draining


@dataclass(frozen=True, slots=True)
class RoutingDecision:
    decode_worker: str
    prefill_worker: str | None      # None: prefill locally on the decode worker
    cached_prefix_tokens: int       # expected prefix-cache hit on the chosen prefill worker
    reason: str
    # No prefill worker can take the prompt now and it is too long to prefill on a decode worker:
    # the caller waits for one (``decode_worker`` is where it would go if it had to run now).
    wait_for_prefill: bool = False


def apply_kv_events(view: WorkerView, events: Iterable[KVEvent]) -> None:
    """Track which block hashes a prefill worker holds, from its stored/removed events."""
    for event in events:
        if event.kind is KVEventKind.STORED:
            view.cached_hashes.add(event.block_hash)
        else:
            view.cached_hashes.discard(event.block_hash)


def sooner_locally(d: WorkerView, p: WorkerView, local_tokens: int, remote_tokens: int) -> bool:
    """Whether idle decode worker ``d`` reaches this prompt's first token before busy prefill
    worker ``p``: the prompt tokens queued on each plus this prompt's (all of it locally, its
    uncached part on ``p``), over each one's measured prefill rate (equal rates while either is
    unmeasured). Never while ``d`` has a stream decoding or ``p`` has nothing queued."""
    if d.decoding_requests > 0 or p.inflight_tokens <= 0:
        return False
    rate_d, rate_p = d.prefill_tokens_per_s, p.prefill_tokens_per_s
    if not rate_d or not rate_p:
        rate_d = rate_p = 1.0
    return (d.local_prefill_tokens + local_tokens) / rate_d < (p.inflight_tokens + remote_tokens) / rate_p


def cached_prefix_blocks(view: WorkerView, hashes: list[int]) -> int:
    n = 0
    for h in hashes:
        if h not in view.cached_hashes:
            break
        n += 1
    return n


@dataclass(frozen=True, slots=True)
class RoutingPolicy:
    block_size: int = 16
    # Prompts whose uncached part is at most this many tokens are prefilled on the decode worker.
    local_prefill_max_tokens: int = 0
    # Weight of one queued token against one cached token when choosing a prefill worker.
    queue_weight: float = 1.0
    # The cluster keeps a prefill pool (at least one replica, replaced when it dies): a prompt
    # longer than the local budget waits for a prefill worker rather than stall a decode
    # worker's streams with its prefill. Without one, decode workers prefill everything.
    prefill_pool: bool = False
    # A decode worker with no stream decoding prefills a longer prompt itself when the prefill
    # workers are busy and its own queue reaches the first token sooner (a burst on an idle
    # cluster: both pools' cores prefill). No stream can stall behind it; streams that start
    # meanwhile are protected by the decode worker's ITL budget (EngineConfig.itl_target_ms).
    idle_local_prefill: bool = False

    def choose(self, prompt_hashes: list[int], num_prompt_tokens: int,
               prefill: list[WorkerView], decode: list[WorkerView],
               exclude: frozenset[str] = frozenset(), prefer_prefill: str | None = None) -> RoutingDecision | None:
        """Pick a decode worker and a prefill worker (or local prefill); None if no decode worker.
        ``prefer_prefill``: the prefill worker of this request's previous attempt, which holds its
        prompt's KV in its prefix cache (the router may not have seen that worker's KV events
        yet); it is taken while it is routable, so a retry reuses the prefill already done."""
        d_candidates = [w for w in decode if w.routable and w.worker_id not in exclude]
        if not d_candidates:
            # A draining worker still serves when nothing else can (it only stops getting work
            # while another worker is there to take it).
            d_candidates = [w for w in decode if w.responsive and w.worker_id not in exclude]
        if not d_candidates:
            return None
        d = max(d_candidates, key=self._decode_score)
        p_candidates = [w for w in prefill if w.routable and w.worker_id not in exclude]
        if not p_candidates:
            if self.prefill_pool and num_prompt_tokens > self.local_prefill_max_tokens:
                return RoutingDecision(d.worker_id, None, 0, "no prefill worker can take it now: waiting for one",
                                       wait_for_prefill=True)
            return RoutingDecision(d.worker_id, None, 0, "no prefill worker available: local prefill")
        preferred = next((w for w in p_candidates if w.worker_id == prefer_prefill), None)
        if preferred is not None:
            return RoutingDecision(d.worker_id, preferred.worker_id,
                                   min(cached_prefix_blocks(preferred, prompt_hashes) * self.block_size,
                                       max(0, num_prompt_tokens - 1)),
                                   f"prefill on {preferred.worker_id}, which holds this prompt's KV from the last attempt")
        best, best_score, best_cached = None, float("-inf"), 0
        for w in p_candidates:
            cached = cached_prefix_blocks(w, prompt_hashes) * self.block_size
            cached = min(cached, max(0, num_prompt_tokens - 1))
            score = cached - self.queue_weight * w.inflight_tokens
            if score > best_score:
                best, best_score, best_cached = w, score, cached
        assert best is not None
        uncached = num_prompt_tokens - best_cached
        if uncached <= self.local_prefill_max_tokens:
            return RoutingDecision(d.worker_id, None, 0, f"short uncached part ({uncached} tokens): local prefill")
        if self.idle_local_prefill and sooner_locally(d, best, num_prompt_tokens, uncached):
            return RoutingDecision(d.worker_id, None, 0,
                                   f"{d.worker_id} has no stream decoding and {best.worker_id} has "
                                   f"{best.inflight_tokens} prompt tokens queued: local prefill is sooner")
        return RoutingDecision(d.worker_id, best.worker_id, best_cached,
                               f"prefill on {best.worker_id} ({best_cached} cached tokens)")

    @staticmethod
    def _decode_score(w: WorkerView) -> tuple[float, int]:
        free = w.num_free_blocks / max(1, w.num_blocks)
        load = w.num_running + w.num_waiting + w.inflight_requests
        return (free - 0.01 * load, -load)

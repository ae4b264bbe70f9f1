"""The planner's decision logic: how many replicas each pool should run, and whom to drain.

Pure Python (no Ray, Redis or clock reads): the caller passes ``now`` and the latest metrics,
and acts on the returned decisions. Times are seconds on one clock shared with the workers'
``started_at`` (wall time, ``time.time()``, since workers report from other hosts).

How one pool is decided, in order:

1. Repair: fewer replicas (running + pending) than ``min_replicas`` -> scale up to the minimum
   at once, cooldowns ignored. More than ``max_replicas`` -> drain one, unless a drain is
   already in progress.
2. Signal: from warm workers only (``warm`` reported and ``warmup_s`` passed since start; not
   draining), a utilisation ratio where 1.0 means "at target":
   prefill = the larger of mean predicted TTFT / TTFT SLO and the mean share of time the workers
   spent computing prompts since their last report (a worker that has just drained its queue
   predicts a TTFT of 0 even when it is busy all the time); decode = the largest of mean KV usage, mean
   (running + waiting) sequences / ``max_num_seqs``, and mean ITL / ITL SLO. The load the
   warm workers report is spread over every replica, so warming and pending replicas count as
   capacity: ``utilisation = ratio * warm_workers / (replicas + pending)``.
3. Scale up when utilisation > ``scale_up_utilization``, to the replica count that brings it
   back to that threshold (at least +1, at most +``max_step``, at most ``max_replicas``),
   once ``scale_up_cooldown_s`` has passed since the last scale-up.
4. Scale down by exactly one when utilisation has stayed < ``scale_down_utilization`` on every
   decision for ``scale_down_stable_s`` (one quiet sample, such as the moment between two waves
   of requests, is not enough), no drain is in progress, no replica is pending, ``scale_down_cooldown_s`` has passed since the last
   scaling action of either kind, and the utilisation projected on one replica fewer stays
   at or below ``scale_up_utilization`` (otherwise the next tick would scale up again).
   The replica to drain is the least loaded warm worker.
5. Otherwise hold. Every decision carries a reason an operator can read in the logs.

With a capacity model (``planner.profile``: ``capacity/traffic_window.py``), the caller also passes
each pool's ``model_target``: the replicas the profile says the observed traffic needs, with the
arithmetic. The threshold rules above stay as guard rails around it:

* a threshold scale-up goes to the larger of its own target and the model's;
* the model alone scales a pool up to its target (within ``max_step``, ``max_replicas`` and the
  scale-up cooldown) only while the pool is not idle (utilisation at or above
  ``scale_down_utilization``): an estimate never starts workers for traffic no worker sees;
* a scale-down still needs every threshold condition of rule 4, and also the model's agreement
  (its target below the current replicas); the reason carries the model's arithmetic.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.engine.contract import WorkerRole, as_role


class ScaleAction(enum.StrEnum):
    HOLD = "hold"
    SCALE_UP = "scale_up"
    SCALE_DOWN = "scale_down"


@dataclass(frozen=True, slots=True)
class WorkerMetrics:
    """One worker's latest report, as the pool manager reads it from its stats.

    Prefill workers give ``predicted_ttft_ms`` or, failing that, ``prefill_tokens_per_s``
    (measured), from which the planner predicts ``queued_prompt_tokens / throughput``.
    ``itl_ms`` is a decode worker's recent mean inter-token latency, None while it decodes
    nothing.
    """

    worker_id: str
    role: WorkerRole
    warm: bool
    started_at: float
    queued_prompt_tokens: int = 0
    running_seqs: int = 0
    waiting_seqs: int = 0
    kv_usage: float = 0.0
    predicted_ttft_ms: float | None = None
    prefill_tokens_per_s: float | None = None
    # a prefill worker's share of the recent time spent computing prompts (0-1), None if unknown
    prefill_busy: float | None = None
    itl_ms: float | None = None
    draining: bool = False
    # Of running_seqs + waiting_seqs and kv_usage, the part that is batch-priority work.
    batch_seqs: int = 0
    batch_kv_usage: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", as_role(self.role))
        if not 0.0 <= self.kv_usage <= 1.0:
            raise ValueError(f"kv_usage must be in [0, 1], got {self.kv_usage}")
        if self.prefill_busy is not None and not 0.0 <= self.prefill_busy <= 1.0:
            raise ValueError(f"prefill_busy must be in [0, 1], got {self.prefill_busy}")
        for name in ("queued_prompt_tokens", "running_seqs", "waiting_seqs"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True, slots=True)
class PoolState:
    """What the actuator knows about one pool right now.

    ``replicas``: replicas running and not draining (warming-up ones included); ``pending``:
    replicas asked for but not yet running. When the pool last scaled is not here: the
    ``Planner`` that decided it owns that record (a cooldown starts with the decision).
    """

    role: WorkerRole
    replicas: int
    min_replicas: int
    max_replicas: int
    max_num_seqs: int = 64
    pending: int = 0
    # What one more replica would need against what the cluster has free (the actuator's words,
    # e.g. "another replica needs 1 CPU; Ray has 0 of 2 CPUs free"): said when max_replicas binds.
    headroom: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", as_role(self.role))
        if self.replicas < 0 or self.pending < 0:
            raise ValueError("replicas and pending must be >= 0")
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError(
                f"need 0 <= min_replicas ({self.min_replicas}) <= max_replicas ({self.max_replicas})"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")

    @property
    def capacity(self) -> int:
        return self.replicas + self.pending


@dataclass(frozen=True, slots=True)
class PlannerPolicy:
    """The planner's settings as plain data (built by ``ClusterConfig.planner_policy()``)."""

    ttft_slo_ms: float = 2000.0
    itl_slo_ms: float = 100.0
    scale_up_utilization: float = 0.8
    scale_down_utilization: float = 0.4
    scale_up_cooldown_s: float = 30.0
    scale_down_cooldown_s: float = 120.0
    warmup_s: float = 30.0
    max_step: int = 2
    scale_down_stable_s: float = 30.0
    batch_budget_replicas: int = 0

    def __post_init__(self) -> None:
        if self.ttft_slo_ms <= 0 or self.itl_slo_ms <= 0:
            raise ValueError("SLOs must be > 0")
        if not 0 <= self.scale_down_utilization < self.scale_up_utilization:
            raise ValueError(
                f"need 0 <= scale_down_utilization ({self.scale_down_utilization}) "
                f"< scale_up_utilization ({self.scale_up_utilization})"
            )
        if min(self.scale_up_cooldown_s, self.scale_down_cooldown_s, self.warmup_s,
               self.scale_down_stable_s) < 0:
            raise ValueError("cooldowns, warmup_s and scale_down_stable_s must be >= 0")
        if self.max_step < 1:
            raise ValueError(f"max_step must be >= 1, got {self.max_step}")


@dataclass(frozen=True, slots=True)
class PlannerDecision:
    """The planner's answer for one pool.

    ``current_replicas`` counts running and pending replicas. A scale-down lowers
    ``target_replicas`` by exactly one and ``drain_worker_id`` names the least loaded warm worker
    to drain; it is None only when no warm worker exists (a pool above ``max_replicas`` that is
    still starting), and then the actuator cancels a pending replica or stops a warming one.
    ``utilization`` is None when there was no signal.
    """

    role: WorkerRole
    action: ScaleAction
    current_replicas: int
    target_replicas: int
    reason: str
    utilization: float | None = None
    drain_worker_id: str | None = None


@dataclass(frozen=True, slots=True)
class _Signal:
    ratio: float
    detail: str


def is_warm(worker: WorkerMetrics, now: float, warmup_s: float) -> bool:
    """True once a worker says it is warm and ``warmup_s`` has passed since it started."""
    return worker.warm and now - worker.started_at >= warmup_s


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _prefill_signal(warm: Sequence[WorkerMetrics], policy: PlannerPolicy) -> _Signal | None:
    predictions = []
    for w in warm:
        if w.predicted_ttft_ms is not None:
            predictions.append(w.predicted_ttft_ms)
        elif w.queued_prompt_tokens == 0:
            predictions.append(0.0)
        elif w.prefill_tokens_per_s:
            predictions.append(1000.0 * w.queued_prompt_tokens / w.prefill_tokens_per_s)
    ttft = _mean(predictions)
    if ttft is None:
        return None
    detail = f"predicted TTFT {ttft:.0f} ms vs SLO {policy.ttft_slo_ms:.0f} ms"
    signal = _Signal(ttft / policy.ttft_slo_ms, detail)
    # A worker that has just emptied its queue predicts a TTFT of 0 however busy it is: how much of
    # its time it spends computing prompts keeps a pool that runs near saturation from reading idle.
    busy = _mean([w.prefill_busy for w in warm if w.prefill_busy is not None])
    if busy is not None and busy > signal.ratio:
        signal = _Signal(busy, f"prefill busy {busy:.0%} of the time ({detail})")
    return signal


def _decode_signal(
    warm: Sequence[WorkerMetrics], policy: PlannerPolicy, max_num_seqs: int, interactive_only: bool = False
) -> _Signal | None:
    """``interactive_only``: the load without the workers' batch-priority sequences and their KV."""
    if not warm:
        return None
    kv = _mean([max(0.0, w.kv_usage - (w.batch_kv_usage if interactive_only else 0.0)) for w in warm]) or 0.0
    seqs = _mean([max(0, w.running_seqs + w.waiting_seqs - (w.batch_seqs if interactive_only else 0))
                  / max_num_seqs for w in warm]) or 0.0
    candidates = [
        _Signal(kv, f"KV usage {kv:.0%}"),
        _Signal(seqs, f"sequences {seqs:.0%} of max_num_seqs"),
    ]
    itl = _mean([w.itl_ms for w in warm if w.itl_ms is not None])
    if itl is not None:
        detail = f"ITL {itl:.0f} ms vs SLO {policy.itl_slo_ms:.0f} ms"
        candidates.append(_Signal(itl / policy.itl_slo_ms, detail))
    return max(candidates, key=lambda s: s.ratio)


def _load_key(worker: WorkerMetrics) -> tuple[float, ...]:
    if worker.role is WorkerRole.PREFILL:
        return (worker.queued_prompt_tokens, worker.waiting_seqs, worker.running_seqs)
    return (worker.running_seqs + worker.waiting_seqs, worker.kv_usage)


def pick_drain_target(workers: Sequence[WorkerMetrics], now: float, warmup_s: float) -> str | None:
    """The least loaded warm, non-draining worker (ties broken by id), or None."""
    warm = [w for w in workers if not w.draining and is_warm(w, now, warmup_s)]
    if not warm:
        return None
    return min(warm, key=lambda w: (_load_key(w), w.worker_id)).worker_id


def _latest(*times: float | None) -> float | None:
    present = [t for t in times if t is not None]
    return max(present) if present else None


def decide_pool(
    now: float,
    pool: PoolState,
    metrics: Sequence[WorkerMetrics],
    policy: PlannerPolicy,
    last_scale_up_at: float | None = None,
    last_scale_down_at: float | None = None,
    model_target: tuple[int, str] | None = None,
) -> PlannerDecision:
    """Decide one pool (see the module docstring); ``metrics`` may hold other roles' workers.
    ``last_scale_up_at``/``last_scale_down_at``: when this pool last scaled (the ``Planner``'s
    record, None: never). ``model_target``: (replicas, arithmetic) from the capacity model, None
    without one."""
    workers = [w for w in metrics if w.role == pool.role]
    capacity = pool.capacity
    last_up = last_scale_up_at
    last_any = _latest(last_up, last_scale_down_at)
    draining = sorted(w.worker_id for w in workers if w.draining)

    def decision(action: ScaleAction, target: int, reason: str, util: float | None = None,
                 drain: str | None = None) -> PlannerDecision:
        return PlannerDecision(pool.role, action, capacity, target, reason, util, drain)

    if capacity < pool.min_replicas:
        return decision(ScaleAction.SCALE_UP, pool.min_replicas,
                        f"{capacity} replicas below min_replicas {pool.min_replicas}")
    if capacity > pool.max_replicas:
        if draining:
            return decision(ScaleAction.HOLD, capacity,
                            f"above max_replicas; drain of {draining[0]} in progress")
        return decision(ScaleAction.SCALE_DOWN, capacity - 1,
                        f"{capacity} replicas above max_replicas {pool.max_replicas}",
                        drain=pick_drain_target(workers, now, policy.warmup_s))

    warm = [w for w in workers if not w.draining and is_warm(w, now, policy.warmup_s)]
    if pool.role is WorkerRole.PREFILL:
        signal = _prefill_signal(warm, policy)
    else:
        signal = _decode_signal(warm, policy, pool.max_num_seqs)
    if signal is None or capacity == 0:
        return decision(ScaleAction.HOLD, capacity, "no signal: no warm worker reports load yet")
    load = signal.ratio * len(warm)  # in units of "one replica at target"
    if pool.role is WorkerRole.DECODE and any(w.batch_seqs for w in warm):
        # Batch work may wait: it adds at most batch_budget_replicas to what the interactive load needs.
        interactive = _decode_signal(warm, policy, pool.max_num_seqs, interactive_only=True)
        capped = interactive.ratio * len(warm) + policy.batch_budget_replicas * policy.scale_up_utilization
        if capped < load:
            load = capped
            signal = _Signal(load / len(warm), f"{interactive.detail} without batch work "
                                               f"(+{policy.batch_budget_replicas} replicas for it)")
    util = load / capacity

    def hold(why: str) -> PlannerDecision:
        return decision(ScaleAction.HOLD, capacity, f"{signal.detail}; {why}", util)

    model_n, model_why = model_target if model_target is not None else (None, "")
    if util > policy.scale_up_utilization or (model_n is not None and model_n > capacity
                                              and util >= policy.scale_down_utilization):
        by_model = util <= policy.scale_up_utilization
        why = (f"capacity model wants {model_n}: {model_why}" if by_model else
               f"{signal.detail}; utilisation {util:.2f}" + (f"; capacity model wants {model_n}" if model_n else ""))
        if capacity >= pool.max_replicas:
            return hold(f"at max_replicas {pool.max_replicas}" + (f" ({pool.headroom})" if pool.headroom else "")
                        + (f"; capacity model wants {model_n}" if by_model else ""))
        if last_up is not None and now - last_up < policy.scale_up_cooldown_s:
            return hold(f"scale-up cooldown, {policy.scale_up_cooldown_s - (now - last_up):.0f} s left"
                        + (f"; capacity model wants {model_n}" if by_model else ""))
        wanted = model_n if by_model else max(math.ceil(load / policy.scale_up_utilization), model_n or 0)
        target = min(max(wanted, capacity + 1), capacity + policy.max_step, pool.max_replicas)
        return decision(ScaleAction.SCALE_UP, target, why, util)

    if util >= policy.scale_down_utilization:
        return hold(f"utilisation {util:.2f} within band")
    if capacity <= pool.min_replicas:
        return hold(f"at min_replicas {pool.min_replicas}")
    if draining:
        return hold(f"drain of {draining[0]} in progress")
    if pool.pending:
        return hold(f"{pool.pending} replicas still starting")
    if last_any is not None and now - last_any < policy.scale_down_cooldown_s:
        return hold(f"scale-down cooldown, {policy.scale_down_cooldown_s - (now - last_any):.0f} s left")
    projected = load / (capacity - 1) if capacity > 1 else (math.inf if load > 0 else 0.0)
    if projected > policy.scale_up_utilization:
        return hold(f"one replica fewer would reach utilisation {projected:.2f}")
    if model_n is not None and model_n >= capacity:
        return hold(f"utilisation {util:.2f} is low, but the capacity model wants {model_n}: {model_why}")
    return decision(ScaleAction.SCALE_DOWN, capacity - 1, f"{signal.detail}; utilisation {util:.2f}"
                    + (f"; capacity model wants {model_n}: {model_why}" if model_n is not None else ""),
                    util, pick_drain_target(workers, now, policy.warmup_s))


@dataclass
class Planner:
    """Holds the policy, the time of each pool's last scale-up and scale-down, and since when
    each pool's utilisation has been below ``scale_down_utilization``.

    ``decide`` is called every ``interval_s`` by the actuator in ``cluster/``; a scale-up or
    scale-down decision starts that pool's cooldown whether or not the actuator succeeds, so
    a pool that cannot be placed is not asked for again on every tick. These times are the only
    record of when a pool scaled: the actuator reads them here and keeps no copy.
    """

    policy: PlannerPolicy
    last_scale_up_at: dict[WorkerRole, float] = field(default_factory=dict)
    last_scale_down_at: dict[WorkerRole, float] = field(default_factory=dict)
    low_since: dict[WorkerRole, float] = field(default_factory=dict)

    def decide(
        self, now: float, pools: Sequence[PoolState], metrics: Sequence[WorkerMetrics],
        model_targets: dict[WorkerRole, tuple[int, str]] | None = None,
    ) -> list[PlannerDecision]:
        decisions = []
        for pool in pools:
            d = decide_pool(now, pool, metrics, self.policy,
                            self.last_scale_up_at.get(pool.role), self.last_scale_down_at.get(pool.role),
                            (model_targets or {}).get(pool.role))
            d = self._steady(now, d)
            if d.action is ScaleAction.SCALE_UP:
                self.last_scale_up_at[pool.role] = now
            elif d.action is ScaleAction.SCALE_DOWN:
                self.last_scale_down_at[pool.role] = now
                self.low_since.pop(pool.role, None)  # the next scale-down needs a new quiet spell
            decisions.append(d)
        return decisions

    def _steady(self, now: float, d: PlannerDecision) -> PlannerDecision:
        """Hold a load-driven scale-down until utilisation has been low for
        ``scale_down_stable_s`` (a repair above ``max_replicas`` is not held)."""
        if d.utilization is None or d.utilization >= self.policy.scale_down_utilization:
            self.low_since.pop(d.role, None)
            return d
        since = self.low_since.setdefault(d.role, now)
        if d.action is not ScaleAction.SCALE_DOWN:
            return d
        quiet = now - since
        if quiet >= self.policy.scale_down_stable_s:
            return d
        return PlannerDecision(d.role, ScaleAction.HOLD, d.current_replicas, d.current_replicas,
                               f"{d.reason}; low for {quiet:.0f} s of the {self.policy.scale_down_stable_s:.0f} s "
                               f"scale_down_stable_s", d.utilization)

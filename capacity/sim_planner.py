"""The live planner inside the simulator (``capacity/simulate.py``): ``pdserve simulate --planner CONFIG``.

The simulated cluster is decided by the same code that scales a real one: every
``planner.interval_s`` of simulated time, ``capacity.planner.Planner.decide`` reads each simulated
worker's metrics (queued prompt tokens, running and waiting sequences, KV usage, the step time as
its ITL) and, with ``planner.profile`` set, the capacity model's targets for the traffic that ended
in the last ``planner.traffic_window_s`` (``capacity.traffic_window``). A scale-up starts workers
that take ``worker_start_s`` to come up; a scale-down drains the worker the planner names: it takes
no new request, finishes what it has, then stops. The result says what the planner did and what
the workers cost (worker-seconds, from the request to start one until it stopped).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from pdserve.capacity.profile import Profile
from pdserve.capacity.planner import Planner, PlannerDecision, PlannerPolicy, PoolState, ScaleAction, WorkerMetrics
from pdserve.capacity.traffic_window import CapacityModel, TrafficWindow
from pdserve.engine.contract import WorkerRole

logger = logging.getLogger(__name__)

MAX_DECISIONS_KEPT = 200


@dataclass(frozen=True, slots=True)
class PoolBounds:
    min_replicas: int
    initial: int
    max_replicas: int

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.initial <= self.max_replicas:
            raise ValueError(f"need 0 <= min_replicas ({self.min_replicas}) <= initial ({self.initial}) "
                             f"<= max_replicas ({self.max_replicas})")


@dataclass(frozen=True, slots=True)
class PlannerSetup:
    """What the simulated planner runs with (``cluster/config_io.load_planner_setup`` reads it from
    a cluster config)."""

    policy: PlannerPolicy
    prefill: PoolBounds
    decode: PoolBounds
    interval_s: float = 10.0
    worker_start_s: float = 30.0
    use_model: bool = False         # the capacity model (planner.profile) beside the thresholds
    window_s: float = 120.0

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.worker_start_s < 0 or self.window_s <= 0:
            raise ValueError("interval_s and window_s must be > 0, worker_start_s >= 0")
        if self.decode.min_replicas < 1:
            raise ValueError("the simulated planner needs decode.min_replicas >= 1")


@dataclass(slots=True)
class PlannerRun:
    """What the planner did in one simulation."""

    decisions: list[dict] = field(default_factory=list)     # the scaling ones (not holds), first ones kept
    scale_ups: int = 0
    scale_downs: int = 0
    worker_seconds: dict[str, float] = field(default_factory=lambda: {"prefill": 0.0, "decode": 0.0})
    most: dict[str, int] = field(default_factory=lambda: {"prefill": 0, "decode": 0})
    ticks: int = 0

    def summary(self) -> dict:
        return {"scale_ups": self.scale_ups, "scale_downs": self.scale_downs, "ticks": self.ticks,
                "worker_seconds": {k: round(v, 1) for k, v in self.worker_seconds.items()},
                "most_replicas": dict(self.most), "decisions": self.decisions}


class SimPlanner:
    """The live ``Planner`` (and capacity model) fed from simulated state at simulated times."""

    def __init__(self, setup: PlannerSetup, profile: Profile, mode: str, max_num_seqs: int) -> None:
        self.setup = setup
        self.mode = mode
        self.max_num_seqs = max_num_seqs
        self.planner = Planner(setup.policy)
        self.now = 0.0
        self.window = TrafficWindow(setup.window_s, clock=lambda: self.now)
        pol = setup.policy
        self.model = (CapacityModel(profile, pol.ttft_slo_ms / 1e3, pol.itl_slo_ms / 1e3, mode == "colocated")
                      if setup.use_model else None)
        self.run = PlannerRun()

    @staticmethod
    def prefill_metrics(index: int, started_at: float, queued_tokens: int, queued_prompts: int,
                        tokens_per_s: float, busy: float | None, draining: bool) -> WorkerMetrics:
        """A simulated prefill worker's report, as the pool manager reads a real one."""
        return WorkerMetrics(f"prefill-{index}", WorkerRole.PREFILL, True, started_at,
                             queued_prompt_tokens=queued_tokens, running_seqs=queued_prompts,
                             prefill_tokens_per_s=tokens_per_s, prefill_busy=busy, draining=draining)

    @staticmethod
    def decode_metrics(index: int, started_at: float, running: int, waiting: int, kv_usage: float,
                       itl_s: float | None, draining: bool) -> WorkerMetrics:
        """A simulated decode (or colocated) worker's report."""
        return WorkerMetrics(f"decode-{index}", WorkerRole.DECODE, True, started_at, running_seqs=running,
                             waiting_seqs=waiting, kv_usage=min(1.0, max(0.0, kv_usage)),
                             itl_ms=None if itl_s is None else 1e3 * itl_s, draining=draining)

    def request_ended(self, t: float, prompt: int, cached: int, output: int) -> None:
        self.now = t
        self.window.add(prompt, cached, output)

    def decide(self, now: float, replicas: dict[str, int], pending: dict[str, int],
               metrics: list[WorkerMetrics]) -> list[PlannerDecision]:
        self.now = now
        self.run.ticks += 1
        pools = []
        for name, bounds in (("prefill", self.setup.prefill), ("decode", self.setup.decode)):
            if name == "prefill" and self.mode == "colocated":
                continue
            pools.append(PoolState(WorkerRole(name), replicas[name], bounds.min_replicas, bounds.max_replicas,
                                   max_num_seqs=self.max_num_seqs, pending=pending[name]))
        targets = None
        if self.model is not None and (seen := self.window.observed()) is not None:
            t = self.model.targets(seen)
            targets = {WorkerRole.DECODE: (t.decode, t.explanation)}
            if self.mode != "colocated":
                targets[WorkerRole.PREFILL] = (t.prefill, t.explanation)
        decisions = self.planner.decide(now, pools, metrics, targets)
        for d in decisions:
            if d.action is ScaleAction.HOLD:
                continue
            if d.action is ScaleAction.SCALE_UP:
                self.run.scale_ups += 1
            else:
                self.run.scale_downs += 1
            if len(self.run.decisions) < MAX_DECISIONS_KEPT:
                self.run.decisions.append({"t": round(now, 1), "pool": d.role.value, "action": d.action.value,
                                           "from": d.current_replicas, "to": d.target_replicas, "reason": d.reason})
        return decisions

    def account(self, dt: float, live: dict[str, int]) -> None:
        """``live[pool]`` workers (starting, serving or draining) ran for ``dt`` simulated seconds."""
        for name, n in live.items():
            self.run.worker_seconds[name] += n * dt
            self.run.most[name] = max(self.run.most[name], n)

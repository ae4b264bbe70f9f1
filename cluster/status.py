"""What ``pdserve status`` shows, typed: the head builds a ``ClusterStatus``
(``RouterService.status``), writes ``to_dict()`` into Redis as JSON, and the CLI reads it back
(``ClusterStatus.from_dict``); ``--json`` prints the stored document as it is. A field a newer
head added is ignored when read back, a missing one takes its default."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from pdserve.engine.contract import WorkerRole, as_role


def _known(cls: type, d: dict[str, Any]) -> dict[str, Any]:
    """The keys of ``d`` that are fields of ``cls`` (a newer writer's extra keys are dropped)."""
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in d.items() if k in names}


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    """One worker: its pool view (alive, draining, load) and what its last stats said."""

    worker_id: str
    role: WorkerRole
    alive: bool
    draining: bool
    responsive: bool
    kv_usage: float
    running: int
    waiting: int
    tokens_per_s: float
    inflight_requests: int
    prefix_hit_rate: float = 0.0
    generated_tokens: int = 0
    node_ip: str = ""
    node_id: str = ""
    num_threads: int | None = None
    cores: list[int] | None = None
    pinning: str = ""
    dtype: str = ""
    kernels: dict[str, str] = field(default_factory=dict)
    linear_backend: str = ""
    attention_backend: str = ""
    itl_ms: float | None = None            # decode workers
    expired_reservations: int = 0          # decode workers

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", as_role(self.role))


@dataclass(frozen=True, slots=True)
class PoolStatus:
    replicas: int
    pending: int
    draining: list[str] = field(default_factory=list)
    peers_skipped: int = 0    # peers a new worker could not add (a dying peer), skipped
    start_failures: int = 0   # worker starts that failed (a replacement is tried again)


@dataclass(frozen=True, slots=True)
class PlannerDecisionStatus:
    """One of the planner's last decisions for a pool."""

    pool: WorkerRole
    action: str
    target: int
    reason: str
    at: float | None = None   # wall time of the pass that decided it

    def __post_init__(self) -> None:
        object.__setattr__(self, "pool", as_role(self.pool))


@dataclass(frozen=True, slots=True)
class RedisStatus:
    """What the head's Redis guard saw (``cluster/state/redis_guard.py``)."""

    up: bool
    outages: int = 0
    down_for_s: float = 0.0
    dropped: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RouterStatus:
    """One live router of an elected control plane, as its last heartbeat recorded it."""

    router_id: str
    http: str
    grpc: str
    leader: bool
    pid: int
    host: str
    seen_at: float = 0.0


@dataclass(frozen=True, slots=True)
class ControlPlaneStatus:
    """An elected control plane: this router, the leader's epoch, every live router."""

    router_id: str
    leader: bool
    epoch: int | None
    takeovers: int
    routers: list[RouterStatus] = field(default_factory=list)

    @property
    def leader_id(self) -> str | None:
        return next((r.router_id for r in self.routers if r.leader), None)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ControlPlaneStatus:
        known = _known(cls, d)
        known["routers"] = [RouterStatus(**_known(RouterStatus, r)) for r in d.get("routers") or []]
        return cls(**known)


@dataclass(frozen=True, slots=True)
class BatchStatus:
    """A running batch as the head's batch runner last saw it."""

    id: str
    status: str
    endpoint: str = ""
    total: int = 0
    completed: int = 0
    failed: int = 0
    running: int = 0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BatchStatus:
        return cls(**_known(cls, d))


@dataclass(frozen=True, slots=True)
class ClusterStatus:
    """What ``pdserve status`` shows: pools, workers, the planner's last decisions, the Redis
    guard's view and the running batches. ``to_dict`` is the stored and ``--json`` document."""

    endpoints: dict[str, str] = field(default_factory=dict)
    pools: dict[WorkerRole, PoolStatus] = field(default_factory=dict)
    workers: list[WorkerStatus] = field(default_factory=list)
    planner: list[PlannerDecisionStatus] = field(default_factory=list)
    migrations: int = 0
    retries: int = 0
    uptime_s: float = 0.0
    redis: RedisStatus | None = None
    batches: list[BatchStatus] = field(default_factory=list)
    control_plane: ControlPlaneStatus | None = None

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["pools"] = {str(role): pool for role, pool in d["pools"].items()}
        for w in d["workers"]:
            w["role"] = str(w["role"])
        for p in d["planner"]:
            p["pool"] = str(p["pool"])
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ClusterStatus:
        """A stored document read back."""
        return cls(
            endpoints=dict(d.get("endpoints") or {}),
            pools={as_role(role): PoolStatus(**_known(PoolStatus, p)) for role, p in (d.get("pools") or {}).items()},
            workers=[WorkerStatus(**_known(WorkerStatus, w)) for w in d.get("workers") or []],
            planner=[PlannerDecisionStatus(**_known(PlannerDecisionStatus, p)) for p in d.get("planner") or []],
            migrations=int(d.get("migrations") or 0), retries=int(d.get("retries") or 0),
            uptime_s=float(d.get("uptime_s") or 0.0),
            redis=None if d.get("redis") is None else RedisStatus(**_known(RedisStatus, d["redis"])),
            batches=[BatchStatus.from_dict(b) for b in d.get("batches") or []],
            control_plane=(None if d.get("control_plane") is None
                           else ControlPlaneStatus.from_dict(d["control_plane"])))

"""The workers of a cluster, in Redis, for every router and for the next control-plane leader.

The leader writes one record per worker it starts (role, Ray actor name and namespace) and
marks it draining before it stops it; it deletes the record once the worker is stopped or
found dead. Every router reads the registry every second to know which workers to route to
(``RegistryFollower``), and a new leader adopts the workers it lists instead of starting
others: the workers are detached Ray actors, so they outlive the router that started them.

A second hash lists the routers themselves (their endpoints, whether they lead), each record
refreshed by its router; a record older than ``ROUTER_STALE_S`` is a router that stopped.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, replace

import redis

from pdserve.engine.contract import WorkerRole, as_role

ROUTER_STALE_S = 10.0


@dataclass(frozen=True, slots=True)
class WorkerRecord:
    worker_id: str
    role: WorkerRole
    actor_name: str
    ray_namespace: str | None
    draining: bool = False
    registered_at: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", as_role(self.role))

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: bytes | str) -> WorkerRecord:
        d = json.loads(raw)
        return cls(str(d["worker_id"]), as_role(d["role"]), str(d["actor_name"]), d.get("ray_namespace"),
                   bool(d.get("draining", False)), float(d.get("registered_at", 0.0)))


@dataclass(frozen=True, slots=True)
class RouterRecord:
    router_id: str
    http: str
    grpc: str
    leader: bool
    pid: int
    host: str
    seen_at: float

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: bytes | str) -> RouterRecord:
        d = json.loads(raw)
        return cls(str(d["router_id"]), str(d["http"]), str(d["grpc"]), bool(d["leader"]), int(d["pid"]),
                   str(d["host"]), float(d["seen_at"]))


class WorkerRegistry:
    def __init__(self, client: redis.Redis, namespace: str = "pdserve") -> None:
        self.client = client
        self.workers_key = f"{namespace}:workers"
        self.routers_key = f"{namespace}:routers"

    # ---------------------------------------------------------------- workers
    def add(self, record: WorkerRecord) -> None:
        if not record.registered_at:
            record = replace(record, registered_at=time.time())
        self.client.hset(self.workers_key, record.worker_id, record.to_json())

    def set_draining(self, worker_id: str, draining: bool) -> None:
        raw = self.client.hget(self.workers_key, worker_id)
        if raw is None:
            return
        self.client.hset(self.workers_key, worker_id, replace(WorkerRecord.from_json(raw), draining=draining).to_json())

    def remove(self, worker_id: str) -> None:
        self.client.hdel(self.workers_key, worker_id)

    def workers(self) -> dict[str, WorkerRecord]:
        return {k.decode() if isinstance(k, bytes) else k: WorkerRecord.from_json(v)
                for k, v in self.client.hgetall(self.workers_key).items()}

    # ---------------------------------------------------------------- routers
    def heartbeat(self, record: RouterRecord) -> None:
        self.client.hset(self.routers_key, record.router_id, record.to_json())

    def forget_router(self, router_id: str) -> None:
        self.client.hdel(self.routers_key, router_id)

    def routers(self, now: float | None = None, stale_s: float = ROUTER_STALE_S) -> list[RouterRecord]:
        """Routers seen within ``stale_s``; older records (routers that stopped) are deleted."""
        now = time.time() if now is None else now
        live, stale = [], []
        for raw in self.client.hgetall(self.routers_key).values():
            r = RouterRecord.from_json(raw)
            (live if now - r.seen_at <= stale_s else stale).append(r)
        if stale:
            self.client.hdel(self.routers_key, *[r.router_id for r in stale])
        return sorted(live, key=lambda r: r.router_id)

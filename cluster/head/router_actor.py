"""The routers beyond the head's own (``router.replicas``): each a Ray actor running a
``RouterService`` on its own HTTP and gRPC ports, in the actor's event loop.

The head starts them once it serves (``start_router_actors``) and stops them when it stops. They
are peers of the head's router: they route to the workers the registry lists and stand for the
control-plane lease (``control_plane.election`` is required). An actor with ``num_cpus`` 0 takes
none of the CPUs the workers were given. The config (with its secrets) and the Redis password
reach the actor as its constructor's arguments, through Ray's object store: never in argv, an
environment variable or a log.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os

from pdserve.cluster.config import ClusterConfig
from pdserve.cluster.config_io import apply_overrides
from pdserve.engine.gc_freeze import freeze_startup_heap

logger = logging.getLogger(__name__)

ACTOR_PREFIX = "pdserve-router-"


def replica_config(config: ClusterConfig, index: int) -> ClusterConfig:
    """Router ``index``'s config (1, 2, ...): the next ports after the head's, or any free ones."""
    r = config.router
    return apply_overrides(config, {"router.http_port": r.http_port + index if r.http_port else 0,
                                    "router.grpc_port": r.grpc_port + index if r.grpc_port else 0},
                           source="router.replicas")


@dataclasses.dataclass(frozen=True, slots=True)
class StartedRouter:
    """A router actor that serves: its id, process and endpoints."""

    router_id: str
    pid: int
    http_url: str
    grpc_target: str


class RouterActor:
    def __init__(self, config: ClusterConfig, redis_url: str, redis_password: str | None, namespace: str) -> None:
        self.config = config
        self.redis_url = redis_url
        self.redis_password = redis_password
        self.namespace = namespace
        self.service = None

    async def start(self) -> StartedRouter:
        from pdserve.cluster.head.router_service import RouterService   # Ray, gRPC, the router: 2 s, not for `status`

        logging.getLogger("pdserve").setLevel(logging.INFO)
        self.service = RouterService(self.config, redis_url=self.redis_url, namespace=self.namespace,
                                     redis_password=self.redis_password)
        endpoints = await self.service.start()
        freeze_startup_heap(f"router {self.service.router_id}")  # its own process: see engine/gc_freeze.py
        return StartedRouter(self.service.router_id, os.getpid(), endpoints.http_url, endpoints.grpc_target)

    async def stop(self, drain_s: float = 30.0) -> None:
        """Stop taking requests, let this router's streams finish (bounded), leave the cluster."""
        if self.service is None:
            return
        await asyncio.wait_for(self.service.drain(drain_s), drain_s + 5.0)
        await self.service.stop(stop_workers=False)


def start_router_actors(config: ClusterConfig, redis_url: str, redis_password: str | None, *,
                        detached: bool, timeout_s: float = 600.0,
                        name_prefix: str = ACTOR_PREFIX) -> list[tuple[object, StartedRouter]]:
    """Start routers 1 .. replicas-1 and wait until each serves; returns (actor, endpoints) pairs."""
    import ray

    actors = []
    for index in range(1, config.router.replicas):
        options = {"name": f"{name_prefix}{index}", "namespace": config.ray.namespace, "num_cpus": 0,
                   "max_restarts": 0, "max_concurrency": 8,
                   "runtime_env": {"env_vars": {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}}}
        if detached:
            options["lifetime"] = "detached"
        actor = ray.remote(RouterActor).options(**options).remote(
            replica_config(config, index), redis_url, redis_password, config.ray.namespace)
        actors.append(actor)
    endpoints = ray.get([a.start.remote() for a in actors], timeout=timeout_s)
    for ep in endpoints:
        logger.info("router %s serving: HTTP %s, gRPC %s", ep.router_id, ep.http_url, ep.grpc_target)
    return list(zip(actors, endpoints))


def stop_router_actors(actors: list, timeout_s: float = 40.0) -> None:
    import ray

    for actor in actors:
        try:
            ray.get(actor.stop.remote(), timeout=timeout_s)
        except Exception as exc:  # noqa: BLE001 - it is killed below whatever happened
            logger.info("router actor did not stop cleanly: %s", exc)
        ray.kill(actor, no_restart=True)

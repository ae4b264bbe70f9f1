"""Starting prefill and decode workers as Ray actors (one OS process each) and wiring their
NIXL agents together. Only this module and the rest of ``cluster/`` touch Ray."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.config import EngineConfig, EngineMode
from pdserve.engine.contract import WorkerRole, as_role

logger = logging.getLogger(__name__)

ACTOR_PREFIX = {WorkerRole.PREFILL: "pdserve-prefill-", WorkerRole.DECODE: "pdserve-decode-"}
# Threads per actor for concurrent control calls (prefill/reserve/start/drain block a thread each).
ACTOR_MAX_CONCURRENCY = 256


@dataclass(slots=True)
class WorkerHandle:
    worker_id: str
    role: WorkerRole
    actor: Any                     # ray.actor.ActorHandle
    metadata: bytes = b""
    node_id: str = ""
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.role = as_role(self.role)


def _actor_class(role: WorkerRole) -> type:
    """The Ray actor class of a role's workers (``cluster/runtime/worker_actors.py``): the worker
    service with Ray metrics, pinned to cores of its own."""
    from pdserve.cluster.runtime.worker_actors import DecodeWorkerActor, PrefillWorkerActor

    if role is WorkerRole.PREFILL:
        return PrefillWorkerActor
    if role is WorkerRole.DECODE:
        return DecodeWorkerActor
    raise ValueError(f"unknown worker role {role!r}")


def actor_options(
    role: WorkerRole,
    worker_id: str,
    *,
    num_cpus: float = 1.0,
    num_gpus: float = 0.0,
    resources: dict[str, float] | None = None,
    accelerator_type: str | None = None,
    namespace: str | None = None,
    detached: bool = False,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The Ray actor options of one worker (pure: what ``start_worker`` asks Ray for).
    ``accelerator_type`` places it only on nodes that advertise that accelerator (Ray's
    ``accelerator_type:<name>`` resource, e.g. ``H100``)."""
    options: dict[str, Any] = {
        "name": ACTOR_PREFIX[as_role(role)] + worker_id,
        "num_cpus": num_cpus,
        "num_gpus": num_gpus,
        "resources": dict(resources or {}),
        "max_concurrency": ACTOR_MAX_CONCURRENCY,
        "max_restarts": 0,
    }
    if accelerator_type:
        options["accelerator_type"] = accelerator_type
    if namespace:
        options["namespace"] = namespace
    if detached:
        options["lifetime"] = "detached"
    env_vars = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") == "0":
        # A loopback-only (single machine) cluster: keep UCX's control traffic on lo as well.
        env_vars["UCX_NET_DEVICES"] = os.environ.get("UCX_NET_DEVICES", "lo")
    options["runtime_env"] = {"env_vars": {**env_vars, **(env or {})}}
    return options


def start_worker(
    role: WorkerRole,
    worker_id: str,
    engine_config: EngineConfig,
    *,
    num_cpus: float = 1.0,
    num_gpus: float = 0.0,
    resources: dict[str, float] | None = None,
    accelerator_type: str | None = None,
    namespace: str | None = None,
    detached: bool = False,
    env: dict[str, str] | None = None,
    transfer_timeout_s: float = 30.0,
    worker_kwargs: dict[str, Any] | None = None,
) -> WorkerHandle:
    """Create the actor (non-blocking); call ``wait_ready`` before routing to it. The worker
    computes on ``num_cpus`` threads (rounded down; ``engine_config.num_threads`` overrides),
    pinned to cores no other worker of its host uses while enough are free."""
    import ray

    role = as_role(role)
    mode = EngineMode.PREFILL if role is WorkerRole.PREFILL else EngineMode.DECODE
    if engine_config.mode is not mode:
        from dataclasses import replace

        engine_config = replace(engine_config, mode=mode)
    options = actor_options(role, worker_id, num_cpus=num_cpus, num_gpus=num_gpus, resources=resources,
                            accelerator_type=accelerator_type, namespace=namespace, detached=detached, env=env)
    cls = ray.remote(_actor_class(role))
    actor = cls.options(**options).remote(worker_id, engine_config, transfer_timeout_s=transfer_timeout_s,
                                          num_cpus=num_cpus, **(worker_kwargs or {}))
    return WorkerHandle(worker_id, role, actor)


def wait_ready(handles: list[WorkerHandle], timeout_s: float = 180.0) -> None:
    """Wait until every worker answers, then fetch each one's NIXL metadata."""
    import ray

    metas = ray.get([h.actor.metadata.remote() for h in handles], timeout=timeout_s)
    for h, md in zip(handles, metas):
        h.metadata = md


def connect_pools(prefill: list[WorkerHandle], decode: list[WorkerHandle], timeout_s: float = 60.0) -> None:
    """Make every prefill agent and every decode agent know each other (both directions:
    prefill writes into decode; decode asks prefill to stop on abort)."""
    import ray

    refs = []
    for p in prefill:
        for d in decode:
            refs.append(p.actor.add_peer.remote(d.metadata))
            refs.append(d.actor.add_peer.remote(p.metadata))
    ray.get(refs, timeout=timeout_s)


def stop_worker(handle: WorkerHandle, graceful: bool = True, timeout_s: float = 20.0) -> None:
    import ray

    if graceful:
        try:
            ray.get(handle.actor.shutdown.remote(), timeout=timeout_s)
        except Exception as exc:  # already dead or hung: kill it anyway
            logger.info("worker %s did not shut down cleanly: %s", handle.worker_id, exc)
    ray.kill(handle.actor, no_restart=True)

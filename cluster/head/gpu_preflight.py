"""The head's pre-flight of a GPU config: whether the Ray cluster it runs on can hold the GPU
pools' replicas, checked once Ray is up and before any worker starts, so that ``pdserve up``
refuses in one line instead of waiting until its timeout for actors Ray can never place.

1. ``gpu_needs``: what one replica of each GPU pool asks of ONE node (a Ray actor never spans
   nodes): its ``num_gpus``, its ``accelerator_type`` (Ray's ``accelerator_type:<name>`` node
   resource) and its custom ``resources``. A pool is a GPU pool when it sets either of the first
   two (``engine.device: cuda`` needs ``num_gpus`` > 0: the config refuses it without); a CPU
   config is never checked, and Ray is not asked.
2. ``offers_from_ray_nodes`` (``ray.nodes()``): what each running node has.
   ``offers_from_node_groups`` (an autoscaler's node groups, where it reported them to the GCS):
   what a node the autoscaler may still start would have, so a group that scales from zero is
   not refused. KubeRay's autoscaler knows a group's GPU count from the pod's ``nvidia.com/gpu``
   limit, but not its accelerator type, which only a running raylet detects.
3. ``gpu_refusal`` (``placement_refusal`` on the needs): the first reason a pool cannot be
   placed, as one line naming the setting, or None: no GPU anywhere; no node of the requested accelerator type; a replica needs more GPUs
   than any one node has; no node has the GPUs and the pool's custom resources together; the
   initial replicas need more GPUs than the running nodes have in all, with no autoscaler group
   to add any (a necessary condition only: it never refuses a config that could be placed).
4. ``wait_for_gpus``: the head's call. Reads Ray and raises ``InvalidRequestError``; on a local
   Ray at once, on a joined cluster after waiting up to ``JOIN_WAIT_S`` for nodes to join (the
   head pod of a KubeRay cluster runs ``pdserve up`` before its GPU pods have joined, and the
   autoscaler KubeRay runs with Ray 2.60 reports no node groups to the GCS).

Totals are what is read, not what is free: replicas already running elsewhere on the cluster are
the pool manager's concern (its replica limit counts free GPUs).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pdserve.cluster.config import ClusterConfig
from pdserve.engine.contract import WorkerRole
from pdserve.engine.errors import InvalidRequestError, PdserveError

logger = logging.getLogger(__name__)

GPU = "GPU"
ACCELERATOR_PREFIX = "accelerator_type:"   # Ray's node resource for the type of its GPUs
_EPS = 1e-9
# How long the head waits for the GPU nodes of a cluster it joins to come up (KubeRay pods pull a
# CUDA image and check the model before their raylet joins), asking Ray every POLL_S; within the
# 600 s that `pdserve up` waits for a head it started in the background.
JOIN_WAIT_S = 480.0
POLL_S = 5.0


@dataclass(frozen=True, slots=True)
class ReplicaNeed:
    """What one replica of a GPU pool asks of the node it lands on."""

    pool: str
    gpus: float                      # Ray GPUs reserved (fractions allowed)
    accelerator_type: str | None
    custom: dict[str, float] = field(default_factory=dict)
    initial: int = 0                 # replicas started with the cluster

    def fits(self, offer: NodeOffer) -> bool:
        """One replica fits on this node when the node is empty."""
        if offer.gpus < self.gpus - _EPS:
            return False
        if self.accelerator_type is not None and self.accelerator_type not in offer.accelerator_types():
            return False
        return all(offer.resources.get(name, 0.0) >= amount for name, amount in self.custom.items())


@dataclass(frozen=True, slots=True)
class NodeOffer:
    """A node's Ray resources: a running node, or a node group the autoscaler may start."""

    name: str
    resources: dict[str, float]
    autoscaled: bool = False

    @property
    def gpus(self) -> float:
        return float(self.resources.get(GPU, 0.0))

    def accelerator_types(self) -> set[str]:
        return {k[len(ACCELERATOR_PREFIX):] for k, v in self.resources.items()
                if k.startswith(ACCELERATOR_PREFIX) and v > 0}


def gpu_needs(config: ClusterConfig) -> list[ReplicaNeed]:
    """The GPU pools of ``config`` (prefill first), each as what one replica needs; [] for a
    CPU config. A pool that may never run a replica (``max_replicas: 0``) is left out."""
    needs = []
    for role in (WorkerRole.PREFILL, WorkerRole.DECODE):
        pool = config.pool(role)
        if not (pool.num_gpus > 0 or pool.accelerator_type) or pool.max_replicas == 0:
            continue
        needs.append(ReplicaNeed(str(role), pool.num_gpus, pool.accelerator_type, dict(pool.resources),
                                 pool.initial_replicas or 0))
    return needs


def offers_from_ray_nodes(nodes: Iterable[Mapping[str, Any]]) -> list[NodeOffer]:
    """The running nodes of ``ray.nodes()`` (dead ones left out)."""
    return [NodeOffer(str(n.get("NodeManagerAddress") or n.get("NodeID", "?")),
                      {k: float(v) for k, v in (n.get("Resources") or {}).items()})
            for n in nodes if n.get("Alive", True)]


def offers_from_node_groups(groups: Iterable[Mapping[str, Any]]) -> list[NodeOffer]:
    """The node groups an autoscaler may start nodes of (``name``, ``resources``, ``max_count``;
    a ``max_count`` of 0 starts none, -1 is unbounded)."""
    return [NodeOffer(str(g.get("name", "?")), {k: float(v) for k, v in (g.get("resources") or {}).items()},
                      autoscaled=True)
            for g in groups if g.get("max_count", -1) != 0]


def gpu_refusal(config: ClusterConfig, offers: list[NodeOffer]) -> str | None:
    """Why the GPU pools of ``config`` cannot be placed on these nodes, in one line; None when
    they can (and for a CPU config)."""
    return placement_refusal(gpu_needs(config), offers)


def placement_refusal(needs: list[ReplicaNeed], offers: list[NodeOffer]) -> str | None:
    """``gpu_refusal`` on the pools' needs: the first pool's reason, then the initial replicas'."""
    for need in needs:
        if (reason := _pool_refusal(need, offers)) is not None:
            return reason
    return _initial_refusal(needs, offers)


def _pool_refusal(need: ReplicaNeed, offers: list[NodeOffer]) -> str | None:
    p = need.pool
    candidates = offers
    if need.gpus > 0:
        candidates = [o for o in offers if o.gpus > 0]
        if not candidates:
            return (f"{p}.num_gpus: a replica needs {_gpus(need.gpus)}, but the Ray cluster has no GPU "
                    f"({_describe(offers)}) and no autoscaler group that adds one; run pdserve on a Ray cluster with "
                    f"GPUs, or set {p}.num_gpus: 0 and {p}.engine.device: cpu")
    if need.accelerator_type is not None:
        typed = [o for o in candidates if need.accelerator_type in o.accelerator_types()]
        if not typed:
            seen = sorted({t for o in offers for t in o.accelerator_types()})
            return (f"{p}.accelerator_type: no node of the Ray cluster has {need.accelerator_type!r} GPUs (it has "
                    f"{', '.join(map(repr, seen)) if seen else 'none of a known type'}); set the type Ray reports, "
                    f"or leave accelerator_type unset (an autoscaler does not know a node group's GPU type)")
        candidates = typed
    if need.gpus > 0:
        most = max(o.gpus for o in candidates)
        if need.gpus > most + _EPS:
            kind = f"{need.accelerator_type} " if need.accelerator_type else ""
            return (f"{p}.num_gpus: a replica needs {_gpus(need.gpus)} on one node, but the most {kind}GPUs any node "
                    f"of the Ray cluster has is {most:g}; lower {p}.num_gpus (fractions allowed) or add a bigger node")
    if not any(need.fits(o) for o in candidates):
        what = _gpus(need.gpus) if need.gpus > 0 else f"{need.accelerator_type} GPUs"
        have = ", ".join(f"{name} {amount:g}" for name, amount in need.custom.items())
        return (f"{p}.resources: no node of the Ray cluster with {what} also has {have}; start the GPU nodes with "
                f"those resources (the k8s overlays' worker groups do)")
    return None


def _initial_refusal(needs: list[ReplicaNeed], offers: list[NodeOffer]) -> str | None:
    if any(o.autoscaled and o.gpus > 0 for o in offers):
        return None   # the autoscaler may add GPU nodes for replicas that wait
    wanted = [(n, n.initial * n.gpus) for n in needs if n.initial and n.gpus > 0]
    total = sum(amount for _, amount in wanted)
    have = sum(o.gpus for o in offers if not o.autoscaled)
    if total <= have + _EPS:
        return None
    parts = " + ".join(f"{n.pool} {n.initial} x {n.gpus:g}" for n, _ in wanted)
    return (f"the initial replicas need {total:g} GPUs ({parts}), but the Ray cluster has {have:g} and no autoscaler "
            f"group that adds more; lower initial_replicas or num_gpus (fractions allowed), or add GPUs")


def _gpus(amount: float) -> str:
    return f"{amount:g} GPU" + ("" if amount == 1 else "s")


def _describe(offers: list[NodeOffer]) -> str:
    running = [o for o in offers if not o.autoscaled]
    cpus = sum(o.resources.get("CPU", 0.0) for o in running)
    return f"{len(running)} node{'' if len(running) == 1 else 's'}, {cpus:g} CPUs"


async def wait_for_gpus(config: ClusterConfig, stop: asyncio.Event | None = None, *, wait_s: float | None = None,
                        poll_s: float = POLL_S) -> None:
    """Return once the Ray cluster this process is connected to can hold the GPU pools of
    ``config``; raise ``InvalidRequestError`` (one line) when it cannot. A local Ray (no
    ``ray.address``) is what it is: refused at once. A joined cluster's GPU nodes may still be
    starting (KubeRay starts the head's ``pdserve up`` before the GPU pods join, and a GPU pod
    pulls a CUDA image and checks its model first): it is asked again every ``poll_s`` for up to
    ``wait_s`` (default ``JOIN_WAIT_S``). ``stop`` set meanwhile ends the wait with a
    ``PdserveError``. Ray is only asked about a GPU config."""
    if not gpu_needs(config):
        return
    import ray

    if wait_s is None:
        wait_s = JOIN_WAIT_S if config.ray.address else 0.0
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    said_at: float | None = None
    while True:
        offers = offers_from_ray_nodes(ray.nodes()) + offers_from_node_groups(_autoscaler_groups(ray))
        reason = gpu_refusal(config, offers)
        if reason is None:
            logger.info("GPU pre-flight: the GPU pools fit on %s", ", ".join(
                f"{o.name} ({o.gpus:g} GPU{'' if o.gpus == 1 else 's'}{', autoscaled' if o.autoscaled else ''})"
                for o in offers if o.gpus > 0))
            return
        left = deadline - loop.time()
        if left <= 0:
            if wait_s > 0:
                reason += f" (after waiting {wait_s:.0f} s for nodes to join)"
            logger.info("GPU pre-flight: refused: %s", reason)   # the caller prints the error itself, once
            raise InvalidRequestError(reason)
        if said_at is None or loop.time() - said_at >= 30:
            said_at = loop.time()
            logger.warning("GPU pre-flight: %s; waiting up to %.0f s for nodes to join", reason, left)
        if stop is None:
            await asyncio.sleep(min(poll_s, left))
        else:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), min(poll_s, left))
            if stop.is_set():
                raise PdserveError(f"stopped while waiting for nodes that can hold the GPU pools ({reason})")


def _autoscaler_groups(ray: Any) -> list[dict[str, Any]]:
    """The node groups an autoscaler reported to the GCS (Ray's autoscaler ``ClusterConfig``);
    [] where none did (a local Ray, nodes started by hand, the autoscaler KubeRay runs with Ray
    2.60) or Ray cannot say."""
    try:
        config = ray._private.state.state.get_cluster_config()
    except Exception as exc:  # a private API: without it the running nodes alone are checked
        logger.info("GPU pre-flight: the autoscaler's node groups could not be read (%s)", exc)
        return []
    if config is None:
        return []
    return [{"name": g.name, "resources": dict(g.resources), "max_count": g.max_count}
            for g in config.node_group_configs]

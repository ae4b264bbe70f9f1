"""Owns the worker actors of both pools: starts the initial replicas, adds and drains replicas
when the planner says so, and replaces dead workers to keep each pool at its minimum.

Scaling down never loses a request: the worker is marked draining (the router sends it
nothing new), waits until it holds no request, and only then is stopped.

A start tolerates a dying peer: a peer whose NIXL agent cannot be added (it is being killed) is
skipped, logged and counted (``PoolRecord.peers_skipped``), and the worker serves without it. A
replacement that fails to start is tried again with exponential backoff
(``REPLACE_BACKOFF_S`` doubling up to ``REPLACE_BACKOFF_MAX_S``) until the pool is back at its
minimum; each failed start is counted (``PoolRecord.start_failures``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
import uuid
from dataclasses import dataclass, field

from pdserve.engine.contract import WorkerRole, WorkerStats
from pdserve.engine.errors import CompatibilityError
from pdserve.cluster.config import ClusterConfig
from pdserve.capacity.planner import Planner, PlannerDecision, PoolState, ScaleAction, WorkerMetrics
from pdserve.capacity.traffic_window import CapacityModel, TrafficWindow
from pdserve.cluster.state.worker_registry import WorkerRecord, WorkerRegistry
from pdserve.cluster.runtime.workers import ACTOR_PREFIX, WorkerHandle, start_worker, stop_worker
from pdserve.router.stats_history import StatsHistory
from pdserve.router.worker_pool import WorkerPool, remote_error

logger = logging.getLogger(__name__)

ROLES = (WorkerRole.PREFILL, WorkerRole.DECODE)
# A replica not placed by then is waiting for resources: the autoscaler is asked for them.
PLACEMENT_GRACE_S = 10.0
# A replacement that failed to start is tried again after this, doubling up to the cap.
REPLACE_BACKOFF_S = 1.0
REPLACE_BACKOFF_MAX_S = 30.0


@dataclass(slots=True)
class PoolRecord:
    role: WorkerRole
    handles: dict[str, WorkerHandle] = field(default_factory=dict)
    pending: int = 0
    draining: set[str] = field(default_factory=set)
    peers_skipped: int = 0    # peers a new worker of this pool could not add (or that could not add it)
    start_failures: int = 0   # worker starts that failed


class PoolManager:
    def __init__(self, config: ClusterConfig, pool: WorkerPool, *, namespace: str | None = None,
                 detached: bool = False, ready_timeout_s: float = 300.0,
                 registry: WorkerRegistry | None = None,
                 replace_backoff_s: tuple[float, float] = (REPLACE_BACKOFF_S, REPLACE_BACKOFF_MAX_S)) -> None:
        """``registry``: where the workers are listed for the other routers and the next leader
        (an elected control plane); each change is written there after it is made.
        ``replace_backoff_s``: (first, largest) wait before a failed replacement is tried again."""
        self.config = config
        self.registry = registry
        self.pool = pool
        self.namespace = namespace
        self.detached = detached
        self.ready_timeout_s = ready_timeout_s
        self.pools = {role: PoolRecord(role) for role in ROLES}
        # decides each pool's size and owns when each pool last scaled (its cooldowns)
        self.planner = Planner(config.planner_policy())
        # with planner.profile: the capacity model and the traffic it reads (Serving feeds the window)
        self.traffic = TrafficWindow(config.planner.traffic_window_s)
        self.capacity = (CapacityModel.load(config.planner.profile, config.slo.ttft_ms / 1e3, config.slo.itl_ms / 1e3,
                                            colocated=config.router.disaggregation.mode == "never")
                         if config.planner.profile is not None else None)
        self.decisions: list[PlannerDecision] = []
        self.decided_at: float | None = None   # wall time of the last decisions
        self._ids = itertools.count()
        self._lock = asyncio.Lock()
        self._join_lock = asyncio.Lock()
        self._metrics_read_at: float | None = None   # the previous ``metrics`` call: its rates' window starts there
        self._asked_autoscaler = False
        self._actions: set[asyncio.Task] = set()  # scale-ups and drains the planner started
        self.replace_backoff_s = replace_backoff_s
        self._closed = False

    # --------------------------------------------------------------- replicas
    def _new_id(self, role: WorkerRole) -> str:
        return f"{role}-{next(self._ids)}-{uuid.uuid4().hex[:6]}"

    async def start_initial(self) -> None:
        counts = {r: self.config.pool(r).initial_replicas or 0 for r in ROLES}
        await asyncio.gather(*(self.add_replica(r) for r in ROLES for _ in range(counts[r])))

    async def add_replica(self, role: WorkerRole) -> str:
        """Start one worker, wait until it answers, connect its NIXL agent to the other pool."""
        settings = self.config.pool(role)
        worker_id = self._new_id(role)
        record = self.pools[role]
        record.pending += 1
        handle: WorkerHandle | None = None
        try:
            handle = start_worker(role, worker_id, self.config.worker_engine_config(role),
                                  num_cpus=self.config.replica_cpus(role), num_gpus=settings.num_gpus,
                                  resources=settings.resources, accelerator_type=settings.accelerator_type,
                                  namespace=self.namespace,
                                  detached=self.detached,
                                  transfer_timeout_s=self.config.router.disaggregation.kv_transfer_timeout_s,
                                  # a router silent as long as a dead worker is gone: its streams end here
                                  worker_kwargs={"owner_gone_after_s": self.config.router.worker_dead_after_s}
                                  if role == WorkerRole.DECODE else None)
            handle.metadata = await self._wait_placed(role, handle)
            if self._asked_autoscaler and not any(r.pending > 1 for r in self.pools.values()):
                self._clear_resource_request()
            # One worker joins at a time: two that became ready together would otherwise each miss
            # the other (neither is in ``handles`` while it connects): a P/D pair that cannot move KV.
            async with self._join_lock:
                await self._connect(handle, role)
                self._join(handle)
            if self.registry is not None:
                await self._registry("add", WorkerRecord(worker_id, role, ACTOR_PREFIX[role] + worker_id,
                                                         self._ray_namespace()))
        except BaseException:
            record.pending -= 1
            record.start_failures += 1
            logger.exception("could not start a %s worker", role)
            if handle is not None:  # not ready, or cancelled while it loaded: never leave it running
                try:
                    stop_worker(handle, graceful=False)
                except Exception as exc:  # noqa: BLE001 - the start's own error is what matters
                    logger.warning("could not stop the unready worker %s: %s", worker_id, exc)
            raise
        record.pending -= 1
        logger.info("%s worker %s is serving", role, worker_id)
        return worker_id

    async def _connect(self, handle: WorkerHandle, role: WorkerRole, timeout_s: float = 60.0) -> None:
        """Make the new worker's NIXL agent and every agent of the other pool know each other.
        A peer that cannot be added either way (it is dying: ``NIXL_ERR_BACKEND``, or it died
        meanwhile) is skipped, logged and counted: the new worker serves without it, and the
        router drops the dead peer on its own. Only an incompatible KV layout fails the start
        (a configuration error, the same for every peer)."""
        other = WorkerRole.DECODE if role == WorkerRole.PREFILL else WorkerRole.PREFILL
        peers = list(self.pools[other].handles.values())
        if role == WorkerRole.DECODE:  # decode workers also move KV to each other (live migration on drain)
            peers += [h for wid, h in self.pools[WorkerRole.DECODE].handles.items() if wid != handle.worker_id]
        failed = await _each([handle.actor.add_peer.remote(p.metadata) for p in peers], timeout_s)
        for err in failed:
            if err is not None and isinstance(remote_error(err), CompatibilityError):
                raise err
        added = []
        for peer, err in zip(peers, failed):
            if err is None:
                added.append(peer)
            else:
                self._skip_peer(role, f"new {role} worker {handle.worker_id} could not add {peer.role} worker "
                                      f"{peer.worker_id} as a peer", err)
        failed = await _each([p.actor.add_peer.remote(handle.metadata) for p in added], timeout_s)
        for peer, err in zip(added, failed):
            if err is not None:
                self._skip_peer(role, f"{peer.role} worker {peer.worker_id} could not add new {role} worker "
                                      f"{handle.worker_id} as a peer", err)

    def _skip_peer(self, role: WorkerRole, what: str, err: BaseException) -> None:
        self.pools[role].peers_skipped += 1
        text = str(remote_error(err)).strip()
        logger.warning("%s (skipped; the start goes on without it): %s", what,
                       text.splitlines()[0] if text else type(err).__name__)

    async def _wait_placed(self, role: WorkerRole, handle: WorkerHandle) -> bytes:
        """Wait for a new worker to answer. If it is still not placed after ``PLACEMENT_GRACE_S``,
        ask Ray's autoscaler for the pending replicas' resources, so that on KubeRay the worker
        group that offers them (``prefill`` / ``decode``) grows by a pod."""
        ref = handle.actor.metadata.remote()
        try:
            return await asyncio.wait_for(asyncio.shield(ref), PLACEMENT_GRACE_S)
        except asyncio.TimeoutError:
            self._request_resources()
        return await asyncio.wait_for(ref, self.ready_timeout_s)

    def _request_resources(self) -> None:
        bundles = []
        for role, record in self.pools.items():
            s = self.config.pool(role)
            bundle = replica_needs(self.config.replica_cpus(role), s.num_gpus, s.resources, s.accelerator_type)
            bundles += [bundle] * record.pending
        try:
            from ray.autoscaler.sdk import request_resources

            request_resources(bundles=bundles)
            self._asked_autoscaler = True
            logger.info("asked the autoscaler for %d worker bundle(s): %s", len(bundles), bundles)
        except Exception as exc:  # no autoscaler (a fixed local Ray): the replica waits for room
            logger.info("autoscaler request not possible: %s", exc)

    def _clear_resource_request(self) -> None:
        """The replicas were placed: withdraw the standing request so the autoscaler can scale in."""
        try:
            from ray.autoscaler.sdk import request_resources

            request_resources(bundles=[])
        except Exception as exc:
            logger.info("could not clear the autoscaler request: %s", exc)
        self._asked_autoscaler = False

    async def drain_and_remove(self, worker_id: str, timeout_s: float = 600.0) -> bool:
        """Stop routing to a worker, wait until it holds no request, then stop it."""
        role = self._role_of(worker_id)
        if role is None:
            return False
        record = self.pools[role]
        self._set_draining(worker_id, True)
        await self._registry("set_draining", worker_id, True)
        handle = record.handles[worker_id]
        if role == WorkerRole.DECODE and self.config.planner.drain_by_migration:
            await self._migrate_away(worker_id, handle)
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                if worker_id not in record.draining:  # load came back: ``undrain`` kept it
                    logger.info("drain of %s cancelled: it serves again", worker_id)
                    return False
                stats = await asyncio.wait_for(handle.actor.stats.remote(), 10.0)
                view = self.pool.members.get(worker_id)
                if not stats.busy and (view is None or view.view.inflight_requests == 0):
                    break
                await asyncio.sleep(0.2)
        except Exception as exc:
            logger.warning("draining %s: %s", worker_id, exc)
        await self._stop(worker_id)
        return True

    async def _migrate_away(self, worker_id: str, handle: WorkerHandle, timeout_s: float = 300.0) -> None:
        """Move a draining decode worker's running streams to the other decode workers (their KV
        over NIXL, decoding goes on there); what cannot move finishes here or is recomputed."""
        targets = [(wid, h.actor) for wid, h in self.pools[WorkerRole.DECODE].handles.items()
                   if wid != worker_id and wid not in self.pools[WorkerRole.DECODE].draining
                   and (m := self.pool.members.get(wid)) is not None and m.view.alive]
        if not targets:
            return
        try:
            report = await asyncio.wait_for(handle.actor.migrate_out.remote(targets), timeout_s)
            logger.info("drain of %s: %d stream(s) moved with their KV, %d recomputed elsewhere, %d left to finish",
                        worker_id, report.moved, report.fallbacks, report.left)
        except Exception as exc:  # the drain still waits for what is left
            logger.warning("drain of %s: moving its streams failed: %s", worker_id, exc)

    def undrain(self, role: WorkerRole, count: int) -> list[str]:
        """Put up to ``count`` draining workers of ``role`` back into service (the cheapest
        capacity there is: loaded, warm, connected); returns their ids."""
        record = self.pools[role]
        kept = sorted(record.draining)[:max(0, count)]
        for worker_id in kept:
            self._set_draining(worker_id, False)
            if self.registry is not None:
                self._act(self._registry("set_draining", worker_id, False), f"undraining {worker_id} in Redis")
            logger.info("%s worker %s kept: load is back, its drain is cancelled", role, worker_id)
        return kept

    async def _stop(self, worker_id: str) -> None:
        role = self._role_of(worker_id)
        if role is None:
            return
        handle = self._leave(worker_id)
        await asyncio.to_thread(stop_worker, handle)
        await self._registry("remove", worker_id)
        logger.info("%s worker %s stopped", role, worker_id)

    async def handle_lost(self, worker_id: str) -> None:
        """A worker died: forget it and start a replacement if its pool fell below the minimum."""
        role = self._role_of(worker_id)
        if role is None:
            return
        self._leave(worker_id)
        await self._registry("remove", worker_id)
        if self._missing(role) > 0:
            logger.warning("%s pool below its minimum after %s died: starting a replacement", role, worker_id)
            await self.replace(role)

    def _missing(self, role: WorkerRole) -> int:
        """Replicas ``role``'s pool lacks to reach its minimum (starting ones count as there)."""
        record = self.pools[role]
        return self.config.pool(role).min_replicas - (len(record.handles) + record.pending)

    async def replace(self, role: WorkerRole) -> None:
        """Start ``role`` workers until its pool is back at its minimum; a start that fails is
        tried again after ``replace_backoff_s[0]`` seconds, doubling up to ``[1]``, until one
        succeeds or the manager shuts down. Concurrent calls never overshoot: each starts one
        worker at a time and counts the others' starting ones."""
        task = asyncio.current_task()
        if task is not None:
            self._actions.add(task)  # cancelled by ``shutdown``: nothing starts after it
        delay, cap = self.replace_backoff_s
        try:
            while not self._closed and self._missing(role) > 0:
                try:
                    await self.add_replica(role)
                    delay = self.replace_backoff_s[0]
                except Exception as exc:  # logged by add_replica with its traceback
                    logger.warning("%s replacement failed (%s failed starts so far); trying again in %.1f s: %s",
                                   role, self.pools[role].start_failures, delay,
                                   str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, cap)
        finally:
            if task is not None:
                self._actions.discard(task)

    async def adopt(self, timeout_s: float = 10.0) -> tuple[list[str], list[str]]:
        """Take over the workers the registry lists (a new control-plane leader): each one that
        answers joins this manager's pools as it is (no restart, its NIXL peers kept); returns
        (adopted ids, dead ids). A dead worker's record is deleted; reaping its ledger entries
        and replacing it is the caller's (``RouterService``)."""
        if self.registry is None:
            return [], []
        import ray

        records = await asyncio.to_thread(self.registry.workers)
        adopted, dead = [], []
        for rec in records.values():
            if rec.role not in self.pools:
                continue
            known = self.pools[rec.role].handles.get(rec.worker_id)
            try:
                actor = known.actor if known is not None else ray.get_actor(rec.actor_name, namespace=rec.ray_namespace)
                metadata = await asyncio.wait_for(actor.metadata.remote(), timeout_s)
            except Exception as exc:  # gone (ValueError: no such actor), dead, or not answering
                logger.warning("%s worker %s not adopted: %s", rec.role, rec.worker_id,
                               str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
                dead.append(rec.worker_id)
                await self._registry("remove", rec.worker_id)
                continue
            self._join(WorkerHandle(rec.worker_id, rec.role, actor, metadata), draining=rec.draining)
            adopted.append(rec.worker_id)
        for record in self.pools.values():  # handles the registry no longer lists: stopped meanwhile
            for wid in [w for w in record.handles if w not in records]:
                self._leave(wid)
        logger.info("control plane: adopted %d worker(s) %s; %d dead", len(adopted), adopted, len(dead))
        return adopted, dead

    async def ensure_minimum(self) -> None:
        """Start workers until every pool has its minimum (after adopting a cluster that lost some)."""
        starts = []
        for role, record in self.pools.items():
            live = len(record.handles) - len(record.draining) + record.pending
            starts += [self.add_replica(role) for _ in range(self.config.pool(role).min_replicas - live)]
        if starts:
            await asyncio.gather(*starts)

    def _ray_namespace(self) -> str | None:
        if self.namespace:
            return self.namespace
        try:
            import ray

            return ray.get_runtime_context().namespace
        except Exception:
            return None

    async def _registry(self, op: str, *args) -> None:
        """One registry write, off the event loop; a failure is logged (the change itself stands)."""
        if self.registry is None:
            return
        try:
            await asyncio.to_thread(getattr(self.registry, op), *args)
        except Exception as exc:
            logger.warning("worker registry %s%s failed: %s", op, args[:1], exc)

    # ------------------------------------------------------------- membership
    # The pools' records are the one owner of which workers the cluster has and which of them
    # drain. The router's ``WorkerPool`` mirrors them, changed only by these three methods; the
    # registry (the other routers and the next leader read it) is written after them, through
    # ``_registry``, by the method that made the change.
    def _join(self, handle: WorkerHandle, draining: bool = False) -> None:
        """A worker joins its pool (started here, or adopted as it is); the router routes to it."""
        record = self.pools[handle.role]
        record.handles[handle.worker_id] = handle
        (record.draining.add if draining else record.draining.discard)(handle.worker_id)
        member = self.pool.members.get(handle.worker_id)
        if member is None or not member.view.alive:
            self.pool.add(handle.worker_id, handle.role, handle.actor)
        self.pool.set_draining(handle.worker_id, draining)

    def _set_draining(self, worker_id: str, draining: bool) -> None:
        """Start (or cancel) a worker's drain: the router sends it nothing new while it drains."""
        record = self.pools[self._role_of(worker_id)]
        (record.draining.add if draining else record.draining.discard)(worker_id)
        self.pool.set_draining(worker_id, draining)

    def _leave(self, worker_id: str) -> WorkerHandle | None:
        """A worker leaves its pool (stopped, dead, or gone from the registry); its handle, None if unknown."""
        role = self._role_of(worker_id)
        if role is None:
            return None
        record = self.pools[role]
        handle = record.handles.pop(worker_id)
        record.draining.discard(worker_id)
        self.pool.remove(worker_id)
        return handle

    def _role_of(self, worker_id: str) -> str | None:
        for role, record in self.pools.items():
            if worker_id in record.handles:
                return role
        return None

    # ---------------------------------------------------------------- planner
    def metrics(self, now_wall: float) -> list[WorkerMetrics]:
        out = []
        warmup = self.config.planner.warmup_s
        since, self._metrics_read_at = self._metrics_read_at, now_wall
        for role, record in self.pools.items():
            for wid in record.handles:
                member = self.pool.members.get(wid)
                if member is None or not member.view.alive:
                    continue
                v = member.view
                stats = v.stats
                rate, busy = (_prefill_progress(member.history, since) if role == WorkerRole.PREFILL and stats
                              else (None, None))
                kv_usage = 1.0 - v.num_free_blocks / max(1, v.num_blocks)
                out.append(WorkerMetrics(
                    worker_id=wid, role=role, warm=(now_wall - v.started_at) >= warmup if v.started_at else False,
                    # batch prompts may wait: they do not scale the prefill pool
                    started_at=v.started_at, queued_prompt_tokens=max(0, v.inflight_tokens - v.batch_inflight_tokens),
                    running_seqs=v.num_running, waiting_seqs=v.num_waiting,
                    kv_usage=min(1.0, max(0.0, kv_usage)), prefill_tokens_per_s=rate, prefill_busy=busy,
                    itl_ms=_itl_ms(stats) if role == WorkerRole.DECODE and stats else None,
                    draining=wid in record.draining,
                    batch_seqs=stats.num_batch_seqs if stats else 0,
                    batch_kv_usage=min(1.0, max(0.0, stats.batch_kv_usage)) if stats else 0.0))
        return out

    def pool_states(self) -> list[PoolState]:
        states = []
        available, total = _ray_resources()
        for role, record in self.pools.items():
            s = self.config.pool(role)
            need = replica_needs(self.config.replica_cpus(role), s.num_gpus, s.resources, s.accelerator_type)
            states.append(PoolState(role=role, replicas=len(record.handles) - len(record.draining),
                                    min_replicas=s.min_replicas, max_replicas=self._limit(role, need, available),
                                    max_num_seqs=s.engine.max_num_seqs, pending=record.pending,
                                    headroom=headroom(role, need, available, total,
                                                      auto=s.max_replicas is None)))
        return states

    def replica_limit(self, role: WorkerRole) -> int:
        """The most replicas ``role``'s pool may run now: its ``max_replicas``, or when that is
        unset, the replicas it has (started or starting) plus those Ray has room for."""
        s = self.config.pool(role)
        return self._limit(role, replica_needs(self.config.replica_cpus(role), s.num_gpus, s.resources,
                                               s.accelerator_type), _ray_resources()[0])

    def _limit(self, role: WorkerRole, need: dict[str, float], available: dict[str, float]) -> int:
        s, record = self.config.pool(role), self.pools[role]
        if s.max_replicas is not None:
            return s.max_replicas
        current = len(record.handles) - len(record.draining) + record.pending
        return auto_max_replicas(current, s.initial_replicas or 0, s.min_replicas, fits(need, available))

    async def plan_once(self) -> list[PlannerDecision]:
        """One planner decision per pool, acted upon in the background: a scale-up that waits
        minutes for a worker, or a drain that waits for long streams, never stops the next
        decisions (which see the pending and draining replicas)."""
        async with self._lock:
            now = time.time()
            decisions = self.planner.decide(now, self.pool_states(), self.metrics(now), self.model_targets())
            self.decisions = decisions
            self.decided_at = now
            for d in decisions:
                role = str(d.role)
                if d.action is ScaleAction.SCALE_UP:
                    n = max(0, d.target_replicas - d.current_replicas)
                    kept = self.undrain(role, n)
                    logger.info("planner: %s +%d (%s)%s", role, n, d.reason,
                                f"; {len(kept)} of them by cancelling drains" if kept else "")
                    for _ in range(n - len(kept)):
                        self._act(self.add_replica(role), f"adding a {role} replica")
                elif d.action is ScaleAction.SCALE_DOWN and d.drain_worker_id:
                    logger.info("planner: %s drain %s (%s)", role, d.drain_worker_id, d.reason)
                    self._act(self.drain_and_remove(d.drain_worker_id), f"draining {d.drain_worker_id}")
            return decisions

    def model_targets(self) -> dict[WorkerRole, tuple[int, str]] | None:
        """The capacity model's replicas per pool for the traffic of the last window (None: no model,
        or too few requests seen to say). Colocated: the model sizes the decode pool only."""
        if self.capacity is None or (seen := self.traffic.observed()) is None:
            return None
        t = self.capacity.targets(seen)
        logger.info("capacity model: %s", t.explanation)
        out = {WorkerRole.DECODE: (t.decode, t.explanation)}
        if not self.capacity.colocated:
            out[WorkerRole.PREFILL] = (t.prefill, t.explanation)
        return out

    def _act(self, coro, what: str) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._actions.add(task)

        def done(t: asyncio.Task) -> None:
            self._actions.discard(t)
            if not t.cancelled() and t.exception() is not None:
                logger.error("planner action failed (%s): %s", what, t.exception())

        task.add_done_callback(done)

    async def shutdown(self, stop_workers: bool = True) -> None:
        """Cancel the planner's actions in flight; stop every worker unless ``stop_workers`` is
        False (an elected control plane's router leaving a cluster that other routers serve)."""
        self._closed = True
        for task in list(self._actions):
            task.cancel()
        await asyncio.gather(*self._actions, return_exceptions=True)
        if not stop_workers:
            return
        for record in self.pools.values():
            for wid in list(record.handles):
                await self._stop(wid)


async def _each(refs: list, timeout_s: float) -> list[BaseException | None]:
    """Await every call (Ray object refs), each within ``timeout_s``: its error, or None."""
    async def one(ref) -> BaseException | None:
        try:
            await asyncio.wait_for(ref, timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            return exc
        return None

    return list(await asyncio.gather(*(one(r) for r in refs)))


def _prefill_progress(history: StatsHistory, since: float | None) -> tuple[float | None, float | None]:
    """Between the worker's report as of ``since`` (the planner's previous pass) and its latest:
    (prompt tokens computed per second, or None if none were; the share of the time its engine
    spent computing prompts). (None, None) when there is nothing to compare yet."""
    progress = history.since(since) if since is not None else None
    if progress is None:
        return None, None
    done = progress.gained(lambda s: s.prompt_tokens_computed)
    busy = min(1.0, max(0.0, progress.gained(lambda s: s.prefill_compute_s) / progress.span_s))
    return (done / progress.span_s if done > 0 else None), busy


def _itl_ms(stats: WorkerStats) -> float | None:
    """A decode worker's recent mean inter-token latency (ms) from its stats; None when unknown."""
    value = stats.itl_ms
    return float(value) if value is not None and math.isfinite(value) and value >= 0 else None


def _ray_resources() -> tuple[dict[str, float], dict[str, float]]:
    """Ray's (available, total) resources; empty when Ray cannot say (not connected)."""
    try:
        import ray

        return dict(ray.available_resources()), dict(ray.cluster_resources())
    except Exception:  # the planner's reason just leaves the headroom out
        return {}, {}


# What a task with ``accelerator_type`` asks of Ray: a sliver of the node's ``accelerator_type:<T>``
# resource, so only nodes of that type place it (Ray's own amount).
ACCELERATOR_AMOUNT = 0.001


def replica_needs(cpus: float, gpus: float, custom: dict[str, float],
                  accelerator_type: str | None = None) -> dict[str, float]:
    """The Ray resources one replica reserves (those above zero); a pool placed by
    ``accelerator_type`` needs a node of that type, so free GPUs of another type are no room."""
    wanted = {"CPU": cpus, "GPU": gpus, **custom}
    if accelerator_type:
        wanted[f"accelerator_type:{accelerator_type}"] = ACCELERATOR_AMOUNT
    return {name: amount for name, amount in wanted.items() if amount > 0}


def fits(need: dict[str, float], available: dict[str, float]) -> int:
    """How many more replicas with these needs Ray's free resources hold now (0 when Ray cannot
    say, or when a replica needs nothing countable)."""
    if not need or not available:
        return 0
    return min(int(available.get(name, 0.0) // amount) for name, amount in need.items())


def auto_max_replicas(current: int, initial: int, min_replicas: int, room: int) -> int:
    """A pool's limit when ``max_replicas`` is not set: the replicas it has (started or starting)
    plus those Ray has room for now, and never fewer than it started with or its minimum."""
    return max(current + room, initial, min_replicas)


def headroom(role: WorkerRole, need: dict[str, float], available: dict[str, float], total: dict[str, float],
             *, auto: bool = False) -> str:
    """One more ``role`` replica's needs against Ray's free resources, in an operator's words:
    which resource is missing (and how much is free of how much), or that there is room and
    only max_replicas holds it back. ``auto``: the pool's limit is Ray's room (max_replicas unset)."""
    if not total:
        return ""
    short = [f"{amount:g} {name}" + (f" ({available.get(name, 0.0):g} of {total.get(name, 0.0):g} free)")
             for name, amount in need.items() if available.get(name, 0.0) < amount]
    if short:
        then = "" if auto else " before raising max_replicas"
        return f"another {role} replica needs {', '.join(short)}: add a node (or free those resources){then}"
    room = fits(need, available)
    return f"Ray has room for {room} more {role} replica{'s' if room != 1 else ''}: raise {role}.max_replicas"

"""The head of a pdserve cluster: the router's servers, the worker pools behind them, the
KV-ledger reaper and the planner loop, wired from one ``ClusterConfig``.

It runs in-process (tests, ``pdserve up`` in the foreground) or inside the ``pdserve-router``
Ray actor (``cluster.launcher``), so that ``pdserve up`` can return while it keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass

from pdserve.engine.contract import RequestRecord, WorkerRole, as_role
from pdserve.cluster.config import ClusterConfig
from pdserve.cluster.status import (BatchStatus, ClusterStatus, ControlPlaneStatus, PlannerDecisionStatus, PoolStatus,
                                    RedisStatus, RouterStatus, WorkerStatus)
from pdserve.cluster.state.ledger import KVLedger, Side
from pdserve.cluster.control.leader import LeaderLease
from pdserve.cluster.control.ledger_writer import LedgerWriter
from pdserve.cluster.control.pool_manager import PoolManager
from pdserve.cluster.control.reaper import LeaseReaper
from pdserve.cluster.runtime.metrics import PlannerMetrics, RayRouterMetrics, RedisMetrics
from pdserve.cluster.state.redis_guard import RedisGuard, RedisUnavailableError
from pdserve.cluster.state.redis_server import connect
from pdserve.cluster.state.batch_store import RedisBatchStore
from pdserve.cluster.state.request_log import RequestLog
from pdserve.cluster.state.worker_registry import RouterRecord, WorkerRegistry
from pdserve.engine.loader import load_model_spec
from pdserve.router.admission import Admission, AdmissionConfig
from pdserve.router.auth import ApiKeyAuth, grpc_server_credentials, server_ssl_context
from pdserve.router.backend import ModelInfo
from pdserve.router.batch_runner import BatchRunner
from pdserve.router.disagg_backend import DisaggBackend
from pdserve.router.grpc_server import start_grpc_server
from pdserve.router.http_server import start_http_server
from pdserve.router.policy import RoutingPolicy
from pdserve.router.serving import Serving, ServingLimits
from pdserve.router.limits import DEFAULT_MAX_CHOICES
from pdserve.router.stats_history import HORIZON_S
from pdserve.router.worker_pool import PoolMember, WorkerPool

logger = logging.getLogger(__name__)

DRAIN_TIMEOUT_S = 30.0   # how long a stopping router lets its requests in flight finish
IN_FLIGHT_INTERVAL_S = 1.0   # how often the Ray gauges of the router's requests in flight are set


class _RequestLogWriter:
    """A ``RequestObserver``: appends every request to the Redis request log (``pdserve requests
    tail``), off the request's path, whatever its end: completed, failed, cancelled, or refused
    before any worker ran it (a 429, a timeout in the queue: no phase, the error says why)."""

    def __init__(self, log: RequestLog, guard: RedisGuard | None = None) -> None:
        self._log = log
        self._guard = guard
        self._pending: set[asyncio.Task] = set()

    def request_ended(self, record: RequestRecord) -> None:
        task = asyncio.get_running_loop().create_task(self._append(record.to_dict()))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _append(self, record: dict) -> None:
        try:
            if self._guard is not None:
                await self._guard.call("request_log", self._log.append, record)
            else:
                await asyncio.to_thread(self._log.append, record)
        except RedisUnavailableError:
            pass  # Redis down: counted (and warned about once per outage) by the guard
        except Exception as exc:  # the request itself already completed; an operator log gap is logged
            logger.warning("request log append failed: %s", exc)


@dataclass(slots=True)
class Endpoints:
    http_url: str
    grpc_target: str


# The request path's Redis client: a short timeout and one retry (the guard fails fast while
# Redis is down and probes in the background, so no call waits out a long backoff).
REDIS_SOCKET_TIMEOUT_S = 2.0
REDIS_RETRIES = 1


class RouterService:
    def __init__(self, config: ClusterConfig, *, redis_url: str | None, namespace: str | None = None,
                 detached_workers: bool = False, reap_interval_s: float = 2.0,
                 redis_namespace: str = "pdserve", redis_password: str | None = None) -> None:
        """``redis_namespace`` keeps two clusters sharing one Redis apart (ledger and request log).
        ``redis_password`` (default: ``config.redis.password``) is used when the URL has none;
        ``config.redis.tls_ca_file`` verifies a ``rediss://`` server."""
        self.config = config
        self.redis_url = redis_url
        self.pool = WorkerPool(stats_timeout_s=config.router.worker_stats_timeout_s,
                               dead_after_s=config.router.worker_dead_after_s,
                               # the planner reads rates over its interval: the reports reach back that far
                               history_s=max(HORIZON_S, 2 * config.planner.interval_s))
        self.router_id = self.pool.router_id
        # An elected control plane: this router leads (planner, pool manager, reaper) only while
        # it holds the lease in Redis; its workers are detached and listed in the registry.
        self.elected = config.control_plane.election
        if self.elected and not redis_url:
            raise ValueError("control_plane.election needs Redis (the lease and the worker registry live there)")
        self.registry: WorkerRegistry | None = None
        self.lease: LeaderLease | None = None
        self.redis_client = None
        self.redis_guard: RedisGuard | None = None
        self.ledger: KVLedger | None = None
        self.request_log: RequestLog | None = None
        self.ledger_writer: LedgerWriter | None = None
        self._lost_while_down: set[str] = set()
        if redis_url:
            if redis_password is None and config.redis.password is not None:
                redis_password = config.redis.password.get_secret_value()
            ca = config.redis.tls_ca_file
            self.redis_client = connect(redis_url, socket_timeout_s=REDIS_SOCKET_TIMEOUT_S,
                                        retries=REDIS_RETRIES, password=redis_password,
                                        ssl_ca_file=str(ca) if ca is not None else None)
            self.redis_metrics = RedisMetrics()
            self.redis_guard = RedisGuard(self.redis_client, on_drop=self.redis_metrics.dropped,
                                          on_state=self.redis_metrics.set_up)
            self.ledger = KVLedger(self.redis_client, namespace=redis_namespace)
            self.request_log = RequestLog(self.redis_client, stream=f"{redis_namespace}:requests")
            if self.elected:
                self.registry = WorkerRegistry(self.redis_client, namespace=redis_namespace)
                self.lease = LeaderLease(self.redis_client, f"{redis_namespace}:control-plane", self.router_id,
                                         config.control_plane.lease_s)
        self.manager = PoolManager(config, self.pool, namespace=namespace, detached=detached_workers or self.elected,
                                   registry=self.registry)
        self._adopted = False          # the manager holds the cluster's workers (leader, after adoption)
        self._takeover: asyncio.Task | None = None
        self._lease_stop = threading.Event()
        self._lease_ticker: threading.Thread | None = None
        self._routers: list[RouterRecord] = []   # every live router, as of the last heartbeat
        self.leader_since_epoch: int | None = None
        self.takeovers = 0             # times this router became the leader
        self.reap_interval_s = reap_interval_s
        self.redis_namespace = redis_namespace
        self.batch_store: RedisBatchStore | None = None
        self.batch_runner: BatchRunner | None = None
        self.backend: DisaggBackend | None = None
        self.serving: Serving | None = None
        self._servers: list = []
        self._tasks: list[asyncio.Task] = []
        self.endpoints: Endpoints | None = None
        self.started_at = time.time()
        self._status_read_at: float | None = None   # the previous ``status`` call: its rates' window starts there

    # ------------------------------------------------------------- lifecycle
    async def start(self) -> Endpoints:
        cfg = self.config
        if self.elected:
            self.pool.start()
            self._lease_stop.clear()
            self._lease_ticker = threading.Thread(target=self._lease_thread, args=(asyncio.get_running_loop(),),
                                                  name="control-plane-lease", daemon=True)
            self._lease_ticker.start()
            await self._wait_for_workers()
        else:
            await self.manager.start_initial()
            self.pool.start()
        await self.pool.refresh()
        spec = load_model_spec(cfg.model.path)
        max_len = min(cfg.model.max_model_len or spec.max_position_embeddings, spec.max_position_embeddings)
        info = ModelInfo(cfg.model.served_name or cfg.model.path.name, max_len, spec.vocab_size,
                         tuple(spec.eos_token_ids), str(cfg.model.path))
        dis = cfg.router.disaggregation
        local_max = {"never": max_len, "always": 0}.get(dis.mode, dis.local_prefill_max_tokens)
        policy = RoutingPolicy(block_size=cfg.decode.engine.block_size, local_prefill_max_tokens=local_max,
                               prefill_pool=dis.mode != "never" and cfg.prefill.min_replicas > 0,
                               idle_local_prefill=dis.mode == "conditional" and dis.local_prefill_when_idle)
        if self.ledger is not None and self.redis_guard is not None:
            self.ledger_writer = LedgerWriter(self.ledger, self.redis_guard)
        self.backend = DisaggBackend(info, self.pool, policy=policy, ledger=self.ledger_writer,
                                     call_timeout_s=cfg.router.request_timeout_s,
                                     transfer_timeout_s=cfg.router.disaggregation.kv_transfer_timeout_s,
                                     prefill_wait_s=cfg.router.disaggregation.prefill_wait_s,
                                     max_predicted_ttft_s=cfg.router.disaggregation.max_predicted_ttft_s)
        capacity = max(1, self._capacity())
        admission = Admission(AdmissionConfig(max_in_flight=capacity, max_queued=cfg.router.max_queued_requests))
        # one request's share of the slots: the setting, or by default 16 (less when capacity is less)
        max_choices = min(cfg.router.max_choices_per_request or DEFAULT_MAX_CHOICES, capacity)
        self.metrics = RayRouterMetrics(info.name)
        self.planner_metrics = PlannerMetrics()
        observers = [self.metrics, self.manager.traffic] + ([_RequestLogWriter(self.request_log, self.redis_guard)]
                                                            if self.request_log is not None else [])
        self.serving = Serving(self.backend, observers=observers, admission=admission,
                               limits=ServingLimits(cfg.router.request_timeout_s, cfg.router.max_tokens_limit,
                                                    max_choices=max_choices, structured=cfg.structured.limits(),
                                                    tenant_cache_isolation=cfg.router.tenant_cache_isolation))
        keys = [k.get_secret_value() for k in cfg.router.api_keys]
        auth = ApiKeyAuth(keys) if keys else None
        r = cfg.router
        tls = bool(r.tls_cert_file and r.tls_key_file)
        if self.redis_client is not None:  # the Batch API keeps its files, batches and results in Redis
            self.batch_store = RedisBatchStore(self.redis_client, namespace=self.redis_namespace)
            self.batch_runner = BatchRunner(self.serving, self.batch_store, lease_s=r.batch_lease_s,
                                            holder=self.router_id)
            self.serving.metrics.add_gauge("batch_items_running", lambda: self.batch_runner.running,
                                           "Batch API items running now.")
            self.serving.metrics.add_gauge("batch_items_pending", lambda: sum(
                b["total"] - b["completed"] - b["failed"] for b in self.batch_runner.snapshot),
                "Items of running batches without a result yet.")
        http = await start_http_server(
            self.serving, host=r.host, port=r.http_port, auth=auth, max_body_bytes=r.max_request_bytes,
            body_timeout_s=r.body_timeout_s, header_timeout_s=r.header_timeout_s, batches=self.batch_store,
            ssl_context=server_ssl_context(str(r.tls_cert_file), str(r.tls_key_file)) if tls else None)
        grpc = await start_grpc_server(
            self.serving, host=r.host, port=r.grpc_port, auth=auth,
            credentials=grpc_server_credentials(str(r.tls_cert_file), str(r.tls_key_file)) if tls else None)
        self._servers = [http, grpc]
        self.endpoints = Endpoints(http.base_url, grpc.target)
        self.pool.on_worker_lost.append(self._on_worker_lost)
        loop = asyncio.get_running_loop()
        if self.ledger is not None:
            self._tasks.append(loop.create_task(self._reap_loop()))
        self._tasks.append(loop.create_task(self._in_flight_loop(), name="router-in-flight"))
        if cfg.planner.enabled:
            self._tasks.append(loop.create_task(self._plan_loop()))
        if self.elected:
            self._tasks.append(loop.create_task(self._follow_loop(), name="worker-registry"))
            self._tasks.append(loop.create_task(self._heartbeat_loop(), name="router-heartbeat"))
        if self.batch_runner is not None:
            self._tasks.append(loop.create_task(self.batch_runner.run(), name="batch-runner"))
        logger.info("router serving: HTTP %s, gRPC %s", http.base_url, grpc.target)
        return self.endpoints

    def _capacity(self) -> int:
        """Requests the decode pool can run at once at its largest (admission's in-flight cap); with
        max_replicas unset, its largest is what it started with plus what Ray has room for now."""
        d = self.config.decode
        return max(self.manager.replica_limit("decode"), d.min_replicas, 1) * d.engine.max_num_seqs

    async def serve_until(self, stop: asyncio.Event, status_key: str, what: str) -> None:
        """Serve until ``stop`` is set, publishing the cluster's status under ``status_key`` every
        second while this router leads the control plane (skipped while Redis is down); then drain."""
        while not stop.is_set():
            if self.is_leader:
                await self.publish_status(status_key, ttl_s=10)
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except asyncio.TimeoutError:
                pass
        logger.info("stopping: draining %s", what)
        await self.drain()

    async def drain(self, timeout_s: float = DRAIN_TIMEOUT_S) -> None:
        """Stop taking requests (the HTTP and gRPC servers close) and wait, at most ``timeout_s``,
        for the requests in flight to finish; ``stop`` follows."""
        deadline = time.monotonic() + timeout_s
        for s in self._servers:
            await s.stop()
        self._servers = []
        while time.monotonic() < deadline and self.backend is not None and self.backend._active:
            await asyncio.sleep(0.1)

    async def stop(self, stop_workers: bool | None = None) -> None:
        """Stop serving. ``stop_workers`` (default: unless the control plane is elected, where
        other routers may serve on) also stops every worker of the cluster."""
        stop_workers = not self.elected if stop_workers is None else stop_workers
        self._lease_stop.set()
        if self._lease_ticker is not None:  # no tick may take the lease again after it is released below
            await asyncio.to_thread(self._lease_ticker.join, 10.0)
        if self._takeover is not None:
            self._tasks.append(self._takeover)
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.batch_runner is not None:
            await self.batch_runner.close()
        for s in self._servers:
            await s.stop()
        if self.elected and stop_workers and not self._adopted:
            await self.manager.adopt()  # a follower stopping the cluster: it stops every listed worker
        await self.pool.stop()
        await self.manager.shutdown(stop_workers=stop_workers)
        if self.lease is not None:
            await asyncio.to_thread(self.lease.release)
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.registry.forget_router, self.router_id)
        if self.redis_guard is not None:
            self.redis_guard.close()

    # --------------------------------------------------- elected control plane
    @property
    def is_leader(self) -> bool:
        """This router runs the planner, the pool manager and the reaper now (an elected control
        plane's leader once it adopted the workers; every router whose control plane is not elected)."""
        return not self.elected or (self.lease is not None and self.lease.leader and self._adopted)

    def _lease_thread(self, loop: asyncio.AbstractEventLoop) -> None:
        """Tick the lease every third of it, in a thread of its own: a busy event loop (a worker
        being started, a burst of streams) never makes the leader miss a renewal."""
        interval = self.config.control_plane.lease_s / 3
        while not self._lease_stop.is_set():
            try:
                state = self.lease.tick()
            except Exception as exc:
                state = None
                logger.warning("control-plane lease: %s", exc)
            try:
                loop.call_soon_threadsafe(self._on_lease, state)
            except RuntimeError:  # the loop closed
                return
            self._lease_stop.wait(interval)

    def _on_lease(self, state) -> None:
        """React to a lease tick (on the event loop): start the takeover when this router took the
        lead, stop leading when it lost it."""
        if self._lease_stop.is_set():
            return
        if state is None or not state.leader:
            if state is not None and state.changed:
                logger.warning("router %s is no longer the control-plane leader", self.router_id)
            self._adopted = False
            if self._takeover is not None and not self._takeover.done():
                self._takeover.cancel()
            return
        if not self._adopted and (self._takeover is None or self._takeover.done()):
            self._takeover = asyncio.get_running_loop().create_task(self._take_over(state.epoch))

    async def _take_over(self, epoch: int | None) -> None:
        """Become the control plane: adopt the registry's workers (reaping the dead ones' ledger
        entries), or start the initial replicas of a new cluster; then top the pools up."""
        try:
            adopted, dead = await self.manager.adopt()
            for worker_id in dead:
                if self.ledger is not None:
                    await self._reap_worker(worker_id)
            if not adopted:
                logger.info("control plane (epoch %s): no live workers listed; starting the initial replicas", epoch)
                await self.manager.start_initial()
            self._adopted = True    # from here the planner, the reaper and replacements run here
            self.leader_since_epoch = epoch
            self.takeovers += 1
            logger.info("router %s leads the control plane (epoch %s) over %d worker(s)", self.router_id, epoch,
                        sum(len(r.handles) for r in self.manager.pools.values()))
            await self.manager.ensure_minimum()
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("control-plane takeover failed; retried on the next lease tick")
            self._adopted = False

    async def _in_flight_loop(self, interval_s: float = IN_FLIGHT_INTERVAL_S) -> None:
        """Keep ``ray_pdserve_num_requests_running/waiting`` (``role="router"``) at admission's
        requests in flight and queued."""
        admission = self.serving.admission
        while True:
            self.metrics.set_in_flight(admission.in_flight, admission.queued)
            await asyncio.sleep(interval_s)

    async def _heartbeat_loop(self, interval_s: float = 2.0) -> None:
        while True:
            try:
                await self._heartbeat()
            except Exception as exc:
                logger.warning("router heartbeat failed: %s", exc)
            await asyncio.sleep(interval_s)

    async def _heartbeat(self) -> None:
        if self.endpoints is None:
            return
        record = RouterRecord(self.router_id, self.endpoints.http_url, self.endpoints.grpc_target,
                              self.is_leader, os.getpid(), socket.gethostname(), time.time())
        with contextlib.suppress(RedisUnavailableError):
            await self._redis("routers", self.registry.heartbeat, record)
            self._routers = await self._redis("routers", self.registry.routers)

    async def _wait_for_workers(self, timeout_s: float = 600.0) -> None:
        """A follower's start: until the registry lists a decode worker (and a prefill worker when
        the cluster disaggregates) and they are in this router's pool."""
        need = {"decode"} | ({"prefill"} if self.config.prefill.min_replicas > 0 else set())
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.is_leader:
                return
            if self._takeover is None or self._takeover.done():  # a leader's start_initial adds to the pool itself
                with contextlib.suppress(RedisUnavailableError):
                    await self._follow_once()
                if need <= {m.role for m in self.pool.members.values() if m.view.alive}:
                    return
            await asyncio.sleep(0.5)
        raise TimeoutError(f"no workers listed in Redis after {timeout_s:.0f} s: is a control-plane leader running?")

    async def _follow_once(self) -> None:
        """Route to what the registry lists: add new workers, drop stopped ones, copy draining."""
        import ray

        records = await self._redis("registry", self.registry.workers)
        for wid, rec in records.items():
            member = self.pool.members.get(wid)
            if member is None:
                try:
                    actor = ray.get_actor(rec.actor_name, namespace=rec.ray_namespace)
                except ValueError:
                    continue  # stopped or dead: the leader deletes its record
                self.pool.add(wid, rec.role, actor)
                logger.info("router %s routes to %s worker %s", self.router_id, rec.role, wid)
            self.pool.set_draining(wid, rec.draining)
        if not self.is_leader:  # the leader's pool manager keeps its own pool up to date
            for wid in [w for w in self.pool.members if w not in records]:
                self.pool.remove(wid)

    async def _follow_loop(self, interval_s: float = 1.0) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self._follow_once()
            except RedisUnavailableError:
                pass
            except Exception as exc:
                logger.warning("worker registry sync failed: %s", exc)

    # ------------------------------------------------------------ background
    def _on_worker_lost(self, worker_id: str) -> None:
        if not self.is_leader:
            return  # the leader reaps and replaces it; the registry then drops it here too
        loop = asyncio.get_running_loop()
        loop.create_task(self._handle_lost(worker_id))

    async def _handle_lost(self, worker_id: str) -> None:
        if self.ledger is not None:
            await self._reap_worker(worker_id)
        try:
            await self.manager.handle_lost(worker_id)
        except Exception:
            logger.exception("replacing %s failed", worker_id)

    def _release(self, worker_id: str, request_id: str, side: Side) -> bool:
        """Reaper callback (runs in a thread): make a worker drop whatever it holds for a request."""
        import ray

        member = self.pool.members.get(worker_id)
        if member is None or not member.view.alive:
            return True  # the worker (and its blocks) are gone
        try:
            ray.get(member.actor.abort.remote(request_id), timeout=10.0)
            return True
        except Exception as exc:
            logger.warning("release of %s on %s failed: %s", request_id, worker_id, exc)
            return False

    async def _reap_worker(self, worker_id: str) -> None:
        """Free a dead worker's ledger entries now, or once Redis is back if it is down."""
        reaper = LeaseReaper(self.ledger, self._release)
        try:
            reaped = await self._redis("reaper", reaper.reap_worker, worker_id)
            logger.info("reclaimed %d ledger entries of dead worker %s", len(reaped), worker_id)
        except RedisUnavailableError:
            self._lost_while_down.add(worker_id)
        except Exception as exc:
            logger.warning("reaping dead worker %s failed: %s", worker_id, exc)

    async def _redis(self, kind: str, fn, *args):
        """A Redis call off the event loop: through the guard (own pool, fail fast when down)."""
        if self.redis_guard is None:
            return await asyncio.to_thread(fn, *args)
        return await self.redis_guard.call(kind, fn, *args)

    async def _reap_loop(self) -> None:
        reaper = LeaseReaper(self.ledger, self._release)
        while True:
            await asyncio.sleep(self.reap_interval_s)
            if self.redis_guard is not None and not self.redis_guard.up:
                continue  # nothing to reap from; the workers' own timeouts hold meanwhile
            try:
                # Redis came back: write what the outage deferred and renew live leases first,
                # so the reaper never takes the blocks of a request that is still running.
                if self.ledger_writer is not None and self.ledger_writer.needs_resync():
                    live = list(self.backend._active) if self.backend is not None else []
                    lease = self.backend.lease_s if self.backend is not None else 120.0
                    await self.ledger_writer.resync(live, lease)
                    if self.ledger_writer.needs_resync():
                        continue
                if not self.is_leader:
                    continue  # the leader reaps
                for worker_id in sorted(self._lost_while_down):
                    self._lost_while_down.discard(worker_id)
                    await self._reap_worker(worker_id)
                reaped = await self._redis("reaper", reaper.reap_once)
                for r in reaped:
                    logger.info("reaper: %s (%s) released %s", r.request_id, r.reason, [s.value for s in r.released])
            except RedisUnavailableError:
                pass  # counted and logged once per outage by the guard
            except Exception as exc:
                logger.warning("reaper pass failed: %s", exc)

    async def publish_status(self, key: str, ttl_s: int = 10) -> bool:
        """Write ``status()`` to Redis under ``key``; False (not an error) while Redis is down."""
        if self.redis_client is None:
            return False
        try:
            await self._redis("status", self.redis_client.set, key, json.dumps(self.status().to_dict()), ttl_s)
        except RedisUnavailableError:
            return False
        return True

    async def _plan_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.planner.interval_s)
            if not self.is_leader:
                continue
            try:
                decisions = await self.manager.plan_once()
                self.planner_metrics.observe(decisions, {r: len(p.handles) for r, p in self.manager.pools.items()})
            except Exception:
                logger.exception("planner pass failed")

    # ---------------------------------------------------------------- status
    @staticmethod
    def _tokens_per_s(m: PoolMember, since: float | None) -> float:
        """Tokens/s a worker produced since the previous status call (generated, or prompt for prefill)."""
        progress = m.history.since(since) if since is not None else None
        return 0.0 if progress is None else progress.per_s(lambda s: s.produced_tokens)

    def _worker_status(self, wid: str, m: PoolMember, since: float | None) -> WorkerStatus:
        v, s = m.view, m.view.stats
        pool = WorkerStatus(
            worker_id=wid, role=m.role, alive=v.alive, draining=v.draining,
            responsive=v.unresponsive_since is None, kv_usage=1.0 - v.num_free_blocks / max(1, v.num_blocks),
            running=v.num_running, waiting=v.num_waiting, tokens_per_s=self._tokens_per_s(m, since),
            inflight_requests=v.inflight_requests)
        if s is None:
            return pool
        decode = s.role is WorkerRole.DECODE
        return dataclasses.replace(
            pool, prefix_hit_rate=s.prefix_hit_rate, generated_tokens=s.generated_tokens, node_ip=s.node_ip,
            node_id=s.node_id, num_threads=s.num_threads, cores=s.cores, pinning=s.pinning, dtype=s.dtype,
            kernels=s.kernels, linear_backend=s.linear_backend, attention_backend=s.attention_backend,
            itl_ms=s.itl_ms if decode else None, expired_reservations=s.expired_reservations if decode else 0)

    def status(self) -> ClusterStatus:
        """``pdserve status``'s record; the head writes its ``to_dict()`` into Redis."""
        guard = self.redis_guard.stats() if self.redis_guard is not None else None
        since, self._status_read_at = self._status_read_at, time.time()
        return ClusterStatus(
            endpoints={"http": self.endpoints.http_url, "grpc": self.endpoints.grpc_target} if self.endpoints else {},
            pools={as_role(role): PoolStatus(len(rec.handles), rec.pending, sorted(rec.draining), rec.peers_skipped,
                                             rec.start_failures)
                   for role, rec in self.manager.pools.items()},
            workers=[self._worker_status(wid, m, since) for wid, m in self.pool.members.items()],
            planner=[PlannerDecisionStatus(pool=d.role, action=d.action.value, target=d.target_replicas,
                                           reason=d.reason, at=self.manager.decided_at)
                     for d in self.manager.decisions],
            migrations=self.backend.migrations if self.backend else 0,
            retries=self.backend.retries if self.backend else 0,
            uptime_s=time.time() - self.started_at,
            redis=None if guard is None else RedisStatus(guard.up, guard.outages, guard.down_for_s, dict(guard.dropped)),
            batches=([BatchStatus.from_dict(b) for b in self.batch_runner.snapshot]
                     if self.batch_runner is not None else []),
            control_plane=self._control_plane_status(),
        )

    def _control_plane_status(self) -> ControlPlaneStatus | None:
        if not self.elected:
            return None
        return ControlPlaneStatus(
            router_id=self.router_id, leader=self.is_leader, epoch=self.leader_since_epoch, takeovers=self.takeovers,
            routers=[RouterStatus(r.router_id, r.http, r.grpc, r.leader, r.pid, r.host, r.seen_at)
                     for r in self._routers])

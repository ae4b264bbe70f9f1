"""The head of a pdserve cluster: the router's servers, the worker pools behind them, the
KV-ledger reaper and the planner loop, wired from one ``ClusterConfig``.

It runs in-process (tests, ``pdserve up`` in the foreground) or inside the ``pdserve-router``
Ray actor (``cluster.launcher``), so that ``pdserve up`` can return while it keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pdserve.cluster.config import ClusterConfig
from pdserve.cluster.ledger import KVLedger, Side
from pdserve.cluster.pool_manager import PoolManager
from pdserve.cluster.reaper import LeaseReaper
from pdserve.cluster.request_log import RequestLog
from pdserve.engine.loader import load_model_spec
from pdserve.router.admission import Admission, AdmissionConfig
from pdserve.router.auth import ApiKeyAuth, grpc_server_credentials, server_ssl_context
from pdserve.router.backend import Finished, GenerateRequest, ModelInfo, TokenDelta
from pdserve.router.disagg_backend import DisaggBackend
from pdserve.router.grpc_server import start_grpc_server
from pdserve.router.http_server import start_http_server
from pdserve.router.policy import RoutingPolicy
from pdserve.router.serving import Serving
from pdserve.router.worker_pool import WorkerPool

logger = logging.getLogger(__name__)


class _LoggedBackend:
    """Appends every finished request's record to the Redis request log (``pdserve requests tail``)."""

    def __init__(self, inner: DisaggBackend, log: RequestLog | None, metrics=None) -> None:
        self._inner = inner
        self._log = log
        self._metrics = metrics

    def model_info(self) -> ModelInfo:
        return self._inner.model_info()

    async def health(self) -> bool:
        return await self._inner.health()

    async def abort(self, request_id: str) -> None:
        await self._inner.abort(request_id)

    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenDelta | Finished]:
        async for item in self._inner.generate(req):
            if isinstance(item, Finished) and self._metrics is not None:
                try:
                    self._metrics.observe_request(item.phase)
                except Exception:
                    logger.exception("router metrics failed")
            if isinstance(item, Finished) and self._log is not None:
                record = {"request_id": req.request_id, "finish_reason": item.finish_reason,
                          "error": str(item.error) if item.error else None, "priority": req.priority.name.lower(),
                          "max_tokens": req.params.max_tokens, "time": time.time(), **item.phase}
                asyncio.get_running_loop().create_task(self._append(record))
            yield item

    async def _append(self, record: dict) -> None:
        try:
            await asyncio.to_thread(self._log.append, record)
        except Exception as exc:  # the request itself already completed; an operator log gap is logged
            logger.warning("request log append failed: %s", exc)


@dataclass(slots=True)
class Endpoints:
    http_url: str
    grpc_target: str


class RouterService:
    def __init__(self, config: ClusterConfig, *, redis_url: str | None, namespace: str | None = None,
                 detached_workers: bool = False, reap_interval_s: float = 2.0,
                 redis_namespace: str = "pdserve") -> None:
        """``redis_namespace`` keeps two clusters sharing one Redis apart (ledger and request log)."""
        self.config = config
        self.redis_url = redis_url
        self.pool = WorkerPool(stats_timeout_s=config.router.worker_stats_timeout_s,
                               dead_after_s=config.router.worker_dead_after_s)
        self.manager = PoolManager(config, self.pool, namespace=namespace, detached=detached_workers)
        self.ledger = KVLedger(redis_url, namespace=redis_namespace) if redis_url else None
        self.request_log = RequestLog(redis_url, stream=f"{redis_namespace}:requests") if redis_url else None
        self.reap_interval_s = reap_interval_s
        self.backend: DisaggBackend | None = None
        self.serving: Serving | None = None
        self._servers: list = []
        self._tasks: list[asyncio.Task] = []
        self.endpoints: Endpoints | None = None
        self.started_at = time.time()
        self._rate_prev: dict[str, tuple[float, float]] = {}

    # ------------------------------------------------------------- lifecycle
    async def start(self) -> Endpoints:
        cfg = self.config
        await self.manager.start_initial()
        self.pool.start()
        await self.pool.refresh()
        spec = load_model_spec(cfg.model.path)
        max_len = min(cfg.model.max_model_len or spec.max_position_embeddings, spec.max_position_embeddings)
        info = ModelInfo(cfg.model.served_name or cfg.model.path.name, max_len, spec.vocab_size,
                         tuple(spec.eos_token_ids), str(cfg.model.path))
        dis = cfg.router.disaggregation
        local_max = {"never": max_len, "always": 0}.get(dis.mode, dis.local_prefill_max_tokens)
        policy = RoutingPolicy(block_size=cfg.decode.engine.block_size, local_prefill_max_tokens=local_max)
        self.backend = DisaggBackend(info, self.pool, policy=policy, ledger=self.ledger,
                                     call_timeout_s=cfg.router.request_timeout_s)
        admission = Admission(AdmissionConfig(max_in_flight=max(1, self._capacity()),
                                              max_queued=cfg.router.max_queued_requests))
        from pdserve.cluster.metrics import PlannerMetrics, RouterMetrics

        self.metrics = RouterMetrics(info.name)
        self.planner_metrics = PlannerMetrics()
        self.serving = Serving(_LoggedBackend(self.backend, self.request_log, self.metrics), admission=admission)
        keys = [k.get_secret_value() for k in cfg.router.api_keys]
        auth = ApiKeyAuth(keys) if keys else None
        r = cfg.router
        tls = bool(r.tls_cert_file and r.tls_key_file)
        http = await start_http_server(
            self.serving, host=r.host, port=r.http_port, auth=auth, max_body_bytes=r.max_request_bytes,
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
        if cfg.planner.enabled:
            self._tasks.append(loop.create_task(self._plan_loop()))
        logger.info("router serving: HTTP %s, gRPC %s", http.base_url, grpc.target)
        return self.endpoints

    def _capacity(self) -> int:
        """Requests the decode pool can run at once at its largest (admission's in-flight cap)."""
        d = self.config.decode
        return (d.max_replicas or d.min_replicas or 1) * d.engine.max_num_seqs

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for s in self._servers:
            await s.stop()
        await self.pool.stop()
        await self.manager.shutdown()

    # ------------------------------------------------------------ background
    def _on_worker_lost(self, worker_id: str) -> None:
        loop = asyncio.get_running_loop()
        loop.create_task(self._handle_lost(worker_id))

    async def _handle_lost(self, worker_id: str) -> None:
        if self.ledger is not None:
            reaper = LeaseReaper(self.ledger, self._release)
            try:
                reaped = await asyncio.to_thread(reaper.reap_worker, worker_id)
                logger.info("reclaimed %d ledger entries of dead worker %s", len(reaped), worker_id)
            except Exception as exc:
                logger.warning("reaping dead worker %s failed: %s", worker_id, exc)
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

    async def _reap_loop(self) -> None:
        reaper = LeaseReaper(self.ledger, self._release)
        while True:
            await asyncio.sleep(self.reap_interval_s)
            try:
                reaped = await asyncio.to_thread(reaper.reap_once)
                for r in reaped:
                    logger.info("reaper: %s (%s) released %s", r.request_id, r.reason, [s.value for s in r.released])
            except Exception as exc:
                logger.warning("reaper pass failed: %s", exc)

    async def _plan_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.planner.interval_s)
            try:
                decisions = await self.manager.plan_once()
                self.planner_metrics.observe(decisions, {r: len(p.handles) for r, p in self.manager.pools.items()})
            except Exception:
                logger.exception("planner pass failed")

    # ---------------------------------------------------------------- status
    def _tokens_per_s(self, wid: str, stats: dict) -> float:
        """Tokens/s a worker produced since the previous status call (generated, or prompt for prefill)."""
        key = "prompt_tokens_computed" if stats.get("role") == "prefill" else "generated_tokens"
        now, count = time.monotonic(), float(stats.get(key, 0))
        prev = self._rate_prev.get(wid)
        self._rate_prev[wid] = (now, count)
        if prev is None or now <= prev[0]:
            return 0.0
        return max(0.0, (count - prev[1]) / (now - prev[0]))

    def status(self) -> dict:
        workers = []
        for wid, m in self.pool.members.items():
            v = m.view
            workers.append({"worker_id": wid, "role": m.role, "alive": v.alive, "draining": v.draining,
                            "responsive": v.unresponsive_since is None, "node_ip": v.stats.get("node_ip", ""),
                            "node_id": v.stats.get("node_id", ""),
                            "kv_usage": 1.0 - v.num_free_blocks / max(1, v.num_blocks),
                            "running": v.num_running, "waiting": v.num_waiting,
                            "prefix_hit_rate": v.stats.get("prefix_hit_rate", 0.0),
                            "generated_tokens": v.stats.get("generated_tokens", 0),
                            "tokens_per_s": self._tokens_per_s(wid, v.stats),
                            "inflight_requests": v.inflight_requests})
        return {
            "endpoints": {"http": self.endpoints.http_url, "grpc": self.endpoints.grpc_target} if self.endpoints else {},
            "pools": {role: {"replicas": len(rec.handles), "pending": rec.pending, "draining": sorted(rec.draining)}
                      for role, rec in self.manager.pools.items()},
            "workers": workers,
            "planner": [{"pool": str(d.role), "action": d.action.value, "target": d.target_replicas,
                         "reason": d.reason} for d in self.manager.decisions],
            "migrations": self.backend.migrations if self.backend else 0,
            "retries": self.backend.retries if self.backend else 0,
            "uptime_s": time.time() - self.started_at,
        }

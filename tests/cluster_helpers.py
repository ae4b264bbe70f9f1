"""Drive a real ``RouterService`` (router + Ray worker pools + ledger reaper) from a test.

``ClusterHarness`` starts the service on an asyncio loop in a thread of the test process, so a
test can talk to it over loopback HTTP/gRPC from its own thread while it also inspects the
router's state (``pool``, ``ledger``) and kills workers with ``ray.kill``. Every wait is
bounded. The harness's ledger lives in its own Redis namespace so that several services in one
test session never see each other's entries.

Typical life cycle::

    h = ClusterHarness(cluster_config(model_dir, **{"decode.initial_replicas": 2}), redis_url)
    h.start()
    ...                      # requests, kills
    h.assert_nothing_held()  # every live worker's blocks free, the ledger empty
    h.stop()
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import uuid
from collections.abc import Coroutine
from concurrent.futures import CancelledError, Future
from pathlib import Path
from typing import Any

import ray
from pdserve.cluster.config import ClusterConfig
from pdserve.cluster.config_io import apply_overrides, config_from_model
from pdserve.cluster.head.router_service import RouterService
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.router.worker_pool import PoolMember
from waiting import wait_until  # noqa: F401  (re-exported for the tests)

START_TIMEOUT_S = 180.0
CALL_TIMEOUT_S = 30.0
FAILED_LEASE_S = 1.0  # see ClusterHarness.wait_started

# Small, CPU-friendly settings: a ~0.03 GiB KV cache, one torch thread, 64-token steps (so long
# prompts are prefilled in chunks), every prompt through the prefill pool, no planner; float32
# (not the 'auto' default) so greedy references match whatever the host's CPU computes natively.
TEST_OVERRIDES: dict[str, Any] = {
    "model.dtype": "float32",
    "router.http_port": 0,
    "router.grpc_port": 0,
    "router.request_timeout_s": 90.0,
    "router.disaggregation.local_prefill_max_tokens": 0,
    "planner.enabled": False,
    **{f"{role}.engine.{key}": value for role in ("prefill", "decode") for key, value in
       (("kv_cache_memory_gb", 0.03), ("num_threads", 1), ("max_num_batched_tokens", 64))},
}


# A prefill pool that takes one request at a time in 8-token chunks: long prompts queue there.
SLOW_PREFILL_OVERRIDES: dict[str, Any] = {
    "router.disaggregation.mode": "always",
    "prefill.engine.max_num_seqs": 1,
    "prefill.engine.max_num_batched_tokens": 8,
    "decode.engine.kv_cache_memory_gb": 0.1,
}


def cluster_config(model_dir: str | Path, **overrides: Any) -> ClusterConfig:
    """The test config for ``model_dir``; keyword keys are dotted paths (``decode.min_replicas``)."""
    return apply_overrides(config_from_model(model_dir), {**TEST_OVERRIDES, **overrides})


def reference_engine(config: ClusterConfig) -> LLMEngine:
    """The engine alone, in this process, with the decode pool's settings (greedy references)."""
    e = config.decode.engine
    return LLMEngine(EngineConfig(model_dir=str(config.model.path), kv_cache_memory_gb=e.kv_cache_memory_gb,
                                  num_threads=1, dtype=config.model.dtype, max_num_batched_tokens=e.max_num_batched_tokens,
                                  block_size=e.block_size))


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


class ClusterHarness:
    def __init__(self, config: ClusterConfig, redis_url: str, *, reap_interval_s: float = 0.5,
                 redis_namespace: str | None = None) -> None:
        self.config = config
        # A namespace of its own (unless routers of one cluster share it): other services on the
        # session's Redis keep their entries apart.
        self.service = RouterService(config, redis_url=redis_url, reap_interval_s=reap_interval_s,
                                     redis_namespace=redis_namespace or f"t{uuid.uuid4().hex[:10]}")
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="router-service", daemon=True)
        self._started = False
        self._starting: Future | None = None

    # ------------------------------------------------------------- lifecycle
    def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        self.begin_start()
        self.wait_started(timeout_s)

    def begin_start(self) -> None:
        """Start the service in the background (workers load while the test computes references)."""
        self._thread.start()
        self._starting = asyncio.run_coroutine_threadsafe(self.service.start(), self.loop)

    def wait_started(self, timeout_s: float = START_TIMEOUT_S) -> None:
        self._starting.result(timeout_s)
        self._started = True
        # An attempt that ended early (a timeout, a kill, an abort) stays FAILED in the ledger for
        # this lease before the reaper (every ``reap_interval_s``) confirms and frees it: the
        # product's 5 s is no figure these tests measure, only a wait in every leak check.
        self.service.backend.failed_lease_s = FAILED_LEASE_S

    def stop(self, timeout_s: float = 120.0) -> None:
        """Stop the service (waiting first for any replacement worker still starting), then the loop."""
        try:
            if self._starting is not None and not self._started:
                self._starting.cancel()
                with contextlib.suppress(Exception, CancelledError):
                    self._starting.result(timeout_s)  # a failed start leaves its workers to stop()
                self._started = True
            if self._started:
                wait_until(lambda: not any(r.pending for r in self.service.manager.pools.values()),
                           START_TIMEOUT_S, "replacement workers started")
                self.call(self.service.stop(stop_workers=True), timeout_s)  # elected or not: no worker outlives a test
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            if not self._thread.is_alive():
                self.loop.close()

    def call(self, coro: Coroutine, timeout_s: float = CALL_TIMEOUT_S) -> Any:
        """Run a coroutine on the service's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    # ------------------------------------------------------------- endpoints
    @property
    def http_url(self) -> str:
        return self.service.endpoints.http_url

    @property
    def grpc_target(self) -> str:
        return self.service.endpoints.grpc_target

    @property
    def model_name(self) -> str:
        return self.service.backend.model_info().name

    def openai(self, timeout_s: float = 60.0):
        import openai

        return openai.OpenAI(base_url=self.http_url + "/v1", api_key="unused", max_retries=0, timeout=timeout_s)

    # ----------------------------------------------------------------- pools
    def members(self, role: str) -> list[PoolMember]:
        """Live workers of a pool, as the router sees them."""
        return [m for m in list(self.service.pool.members.values()) if m.role == role and m.view.alive]

    def wait_routable(self, role: str, count: int, timeout_s: float) -> None:
        wait_until(lambda: sum(m.view.routable for m in self.members(role)) >= count, timeout_s,
                   f"{count} routable {role} workers")

    def ensure_replicas(self, role: str, count: int, timeout_s: float = START_TIMEOUT_S) -> None:
        """Add workers until ``role`` has ``count`` live ones (after earlier tests killed some)."""
        self.wait_no_pending(timeout_s)
        missing = count - len(self.members(role))
        for _ in range(missing):
            self.call(self.service.manager.add_replica(role), timeout_s)
        self.wait_routable(role, count, 30.0)

    def wait_no_pending(self, timeout_s: float = START_TIMEOUT_S) -> None:
        wait_until(lambda: not any(r.pending for r in self.service.manager.pools.values()), timeout_s,
                   "replacement workers started")

    def busy_member(self, role: str) -> PoolMember | None:
        """The worker of ``role`` that holds a request now (prefill: tokens queued there)."""
        for m in self.members(role):
            if (m.view.inflight_tokens if role == "prefill" else m.view.inflight_requests) > 0:
                return m
        return None

    def wait_busy(self, role: str, timeout_s: float = 30.0, poll_s: float = 0.002) -> PoolMember:
        found: list[PoolMember] = []

        def busy() -> bool:
            m = self.busy_member(role)
            if m is not None:
                found.append(m)
            return m is not None

        wait_until(busy, timeout_s, f"a {role} worker holding a request", poll_s)
        return found[0]

    def kill(self, member: PoolMember) -> None:
        """Crash the worker's process now (SIGKILL). ``ray.kill`` is asynchronous: on a busy
        host it took seconds to act, time in which a short request could finish untouched."""
        stats = member.view.stats or ray.get(member.actor.stats.remote(), timeout=CALL_TIMEOUT_S)
        pid = stats.pid
        os.kill(int(pid), signal.SIGKILL)

    # --------------------------------------------------------------- leaks
    def blocks_in_use(self) -> dict[str, int]:
        """KV blocks held by a request on every live worker (0 everywhere when nothing leaked)."""
        live = [m for m in self.members("prefill") + self.members("decode")]
        counts = ray.get([m.actor.blocks_in_use.remote() for m in live], timeout=CALL_TIMEOUT_S)
        return {m.worker_id: n for m, n in zip(live, counts)}

    def generated_tokens(self) -> int:
        """Tokens the live decode workers have sampled so far."""
        stats = ray.get([m.actor.stats.remote() for m in self.members("decode")], timeout=CALL_TIMEOUT_S)
        return sum(s.generated_tokens for s in stats)

    def ledger_active(self) -> list:
        return self.service.ledger.active()

    def assert_nothing_held(self, timeout_s: float = 60.0) -> None:
        """Every live worker's blocks are free and the ledger holds no entry (after the reaper ran).

        Reserved blocks whose sender died stay held until their transfer params expire (the
        workers' 30 s transfer timeout), hence the default bound.
        """
        held: dict[str, int] = {}

        def idle() -> bool:
            held.clear()
            held.update({w: n for w, n in self.blocks_in_use().items() if n})
            return not held and not any(m.view.inflight_requests for m in self.members("decode"))

        try:
            wait_until(idle, timeout_s, "every worker's KV blocks freed", 0.1)
        except TimeoutError as exc:
            raise AssertionError(f"blocks still held: {held}") from exc
        active: list = []

        def ledger_empty() -> bool:
            active[:] = self.ledger_active()
            return not active

        try:
            wait_until(ledger_empty, timeout_s, "ledger entries reaped", 0.2)
        except TimeoutError as exc:
            raise AssertionError(f"ledger entries still active: "
                                 f"{[(e.request_id, e.state.value) for e in active]}") from exc


@contextlib.contextmanager
def running_cluster(config: ClusterConfig, redis_url: str):
    """A started ``ClusterHarness`` (a module fixture's body): on the way out it checks nothing
    is held, then stops it whatever happened."""
    h = ClusterHarness(config, redis_url)
    h.start()
    try:
        yield h
        h.assert_nothing_held()
    finally:
        h.stop()

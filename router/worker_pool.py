"""The router's live view of the worker pools: handles, health, load, prefix caches, and one
output pump per decode worker (one Ray call per decode step carries every request's tokens;
the pump fans them out to per-attempt queues)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.contract import WorkerRole, WorkerStats, as_role
from pdserve.router.policy import WorkerView, apply_kv_events
from pdserve.router.stats_history import HORIZON_S, StatsHistory

logger = logging.getLogger(__name__)


class WorkerLost(Exception):
    """A worker died (or stopped answering) while it held part of a request."""

    def __init__(self, worker_id: str, detail: str = "") -> None:
        super().__init__(f"worker {worker_id} lost{': ' + detail if detail else ''}")
        self.worker_id = worker_id


LOST = object()  # queued into an attempt's stream when its decode worker dies
DEADLINE = object()  # queued into an attempt's stream when the request's deadline passes


def is_actor_death(exc: BaseException) -> bool:
    import ray

    return isinstance(exc, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError))


def remote_error(exc: BaseException) -> BaseException:
    """The worker's own exception inside a Ray task error (so that its message, not Ray's
    remote traceback, is what the router reports); ``exc`` itself otherwise."""
    import ray

    cause = getattr(exc, "cause", None) if isinstance(exc, ray.exceptions.RayTaskError) else None
    return cause if isinstance(cause, BaseException) else exc


@dataclass(slots=True)
class PoolMember:
    worker_id: str
    role: WorkerRole
    actor: Any
    view: WorkerView
    # its recent stats reports: every rate read from its counters (status, planner) comes from here
    history: StatsHistory = field(default_factory=StatsHistory)

    def __post_init__(self) -> None:
        self.role = as_role(self.role)


class WorkerPool:
    def __init__(self, stats_interval_s: float = 0.25, outputs_wait_s: float = 0.5, *,
                 stats_timeout_s: float = 5.0, dead_after_s: float = 30.0, router_id: str | None = None,
                 history_s: float = HORIZON_S) -> None:
        """A worker whose stats poll takes longer than ``stats_timeout_s`` gets no new work; one
        silent for ``dead_after_s`` is killed (a hung process must not keep its blocks, its
        streams or its Ray resources) and treated as lost. ``router_id`` names this router to the
        decode workers, which keep one outbox per router (several routers share the workers).
        ``history_s``: how far back each worker's stats reports are kept (the longest window a
        rate is read over)."""
        self.router_id = router_id or f"router-{uuid.uuid4().hex[:12]}"
        self.members: dict[str, PoolMember] = {}
        self._queues: dict[str, asyncio.Queue] = {}      # attempt id -> stream
        self._attempt_worker: dict[str, str] = {}         # attempt id -> decode worker id
        self._arrived_early: dict[str, list] = {}          # attempt id -> outputs of its next decode worker
        self._tasks: dict[str, asyncio.Task] = {}
        self._polls: dict[str, asyncio.Task] = {}         # worker id -> its stats poll in flight
        self._monitor: asyncio.Task | None = None
        self._stats_interval_s = stats_interval_s
        self._outputs_wait_s = outputs_wait_s
        self.stats_timeout_s = stats_timeout_s
        self.dead_after_s = dead_after_s
        self.history_s = history_s
        self.on_worker_lost: list[Callable[[str], None]] = []

    # ------------------------------------------------------------ membership
    def add(self, worker_id: str, role: WorkerRole, actor: Any) -> None:
        role = as_role(role)
        self.members[worker_id] = PoolMember(worker_id, role, actor, WorkerView(worker_id, role),
                                             StatsHistory(self.history_s))
        if role is WorkerRole.DECODE and self._monitor is not None:
            self._tasks[worker_id] = asyncio.get_running_loop().create_task(self._pump(worker_id))

    def remove(self, worker_id: str) -> None:
        member = self.members.pop(worker_id, None)
        task = self._tasks.pop(worker_id, None)
        if task is not None:
            task.cancel()
        if member is not None:
            self._fail_attempts_on(worker_id)

    def set_draining(self, worker_id: str, draining: bool = True) -> None:
        if worker_id in self.members:
            self.members[worker_id].view.draining = draining

    def views(self, role: WorkerRole) -> list[WorkerView]:
        return [m.view for m in self.members.values() if m.role is as_role(role)]

    def actor(self, worker_id: str) -> Any:
        member = self.members.get(worker_id)
        if member is None or not member.view.alive:
            raise WorkerLost(worker_id, "not in the pool")
        return member.actor

    def mark_dead(self, worker_id: str, detail: str = "") -> None:
        member = self.members.get(worker_id)
        if member is None or not member.view.alive:
            return
        member.view.alive = False
        logger.warning("worker %s marked dead: %s", worker_id, detail)
        self._fail_attempts_on(worker_id)
        for cb in self.on_worker_lost:
            cb(worker_id)

    # --------------------------------------------------------------- streams
    def open_stream(self, attempt_id: str, decode_worker_id: str) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()
        self._queues[attempt_id] = q
        self._attempt_worker[attempt_id] = decode_worker_id
        member = self.members.get(decode_worker_id)
        if member is None or not member.view.alive:
            q.put_nowait(LOST)
        return q

    def close_stream(self, attempt_id: str) -> None:
        self._queues.pop(attempt_id, None)
        self._attempt_worker.pop(attempt_id, None)
        self._arrived_early.pop(attempt_id, None)

    def _fail_attempts_on(self, worker_id: str) -> None:
        for attempt, wid in list(self._attempt_worker.items()):
            if wid == worker_id and attempt in self._queues:
                self._queues[attempt].put_nowait(LOST)

    # ----------------------------------------------------------------- tasks
    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._monitor = loop.create_task(self._monitor_loop())
        for wid, m in self.members.items():
            if m.role is WorkerRole.DECODE and wid not in self._tasks:
                self._tasks[wid] = loop.create_task(self._pump(wid))

    async def stop(self) -> None:
        tasks = (list(self._tasks.values()) + list(self._polls.values())
                 + ([self._monitor] if self._monitor else []))
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        self._monitor = None

    async def _pump(self, worker_id: str) -> None:
        while worker_id in self.members:
            member = self.members[worker_id]
            try:
                outputs = await member.actor.take_outputs.remote(self._outputs_wait_s, self.router_id)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if is_actor_death(exc):
                    self.mark_dead(worker_id, str(exc).splitlines()[0])
                    return
                logger.exception("drain from %s failed", worker_id)
                await asyncio.sleep(0.1)
                continue
            for out in outputs:
                q = self._queues.get(out.request_id)
                if q is None:
                    continue
                current = self._attempt_worker.get(out.request_id)
                if current is not None and current != worker_id:
                    # a request whose KV is moving here: its old worker's last outputs (and the
                    # "moved" mark) may still be on their way; these wait for them, in order
                    self._arrived_early.setdefault(out.request_id, []).append(out)
                    continue
                q.put_nowait(out)
                if out.moved_to:
                    self._attempt_worker[out.request_id] = out.moved_to
                    for early in self._arrived_early.pop(out.request_id, []):
                        q.put_nowait(early)

    async def _monitor_loop(self) -> None:
        """Poll every live worker each interval; a worker whose poll is still out is skipped, so
        one hung worker never delays what the router knows of the others."""
        while True:
            await asyncio.sleep(self._stats_interval_s)
            for wid, member in list(self.members.items()):
                if member.view.alive and wid not in self._polls:
                    task = asyncio.get_running_loop().create_task(self._poll(wid, member))
                    self._polls[wid] = task
                    task.add_done_callback(lambda _t, w=wid: self._polls.pop(w, None))

    async def refresh(self) -> None:
        """Pull every live worker's stats (and a prefill worker's KV events) once."""
        await asyncio.gather(*(self._poll(wid, m) for wid, m in list(self.members.items()) if m.view.alive))

    async def _poll(self, wid: str, member: PoolMember) -> None:
        asked = time.monotonic()
        try:
            stats = await asyncio.wait_for(member.actor.stats.remote(), timeout=self.stats_timeout_s)
            if member.role is WorkerRole.PREFILL:
                events = await asyncio.wait_for(member.actor.take_kv_events.remote(),
                                                timeout=self.stats_timeout_s)
                apply_kv_events(member.view, events)
        except asyncio.CancelledError:
            raise
        except asyncio.TimeoutError:
            self._unresponsive(wid, member, asked)
            return
        except Exception as exc:
            if is_actor_death(exc):
                self.mark_dead(wid, f"{type(exc).__name__}: {exc}".splitlines()[0])
            else:
                logger.warning("stats of %s failed: %s", wid, exc)
            return
        self._update(member, stats)

    def _unresponsive(self, wid: str, member: PoolMember, asked: float) -> None:
        v = member.view
        if not v.alive:
            return
        if v.unresponsive_since is None:
            v.unresponsive_since = asked
            logger.warning("worker %s did not answer within %.0f s: no new requests go to it until it "
                           "does (killed after %.0f s)", wid, self.stats_timeout_s, self.dead_after_s)
        silent = time.monotonic() - v.unresponsive_since
        if silent >= self.dead_after_s:
            import ray

            logger.error("worker %s silent for %.0f s: killing it", wid, silent)
            try:
                ray.kill(member.actor, no_restart=True)
            except Exception as exc:  # already gone: dead either way
                logger.warning("could not kill %s: %s", wid, exc)
            self.mark_dead(wid, f"unresponsive for {silent:.0f} s, killed")

    def _update(self, member: PoolMember, stats: WorkerStats) -> None:
        if member.view.unresponsive_since is not None:
            logger.warning("worker %s answers again after %.1f s", member.worker_id,
                           time.monotonic() - member.view.unresponsive_since)
            member.view.unresponsive_since = None
        v = member.view
        v.num_blocks = stats.num_blocks
        v.num_free_blocks = stats.num_free_blocks
        v.num_running = stats.num_running
        v.num_waiting = stats.num_waiting
        v.started_at = stats.started_at
        v.prefill_tokens_per_s = measured_prefill_rate(v.prefill_tokens_per_s, v.stats, stats)
        v.stats = stats
        member.history.add(time.time(), stats)


def measured_prefill_rate(rate: float | None, prev: WorkerStats | None, stats: WorkerStats,
                          weight: float = 0.5) -> float | None:
    """The prompt tokens/s a worker prefills at while busy: what its ``prompt_tokens_computed``
    gained over what its ``prefill_compute_s`` gained since the previous stats, averaged with the
    previous rate (``weight`` on the new sample). Unchanged when it prefilled nothing since (an
    idle worker keeps its rate) or restarted (counters went back)."""
    if prev is None:
        return rate
    tokens = stats.prompt_tokens_computed - prev.prompt_tokens_computed
    seconds = stats.prefill_compute_s - prev.prefill_compute_s
    if tokens <= 0 or seconds <= 0:
        return rate
    sample = tokens / seconds
    return sample if rate is None else weight * sample + (1 - weight) * rate

"""A small driver for disaggregated prefill/decode tests: real Ray actors, real NIXL, real model.

It plays the router's part of one handoff, with a bound on every wait:

1. ``D.reserve`` blocks for the prompt and get the ``TransferParams`` bytes;
2. ``P.prefill`` the prompt into those blocks (several at once through Ray);
3. ``D.start`` each request as soon as its prefill returns "prefilled" (a request that ended at
   its first token, or failed, is aborted on D instead, as a router would);
4. ``D.take_outputs`` until every started request has its final output.

``DisaggPool`` starts one prefill and one decode worker, wires their NIXL agents, and swaps in
a spare for a worker that a test killed. ``wait_nothing_leaked`` is the end of every lifecycle
test: no KV block, request, NIXL transfer handle or mailbox left on any worker.
"""

from __future__ import annotations

import itertools
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pdserve.cluster.runtime.workers import WorkerHandle, connect_pools, start_worker, stop_worker, wait_ready
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import StepOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.contract import PrefillResult
from waiting import wait_until  # noqa: F401  (re-exported for the tests)

READY_TIMEOUT_S = 120.0
CALL_TIMEOUT_S = 30.0

_ids = itertools.count()


def engine_config(model_dir: str | Path, **overrides: Any) -> EngineConfig:
    """Small settings for tests: a ~0.03 GB cache, one torch thread, 32-token chunks, float32."""
    base = EngineConfig(model_dir=str(model_dir), kv_cache_memory_gb=0.03, num_threads=1, dtype="float32",
                        max_num_batched_tokens=32, max_num_seqs=16)
    return replace(base, **overrides)


def new_request_id(tag: str) -> str:
    return f"{tag}-{next(_ids)}-{uuid.uuid4().hex[:6]}"


@dataclass(slots=True)
class DisaggRequest:
    request_id: str
    prompt: list[int]
    params: SamplingParams


@dataclass(slots=True)
class DisaggOutcome:
    """What the router would have seen for one request."""

    request_id: str
    prefill: PrefillResult | None = None
    token_ids: list[int] = field(default_factory=list)
    final: StepOutput | None = None
    started: bool = False

    @property
    def finish_reason(self) -> str | None:
        if self.final is not None:
            return self.final.finish_reason
        return self.prefill.finish_reason if self.prefill is not None else None


_LEAK_FIELDS = ("num_running", "num_waiting", "in_flight", "reservations", "kv_open_transfers", "kv_mailboxes")


def wait_nothing_leaked(handles: list[WorkerHandle], timeout_s: float = 15.0) -> None:
    """Wait until every worker holds no KV block, no request state, no NIXL handle or mailbox."""
    import ray

    last: dict[str, dict[str, int]] = {}

    def idle() -> bool:
        nonlocal last
        stats = ray.get([h.actor.stats.remote() for h in handles], timeout=CALL_TIMEOUT_S)
        used = ray.get([h.actor.blocks_in_use.remote() for h in handles], timeout=CALL_TIMEOUT_S)
        last = {}
        for h, st, n in zip(handles, stats, used):
            held = {k: getattr(st, k) for k in _LEAK_FIELDS if getattr(st, k)}
            assert bool(held) == st.holds_anything, (held, st)
            if n:
                held["blocks_in_use"] = n
            if held:
                last[h.worker_id] = held
        return not last

    try:
        wait_until(idle, timeout_s, interval_s=0.2, what="workers idle with nothing held")
    except TimeoutError as exc:
        raise TimeoutError(f"{exc}; still held: {last}") from None


def drain_until_finished(decode: WorkerHandle, outcomes: dict[str, DisaggOutcome],
                         timeout_s: float) -> list[StepOutput]:
    """Drain ``decode`` until every started outcome has its final output; returns foreign outputs."""
    deadline = time.monotonic() + timeout_s
    foreign: list[StepOutput] = []
    while any(o.started and o.final is None for o in outcomes.values()):
        if time.monotonic() >= deadline:
            waiting = [r for r, o in outcomes.items() if o.started and o.final is None]
            raise TimeoutError(f"requests {waiting} did not finish within {timeout_s:.1f} s")
        foreign.extend(_drain_once(decode, outcomes, 0.1))
    return foreign


def run_disagg(prefill: WorkerHandle, decode: WorkerHandle, requests: list[DisaggRequest],
               timeout_s: float = 60.0) -> dict[str, DisaggOutcome]:
    """Reserve -> prefill (all at once) -> start each as its prefill returns -> drain to the end."""
    import ray

    deadline = time.monotonic() + timeout_s
    params_bytes = ray.get([decode.actor.reserve.remote(r.request_id, len(r.prompt)) for r in requests],
                           timeout=CALL_TIMEOUT_S)
    outcomes = {r.request_id: DisaggOutcome(r.request_id) for r in requests}
    by_ref = {prefill.actor.prefill.remote(r.request_id, r.prompt, r.params, tp): r
              for r, tp in zip(requests, params_bytes)}
    while by_ref:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"prefills {[r.request_id for r in by_ref.values()]} did not return "
                               f"within {timeout_s:.1f} s")
        ready, _ = ray.wait(list(by_ref), num_returns=1, timeout=min(left, 0.2))
        for ref in ready:
            req = by_ref.pop(ref)
            res: PrefillResult = ray.get(ref, timeout=CALL_TIMEOUT_S)
            o = outcomes[req.request_id]
            o.prefill = res
            if res.first_token_id is not None:
                o.token_ids.append(res.first_token_id)
            if res.finish_reason == "prefilled":
                ray.get(decode.actor.start.remote(req.request_id, req.prompt, res.first_token_id,
                                                  req.params), timeout=CALL_TIMEOUT_S)
                o.started = True
            else:
                ray.get(decode.actor.abort.remote(req.request_id), timeout=CALL_TIMEOUT_S)
        # Keep the decode side's outbox moving while other prefills are still running.
        _drain_once(decode, outcomes, 0.0)
    drain_until_finished(decode, outcomes, max(0.0, deadline - time.monotonic()))
    return outcomes


def _drain_once(decode: WorkerHandle, outcomes: dict[str, DisaggOutcome], wait_s: float) -> list[StepOutput]:
    """One ``drain`` call filed into ``outcomes``; returns the outputs of other requests."""
    import ray

    foreign: list[StepOutput] = []
    for out in ray.get(decode.actor.take_outputs.remote(wait_s), timeout=CALL_TIMEOUT_S):
        o = outcomes.get(out.request_id)
        if o is None:
            foreign.append(out)
            continue
        o.token_ids.extend(out.new_token_ids)
        if out.finished:
            o.final = out
    return foreign


class DisaggPool:
    """One prefill and one decode worker (Ray actors), connected; killed ones can be replaced."""

    def __init__(self, config: EngineConfig, tag: str, *, transfer_timeout_s: float = 30.0,
                 kv_quarantine_s: float = 5.0) -> None:
        self.config = config
        self.tag = tag
        self.transfer_timeout_s = transfer_timeout_s
        self.kv_quarantine_s = kv_quarantine_s
        self._n = itertools.count()
        self.started: list[WorkerHandle] = []
        self.prefill = self._start("prefill")
        self.decode = self._start("decode")
        try:
            wait_ready([self.prefill, self.decode], READY_TIMEOUT_S)
            connect_pools([self.prefill], [self.decode])
        except BaseException:
            self.close()
            raise

    def _start(self, role: str, config: EngineConfig | None = None) -> WorkerHandle:
        kwargs = {"kv_quarantine_s": self.kv_quarantine_s} if role == "decode" else {}
        worker_id = f"{self.tag}-{role[0]}{next(self._n)}-{uuid.uuid4().hex[:4]}"
        handle = start_worker(role, worker_id, config or self.config, num_cpus=0.5,
                              transfer_timeout_s=self.transfer_timeout_s, worker_kwargs=kwargs)
        self.started.append(handle)
        return handle

    def start_extra_decode(self, config: EngineConfig) -> WorkerHandle:
        """A decode worker with another config, ready but connected to nobody."""
        handle = self._start("decode", config)
        wait_ready([handle], READY_TIMEOUT_S)
        return handle

    def spawn(self, role: str) -> WorkerHandle:
        """Start a spare worker without waiting (its start-up overlaps the test's own waits)."""
        return self._start(role)

    def adopt(self, spare: WorkerHandle) -> WorkerHandle:
        """Wait for a spare, connect it, and make it the pool's worker of its role."""
        wait_ready([spare], READY_TIMEOUT_S)
        if spare.role == "prefill":
            self.prefill = spare
        else:
            self.decode = spare
        connect_pools([self.prefill], [self.decode])
        return spare

    def close(self) -> None:
        for handle in self.started:
            stop_worker(handle, graceful=True, timeout_s=10.0)

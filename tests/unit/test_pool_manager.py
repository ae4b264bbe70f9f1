"""The pool manager's bookkeeping when load returns during a drain (no Ray: no worker starts)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.cluster.config_io import apply_overrides, config_from_model
from pdserve.cluster.pool_manager import PoolManager
from pdserve.router.worker_pool import WorkerPool


def manager(tmp_path: Path) -> PoolManager:
    config = apply_overrides(config_from_model(tmp_path, check_paths=False),
                             {"decode.min_replicas": 1, "decode.max_replicas": 4})
    m = PoolManager(config, WorkerPool())
    for wid in ("decode-a", "decode-b", "decode-c"):
        m.pools["decode"].handles[wid] = object()  # type: ignore[assignment]
        m.pool.add(wid, "decode", actor=None)
    return m


def replicas(m: PoolManager, role: str) -> int:
    return next(p.replicas for p in m.pool_states() if p.role == role)


def test_a_scale_up_during_drains_keeps_the_draining_workers_first(tmp_path: Path) -> None:
    m = manager(tmp_path)
    for wid in ("decode-b", "decode-c"):
        m.pools["decode"].draining.add(wid)
        m.pool.set_draining(wid)
    assert replicas(m, "decode") == 1

    assert m.undrain("decode", 1) == ["decode-b"]
    assert m.pools["decode"].draining == {"decode-c"}
    assert m.pool.members["decode-b"].view.routable and not m.pool.members["decode-c"].view.routable
    assert replicas(m, "decode") == 2

    assert m.undrain("decode", 5) == ["decode-c"]  # asked for more than drain: the rest are new replicas
    assert m.undrain("decode", 1) == [] and replicas(m, "decode") == 3
    assert all(member.view.routable for member in m.pool.members.values())


def test_batch_prompts_queued_on_a_prefill_worker_do_not_raise_its_planner_signal(tmp_path: Path) -> None:
    """The planner reads a prefill worker's queue as interactive prompt tokens only: batch work may wait."""
    m = manager(tmp_path)
    m.pools["prefill"].handles["prefill-a"] = object()  # type: ignore[assignment]
    m.pool.add("prefill-a", "prefill", actor=None)
    view = m.pool.members["prefill-a"].view
    view.started_at = 1.0
    view.inflight_tokens, view.batch_inflight_tokens = 3000, 2500
    by_id = {w.worker_id: w for w in m.metrics(now_wall=1000.0)}
    assert by_id["prefill-a"].queued_prompt_tokens == 500


def test_a_prefill_workers_busy_share_is_its_prompt_compute_time_over_the_time_between_reports(tmp_path: Path) -> None:
    """The planner's prefill signal reads how much of the time a worker computed prompts, so a
    pool that keeps its queues empty by running flat out does not read idle."""
    from pdserve.engine.contract import WorkerRole, WorkerStats

    def stats(tokens: int, compute_s: float) -> WorkerStats:
        return WorkerStats(worker_id="prefill-a", role=WorkerRole.PREFILL, num_running=0, num_waiting=0,
                           num_free_blocks=10, num_blocks=10, kv_usage=0.0, prefix_hit_rate=0.0, generated_tokens=0,
                           prompt_tokens_computed=tokens, prefill_compute_s=compute_s, prefill_budget_tokens=None,
                           max_prefill_tokens_with_decodes=0, kv_open_transfers=0, kv_mailboxes=0, started_at=1.0,
                           niceness=0, pid=1, transfer_timeout_s=None)

    m = manager(tmp_path)
    m.pools["prefill"].handles["prefill-a"] = object()  # type: ignore[assignment]
    m.pool.add("prefill-a", "prefill", actor=None)
    view = m.pool.members["prefill-a"].view
    view.started_at = 1.0
    view.stats = stats(1000, 2.0)
    first = {w.worker_id: w for w in m.metrics(now_wall=1000.0)}["prefill-a"]
    assert first.prefill_busy is None and first.prefill_tokens_per_s is None     # nothing to compare yet
    view.stats = stats(10_000, 11.0)                                              # 9 s of prompts in 10 s
    later = {w.worker_id: w for w in m.metrics(now_wall=1010.0)}["prefill-a"]
    assert later.prefill_busy == pytest.approx(0.9) and later.prefill_tokens_per_s == pytest.approx(900.0)
    view.stats = stats(10_000, 11.0)                                              # idle since
    idle = {w.worker_id: w for w in m.metrics(now_wall=1020.0)}["prefill-a"]
    assert idle.prefill_busy == 0.0 and idle.prefill_tokens_per_s is None

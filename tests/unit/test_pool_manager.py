"""The pool manager's bookkeeping (no Ray: worker starts are fakes): load returning during a drain,
starts that skip a dying peer, replacements tried again with backoff."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from pdserve.cluster.config_io import apply_overrides, config_from_model
from pdserve.cluster.control.pool_manager import PoolManager
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
    member = m.pool.members["prefill-a"]
    member.view.started_at = 1.0

    def reported(at: float, report: WorkerStats) -> None:  # what the worker pool's stats poll records
        member.view.stats = report
        member.history.add(at, report)

    reported(999.5, stats(1000, 2.0))
    first = {w.worker_id: w for w in m.metrics(now_wall=1000.0)}["prefill-a"]
    assert first.prefill_busy is None and first.prefill_tokens_per_s is None     # nothing to compare yet
    reported(1009.5, stats(10_000, 11.0))                                         # 9 s of prompts in 10 s
    later = {w.worker_id: w for w in m.metrics(now_wall=1010.0)}["prefill-a"]
    assert later.prefill_busy == pytest.approx(0.9) and later.prefill_tokens_per_s == pytest.approx(900.0)
    reported(1019.5, stats(10_000, 11.0))                                         # idle since
    idle = {w.worker_id: w for w in m.metrics(now_wall=1020.0)}["prefill-a"]
    assert idle.prefill_busy == 0.0 and idle.prefill_tokens_per_s is None


# ------------------------------------------------------------ starts that tolerate a dying peer
DYING: dict[str, BaseException] = {}  # fake workers being killed, by name


@pytest.fixture(autouse=True)
def _no_dying_workers():
    yield
    DYING.clear()


class _Method:
    """``actor.method.remote(...)`` of a fake actor: an awaitable, as a Ray object ref is."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def remote(self, *args):
        return self.fn(*args)


class FakeActor:
    """A worker whose NIXL agent adds peers; a dying one (``fails_with``) raises that when it is
    asked to add a peer, and so does any agent asked to add it."""

    def __init__(self, name: str, fails_with: BaseException | None = None) -> None:
        self.name, self.fails_with, self.peers = name, fails_with, []
        self.add_peer, self.metadata = _Method(self._add_peer), _Method(self._metadata)
        if fails_with is not None:
            DYING[name] = fails_with

    async def _add_peer(self, metadata: bytes) -> str:
        failure = self.fails_with or DYING.get(metadata.decode())
        if failure is not None:
            raise failure
        self.peers.append(metadata.decode())
        return metadata.decode()

    async def _metadata(self) -> bytes:
        return self.name.encode()


def fake_starts(monkeypatch: pytest.MonkeyPatch, fail_first: int = 0):
    """Replace Ray's worker start with fake actors; the first ``fail_first`` starts raise."""
    from pdserve.cluster.control import pool_manager
    from pdserve.cluster.runtime.workers import WorkerHandle

    started: list[FakeActor] = []
    stopped: list[str] = []

    def start_worker(role: str, worker_id: str, *args, **kwargs) -> WorkerHandle:
        if len(stopped) < fail_first:
            stopped.append(f"never started {worker_id}")
            raise RuntimeError("no room for the worker")
        actor = FakeActor(worker_id)
        started.append(actor)
        return WorkerHandle(worker_id, role, actor)

    monkeypatch.setattr(pool_manager, "start_worker", start_worker)
    monkeypatch.setattr(pool_manager, "stop_worker", lambda handle, graceful=True: stopped.append(handle.worker_id))
    return started, stopped


def with_peers(m: PoolManager, role: str, peers: dict[str, FakeActor]) -> None:
    from pdserve.cluster.runtime.workers import WorkerHandle

    m.pools[role].handles.clear()
    for wid, actor in peers.items():
        m.pools[role].handles[wid] = WorkerHandle(wid, role, actor, metadata=wid.encode())


def test_a_new_worker_skips_a_peer_that_cannot_be_added_and_serves(tmp_path: Path, monkeypatch, caplog) -> None:
    """The chaos benchmark's case: a decode worker being killed answers add_peer with NIXL_ERR_BACKEND
    while a prefill replacement joins; the start goes on without it (logged and counted)."""
    from pdserve.engine.errors import KVTransferError

    started, stopped = fake_starts(monkeypatch)
    m = manager(tmp_path)
    ok, dying = FakeActor("decode-ok"), FakeActor("decode-dying", KVTransferError("NIXL_ERR_BACKEND: remote agent gone"))
    with_peers(m, "decode", {"decode-ok": ok, "decode-dying": dying})

    worker_id = asyncio.run(m.add_replica("prefill"))

    new = started[0]
    assert worker_id in m.pools["prefill"].handles and worker_id in m.pool.members and not stopped
    assert new.peers == ["decode-ok"] and ok.peers == [worker_id] and dying.peers == []
    assert m.pools["prefill"].peers_skipped == 1 and m.pools["prefill"].pending == 0
    assert m.pools["prefill"].start_failures == 0
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skipped) == 1 and "decode-dying" in skipped[0] and "NIXL_ERR_BACKEND" in skipped[0], skipped


def test_a_peer_that_cannot_add_the_new_worker_is_skipped_too(tmp_path: Path, monkeypatch) -> None:
    """The other direction: the new decode worker adds every prefill peer; one prefill peer dies
    before it adds the new one back."""
    started, _ = fake_starts(monkeypatch)
    m = manager(tmp_path)
    with_peers(m, "decode", {})
    gone = FakeActor("prefill-gone")  # its metadata loads; it dies before it adds the new worker
    gone.fails_with = RuntimeError("The actor died unexpectedly before finishing this task.")
    fine = FakeActor("prefill-fine")
    with_peers(m, "prefill", {"prefill-gone": gone, "prefill-fine": fine})

    worker_id = asyncio.run(m.add_replica("decode"))

    assert worker_id in m.pools["decode"].handles
    assert started[0].peers == ["prefill-gone", "prefill-fine"] and fine.peers == [worker_id]
    assert m.pools["decode"].peers_skipped == 1


def test_an_incompatible_kv_layout_still_fails_the_start(tmp_path: Path, monkeypatch) -> None:
    """A configuration error is the same for every peer: skipping it would leave a worker no peer
    can use."""
    from pdserve.engine.errors import CompatibilityError

    started, stopped = fake_starts(monkeypatch)
    m = manager(tmp_path)
    with_peers(m, "decode", {"decode-x": FakeActor("decode-x")})
    monkeypatch.setattr(FakeActor, "_add_peer", _raising_add_peer)
    with pytest.raises(CompatibilityError):
        asyncio.run(m.add_replica("prefill"))
    assert stopped == [started[0].name] and not m.pools["prefill"].handles
    assert m.pools["prefill"].start_failures == 1 and m.pools["prefill"].pending == 0


async def _raising_add_peer(self: FakeActor, metadata: bytes) -> str:
    from pdserve.engine.errors import CompatibilityError

    if self.name.startswith("prefill-"):  # the new worker finds the peer's layout differs
        raise CompatibilityError(f"KV agent {metadata.decode()} is incompatible with {self.name}: block size 16 != 32")
    self.peers.append(metadata.decode())
    return metadata.decode()


def test_a_failed_replacement_is_tried_again_with_backoff_until_the_pool_is_whole(tmp_path: Path,
                                                                                   monkeypatch) -> None:
    started, stopped = fake_starts(monkeypatch, fail_first=2)
    m = manager(tmp_path)
    m.replace_backoff_s = (0.01, 0.015)
    with_peers(m, "prefill", {})
    with_peers(m, "decode", {"decode-a": FakeActor("decode-a"), "decode-lost": FakeActor("decode-lost")})
    m.config = apply_overrides(m.config, {"decode.min_replicas": 2})
    waits: list[float] = []
    real_sleep = asyncio.sleep

    async def sleep(delay: float) -> None:
        waits.append(delay)
        await real_sleep(0)

    monkeypatch.setattr(asyncio, "sleep", sleep)
    asyncio.run(m.handle_lost("decode-lost"))

    assert waits == [0.01, 0.015]  # doubled, capped
    assert m.pools["decode"].start_failures == 2 and len(stopped) == 2
    assert sorted(m.pools["decode"].handles) == sorted(["decode-a", started[0].name])
    assert m.pools["decode"].pending == 0 and "decode-lost" not in m.pool.members


def test_shutdown_ends_a_replacement_that_keeps_failing(tmp_path: Path, monkeypatch) -> None:
    _, stopped = fake_starts(monkeypatch, fail_first=10**6)
    m = manager(tmp_path)
    m.replace_backoff_s = (0.01, 0.01)
    with_peers(m, "prefill", {})
    with_peers(m, "decode", {})
    m.config = apply_overrides(m.config, {"decode.min_replicas": 1})

    async def scenario() -> int:
        task = asyncio.get_running_loop().create_task(m.replace("decode"))
        while len(stopped) < 3:
            await asyncio.sleep(0.005)
        await m.shutdown(stop_workers=False)
        assert task.done() and task.cancelled()
        tries = len(stopped)
        await asyncio.sleep(0.05)
        return tries

    tries = asyncio.run(scenario())
    assert len(stopped) == tries  # nothing started after the shutdown

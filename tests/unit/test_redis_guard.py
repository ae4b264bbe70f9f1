"""RedisGuard (circuit breaker, own pool) and LedgerWriter (backlog, resync) without a server:
a stand-in client whose ``ping`` and a stand-in ledger whose writes fail while ``down`` is set.

Life cycle checked: Redis up -> a write fails (outage starts, one warning) -> further writes
fail at once and are counted -> the probe sees Redis back -> the writer replays what the
outage deferred, in order, and renews live leases -> nothing is left in the backlog.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from pdserve.cluster.state.ledger import InvalidTransitionError, LedgerState
from pdserve.cluster.control.ledger_writer import LedgerWriter
from pdserve.cluster.state.redis_guard import RedisGuard, RedisUnavailableError

S = LedgerState


class FakeRedis:
    """Stands for Redis: every call raises ConnectionError while ``down``; writes are recorded."""

    def __init__(self) -> None:
        self.down = False
        self.calls: list[tuple] = []

    def _check(self) -> None:
        if self.down:
            raise RedisConnectionError("Connection refused")

    def ping(self) -> bool:
        self._check()
        return True

    # the KVLedger methods LedgerWriter uses
    def reserve(self, attempt: str, worker: str, blocks: list[int], lease_s: float) -> None:
        self._check()
        self.calls.append(("reserve", attempt, worker, tuple(blocks), lease_s))

    def transition(self, attempt: str, to: LedgerState, **kwargs: object) -> None:
        self._check()
        if any(c[:2] == ("transition", attempt) and c[2] is S.FREED for c in self.calls):
            raise InvalidTransitionError(f"{attempt} is FREED")
        self.calls.append(("transition", attempt, to))

    def renew(self, attempt: str, lease_s: float) -> None:
        self._check()
        self.calls.append(("renew", attempt, lease_s))


def wait_for(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


@pytest.fixture
def fake() -> FakeRedis:
    return FakeRedis()


@pytest.fixture
def guard(fake: FakeRedis):
    g = RedisGuard(fake, probe_interval_s=0.02)  # type: ignore[arg-type]
    yield g
    g.close()


def test_an_outage_opens_the_breaker_once_and_later_calls_fail_at_once(
        fake: FakeRedis, guard: RedisGuard, caplog: pytest.LogCaptureFixture) -> None:
    async def run() -> list[float]:
        fake.down = True
        with pytest.raises(RedisUnavailableError):
            await guard.call("ledger", fake.reserve, "a#1", "d", [1], 5.0)
        took = []
        for _ in range(50):
            t0 = time.perf_counter()
            with pytest.raises(RedisUnavailableError):
                await guard.call("request_log", fake.ping)
            took.append(time.perf_counter() - t0)
        return took

    with caplog.at_level(logging.WARNING, logger="pdserve.cluster.state.redis_guard"):
        took = asyncio.run(run())
    assert not guard.up and guard.outages == 1
    assert guard.stats().dropped == {"ledger": 1, "request_log": 50}
    assert max(took) < 0.01  # no socket, no timeout while the breaker is open
    assert sum("Redis unreachable" in r.message for r in caplog.records) == 1  # one per outage

    fake.down = False  # the probe closes the breaker by itself
    wait_for(lambda: guard.up)
    assert any("Redis is back" in r.message for r in caplog.records)
    assert asyncio.run(guard.call("ledger", fake.ping)) is True


def test_calls_run_on_the_guards_own_threads_not_the_default_executor(fake: FakeRedis,
                                                                      guard: RedisGuard) -> None:
    async def run() -> str:
        return await guard.call("ledger", lambda: threading.current_thread().name)

    assert asyncio.run(run()).startswith("pdserve-redis")


def test_a_full_queue_fails_fast_instead_of_waiting(fake: FakeRedis) -> None:
    guard = RedisGuard(fake, max_workers=1, max_pending=2)  # type: ignore[arg-type]
    release = threading.Event()

    async def run() -> list:
        slow = [asyncio.ensure_future(guard.call("ledger", release.wait, 5)) for _ in range(2)]
        await asyncio.sleep(0.05)
        with pytest.raises(RedisUnavailableError, match="already queued"):
            await guard.call("request_log", fake.ping)
        release.set()
        return await asyncio.gather(*slow)

    try:
        assert asyncio.run(run()) == [True, True]
        assert guard.up and guard.stats().dropped == {"request_log": 1}
    finally:
        guard.close()


def test_writer_replays_deferred_steps_in_order_and_renews_live_leases(fake: FakeRedis,
                                                                       guard: RedisGuard) -> None:
    writer = LedgerWriter(fake, guard)  # type: ignore[arg-type]

    async def run() -> None:
        await writer.reserve("live#1", "d", [1, 2], 30.0)  # written before the outage
        await writer.reserve("ends#1", "d", [3], 30.0)
        fake.down = True
        await writer.transition("ends#1", S.DECODING)  # the outage starts here
        await writer.transition("ends#1", S.FREED)
        await writer.reserve("short#1", "d", [4], 30.0)  # lives and ends during the outage
        await writer.transition("short#1", S.DECODING)
        await writer.transition("short#1", S.FREED)
        await writer.reserve("new#1", "d", [5], 30.0)  # starts during the outage, still live
        await writer.transition("new#1", S.DECODING)
        await writer.renew("live#1", 30.0)  # not kept: resync renews
        assert writer.backlog == 3 and not writer.needs_resync()  # nothing to do while down
        fake.down = False
        wait_for(lambda: guard.up)
        assert writer.needs_resync()
        fake.calls.clear()
        stats = await writer.resync(["live#1", "new#1"], 30.0)
        assert (stats.replayed, stats.skipped, stats.renewed, stats.pending) == (4, 1, 2, 0)
        assert not writer.needs_resync()

    asyncio.run(run())
    assert fake.calls == [
        ("transition", "ends#1", S.DECODING), ("transition", "ends#1", S.FREED),
        ("reserve", "new#1", "d", (5,), 30.0), ("transition", "new#1", S.DECODING),
        ("renew", "live#1", 30.0), ("renew", "new#1", 30.0),
    ]
    assert writer.backlog == 0  # nothing deferred is left behind


def test_a_resync_cut_short_by_another_outage_keeps_the_rest(fake: FakeRedis, guard: RedisGuard) -> None:
    writer = LedgerWriter(fake, guard)  # type: ignore[arg-type]

    async def run() -> None:
        fake.down = True
        await writer.reserve("a#1", "d", [1], 30.0)
        await writer.transition("a#1", S.DECODING)
        fake.down = False
        wait_for(lambda: guard.up)
        fake.down = True  # down again before the resync
        stats = await writer.resync(["a#1"], 30.0)
        assert stats.pending == 1 and writer.backlog == 1
        fake.down = False
        wait_for(lambda: guard.up)
        stats = await writer.resync(["a#1"], 30.0)
        assert (stats.replayed, stats.pending) == (2, 0)

    asyncio.run(run())
    assert [c[0] for c in fake.calls] == ["reserve", "transition", "renew"]

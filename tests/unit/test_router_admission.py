"""Admission: a bounded number in flight, a bounded line, refusal with retry-after beyond it; a
freed slot goes to the waiting request (group) that holds the fewest, the oldest among equals."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.engine.errors import OverloadedError
from pdserve.router.admission import Admission, AdmissionConfig


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError):
        AdmissionConfig(max_in_flight=0)
    with pytest.raises(ValueError):
        AdmissionConfig(max_queued=-1)


def test_full_then_queue_then_refuse_then_drain() -> None:
    async def scenario() -> None:
        adm = Admission(AdmissionConfig(max_in_flight=2, max_queued=1, retry_after_s=3))
        await adm.acquire()
        await adm.acquire()                       # two in flight: full
        waiter = asyncio.create_task(adm.acquire())
        await asyncio.sleep(0)
        assert (adm.in_flight, adm.queued) == (2, 1) and not waiter.done()
        with pytest.raises(OverloadedError) as info:  # line full: refused at once
            await adm.acquire()
        assert info.value.retry_after_s == 3 and adm.rejected_total == 1
        adm.release()                             # the slot passes to the waiter
        await asyncio.wait_for(waiter, 1)
        assert (adm.in_flight, adm.queued) == (2, 0)
        adm.release()
        adm.release()
        assert (adm.in_flight, adm.queued) == (0, 0)

    asyncio.run(scenario())


def test_cancelled_waiter_leaves_the_line_and_leaks_no_slot() -> None:
    async def scenario() -> None:
        adm = Admission(AdmissionConfig(max_in_flight=1, max_queued=4))
        async with adm.slot():
            waiter = asyncio.create_task(adm.acquire())
            await asyncio.sleep(0)
            waiter.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiter
            assert adm.queued == 0
        assert (adm.in_flight, adm.queued) == (0, 0)
        async with adm.slot():
            assert adm.in_flight == 1
        assert adm.in_flight == 0

    asyncio.run(scenario())


async def _waiting(adm: Admission, group: str) -> asyncio.Task:
    task = asyncio.create_task(adm.acquire(group))
    await asyncio.sleep(0)
    assert not task.done()
    return task


def test_a_small_request_that_arrives_later_gets_the_next_slot_before_a_wide_ones_rest() -> None:
    async def scenario() -> None:
        adm = Admission(AdmissionConfig(max_in_flight=4, max_queued=16))
        for _ in range(3):
            await adm.acquire("wide")             # the wide request's first three choices run
        await adm.acquire("other")                # full
        wide_rest = [await _waiting(adm, "wide") for _ in range(5)]
        small = await _waiting(adm, "small")      # arrives after all of them
        assert (adm.in_flight, adm.queued) == (4, 6)
        adm.release("other")                      # wide holds 3, small 0: small goes first
        await asyncio.wait_for(small, 1)
        assert not any(t.done() for t in wide_rest)
        assert (adm.held("wide"), adm.held("small")) == (3, 1)
        adm.release("small")                      # nobody else waits: the wide one takes it
        await asyncio.sleep(0)
        assert sum(t.done() for t in wide_rest) == 1 and adm.held("wide") == 4
        for t in wide_rest:                       # then the rest, as its own choices end
            if not t.done():
                adm.release("wide")
                await asyncio.wait_for(t, 1)
        for _ in range(4):
            adm.release("wide")
        assert (adm.in_flight, adm.queued, adm.held("wide")) == (0, 0, 0)

    asyncio.run(scenario())


def test_a_wide_request_is_not_starved_by_a_stream_of_small_ones() -> None:
    async def scenario() -> None:
        adm = Admission(AdmissionConfig(max_in_flight=2, max_queued=16))
        await adm.acquire("a")
        await adm.acquire("b")
        wide = [await _waiting(adm, "wide") for _ in range(2)]   # holds none, waits longest
        small = await _waiting(adm, "s1")
        adm.release("a")                                         # equals at 0 held: the older first
        await asyncio.sleep(0)
        assert wide[0].done() and not small.done()
        adm.release("b")                                         # wide holds 1 now: s1 goes
        await asyncio.sleep(0)
        assert small.done() and not wide[1].done()
        later = await _waiting(adm, "s2")
        adm.release("wide")                                      # wide holds 0 again, and is older
        await asyncio.sleep(0)
        assert wide[1].done() and not later.done()
        adm.release("s1")
        await asyncio.wait_for(later, 1)
        for g in ("wide", "s2"):
            adm.release(g)
        assert (adm.in_flight, adm.queued) == (0, 0)

    asyncio.run(scenario())


def test_two_wide_requests_share_the_freed_slots_in_turn() -> None:
    async def scenario() -> None:
        adm = Admission(AdmissionConfig(max_in_flight=4, max_queued=16))
        for _ in range(4):
            await adm.acquire("x")
        a = [await _waiting(adm, "a") for _ in range(3)]
        b = [await _waiting(adm, "b") for _ in range(3)]
        order = []
        for _ in range(4):
            adm.release("x")
            await asyncio.sleep(0)
            order.append((sum(t.done() for t in a), sum(t.done() for t in b)))
        assert order == [(1, 0), (1, 1), (2, 1), (2, 2)]
        for t in a + b:
            t.cancel()
        await asyncio.gather(*a, *b, return_exceptions=True)
        for g, n in (("a", 2), ("b", 2)):
            for _ in range(n):
                adm.release(g)
        assert (adm.in_flight, adm.queued, adm.held("a"), adm.held("b")) == (0, 0, 0, 0)

    asyncio.run(scenario())


def test_a_waiter_cancelled_just_before_a_release_is_skipped_and_nothing_leaks() -> None:
    async def scenario() -> None:
        adm = Admission(AdmissionConfig(max_in_flight=1, max_queued=4))
        await adm.acquire("a")
        gone = await _waiting(adm, "gone")
        next_one = await _waiting(adm, "next")
        gone.cancel()                             # its future is cancelled, its task not yet run
        adm.release("a")                          # the slot skips it
        await asyncio.wait_for(next_one, 1)
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert (adm.in_flight, adm.queued, adm.held("next"), adm.held("gone")) == (1, 0, 1, 0)
        adm.release("next")
        assert (adm.in_flight, adm.queued) == (0, 0)

    asyncio.run(scenario())


def test_anonymous_slots_leave_nothing_behind():
    """acquire()/release() without a group (each a group of its own) keep no per-group count."""
    async def go():
        adm = Admission(AdmissionConfig(max_in_flight=1, max_queued=4))
        await adm.acquire()
        waiter = asyncio.create_task(adm.acquire())
        await asyncio.sleep(0)
        adm.release()                             # handed to the anonymous waiter
        await waiter
        adm.release()
        assert adm.in_flight == 0 and adm.queued == 0 and adm._held == {}
    asyncio.run(go())

"""Admission: a bounded number in flight, a bounded FIFO line, refusal with retry-after beyond it."""

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

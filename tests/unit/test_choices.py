"""The pieces both front ends use to answer with whole choices: every choice's chunks and end
gathered (an error ends the response), and candidates ranked by the sum of their logprobs."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.engine.errors import WorkerUnavailableError
from pdserve.router.backend import Finished
from pdserve.router.choices import by_likelihood, collect
from pdserve.router.serving import Chunk


async def _events(items, closed: list[bool]):
    try:
        for item in items:
            yield item
    finally:
        closed.append(True)


def test_collect_gathers_each_choice_and_closes_the_events() -> None:
    closed: list[bool] = []
    a, b = Chunk([1], "a"), Chunk([2], "b")
    items = [(0, a), (1, b), (1, Finished("stop")), (0, Finished("length"))]
    chunks, finals = asyncio.run(collect(_events(items, closed), [0, 1, 2]))
    assert chunks == {0: [a], 1: [b], 2: []}
    assert {i: f.finish_reason for i, f in finals.items()} == {0: "length", 1: "stop"}
    assert closed == [True]


def test_collect_raises_a_choice_error_and_still_closes_the_events() -> None:
    closed: list[bool] = []
    items = [(0, Chunk([1], "a")), (1, Finished("error", error=WorkerUnavailableError("gone"))), (0, Chunk([2], "b"))]
    with pytest.raises(WorkerUnavailableError):
        asyncio.run(collect(_events(items, closed), [0, 1]))
    assert closed == [True]


def test_by_likelihood_orders_by_summed_logprobs_and_keeps_ties_in_order() -> None:
    chunks = {0: [Chunk([5], "x", [{5: -2.0}])],
              1: [Chunk([6], "y", [{6: -0.5}]), Chunk([7], "z", [{7: -0.5}])],
              2: [Chunk([8], "w", [{8: -1.0}])],
              3: [Chunk([9], "v", [{9: -2.0}])]}
    assert by_likelihood([0, 1, 2, 3], chunks) == [1, 2, 0, 3]

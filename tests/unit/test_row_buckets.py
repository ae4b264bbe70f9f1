"""Row buckets: the few row counts a step's matmuls run at (engine/row_buckets.py)."""

from __future__ import annotations

import pytest

from pdserve.engine.row_buckets import EXACT_ROWS, buckets_up_to, row_bucket


def test_small_counts_run_exactly_and_larger_ones_pad_by_at_most_an_eighth() -> None:
    assert [row_bucket(n) for n in range(1, EXACT_ROWS + 1)] == list(range(1, EXACT_ROWS + 1))
    assert [row_bucket(n) for n in (33, 36, 37, 64, 65, 129, 2048, 2049)] == [36, 36, 40, 64, 72, 144, 2048, 2304]
    last = 0
    for n in range(1, 5000):
        b = row_bucket(n)
        assert n <= b <= n + n // 8, n
        assert b >= last, "buckets must not shrink as the count grows"
        assert row_bucket(b) == b, "a bucket is its own bucket"
        last = b


def test_buckets_up_to_lists_every_size_a_count_can_take() -> None:
    sizes = buckets_up_to(2048)
    assert sizes == sorted(set(row_bucket(n) for n in range(1, 2049)))
    assert len(sizes) == 80 and sizes[-1] == 2048
    assert buckets_up_to(2049)[-1] == 2304       # the last one covers the count
    assert buckets_up_to(5) == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("bad", [0, -3])
def test_counts_below_one_are_refused(bad: int) -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        row_bucket(bad)
    with pytest.raises(ValueError, match="must be >= 1"):
        buckets_up_to(bad)

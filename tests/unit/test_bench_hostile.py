"""The hostile benchmark's arithmetic: a neighbour's gaps inside and before a hostile window."""

from __future__ import annotations

from pdserve.bench.hostile import CASES, Neighbour, Round, _nested_array_schema, format_table, _summary


def test_gaps_split_at_the_window_and_never_span_two_streams():
    n = Neighbour(None, "", "", 0)
    n.streams = [[0.0, 0.01, 0.02, 0.03, 0.50, 0.51], [5.0, 5.01]]  # a 0.47 s stall, then a new stream at 5.0
    max_gap, p99 = n.gaps(start=0.025, end=1.0)
    assert round(max_gap) == 470
    assert round(p99) == 10
    # the 4.49 s between the two streams is no token gap
    max_gap, _ = n.gaps(start=0.6, end=6.0)
    assert round(max_gap) == 10


def test_nested_schema_is_valid_json_of_the_asked_depth():
    import json

    doc = json.loads(_nested_array_schema(5))
    depth = 0
    while "items" in doc:
        doc, depth = doc["items"], depth + 1
    assert depth == 5


def test_summary_and_table_carry_the_ratio_and_extras():
    rounds = [Round(400, 0.01, 30.0, 15.0), Round(400, 0.02, 60.0, 15.0)]
    rounds[0].extra["closed_by_server"] = 100.0
    rounds[1].extra["closed_by_server"] = 98.0
    s = _summary(rounds)
    assert s["gap_ratio"] == 3.0 and s["gap_ratio_worst"] == 4.0 and s["closed_by_server"] == 99.0
    table = format_table({"host": "test-cpu", "cases": {CASES[0]: s}})
    assert "test-cpu" in table and "3.00" in table and "closed_by_server = 99.00" in table

"""Request log stream against a real Redis: round trip, bounded length, follow."""

from __future__ import annotations

import threading

import pytest

from pdserve.cluster.state.request_log import RequestLog


STREAM_NODE_ENTRIES = 100  # Valkey's stream-node-max-entries: approximate trimming's granularity


def make_record(i: int) -> dict:
    return {"request_id": f"r{i}", "prompt_tokens": i, "ttft_s": 0.5 + i,
            "workers": {"prefill": "pre-0", "decode": "dec-0"}, "finish_reason": "stop",
            "cached": None, "phases": [1, 2.5]}


@pytest.fixture
def log(redis_client, redis_namespace) -> RequestLog:
    return RequestLog(redis_client, stream=f"{redis_namespace}:requests", maxlen=1000)


def test_append_and_tail_round_trip_json_values_in_order(log: RequestLog) -> None:
    ids = [log.append(make_record(i)) for i in range(30)]
    assert len(set(ids)) == 30
    assert log.tail(5) == [make_record(i) for i in range(25, 30)]
    assert log.tail(100) == [make_record(i) for i in range(30)]


def test_stream_stays_bounded_near_maxlen(log: RequestLog) -> None:
    for i in range(2 * log.maxlen):
        log.append({"i": i})
    assert log.maxlen <= len(log) <= log.maxlen + STREAM_NODE_ENTRIES
    assert log.tail(1) == [{"i": 2 * log.maxlen - 1}]


def test_follow_yields_records_appended_after_it_started(log: RequestLog) -> None:
    log.append({"old": True})
    follower = log.follow(block_ms=100, max_idle_s=5.0)
    got: list[dict] = []

    def consume() -> None:
        for record in follower:
            got.append(record)
            if len(got) == 3:
                return

    reader = threading.Thread(target=consume)
    reader.start()
    for i in range(3):
        log.append({"new": i})
    reader.join(timeout=10)
    assert not reader.is_alive()
    assert got == [{"new": 0}, {"new": 1}, {"new": 2}]


def test_follow_from_start_then_idle_timeout_ends_it(log: RequestLog) -> None:
    for i in range(3):
        log.append({"i": i})
    records = list(log.follow(block_ms=50, from_start=True, max_idle_s=0.3))
    assert records == [{"i": i} for i in range(3)]


def test_bad_input_is_refused(redis_client, redis_namespace) -> None:
    log = RequestLog(redis_client, stream=f"{redis_namespace}:requests")
    with pytest.raises(ValueError):
        log.append({})
    with pytest.raises(TypeError):
        log.append({"x": object()})
    with pytest.raises(ValueError):
        RequestLog(redis_client, stream=f"{redis_namespace}:requests", maxlen=0)
    assert len(log) == 0

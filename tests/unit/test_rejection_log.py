"""RejectionLog: one INFO line per refused request, at most a burst per window, then a count."""

from __future__ import annotations

import logging

import pytest

from pdserve.router.rejection_log import MAX_MESSAGE_CHARS, RejectionLog


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_flood_is_cut_to_the_burst_and_the_rest_is_counted(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    log = RejectionLog(logging.getLogger("test.rejections"), burst=3, window_s=10.0, clock=clock)
    with caplog.at_level(logging.INFO, logger="test.rejections"):
        written = [log.refused("POST /v1/completions", 400, f"bad {i}") for i in range(1000)]
        assert written.count(True) == 3 and len(caplog.records) == 3
        clock.now += 10.0  # next window: one line counts what was skipped, then logging resumes
        assert log.refused("POST /v1/completions", 415, "again")
    lines = [r.getMessage() for r in caplog.records]
    assert lines[:3] == [f"refused POST /v1/completions: 400 bad {i}" for i in range(3)]
    assert lines[3].startswith("997 more refused requests not logged")
    assert lines[4] == "refused POST /v1/completions: 415 again"
    assert all(r.levelno == logging.INFO and r.exc_info is None for r in caplog.records)


def test_a_long_or_multiline_message_becomes_one_short_line(caplog: pytest.LogCaptureFixture) -> None:
    log = RejectionLog(logging.getLogger("test.rejections"))
    with caplog.at_level(logging.INFO, logger="test.rejections"):
        log.refused("POST /x", 400, "line one\nline two " + "x" * 10_000)
    (line,) = [r.getMessage() for r in caplog.records]
    assert "\n" not in line and len(line) < MAX_MESSAGE_CHARS + 50

"""EngineLoop on a stand-in engine (pure loop logic): commands run on the loop's own thread, and
starting a loop shortens the process's GIL switch interval so serving threads wait less for it."""

from __future__ import annotations

import sys
import threading

import pytest

from pdserve.engine.engine_loop import SWITCH_INTERVAL_S, EngineLoop


class _IdleEngine:
    def __init__(self) -> None:
        self.interrupt = threading.Event()

    def has_unfinished(self) -> bool:
        return False


@pytest.fixture
def default_switch_interval():
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)   # Python's default
    yield
    sys.setswitchinterval(before)


def test_starting_a_loop_shortens_the_gil_switch_interval_and_runs_commands_on_its_thread(
        default_switch_interval) -> None:
    loop = EngineLoop(_IdleEngine(), lambda outputs: None, name="test-loop")
    assert sys.getswitchinterval() == pytest.approx(0.005)
    loop.start()
    try:
        assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S)
        assert SWITCH_INTERVAL_S <= 0.001
        assert loop.call(lambda _e: threading.current_thread().name, timeout_s=10) == "test-loop"
    finally:
        loop.stop()
    assert not loop.alive


def test_a_shorter_interval_already_set_is_kept(default_switch_interval) -> None:
    sys.setswitchinterval(0.0001)
    loop = EngineLoop(_IdleEngine(), lambda outputs: None)
    loop.start()
    loop.stop()
    assert sys.getswitchinterval() == pytest.approx(0.0001)

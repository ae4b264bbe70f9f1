"""The chaos benchmark's bookkeeping (``scripts/kill_soak.py``): a scheduled kill that finds no
worker of its role is skipped and recorded, and the chaos run still passes; a kill the run
ended before stays a failure. No cluster: a stand-in harness with no worker left."""

from __future__ import annotations

import importlib.util
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "kill_soak.py"


@pytest.fixture(scope="module")
def kill_soak():
    spec = importlib.util.spec_from_file_location("kill_soak_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


class NoWorkerLeft:
    """Every worker of the pool is dead and its replacement still starting."""

    def wait_busy(self, role: str, timeout_s: float, poll_s: float):
        raise TimeoutError(f"no busy {role} worker")

    def members(self, role: str) -> list:
        return []

    def kill(self, victim) -> None:
        raise AssertionError("nothing to kill")


def chaos_report(kills: list[dict]) -> dict:
    return {"reference_failures": [], "reference": {"failed": 0}, "completed": 1000, "requests": 1000,
            "lost": 0, "duplicated_tokens": 0, "missing_tokens": 0, "wrong_tokens": 0, "leaked_blocks": 0,
            "live_ledger_entries_after": 0, "kills": kills, "failed": 0, "identical_to_reference": 1000,
            "blocks_held_after": {}}


def test_a_kill_that_finds_no_worker_is_skipped_and_the_chaos_run_passes(kill_soak) -> None:
    kill = kill_soak.Kill("prefill", 300)
    kill_soak.kill_one(NoWorkerLeft(), kill, time.monotonic())
    assert kill.skipped == "no live prefill worker to kill" and kill.worker_id == ""
    done = kill_soak.Kill("decode", 100, worker_id="decode-1-abc")
    kills = [asdict(done), asdict(kill)]

    assert kill_soak.chaos_verdict(chaos_report(kills)) == []
    # the plain kill soak's two kills are its point: a skipped one fails it, and says why
    assert kill_soak.verdict(chaos_report(kills)) == ["a kill found no worker to kill"]


def test_a_kill_the_run_ended_before_still_fails_the_chaos_run(kill_soak) -> None:
    never = kill_soak.Kill("decode", 990)  # neither done nor skipped
    assert kill_soak.chaos_verdict(chaos_report([asdict(never)])) == ["a kill did not happen (the run ended first)"]

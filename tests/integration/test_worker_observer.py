"""A worker reports to its observer (``worker.base.WorkerObserver``) as things happen:
the hooks the Ray metrics are built on (``cluster/runtime/metered.py``). One decode worker in this
process, with its real engine and NIXL agent, prefilling and decoding locally."""

from __future__ import annotations

import time

import pytest

from disagg_helpers import engine_config
from pdserve.decode_worker.worker import DecodeWorker
from pdserve.engine.config import EngineMode
from pdserve.engine.contract import RequestPhase
from pdserve.engine.sampling_params import SamplingParams
from pdserve.worker.base import WorkerObserver

pytestmark = pytest.mark.timeout(120)


class Recorder(WorkerObserver):
    def __init__(self) -> None:
        self.gaps: list[float] = []
        self.finished: list[RequestPhase] = []

    def itl_gaps(self, gaps_s: list[float]) -> None:
        self.gaps += gaps_s

    def request_finished(self, phase: RequestPhase) -> None:
        self.finished.append(phase)


class Broken(WorkerObserver):
    def itl_gaps(self, gaps_s: list[float]) -> None:
        raise RuntimeError("observer bug")

    def request_finished(self, phase: RequestPhase) -> None:
        raise RuntimeError("observer bug")


def run_to_end(worker: DecodeWorker, request_id: str, max_tokens: int) -> list[int]:
    worker.generate_local(request_id, list(range(5, 25)), SamplingParams(max_tokens=max_tokens, temperature=0.0))
    tokens: list[int] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for out in worker.take_outputs(0.2):
            tokens += out.new_token_ids
            if out.finished:
                assert out.finish_reason == "length", out
                return tokens
    raise TimeoutError(f"{request_id} did not finish")


def test_decode_worker_reports_gaps_and_finished_requests(tiny_model) -> None:
    worker = DecodeWorker("d-observed", engine_config(tiny_model, mode=EngineMode.DECODE))
    try:
        recorder = Recorder()
        worker.observer = recorder
        tokens = run_to_end(worker, "r1", 8)
        assert len(tokens) == 8
        assert len(recorder.gaps) >= 6 and all(g >= 0 for g in recorder.gaps)
        assert [(p.output_tokens, p.finish_reason) for p in recorder.finished] == [(8, "length")]
        worker.observer = Broken()   # an observer that raises is logged; the request is unharmed
        assert run_to_end(worker, "r2", 8) == tokens
        assert worker.blocks_in_use() == 0
    finally:
        worker.shutdown()

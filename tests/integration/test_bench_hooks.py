"""The benchmarks' hooks into the engine still reach what they time (a hook that misses makes a
benchmark print nothing or divide by zero, and no other test runs the benchmarks)."""

from __future__ import annotations

import pytest

from pdserve.bench.engine import EngineDecode
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine

pytestmark = pytest.mark.slow


def test_bench_engine_times_the_model_runner_inside_each_step(tiny_model) -> None:
    engine = LLMEngine(EngineConfig(model_dir=str(tiny_model), num_blocks=128, warm_up=False))
    decode = EngineDecode(engine, [[5, 6, 7, 8], [9, 10, 11, 12]], max_steps=4)
    try:
        for _ in range(3):
            step_s, runner_s = decode.step()
            assert 0.0 < runner_s <= step_s
    finally:
        decode.close()
    assert "execute_scored" not in vars(engine.runner)   # the hook is gone again

"""Shared check of a matmul backend: an engine forced onto it decodes the same greedy tokens."""

from __future__ import annotations

from pathlib import Path


def forced_backend_greedy_tokens(model_dir: Path, backend: str) -> list[list[int]]:
    """Greedy tokens of two fixed prompts from an engine whose every matmul call is ``backend``
    (asserted), float32, 12 tokens each, EOS ignored."""
    from pdserve.engine import kernel_select as ks
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model_dir=str(model_dir), dtype="float32", num_blocks=16,
                                    linear_backend=backend))
    assert engine.runner.kernels.source == "forced"
    assert engine.runner.describe()["kernels"] == dict.fromkeys(ks.OPS, backend)
    out = engine.generate([[5, 9, 13, 2, 77, 31], [101, 4, 8]],
                          SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert all(len(t) == 12 for t in out)
    return out

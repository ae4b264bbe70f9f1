"""``dtype: auto``: bf16 only where the CPU computes it natively (a measured probe), CUDA bf16."""

from __future__ import annotations

import pytest

from pdserve.engine import dtype_probe
from pdserve.engine.config import EngineConfig


def test_explicit_dtypes_pass_through_and_cuda_picks_bf16():
    assert dtype_probe.resolve_dtype("float32") == "float32"
    assert dtype_probe.resolve_dtype("bfloat16") == "bfloat16"
    assert dtype_probe.resolve_dtype("auto", "cuda") == "bfloat16"
    with pytest.raises(ValueError, match="auto"):
        dtype_probe.resolve_dtype("float16")


@pytest.mark.parametrize(("fp32_s", "bf16_s", "err", "native"), [
    (2.0, 1.0, 0.003, True),      # 2x: native bf16 dot products
    (1.0, 1.0, 0.003, False),     # no faster: emulated
    (1.0, 3.0, 0.003, False),     # slower: emulated through float32
    (2.0, 1.0, 0.5, False),       # fast but wrong: never trusted
])
def test_probe_decides_by_measured_speed_and_agreement(monkeypatch, fp32_s, bf16_s, err, native):
    monkeypatch.setattr(dtype_probe, "_bf16_instructions", lambda: True)
    monkeypatch.setattr(dtype_probe, "_time_matmuls", lambda: (fp32_s, bf16_s, err))
    got, why = dtype_probe.probe_cpu_bf16()
    assert got is native and "x float32" in why


def test_one_slow_float32_round_does_not_make_emulated_bf16_native(monkeypatch):
    """The median of the rounds decides: one noisy round (here 1.8x) is outvoted."""
    rounds = iter([(1.8, 1.0, 0.003)] + [(1.0, 4.0, 0.003)] * (dtype_probe._ROUNDS - 1))
    monkeypatch.setattr(dtype_probe, "_bf16_instructions", lambda: True)
    monkeypatch.setattr(dtype_probe, "_time_matmuls", lambda: next(rounds))
    assert dtype_probe.probe_cpu_bf16()[0] is False


def test_no_bf16_instruction_means_float32_without_timing(monkeypatch):
    monkeypatch.setattr(dtype_probe, "_bf16_instructions", lambda: False)
    monkeypatch.setattr(dtype_probe, "_time_matmuls", lambda: (2.0, 1.0, 0.003))   # would say native
    native, why = dtype_probe.probe_cpu_bf16()
    assert native is False and "AVX512-BF16" in why


def test_the_instruction_probe_agrees_with_the_cpu_flags():
    """On Linux, /proc/cpuinfo's flags say what CPUID says: the probe must not contradict them."""
    from pathlib import Path

    flags = next((ln.split(":", 1)[1].split() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                  if ln.startswith("flags")), None)
    isa = dtype_probe._bf16_instructions()
    if flags is None or isa is None:
        pytest.skip("no /proc/cpuinfo flags, or a torch without the CPUID probes")
    assert isa == bool({"avx512_bf16", "amx_tile", "amx_bf16"} & set(flags))


def test_probe_refuses_bf16_when_onednn_reports_no_support(monkeypatch):
    import torch

    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False, raising=False)
    assert dtype_probe.probe_cpu_bf16() == (False, "oneDNN reports no bf16 support on this CPU")


def test_real_probe_runs_and_auto_is_the_default(tiny_model):
    native, why = dtype_probe.probe_cpu_bf16()
    assert isinstance(native, bool) and why
    assert EngineConfig(model_dir="m").dtype == "auto"
    from pdserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model_dir=str(tiny_model), num_blocks=4, linear_backend="dense"))
    assert engine.config.dtype == engine.runner.describe()["dtype"] in ("float32", "bfloat16")

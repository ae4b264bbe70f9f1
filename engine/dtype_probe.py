"""``dtype: auto``: bfloat16 where this machine computes it natively, float32 otherwise.

Detected by probing, never by CPU name:
1. CUDA devices compute bf16 natively: ``bfloat16``.
2. On CPU, oneDNN must report bf16 support (``torch.ops.mkldnn._is_mkldnn_bf16_supported``);
   without it a bf16 matmul is emulated.
3. The CPU must have a bf16 dot-product instruction, as CPUID reports it to torch
   (``torch.cpu._is_avx512_bf16_supported`` or ``_is_amx_tile_supported``; a torch without these
   probes skips this step). oneDNN reports "support" on any AVX-512 CPU, where it emulates bf16.
4. A bf16 matmul on a prefill-sized shape must agree with the float32 one and run at least
   ``NATIVE_SPEEDUP`` times as fast, by the median of ``_ROUNDS`` rounds that time the two in
   turn: native bf16 (AVX512-BF16, AMX) doubles the multiply throughput or better, while emulation
   (convert, then float32 FMA) is slower than float32. One round alone was not enough: on a
   shared host a slow moment during the float32 timing once made emulated bf16 read 1.8x faster.

The verdict is cached per process (it costs ~0.1 s once).
"""

from __future__ import annotations

import functools
import logging
import time

logger = logging.getLogger(__name__)

NATIVE_SPEEDUP = 1.25     # bf16 over float32 GEMM throughput that only native bf16 reaches
_PROBE_SHAPE = (256, 512, 512)
_REPEATS = 5
_ROUNDS = 5


@functools.cache
def resolve_dtype(requested: str, device: str = "cpu") -> str:
    """``requested`` itself for "float32"/"bfloat16"; for "auto" the probe's verdict (logged)."""
    if requested in ("float32", "bfloat16"):
        return requested
    if requested != "auto":
        raise ValueError(f"dtype must be 'auto', 'float32' or 'bfloat16', got {requested!r}")
    if device == "cuda":
        logger.info("dtype auto: bfloat16 (CUDA)")
        return "bfloat16"
    native, why = probe_cpu_bf16()
    chosen = "bfloat16" if native else "float32"
    logger.info("dtype auto: %s (%s)", chosen, why)
    return chosen


def probe_cpu_bf16() -> tuple[bool, str]:
    """Whether this CPU computes bf16 matmuls natively, and the measurement that says so."""
    import torch

    try:
        supported = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError) as exc:
        return False, f"oneDNN bf16 check unavailable: {exc}"
    if not supported:
        return False, "oneDNN reports no bf16 support on this CPU"
    if (isa := _bf16_instructions()) is not None and not isa:
        return False, "CPUID reports no AVX512-BF16 or AMX: oneDNN would emulate bf16"
    rounds = [_time_matmuls() for _ in range(_ROUNDS)]
    speedup = sorted(fp32 / bf16 for fp32, bf16, _ in rounds)[len(rounds) // 2]
    err = max(e for _, _, e in rounds)
    why = f"bf16 matmul {speedup:.2f}x float32 (native needs >= {NATIVE_SPEEDUP}x), rel. error {err:.3f}"
    return speedup >= NATIVE_SPEEDUP and err <= 0.02, why


def _bf16_instructions() -> bool | None:
    """Whether CPUID reports a bf16 dot-product instruction (AVX512-BF16 or AMX), or None when
    this torch cannot tell."""
    import torch

    probes = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    if not all(callable(p) for p in probes):
        return None
    try:
        return any(bool(p()) for p in probes)
    except RuntimeError:
        return None


def _time_matmuls() -> tuple[float, float, float]:
    """Best-of-``_REPEATS`` seconds of one float32 and one bf16 matmul, and the bf16 result's
    error relative to the float32 one."""
    import torch

    m, k, n = _PROBE_SHAPE
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen)
    ab, bb = a.bfloat16(), b.bfloat16()
    best = {}
    for name, x, y in (("fp32", a, b), ("bf16", ab, bb)):
        torch.mm(x, y)  # warm-up: oneDNN/MKL plan the shape once
        times = []
        for _ in range(_REPEATS):
            t0 = time.perf_counter()
            torch.mm(x, y)
            times.append(time.perf_counter() - t0)
        best[name] = min(times)
    ref = torch.mm(ab.float(), bb.float())
    err = float((torch.mm(ab, bb).float() - ref).abs().max() / ref.abs().max())
    return best["fp32"], best["bf16"], err

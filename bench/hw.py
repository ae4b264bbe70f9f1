"""Hardware microbenchmarks that set the rooflines of the engine benchmark.

* Copy bandwidth: ``dst.copy_(src)`` over a buffer far larger than the last-level cache, best of
  N, counted STREAM-style as bytes read + bytes written. Decode at batch 1 streams every weight
  once per token, so ``bandwidth / weight bytes`` is its ceiling.
* Read bandwidth: ``src.sum()`` over the same buffer (bytes read only), reported alongside.
* Matmul throughput: ``a @ b`` for square matrices, best of N, ``2 n^3`` FLOPs per product.
  Prefill is a chain of large matmuls, so this is its ceiling.

All functions use torch's current intra-op thread count (set it before calling).
"""

from __future__ import annotations

import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, slots=True)
class HardwareFigures:
    copy_gbs: float           # (read + write) bytes / s of a large copy, best of N, in GB/s (1e9)
    read_gbs: float           # bytes read / s of a large reduction, best of N, in GB/s
    buffer_bytes: int         # size of the source buffer
    matmul_gflops: dict[str, float]  # dtype -> GFLOP/s of an n x n @ n x n product
    matmul_n: int

    def to_dict(self) -> dict:
        return asdict(self)


def _best(fn, repeats: int) -> float:
    """Smallest wall time of ``repeats`` calls of ``fn`` (after one untimed warm-up call)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def copy_bandwidth(buffer_bytes: int = 1 << 30, repeats: int = 5) -> tuple[float, float]:
    """(copy GB/s counting read + write, read-only GB/s) over a float32 buffer of ``buffer_bytes``."""
    if buffer_bytes < 1 << 20:
        raise ValueError(f"buffer_bytes must be at least 1 MiB, got {buffer_bytes}")
    n = buffer_bytes // 4
    src = torch.ones(n, dtype=torch.float32)
    dst = torch.empty_like(src)
    t_copy = _best(lambda: dst.copy_(src), repeats)
    t_read = _best(src.sum, repeats)
    nbytes = n * 4
    return 2 * nbytes / t_copy / 1e9, nbytes / t_read / 1e9


def matmul_gflops(n: int = 2048, dtype: str = "float32", repeats: int = 5) -> float:
    """GFLOP/s of ``[n, n] @ [n, n]`` in ``dtype`` (best of ``repeats``)."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(_DTYPES[dtype])
    b = torch.randn(n, n, generator=gen).to(_DTYPES[dtype])
    out = torch.empty(n, n, dtype=_DTYPES[dtype])
    with torch.inference_mode():
        t = _best(lambda: torch.mm(a, b, out=out), repeats)
    return 2 * n**3 / t / 1e9


def measure(dtypes: list[str], *, buffer_bytes: int = 1 << 30, matmul_n: int = 2048,
            repeats: int = 5) -> HardwareFigures:
    copy_gbs, read_gbs = copy_bandwidth(buffer_bytes, repeats)
    gflops = {"float32": matmul_gflops(matmul_n, "float32", repeats),
              "bfloat16": matmul_gflops(matmul_n, "bfloat16", repeats)}
    for d in dtypes:
        if d not in gflops:
            gflops[d] = matmul_gflops(matmul_n, d, repeats)
    return HardwareFigures(copy_gbs, read_gbs, buffer_bytes, gflops, matmul_n)


def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo, else ``platform.processor()``."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"

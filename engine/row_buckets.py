"""Row counts a step's matmuls run at: a few fixed sizes instead of every count a batch can have.

oneDNN (the bf16 matmuls on CPU, and the float32 ``packed`` backend) builds a kernel for each new
shape it meets and keeps the last ~1,000 it built. Building one takes 1-3 ms against 0.1-0.3 ms to
run it at these sizes (Intel Xeon with AMX, bf16, 2 threads, 2026-12-05): a step at a row count
never seen before ran x1.33 its repeats (six kernels per step: the layer's four matmuls, the
output projection, and the fused epilogues), and a server whose batches and prompts mix freely
keeps meeting new counts, or cycles through more than the cache holds. float32 through MKL builds
nothing per shape (a first call x0.99 of its repeats).

``row_bucket(n)`` rounds a row count up so each power-of-two range holds at most eight sizes:
up to ``EXACT_ROWS`` rows exactly (decode batches: there a few padded rows would cost as much as
the rows themselves), then steps of 1/8 of the range (33-64 rows in steps of 4, 65-128 in 8,
129-256 in 16, ...). The padding is at most 1/8 of the rows (mean ~1/16): 2048 tokens of prompt
fit 80 sizes, whose kernels ``ModelRunner.warm_up`` builds before the first request.
"""

from __future__ import annotations

EXACT_ROWS = 32
STEPS_PER_OCTAVE = 8


def row_bucket(n: int) -> int:
    """The row count a step of ``n`` rows runs its matmuls at (``n`` <= result <= ``n * 9 / 8``)."""
    if n < 1:
        raise ValueError(f"row_bucket: n must be >= 1, got {n}")
    if n <= EXACT_ROWS:
        return n
    step = max(1, (1 << ((n - 1).bit_length() - 1)) // STEPS_PER_OCTAVE)
    return -(-n // step) * step


def buckets_up_to(n: int) -> list[int]:
    """Every row count ``row_bucket`` gives for 1..``n`` rows, ascending (the last covers ``n``)."""
    if n < 1:
        raise ValueError(f"buckets_up_to: n must be >= 1, got {n}")
    out: list[int] = []
    m = 1
    while m <= n:
        b = row_bucket(m)
        out.append(b)
        m = b + 1
    return out

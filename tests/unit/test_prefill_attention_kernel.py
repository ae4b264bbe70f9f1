"""The C++ paged prefill attention (causal, reads context and chunk in place) against the SDPA path.

Both backends get the same random cache, block tables and fused qkv rows of one step (decode rows
first, then prefill chunks); each writes the step's K/V and attends. Covered: fresh prompts and
chunks over a cached context (start > 0), chunk lengths on and off the kernel's 16-query tile and
the key vector width, block sizes 4/8/16, grouped-query attention (group 1, 3, 4), a head_dim that
is no multiple of the vector width, shuffled non-contiguous block tables, float32 (tight) and
bfloat16 (looser: SDPA rounds probabilities to bfloat16, the kernel keeps float32).
"""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine.attention import PagedKVCache


@pytest.fixture(scope="module", autouse=True)
def kernel(native_kernels):
    """Every test here needs the native library (skipped only where no compiler could build it)."""


def _case(dtype: torch.dtype, kv_heads: int, group: int, chunks: list[tuple[int, int]], *, decodes: int = 0,
          block_size: int = 8, head_dim: int = 64, layers: int = 2, seed: int = 0):
    """``chunks``: (start, num_tokens) of each prefill item. Returns (native, sdpa) outputs and caches."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    dec_pos = [rng.randrange(1, 40) for _ in range(decodes)]
    need = [-(-(p + 1) // block_size) for p in dec_pos] + [-(-(s + n) // block_size) for s, n in chunks]
    num_blocks = sum(need) + 3
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables = [[ids.pop() for _ in range(k)] for k in need]
    cache = torch.randn(num_blocks, layers, 2, block_size, kv_heads, head_dim, generator=g).mul(2).to(dtype)
    heads = kv_heads * group
    tokens = decodes + sum(n for _, n in chunks)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).mul(2).to(dtype)
    positions = torch.tensor(dec_pos + [p for s, n in chunks for p in range(s, s + n)])
    out = {}
    for backend in ("native", "sdpa"):
        c = PagedKVCache(cache.clone(), heads, backend)
        plan = c.plan(list(zip(dec_pos, tables[:decodes])),
                      [(s, n, t) for (s, n), t in zip(chunks, tables[decodes:])], positions)
        if backend == "native":
            assert plan.native_prefill
        out[backend] = (plan.attend(layers - 1, qkv.clone()), c.kv_cache)
    return out["native"][0], out["sdpa"][0], out["native"][1], out["sdpa"][1]


CHUNKS = [(0, 1), (0, 16), (0, 17), (0, 45), (5, 3), (16, 16), (31, 40), (64, 1)]


@pytest.mark.parametrize("kv_heads,group", [(1, 1), (3, 3), (2, 4)])
@pytest.mark.parametrize("block_size", [4, 8, 16])
def test_float32_matches_sdpa(kv_heads: int, group: int, block_size: int) -> None:
    got, want, cache_n, cache_s = _case(torch.float32, kv_heads, group, CHUNKS, block_size=block_size)
    assert torch.equal(cache_n, cache_s)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


def test_decode_rows_then_chunks_in_one_step() -> None:
    got, want, _, _ = _case(torch.float32, 3, 3, [(0, 20), (12, 9)], decodes=5)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


def test_head_dim_off_the_vector_width() -> None:
    got, want, _, _ = _case(torch.float32, 2, 3, [(0, 19), (7, 30)], head_dim=40)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


def test_one_long_prompt() -> None:
    got, want, _, _ = _case(torch.float32, 3, 3, [(0, 300)], block_size=16, seed=3)
    torch.testing.assert_close(got, want, rtol=5e-5, atol=5e-5)


def test_bfloat16_close_to_sdpa() -> None:
    got, want, _, _ = _case(torch.bfloat16, 3, 3, CHUNKS, block_size=16, seed=1)
    ref, _, _, _ = _case(torch.float32, 3, 3, CHUNKS, block_size=16, seed=1)
    # the kernel keeps probabilities in float32: it is at least as close to float32 as SDPA is
    err_kernel = (got.float() - ref).abs().max()
    err_sdpa = (want.float() - ref).abs().max()
    assert err_kernel <= err_sdpa * 1.5 + 1e-2, (err_kernel, err_sdpa)
    torch.testing.assert_close(got.float(), want.float(), rtol=0.05, atol=0.06)


@pytest.mark.parametrize("head_dim", [40, 33])
def test_bfloat16_other_head_dims(head_dim: int) -> None:
    """bf16 scores take two dimensions at a time where the CPU has AVX512-BF16 (an even head_dim,
    here with a scale that is not a power of two), the FMA path otherwise (odd): both stay as close
    to the float32 result as SDPA is."""
    chunks = [(0, 19), (7, 30)]
    got, want, _, _ = _case(torch.bfloat16, 2, 3, chunks, head_dim=head_dim, seed=2)
    ref, _, _, _ = _case(torch.float32, 2, 3, chunks, head_dim=head_dim, seed=2)
    err_kernel = (got.float() - ref).abs().max()
    err_sdpa = (want.float() - ref).abs().max()
    assert err_kernel <= err_sdpa * 1.5 + 1e-2, (err_kernel, err_sdpa)


def test_kernel_rejects_bad_inputs() -> None:
    cache = torch.zeros(4, 1, 2, 8, 1, 16)
    q = torch.zeros(5, 16)
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    op = torch.ops.pdserve.paged_prefill_attention
    with pytest.raises(RuntimeError, match="block id out of range"):
        op(q, cache, 0, i32([[9]]), i32([0]), i32([5]), i32([0]), 0.25)
    with pytest.raises(RuntimeError, match="chunk rows outside q"):
        op(q, cache, 0, i32([[0]]), i32([0]), i32([5]), i32([1]), 0.25)
    with pytest.raises(RuntimeError, match="outside its block table"):
        op(q, cache, 0, i32([[0]]), i32([4]), i32([5]), i32([0]), 0.25)

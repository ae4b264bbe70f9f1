"""The C++ paged decode attention (reads K/V in place through block tables) against the SDPA path.

Both backends get the same random cache, block tables and fused qkv rows; each writes the step's
new K/V and attends. Covered: grouped-query attention (group 1, 3, 4), ragged context lengths,
lengths on and next to block boundaries, shuffled non-contiguous tables, float32 (tight) and
bfloat16 (looser: the SDPA path rounds probabilities to bfloat16, the kernel keeps float32).
"""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine.attention import PagedKVCache
from pdserve.engine.kernels import load

BS = 8


@pytest.fixture(scope="module", autouse=True)
def kernel(native_kernels):
    """Every test here needs the native library (skipped only where no compiler could build it)."""


def _run(backend: str, cache: torch.Tensor, heads: int, positions: list[int], tables: list[list[int]],
         qkv: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    c = PagedKVCache(cache.clone(), heads, backend)
    assert c.backend == backend
    plan = c.plan(list(zip(positions, tables)), [], torch.tensor(positions))
    return plan.attend(layer, qkv.clone()), c.kv_cache


def _case(dtype: torch.dtype, kv_heads: int, group: int, positions: list[int], head_dim: int = 64,
          layers: int = 3, seed: int = 0,
          block_size: int = BS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    need = [-(-(p + 1) // block_size) for p in positions]
    num_blocks = sum(need) + 5
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables = [[ids.pop() for _ in range(n + rng.randrange(2))] for n in need]  # some tables longer than needed
    cache = torch.randn(num_blocks, layers, 2, block_size, kv_heads, head_dim, generator=g).mul(2).to(dtype)
    heads = kv_heads * group
    qkv = torch.randn(len(positions), (heads + 2 * kv_heads) * head_dim, generator=g).mul(2).to(dtype)
    outs = {}
    for backend in ("native", "sdpa"):
        outs[backend] = _run(backend, cache, heads, positions, tables, qkv, layer=layers - 1)
    return outs["native"][0], outs["sdpa"][0], outs["native"][1], outs["sdpa"][1]


# context lengths (position + 1): 1, block boundaries 8/16/64, one past them, ragged in between
POSITIONS = [0, 7, 8, 15, 16, 63, 64, 100, 3]


@pytest.mark.parametrize("kv_heads,group", [(1, 1), (2, 3), (3, 4), (4, 1)])
def test_float32_matches_sdpa(kv_heads: int, group: int) -> None:
    got, want, cache_n, cache_s = _case(torch.float32, kv_heads, group, POSITIONS)
    assert torch.equal(cache_n, cache_s)  # both wrote the same new K/V
    assert got.shape == want.shape == (len(POSITIONS), kv_heads * group * 64)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_heads,group", [(2, 3), (3, 3)])
def test_bfloat16_matches_sdpa(kv_heads: int, group: int) -> None:
    got, want, _, _ = _case(torch.bfloat16, kv_heads, group, POSITIONS)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_size_not_a_multiple_of_four(dtype: torch.dtype) -> None:
    """The fast path reduces rows four at a time within a block; the rest of a block (and of a short
    last block) takes the one-row path. Batch 8 and 1 exercise both task shapes."""
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for positions in ([4, 5, 6, 9, 30, 31, 44, 0], [57]):
        got, want, _, _ = _case(dtype, 3, 3, positions, block_size=6, seed=5)
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_single_sequence_long_context_odd_head_dim() -> None:
    """Batch 1 (one task per kv head), a context over many blocks, head_dim not a multiple of 16."""
    got, want, _, _ = _case(torch.float32, 2, 2, [299], head_dim=40, seed=3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_kernel_checks_block_ids() -> None:
    cache = torch.zeros(4, 1, 2, BS, 1, 16)
    q = torch.zeros(1, 16)
    with pytest.raises(RuntimeError, match="block id out of range"):
        torch.ops.pdserve.paged_decode_attention(q, cache, 0, torch.tensor([[9]], dtype=torch.int32),
                                                 torch.tensor([3], dtype=torch.int32), 0.25)
    with pytest.raises(RuntimeError, match="context length"):
        torch.ops.pdserve.paged_decode_attention(q, cache, 0, torch.tensor([[1]], dtype=torch.int32),
                                                 torch.tensor([BS + 1], dtype=torch.int32), 0.25)


def test_backend_choice() -> None:
    cache = torch.zeros(4, 1, 2, BS, 1, 16)
    assert PagedKVCache(cache, 2, "auto").backend == "native"
    assert PagedKVCache(cache, 2, "sdpa").backend == "sdpa"
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        PagedKVCache(cache, 2, "flash")
    with pytest.raises(ValueError, match="float16"):
        PagedKVCache(cache.half(), 2, "native")


def test_missing_library_falls_back(tmp_path, monkeypatch, caplog) -> None:
    """A host where the library was never built: auto falls back with a log line, native refuses."""
    monkeypatch.setenv("PDSERVE_KERNEL_DIR", str(tmp_path / "empty"))
    load.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="pdserve.engine.kernels"):
            assert PagedKVCache(torch.zeros(4, 1, 2, BS, 1, 16), 2, "auto").backend == "sdpa"
        assert "not built" in caplog.text
        with pytest.raises(ValueError, match="not built"):
            PagedKVCache(torch.zeros(4, 1, 2, BS, 1, 16), 2, "native")
    finally:
        monkeypatch.undo()
        load.cache_clear()
        assert load().available

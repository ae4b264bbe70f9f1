"""``torch.ops.pdserve.rope_`` (used by ``engine.layers.apply_rope_``) against the rotate-half form
Hugging Face's Llama computes, on the real layout: the query and key columns of a fused qkv row."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.layers import apply_rope_


@pytest.fixture(scope="module", autouse=True)
def kernel(native_kernels):
    """Every test here needs the native library (skipped only where no compiler could build it)."""


def _reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _tables(tokens: int, dim: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    angles = torch.rand(tokens, 1, dim // 2, generator=g) * 50
    emb = torch.cat([angles, angles], dim=-1)
    signed = emb.sin()
    signed[..., : dim // 2].neg_()          # RotaryTables' signed sine
    return emb.cos(), emb.sin(), signed


@pytest.mark.parametrize("tokens,heads,dim", [(1, 12, 64), (37, 5, 64), (9, 3, 40), (300, 2, 128)])
def test_float32_matches_rotate_half(tokens: int, heads: int, dim: int) -> None:
    g = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (heads + 3) * dim, generator=g)    # extra columns: the V part
    cos, sin, signed = _tables(tokens, dim, g)
    qk = qkv[:, : heads * dim].view(tokens, heads, dim)
    want = _reference(qk.clone(), cos, sin)
    v_before = qkv[:, heads * dim :].clone()
    apply_rope_(qk, cos, signed)
    torch.testing.assert_close(qk, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(qkv[:, heads * dim :], v_before)           # the rest of the row is untouched


def test_bfloat16_within_one_rounding() -> None:
    g = torch.Generator().manual_seed(7)
    tokens, heads, dim = 64, 12, 64
    qkv = torch.randn(tokens, (heads + 3) * dim, generator=g).bfloat16()
    cos, sin, signed = _tables(tokens, dim, g)
    qk = qkv[:, : heads * dim].view(tokens, heads, dim)
    want = _reference(qk.float(), cos.bfloat16().float(), sin.bfloat16().float())
    apply_rope_(qk, cos.bfloat16(), signed.bfloat16())
    ulp = 2.0 ** (torch.floor(torch.log2(want.abs().clamp_min(1e-30))) - 7)
    assert bool(((qk.float() - want).abs() <= ulp).all())


def test_kernel_rejects_a_layout_it_cannot_rotate() -> None:
    with pytest.raises(RuntimeError, match="head_dim must be even"):
        torch.ops.pdserve.rope_(torch.zeros(2, 3, 5), torch.zeros(2, 1, 5), torch.zeros(2, 1, 5))
    with pytest.raises(RuntimeError, match="cos and sin"):
        torch.ops.pdserve.rope_(torch.zeros(2, 3, 8), torch.zeros(3, 1, 8), torch.zeros(2, 1, 8))

"""RoPE tables grow on demand without changing any value."""

from __future__ import annotations

import torch

from pdserve.engine.layers import RotaryTables, apply_rope_
from pdserve.engine.loader import load_model_spec
from pdserve.engine.testmodel import ensure_model


def test_tables_grow_to_the_same_values():
    spec = load_model_spec(ensure_model("tiny"))
    small = RotaryTables(spec, spec.max_position_embeddings, torch.float32, "cpu", initial=8)
    big = RotaryTables(spec, spec.max_position_embeddings, torch.float32, "cpu")
    pos = torch.tensor([0, 7, 8, 300, 1000])
    got, want = small.lookup(pos, 1001), big.lookup(pos, 1001)
    assert small.cos.shape[0] >= 1001
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_rope_matches_rotate_half_form():
    spec = load_model_spec(ensure_model("tiny"))
    tables = RotaryTables(spec, 64, torch.float32, "cpu")
    x = torch.randn(5, 3, spec.head_dim)
    pos = torch.arange(5) * 7
    cos, sin = tables.lookup(pos, 64)
    half = spec.head_dim // 2
    rotate_half = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    inv_freq = 1.0 / spec.rope_theta ** (torch.arange(0, spec.head_dim, 2).float() / spec.head_dim)
    freqs = pos[:, None].float() * inv_freq
    emb = torch.cat([freqs, freqs], -1)[:, None, :]
    want = x * emb.cos() + rotate_half * emb.sin()
    got = x.clone()
    apply_rope_(got, cos, sin)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

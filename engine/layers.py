"""The per-layer math of a Llama-family decoder: RoPE tables (default, linear, llama3), in-place
rotary embedding, and one decoder layer over a flat batch of tokens.

Everything operates on ``[num_tokens, features]`` activations: tokens of every sequence in a step
are concatenated so each matmul reads its weight once per step.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from pdserve.engine.attention import AttentionPlan
from pdserve.engine.loader import LayerWeights, ModelSpec


def rope_inv_freq(spec: ModelSpec) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` (float32), with the checkpoint's scaling applied."""
    d = spec.head_dim
    inv = 1.0 / (spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = spec.rope_scaling
    if scaling is None:
        return inv
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv / factor
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_ctx = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, blended, scaled)


class RotaryTables:
    """Precomputed ``cos`` and signed ``sin`` per position, ``[max_positions, 1, head_dim]``.

    The signed sine is ``cat(-sin, sin)``, so that rotating by half the head is a flip of the two
    halves: ``x * cos + flip_halves(x) * sin_signed`` equals the usual ``rotate_half`` form.
    """

    def __init__(self, spec: ModelSpec, max_positions: int, dtype: torch.dtype, device: str) -> None:
        inv = rope_inv_freq(spec)
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = pos[:, None] * inv[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        half = spec.head_dim // 2
        sin = emb.sin()
        sin[:, :half].neg_()
        self.cos = emb.cos().to(dtype=dtype, device=device)[:, None, :].contiguous()
        self.sin = sin.to(dtype=dtype, device=device)[:, None, :].contiguous()
        self.max_positions = max_positions

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos.index_select(0, positions), self.sin.index_select(0, positions)


def apply_rope_(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate ``qk`` ``[T, heads, head_dim]`` in place (a view into the fused qkv output)."""
    t, n, d = qk.shape
    flipped = qk.view(t, n, 2, d // 2).flip(2).view(t, n, d)
    qk.mul_(cos).addcmul_(flipped, sin)


class DecoderLayer:
    """One transformer block; attention over the paged cache is delegated to ``attend``."""

    __slots__ = ("w", "eps", "hidden", "q_width", "qk_heads", "head_dim", "inter")

    def __init__(self, w: LayerWeights, spec: ModelSpec) -> None:
        self.w = w
        self.eps = spec.rms_norm_eps
        self.hidden = (spec.hidden_size,)
        self.q_width = spec.num_heads * spec.head_dim
        self.qk_heads = spec.num_heads + spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.inter = spec.intermediate_size

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: AttentionPlan,
                index: int) -> torch.Tensor:
        """``x`` is the residual stream ``[T, hidden]``; ``plan.attend`` writes this layer's K/V
        into the paged cache and attends. Returns the new residual stream."""
        w = self.w
        h = F.rms_norm(x, self.hidden, w.input_norm, self.eps)
        qkv = F.linear(h, w.qkv, w.qkv_bias)
        t = qkv.shape[0]
        qk = qkv[:, : self.qk_heads * self.head_dim].view(t, self.qk_heads, self.head_dim)
        apply_rope_(qk, cos, sin)
        attn = plan.attend(index, qkv)
        if w.o_bias is None:
            x = torch.addmm(x, attn, w.o.t())
        else:
            x = x + F.linear(attn, w.o, w.o_bias)
        h = F.rms_norm(x, self.hidden, w.post_norm, self.eps)
        gu = F.linear(h, w.gate_up)
        act = F.silu(gu[:, : self.inter]) * gu[:, self.inter :]
        return torch.addmm(x, act, w.down.t())

"""The per-layer math of a Llama-family decoder: RoPE tables (default, linear, llama3), in-place
rotary embedding, and one decoder layer over a flat batch of tokens.

Everything operates on ``[num_tokens, features]`` activations: tokens of every sequence in a step
are concatenated so each matmul reads its weight once per step.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from pdserve.engine.attention import AttentionPlan
from pdserve.engine.attention_packed import PackedPlan
from pdserve.engine.kv_index import HOST
from pdserve.engine.linear import make_layer_linear
from pdserve.engine.loader import LayerWeights, ModelSpec


def rope_inv_freq(spec: ModelSpec) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` (float32), with the checkpoint's scaling applied."""
    d = spec.head_dim
    inv = 1.0 / (spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=HOST).float() / d))
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
    """Precomputed ``cos`` and signed ``sin`` per position, ``[positions, 1, head_dim]``.

    The signed sine is ``cat(-sin, sin)``, so that rotating by half the head is a flip of the two
    halves: ``x * cos + flip_halves(x) * sin_signed`` equals the usual ``rotate_half`` form. Tables
    grow on demand (doubling) up to ``max_positions``, so a 128k-context config costs nothing
    until long sequences arrive.
    """

    def __init__(self, spec: ModelSpec, max_positions: int, dtype: torch.dtype, device: str | torch.device,
                 initial: int = 4096) -> None:
        self.inv_freq = rope_inv_freq(spec)
        self.half = spec.head_dim // 2
        self.dtype, self.device = dtype, device
        self.max_positions = max_positions
        self._build(min(initial, max_positions))

    def _build(self, n: int) -> None:
        freqs = torch.arange(n, dtype=torch.float32, device=HOST)[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        sin = emb.sin()
        sin[:, : self.half].neg_()
        self.cos = emb.cos().to(dtype=self.dtype, device=self.device)[:, None, :].contiguous()
        self.sin = sin.to(dtype=self.dtype, device=self.device)[:, None, :].contiguous()

    def lookup(self, positions: torch.Tensor, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin rows ``[T, 1, head_dim]`` for ``positions`` (all < max_position)."""
        if max_position > self.cos.shape[0]:
            self._build(min(self.max_positions, max(max_position, 2 * self.cos.shape[0])))
        return self.cos.index_select(0, positions), self.sin.index_select(0, positions)


@functools.cache
def _native_rms_norm() -> bool:
    """True when ``torch.ops.pdserve.rms_norm`` is loaded (the kernel library ``make setup`` builds)."""
    from pdserve.engine.kernels import load

    return load().available and hasattr(torch.ops.pdserve, "rms_norm")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of the rows of ``x`` ``[T, hidden]`` as Hugging Face's LlamaRMSNorm computes it.

    On CPU in float32/bfloat16 it is the C++ kernel (one pass per row; ``F.rms_norm`` measured
    3-20x slower in bfloat16, most at prefill sizes); elsewhere, or without the kernel library,
    ``F.rms_norm``."""
    if (x.device.type == "cpu" and x.dim() == 2 and x.stride(1) == 1 and x.dtype == weight.dtype
            and x.dtype in (torch.float32, torch.bfloat16) and _native_rms_norm()):
        return torch.ops.pdserve.rms_norm(x, weight, eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


@functools.cache
def _native_rope() -> bool:
    from pdserve.engine.kernels import load

    return load().available and hasattr(torch.ops.pdserve, "rope_")


def apply_rope_(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate ``qk`` ``[T, heads, head_dim]`` in place (a view into the fused qkv output).

    On CPU in float32/bfloat16 it is one pass of the C++ kernel (float32 arithmetic, one
    rounding); elsewhere the flip form below."""
    if (qk.device.type == "cpu" and qk.dtype in (torch.float32, torch.bfloat16) and qk.dtype == cos.dtype
            and qk.stride(2) == 1 and qk.stride(1) == qk.shape[2] and _native_rope()):
        torch.ops.pdserve.rope_(qk, cos, sin)
        return
    t, n, d = qk.shape
    flipped = qk.view(t, n, 2, d // 2).flip(2).view(t, n, d)
    qk.mul_(cos).addcmul_(flipped, sin)


class DecoderLayer:
    """One transformer block; attention over the paged cache is delegated to ``attend``."""

    __slots__ = ("mm", "input_norm", "post_norm", "eps", "qk_heads", "head_dim")

    def __init__(self, w: LayerWeights, spec: ModelSpec, linear: dict[str, str]) -> None:
        """``linear``: the backend of each matmul call (``engine/kernel_select.py``)."""
        self.mm = make_layer_linear(w, linear)
        self.input_norm, self.post_norm = w.input_norm, w.post_norm
        self.eps = spec.rms_norm_eps
        self.qk_heads = spec.num_heads + spec.num_kv_heads
        self.head_dim = spec.head_dim

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: AttentionPlan | PackedPlan,
                index: int, rows: int | None = None) -> torch.Tensor:
        """``x`` is the residual stream ``[M, hidden]``; ``plan.attend`` writes this layer's K/V
        into the paged cache and attends. Returns the new residual stream. ``rows``: the step's
        real tokens, the first ``rows`` of ``x`` (``M - rows`` padding rows go through the matmuls
        and norms only, ``engine/row_buckets.py``); None: all of them."""
        mm = self.mm
        t = x.shape[0] if rows is None else rows
        h = rms_norm(x, self.input_norm, self.eps)
        qkv = mm.qkv(h)
        qk = qkv[:t, : self.qk_heads * self.head_dim].view(t, self.qk_heads, self.head_dim)
        apply_rope_(qk, cos, sin)
        a = plan.attend(index, qkv[:t])
        x = mm.o_add(a if t == x.shape[0] else F.pad(a, (0, 0, 0, x.shape[0] - t)), x)
        return mm.mlp_add(rms_norm(x, self.post_norm, self.eps), x)

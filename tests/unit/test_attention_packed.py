"""The packed attention backends ("flex", "varlen"; engine/attention_packed.py) against the gather +
SDPA plan, on one mixed step: decodes of ragged lengths, a prefill chunk after cached context
(start not block-aligned), and a fresh chunk, with shuffled block tables and grouped queries.

"varlen" runs flash attention, CUDA only: here its packing (offsets, the packed K/V rows) is
checked with a reference kernel of the same contract (per item, causal aligned to the end of the
item's context). "flex" runs eagerly on CPU, itself.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine import attention_packed
from pdserve.engine.attention import PagedKVCache
from pdserve.engine.attention_packed import PackedLayout, PackedPlan, VarlenKernel, packed_kernel

BLOCK, LAYERS, KV_HEADS, GROUP, HEAD_DIM = 8, 2, 2, 3, 16
DECODE_POSITIONS = [0, 7, 8, 20]
PREFILLS = [(13, 6), (0, 5)]   # (start, tokens): one after cached context, one fresh


class ReferenceVarlen:
    """varlen_attn's contract on CPU: item i's queries attend its keys, causal from the end."""

    name = "reference"

    def prepare(self, layout: PackedLayout) -> None:
        return None

    def attend(self, q, k, v, layout, state, scale):
        cu_q, cu_k = layout.cu_q.tolist(), layout.cu_k.tolist()
        outs = []
        for i in range(len(cu_q) - 1):
            qi = q[cu_q[i]:cu_q[i + 1]].transpose(0, 1)
            ki, vi = k[cu_k[i]:cu_k[i + 1]].transpose(0, 1), v[cu_k[i]:cu_k[i + 1]].transpose(0, 1)
            nq, nk = qi.shape[1], ki.shape[1]
            mask = torch.arange(nk, device=q.device)[None, :] <= torch.arange(nk - nq, nk, device=q.device)[:, None]
            outs.append(F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale,
                                                       enable_gqa=True).transpose(0, 1))
        return torch.cat(outs)


def _step(seed: int = 0):
    """A cache with random context, and one step's decodes, prefills, positions and qkv."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    ends = [p + 1 for p in DECODE_POSITIONS] + [s + n for s, n in PREFILLS]
    need = [-(-e // BLOCK) for e in ends]
    ids = list(range(sum(need) + 4))
    rng.shuffle(ids)
    tables = [[ids.pop() for _ in range(n)] for n in need]
    cache = torch.randn(len(ids) + sum(need), LAYERS, 2, BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
    decodes = [(p, t) for p, t in zip(DECODE_POSITIONS, tables)]
    prefills = [(s, n, t) for (s, n), t in zip(PREFILLS, tables[len(DECODE_POSITIONS):])]
    positions = torch.tensor(DECODE_POSITIONS + [p for s, n in PREFILLS for p in range(s, s + n)])
    heads = KV_HEADS * GROUP
    qkv = torch.randn(len(positions), (heads + 2 * KV_HEADS) * HEAD_DIM, generator=gen)
    return cache, decodes, prefills, positions, qkv


def _attend(cache: torch.Tensor, backend: str, step, kernel=None) -> tuple[torch.Tensor, torch.Tensor]:
    _, decodes, prefills, positions, qkv = step
    kv = cache.clone()
    paged = PagedKVCache(kv, KV_HEADS * GROUP, backend)
    plan = (PackedPlan(paged, decodes, prefills, positions, kernel) if kernel is not None
            else paged.plan(decodes, prefills, positions))
    return plan.attend(LAYERS - 1, qkv.clone()), kv


def test_varlen_packing_matches_sdpa():
    step = _step()
    want, cache_s = _attend(step[0], "sdpa", step)
    got, cache_p = _attend(step[0], "sdpa", step, kernel=ReferenceVarlen())
    assert torch.equal(cache_p, cache_s)   # the same new K/V written to the same rows
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_flex_matches_sdpa():
    step = _step(1)
    want, _ = _attend(step[0], "sdpa", step)
    got, _ = _attend(step[0], "flex", step)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_packed_plan_names_its_device():
    """As test_device_hygiene: torch's default device "meta", the cache's "cpu"."""
    step = _step(2)
    want, _ = _attend(step[0], "sdpa", step, kernel=ReferenceVarlen())
    before = torch.get_default_device()
    torch.set_default_device("meta")
    try:
        got, _ = _attend(step[0], "sdpa", step, kernel=ReferenceVarlen())
    finally:
        torch.set_default_device(before)
    assert torch.equal(got, want)


def test_varlen_needs_bf16_on_cuda():
    with pytest.raises(ValueError, match="bfloat16 or float16 KV cache on CUDA"):
        packed_kernel("varlen", torch.zeros(2, 1, 2, BLOCK, 1, HEAD_DIM))
    with pytest.raises(ValueError, match="varlen"):
        PagedKVCache(torch.zeros(2, 1, 2, BLOCK, 1, HEAD_DIM), 1, "varlen")


@pytest.mark.parametrize("signature,expected", [
    ("is_causal", {"is_causal": True}),
    ("window_size", {"window_size": (-1, 0), "enable_gqa": True}),
])
def test_varlen_asks_for_causal_in_this_torchs_terms(monkeypatch, signature, expected):
    """torch 2.9/2.10 spell causal ``is_causal``, later ones ``window_size=(-1, 0)`` (+ ``enable_gqa``)."""
    import torch.nn.attention.varlen as varlen

    seen = {}

    def causal_flag(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, is_causal=False):
        seen.update(scale=scale, is_causal=is_causal)
        return q

    def window(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
        seen.update(scale=scale, window_size=window_size, enable_gqa=enable_gqa)
        return q

    monkeypatch.setattr(varlen, "varlen_attn", causal_flag if signature == "is_causal" else window)
    kernel = VarlenKernel()
    q = torch.zeros(3, 2, 4)
    layout = PackedLayout(*(torch.zeros(2, dtype=torch.int32),) * 2, 3, 3, *(torch.zeros(3),) * 4)
    assert kernel.attend(q, q, q, layout, None, 0.5) is q
    assert seen == {"scale": 0.5, **expected}


def test_unknown_packed_backend():
    with pytest.raises(ValueError, match="not a packed attention backend"):
        attention_packed.packed_kernel("sdpa", torch.zeros(2, 1, 2, BLOCK, 1, HEAD_DIM))

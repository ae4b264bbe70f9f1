"""Attention over packed contexts: the "flex" and "varlen" attention backends (GPU candidates).

The "sdpa" backend (``engine/attention.py``) gathers each item's blocks, pads every context to the
longest and masks the padding. These two gather each item's context without padding, all items
one after another in one packed ``[total_context, kv_heads, head_dim]`` K and V per layer, and
attend with one call per layer for the whole step, decodes and prefill chunks alike:

* "varlen": ``torch.nn.attention.varlen.varlen_attn`` (flash attention over cumulative sequence
  offsets; CUDA, bfloat16/float16 only). Its causal mask is aligned bottom-right (the last query of
  an item sees its whole context), which is what a chunk that starts at ``start_pos`` needs.
* "flex": ``torch.nn.attention.flex_attention`` with a block mask that lets a query see the keys of
  its own item at positions up to its own (document-causal). Compiled on CUDA (``torch.compile``,
  dynamic shapes, so one compile serves every step); eager elsewhere (it then builds the whole
  score matrix: correct, slow, meant for tests on CPU).

Life of one step on these backends:
1. ``PackedPlan`` works out on the host where each new token's K/V goes (``write_rows``), and the
   cache row of every context position of every item, in item order (decodes first); these and
   the items' offsets (``PackedLayout``) move to the cache's device once.
2. The kernel prepares what it needs once per step (flex: its block mask).
3. ``attend(layer, qkv)``, per layer: writes the layer's new K/V, gathers the packed K and V (one
   ``index_select`` each) and runs the kernel over all rows of the step.

Which backend is fastest is for the GPU to say (``scripts/gpu_check_engine.py`` times each);
``attention_backend: auto`` stays "sdpa" off CPU until a measurement says otherwise.
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from pdserve.engine.kv_index import HOST, pad_tables, write_rows

logger = logging.getLogger(__name__)

PACKED_BACKENDS = ("flex", "varlen")


class PagedCache(Protocol):
    """What a plan reads of ``engine.attention.PagedKVCache``."""

    rows: torch.Tensor            # the cache as [rows, kv_heads * head_dim]
    device: torch.device
    block_size: int
    rows_per_block: int
    layer_kv_rows: torch.Tensor   # [layers, 2] host
    num_kv_heads: int
    head_dim: int
    group: int
    q_width: int
    kv_width: int
    scale: float


@dataclass(frozen=True, slots=True)
class PackedLayout:
    """Where each item's queries and keys lie in the packed rows of one step (device tensors).

    Item ``i``'s queries are rows ``cu_q[i]:cu_q[i+1]`` of the step, its keys rows
    ``cu_k[i]:cu_k[i+1]`` of the packed K/V; ``doc_*`` names each row's item, ``pos_*`` its
    position in the sequence."""

    cu_q: torch.Tensor     # [items + 1] int32
    cu_k: torch.Tensor     # [items + 1] int32
    max_q: int
    max_k: int
    doc_q: torch.Tensor    # [T] int64
    pos_q: torch.Tensor    # [T] int64
    doc_k: torch.Tensor    # [total_context] int64
    pos_k: torch.Tensor    # [total_context] int64


class PackedKernel(Protocol):
    name: str

    def prepare(self, layout: PackedLayout) -> Any:
        """Per-step state (built once, used by every layer)."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: PackedLayout,
               state: Any, scale: float) -> torch.Tensor:
        """``q`` ``[T, heads, D]``, ``k``/``v`` ``[total_context, kv_heads, D]`` -> ``[T, heads, D]``."""


class PackedPlan:
    """Index tensors of one step on a packed backend; ``attend(layer, qkv)`` once per layer."""

    def __init__(self, cache: PagedCache, decodes: list[tuple[int, list[int]]],
                 prefills: list[tuple[int, int, list[int]]], positions: torch.Tensor,
                 kernel: PackedKernel) -> None:
        self.cache = c = cache
        self.kernel, dev = kernel, cache.device
        items = [(p, 1, t) for p, t in decodes] + list(prefills)  # (start, tokens, table), row order
        tables = [t for _, _, t in items]
        self.write = write_rows(tables, [n for _, n, _ in items], positions, c.block_size, c.rows_per_block,
                                c.layer_kv_rows, dev)   # [L, T, 2]
        q_lens = torch.tensor([n for _, n, _ in items], dtype=torch.int64, device=HOST)
        k_lens = torch.tensor([s + n for s, n, _ in items], dtype=torch.int64, device=HOST)
        cu_q, cu_k = _offsets(q_lens), _offsets(k_lens)
        ids = torch.arange(len(items), device=HOST)
        doc_k = torch.repeat_interleave(ids, k_lens)
        pos_k = torch.arange(int(cu_k[-1]), device=HOST) - cu_k[:-1][doc_k]
        blk = pad_tables(tables)[doc_k, pos_k // c.block_size]
        self.kv_base = (blk * c.rows_per_block + pos_k % c.block_size).to(dev)   # K rows of layer 0
        self.layout = PackedLayout(
            cu_q=cu_q.to(device=dev, dtype=torch.int32), cu_k=cu_k.to(device=dev, dtype=torch.int32),
            max_q=int(q_lens.max()), max_k=int(k_lens.max()),
            doc_q=torch.repeat_interleave(ids, q_lens).to(dev), pos_q=positions.to(dev),
            doc_k=doc_k.to(dev), pos_k=pos_k.to(dev))
        self.state = kernel.prepare(self.layout)

    def attend(self, layer: int, qkv: torch.Tensor) -> torch.Tensor:
        """Write this layer's new K/V (already rotated) and return attention output [T, heads*D]."""
        c = self.cache
        t = qkv.shape[0]
        c.rows.index_put_((self.write[layer],), qkv[:, c.q_width :].view(t, 2, c.kv_width))
        k_rows = self.kv_base + layer * 2 * c.block_size
        k = c.rows.index_select(0, k_rows).view(-1, c.num_kv_heads, c.head_dim)
        v = c.rows.index_select(0, k_rows + c.block_size).view(-1, c.num_kv_heads, c.head_dim)
        q = qkv[:, : c.q_width].view(t, c.num_kv_heads * c.group, c.head_dim)
        return self.kernel.attend(q, k, v, self.layout, self.state, c.scale).reshape(t, c.q_width)


def _offsets(lens: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.zeros(1, dtype=lens.dtype, device=HOST), lens.cumsum(0)])


class VarlenKernel:
    """Flash attention over cumulative offsets (``torch.nn.attention.varlen``; CUDA, bf16/fp16)."""

    name = "varlen"

    def __init__(self) -> None:
        from torch.nn.attention.varlen import varlen_attn

        # torch 2.9/2.10 take ``is_causal``; later ones ``window_size=(-1, 0)`` for causal, and
        # ``enable_gqa`` where K/V have fewer heads (flash itself always accepts that).
        params = inspect.signature(varlen_attn).parameters
        if "is_causal" in params:
            self._causal: dict[str, Any] = {"is_causal": True}
        elif "window_size" in params:
            self._causal = {"window_size": (-1, 0)}
        else:
            raise ValueError("this torch's varlen_attn takes neither is_causal nor window_size")
        if "enable_gqa" in params:
            self._causal["enable_gqa"] = True
        self._fn = varlen_attn

    def prepare(self, layout: PackedLayout) -> None:
        return None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: PackedLayout,
               state: Any, scale: float) -> torch.Tensor:
        return self._fn(q, k, v, layout.cu_q, layout.cu_k, layout.max_q, layout.max_k, scale=scale, **self._causal)


class FlexKernel:
    """FlexAttention with a document-causal block mask, compiled on CUDA, eager on CPU."""

    name = "flex"

    def __init__(self, device: torch.device) -> None:
        from torch.nn.attention import flex_attention as fa

        self._create_block_mask = fa.create_block_mask
        self._device = device
        self._fn = _compiled_flex() if device.type == "cuda" else fa.flex_attention

    def prepare(self, layout: PackedLayout) -> Any:
        doc_q, pos_q, doc_k, pos_k = layout.doc_q, layout.pos_q, layout.doc_k, layout.pos_k

        def same_item_causal(b, h, q_idx, kv_idx):  # noqa: ANN001, ARG001  (flex's mask_mod signature)
            return (doc_q[q_idx] == doc_k[kv_idx]) & (pos_k[kv_idx] <= pos_q[q_idx])

        return self._create_block_mask(same_item_causal, None, None, doc_q.shape[0], doc_k.shape[0],
                                       device=self._device)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: PackedLayout,
               state: Any, scale: float) -> torch.Tensor:
        o = self._fn(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                     block_mask=state, scale=scale, enable_gqa=True)
        return o[0].transpose(0, 1)


@functools.cache
def _compiled_flex() -> Any:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True)


def packed_kernel(backend: str, kv_cache: torch.Tensor) -> PackedKernel:
    """The kernel of a packed backend for a cache; ``ValueError`` where it cannot run."""
    if backend == "varlen":
        if kv_cache.device.type != "cuda" or kv_cache.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"attention_backend='varlen' (flash attention) needs a bfloat16 or float16 KV cache "
                             f"on CUDA, this one is {kv_cache.dtype} on {kv_cache.device}")
        try:
            return VarlenKernel()
        except ImportError as exc:
            raise ValueError(f"attention_backend='varlen' needs torch.nn.attention.varlen (torch >= 2.9): {exc}") from exc
    if backend == "flex":
        try:
            return FlexKernel(kv_cache.device)
        except ImportError as exc:
            raise ValueError(f"attention_backend='flex' needs torch.nn.attention.flex_attention: {exc}") from exc
    raise ValueError(f"not a packed attention backend: {backend!r}")

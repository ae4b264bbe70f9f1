"""Paged attention over the block-major KV cache ``[num_blocks, layers, 2, block_size, kv_heads, head_dim]``.

Writes address the cache as rows of ``kv_heads * head_dim`` values (``kv_cache.view(-1, kvh*D)``,
row ``((block * L + layer) * 2 + kv) * block_size + offset``): one ``index_put_`` per layer stores
every new token's K and V. Reads gather whole blocks: for layer ``l`` the K (or V) of one block is a
contiguous ``[block_size, kv_heads, head_dim]`` slab, so ``index_select`` over a block table copies
large contiguous pieces, and the result views as ``[seqs, positions, kv_heads, head_dim]`` without
another copy. A step's plan turns block tables into index tensors once, for all layers.

Rows of the flat token batch are ordered decodes first (one token each, attended together: by the C++
kernel ``torch.ops.pdserve.paged_decode_attention``, which reads K/V in place through the block
tables, or, on the "sdpa" backend, by one SDPA call over gathered blocks, padded to the longest table
and masked), then prefill chunks (one SDPA call each, over
the cached context and the chunk, causal with the mask offset by the chunk's start position).
Grouped-query attention never repeats K/V: queries are viewed as ``[.., kv_heads, group, ..]``.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.engine.attention_packed import PACKED_BACKENDS, PackedPlan, packed_kernel
from pdserve.engine.kv_index import HOST, layer_kv_rows, pad_tables, write_rows

logger = logging.getLogger(__name__)

ATTENTION_BACKENDS = ("auto", "native", "sdpa", *PACKED_BACKENDS)
FRESH_PROBE_TOKENS = 1024     # the fresh prefill chunk timed at start (choose_fresh_prefill)
FRESH_PROBE_MIN_TOKENS = 64   # a cache too small for this keeps the kernel
FRESH_SWITCH_MARGIN = 0.1     # SDPA must be this much faster to be chosen (timing is noisy)
_NO_BLOCKS = torch.empty(0, dtype=torch.int64, device=HOST)


@dataclass(slots=True)
class _Prefill:
    row: int                 # first row of the chunk in the flat token batch
    num_tokens: int
    blocks: torch.Tensor     # [num_blocks_of_context] block ids
    ctx: int                 # gathered positions (block-padded)
    mask: torch.Tensor | None  # [num_tokens * group, ctx] bool, True = may attend; None: fresh chunk
    # the C++ kernel for this one chunk: (table [1, nb], start [1], length [1], row offset [1]) int32
    native: tuple[torch.Tensor, ...] | None = None


class AttentionPlan:
    """Index tensors of one step; ``attend(layer, qkv)`` is called once per layer."""

    def __init__(self, cache: PagedKVCache, decodes: list[tuple[int, list[int]]],
                 prefills: list[tuple[int, int, list[int]]], positions: torch.Tensor) -> None:
        self.cache = c = cache
        dev, bs = c.device, c.block_size
        tables = [t for _, t in decodes] + [t for _, _, t in prefills]
        lens = [1] * len(decodes) + [n for _, n, _ in prefills]
        self.write = write_rows(tables, lens, positions, bs, c.rows_per_block, c.layer_kv_rows, dev)   # [L, T, 2]
        self.num_decodes = b = len(decodes)
        if decodes and c.native:
            nb = -(-max(p + 1 for p, _ in decodes) // bs)
            self.decode_tables = pad_tables([t[:nb] for _, t in decodes], nb).to(torch.int32)
            self.decode_lens = torch.tensor([p + 1 for p, _ in decodes], dtype=torch.int32, device=HOST)
        elif decodes:
            ctx = torch.tensor([p + 1 for p, _ in decodes], device=HOST)
            nb = -(-int(ctx.max()) // bs)
            self.decode_blocks = pad_tables([t[:nb] for _, t in decodes], nb).view(-1).to(dev)
            self.decode_ctx = nb * bs
            self.decode_mask = (torch.arange(nb * bs, device=HOST)[None, :] < ctx[:, None]).view(b, 1, 1, nb * bs).to(dev)
        self.prefills: list[_Prefill] = []
        self.native_prefill = bool(prefills) and c.native_prefill
        # Chunks with nothing cached before them go to SDPA where it measured faster at start
        # (PagedKVCache.fresh_prefill); the others then take the kernel one chunk at a time.
        per_chunk = self.native_prefill and c.fresh_prefill == "sdpa" and any(s == 0 for s, _, _ in prefills)
        if per_chunk:
            self.native_prefill = False
        if self.native_prefill:
            # one kernel call per layer for every chunk: it reads context and chunk in place
            nb = max(-(-(start + n) // bs) for start, n, _ in prefills)
            self.prefill_tables = pad_tables([t[:nb] for _, _, t in prefills], nb).to(torch.int32)
            self.prefill_starts = torch.tensor([start for start, _, _ in prefills], dtype=torch.int32, device=HOST)
            self.prefill_lens = torch.tensor([n for _, n, _ in prefills], dtype=torch.int32, device=HOST)
            offsets = [0]
            for _, n, _ in prefills[:-1]:
                offsets.append(offsets[-1] + n)
            self.prefill_rows = torch.tensor(offsets, dtype=torch.int32, device=HOST)
            prefills = []
        row = b
        for start, n, table in prefills:
            nb = -(-(start + n) // bs)
            if per_chunk and start > 0:
                native = (pad_tables([table[:nb]], nb).to(torch.int32), torch.tensor([start], dtype=torch.int32, device=HOST),
                          torch.tensor([n], dtype=torch.int32, device=HOST), torch.zeros(1, dtype=torch.int32, device=HOST))
                self.prefills.append(_Prefill(row, n, _NO_BLOCKS, 0, None, native))
                row += n
                continue
            if start == 0:
                # Nothing cached before this chunk: attend to its own K/V, causal, with no gather.
                self.prefills.append(_Prefill(row, n, _NO_BLOCKS, 0, None))
                row += n
                continue
            ar = torch.arange(nb * bs, device=HOST)
            qpos = torch.arange(start, start + n, device=HOST).repeat_interleave(c.group)
            self.prefills.append(_Prefill(row, n, torch.tensor(table[:nb], dtype=torch.int64, device=dev), nb * bs,
                                          (ar[None, :] <= qpos[:, None]).to(dev)))
            row += n

    def _gather(self, layer: int, blocks: torch.Tensor, seqs: int, ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``blocks`` as ``[seqs, kv_heads, ctx, head_dim]`` views (one copy each)."""
        c = self.cache
        k = c.k_layers[layer].index_select(0, blocks).view(seqs, ctx, c.num_kv_heads, c.head_dim)
        v = c.v_layers[layer].index_select(0, blocks).view(seqs, ctx, c.num_kv_heads, c.head_dim)
        return k.transpose(1, 2), v.transpose(1, 2)

    def attend(self, layer: int, qkv: torch.Tensor) -> torch.Tensor:
        """Write this layer's new K/V (already rotated) and return attention output [T, heads*D]."""
        c = self.cache
        t = qkv.shape[0]
        c.rows.index_put_((self.write[layer],), qkv[:, c.q_width :].view(t, 2, c.kv_width))
        outs = []
        if self.num_decodes and c.native:
            b = self.num_decodes
            outs.append(torch.ops.pdserve.paged_decode_attention(
                qkv[:b, : c.q_width], c.kv_cache, layer, self.decode_tables, self.decode_lens, c.scale))
        elif self.num_decodes:
            b = self.num_decodes
            k, v = self._gather(layer, self.decode_blocks, b, self.decode_ctx)
            q = qkv[:b, : c.q_width].view(b, c.num_kv_heads, c.group, c.head_dim)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=self.decode_mask)
            outs.append(o.reshape(b, c.q_width))
        if self.native_prefill:
            outs.append(torch.ops.pdserve.paged_prefill_attention(
                qkv[self.num_decodes :, : c.q_width], c.kv_cache, layer, self.prefill_tables, self.prefill_starts,
                self.prefill_lens, self.prefill_rows, c.scale))
        for p in self.prefills:
            n = p.num_tokens
            if p.native is not None:
                table, start, length, rows = p.native
                outs.append(torch.ops.pdserve.paged_prefill_attention(
                    qkv[p.row : p.row + n, : c.q_width], c.kv_cache, layer, table, start, length, rows, c.scale))
                continue
            if p.mask is None:
                outs.append(self._fresh_chunk(qkv[p.row : p.row + n], n))
                continue
            k, v = self._gather(layer, p.blocks, 1, p.ctx)
            q = qkv[p.row : p.row + n, : c.q_width].view(n, c.num_kv_heads, c.group, c.head_dim)
            q = q.transpose(0, 1).reshape(1, c.num_kv_heads, n * c.group, c.head_dim)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=p.mask)
            outs.append(o.view(c.num_kv_heads, n, c.group, c.head_dim).transpose(0, 1).reshape(n, c.q_width))
        return outs[0] if len(outs) == 1 else torch.cat(outs)


    def _fresh_chunk(self, qkv: torch.Tensor, n: int) -> torch.Tensor:
        """Causal attention of a chunk that starts at position 0, on its own K/V (grouped query)."""
        c = self.cache
        heads = c.num_kv_heads * c.group
        q = qkv[:, : c.q_width].view(n, heads, c.head_dim).transpose(0, 1)
        k = qkv[:, c.q_width : c.q_width + c.kv_width].view(n, c.num_kv_heads, c.head_dim).transpose(0, 1)
        v = qkv[:, c.q_width + c.kv_width :].view(n, c.num_kv_heads, c.head_dim).transpose(0, 1)
        o = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, enable_gqa=True)
        return o[0].transpose(0, 1).reshape(n, c.q_width)


class PagedKVCache:
    """Owns the cache tensor, its per-layer views and the constants that address it."""

    def __init__(self, kv_cache: torch.Tensor, num_heads: int, backend: str = "auto") -> None:
        """``backend``: "native" (the C++ kernel reads the cache in place; an error if it is not
        built), "sdpa" (gather blocks, torch SDPA), "flex" or "varlen" (each item's context gathered
        without padding, then FlexAttention with a block mask or flash varlen attention:
        ``engine/attention_packed.py``) or "auto" (native when built and on CPU, else sdpa)."""
        nb, layers, two, bs, kvh, d = kv_cache.shape
        if two != 2 or num_heads % kvh:
            raise ValueError(f"bad kv_cache shape {tuple(kv_cache.shape)} for {num_heads} heads")
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        self.rows = kv_cache.view(-1, kvh * d)
        self.k_layers = [kv_cache[:, i, 0] for i in range(layers)]   # [num_blocks, bs, kvh, d] views
        self.v_layers = [kv_cache[:, i, 1] for i in range(layers)]
        self.num_blocks, self.num_layers, self.block_size = nb, layers, bs
        self.num_kv_heads, self.head_dim, self.kv_width = kvh, d, kvh * d
        self.group = num_heads // kvh
        self.q_width = num_heads * d
        self.rows_per_block = layers * 2 * bs
        self.layer_kv_rows = layer_kv_rows(layers, bs)   # [L, 2]
        self.scale = 1.0 / math.sqrt(d)   # SDPA's default
        self.native = _use_native(backend, kv_cache)
        self.native_prefill = self.native and hasattr(torch.ops.pdserve, "paged_prefill_attention")
        self.backend = backend if backend in PACKED_BACKENDS else "native" if self.native else "sdpa"
        self._packed = packed_kernel(self.backend, kv_cache) if self.backend in PACKED_BACKENDS else None
        # What a prefill chunk with nothing cached before it uses: measured on this machine when
        # both are here (choose_fresh_prefill), else the only one there is.
        self.fresh_prefill = "native" if self.native_prefill else "sdpa"
        self.fresh_prefill_timings_ms: dict[str, float] = {}

    def choose_fresh_prefill(self, max_tokens: int = FRESH_PROBE_TOKENS, repeats: int = 3) -> str:
        """Time the C++ prefill kernel against torch's SDPA on one fresh chunk of up to ``max_tokens``
        (one layer, scratch blocks zeroed after) and keep the faster for fresh chunks, SDPA only when
        it is clearly faster (``FRESH_SWITCH_MARGIN``) and agrees with the kernel. Call before any
        request: it writes the first blocks of the cache."""
        if not self.native_prefill:
            return self.fresh_prefill
        n = min(max_tokens, (self.num_blocks - 1) * self.block_size)
        if n < FRESH_PROBE_MIN_TOKENS:
            return self.fresh_prefill
        gen = torch.Generator(device=HOST).manual_seed(0)
        qkv = (torch.randn(n, self.q_width + 2 * self.kv_width, generator=gen, device=HOST) * 0.5).to(
            device=self.device, dtype=self.kv_cache.dtype)
        table = list(range(-(-n // self.block_size)))
        outs, best = {}, {}
        try:
            for choice in ("native", "sdpa", "native", "sdpa"):
                self.fresh_prefill = choice
                plan = self.plan([], [(0, n, table)], torch.arange(n, device=HOST))
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    outs[choice] = plan.attend(0, qkv)
                    dt = time.perf_counter() - t0
                    best[choice] = min(best.get(choice, dt), dt)
        finally:
            self.kv_cache[: len(table)].zero_()
        tol = 2e-2 if self.kv_cache.dtype == torch.bfloat16 else 1e-3
        scale = float(outs["native"].float().abs().max()) or 1.0
        agree = float((outs["native"].float() - outs["sdpa"].float()).abs().max()) <= tol * scale
        faster = best["sdpa"] * (1.0 + FRESH_SWITCH_MARGIN) < best["native"]
        self.fresh_prefill = "sdpa" if agree and faster else "native"
        self.fresh_prefill_timings_ms = {k: round(1e3 * v, 3) for k, v in best.items()}
        logger.info("fresh prefill chunks (%d tokens, one layer): native %.1f ms, sdpa %.1f ms%s -> %s", n,
                    1e3 * best["native"], 1e3 * best["sdpa"], "" if agree else " (sdpa disagrees)", self.fresh_prefill)
        return self.fresh_prefill

    def plan(self, decodes: list[tuple[int, list[int]]], prefills: list[tuple[int, int, list[int]]],
             positions: torch.Tensor) -> AttentionPlan | PackedPlan:
        """``decodes``: (position, block_table) per one-token item; ``prefills``: (start_pos,
        num_tokens, block_table); ``positions``: [T] position of every token, decodes first."""
        for _, table in decodes:
            _check_table(table, self.num_blocks)
        for _, _, table in prefills:
            _check_table(table, self.num_blocks)
        if self._packed is not None:
            return PackedPlan(self, decodes, prefills, positions, self._packed)
        return AttentionPlan(self, decodes, prefills, positions)


def _use_native(backend: str, kv_cache: torch.Tensor) -> bool:
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {backend!r}")
    if backend in ("sdpa", *PACKED_BACKENDS):
        return False
    why = None
    if kv_cache.device.type != "cpu":
        why = f"the C++ kernel runs on CPU, the KV cache is on {kv_cache.device}"
    elif kv_cache.dtype not in (torch.float32, torch.bfloat16):
        why = f"the C++ kernel supports float32 and bfloat16, the KV cache is {kv_cache.dtype}"
    else:
        from pdserve.engine.kernels import load

        status = load()
        why = None if status.available else status.reason
    if why is None:
        return True
    if backend == "native":
        raise ValueError(f"attention_backend='native' is unavailable: {why}")
    logger.info("attention backend auto: sdpa (%s)", why)
    return False


def _check_table(table: list[int], num_blocks: int) -> None:
    if table and (min(table) < 0 or max(table) >= num_blocks):
        raise ValueError(f"block table {table} has ids outside [0, {num_blocks})")


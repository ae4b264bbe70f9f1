"""Paged attention over the block-major KV cache ``[num_blocks, layers, 2, block_size, kv_heads, head_dim]``.

The cache is addressed as rows of ``head_dim`` values (``kv_cache.view(-1, head_dim)``); row
``((((block * L + layer) * 2 + kv) * block_size + offset) * kv_heads + head)``. A step's plan turns
every sequence's block table into row indices once (for all layers at once), so each layer costs
one ``index_put_`` (write the new K/V) plus one ``index_select`` per attention call (gather the
context), with no Python loop over tokens or blocks.

Rows of the flat token batch are ordered decodes first (one token each, attended together in one
SDPA call, padded to the longest context and masked), then prefill chunks (one SDPA call each,
over cached context + the chunk, causal with the mask offset by the chunk's start position).
Grouped-query attention never repeats K/V: queries are viewed as ``[.., kv_heads, group, ..]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class _Prefill:
    row: int                 # first row of the chunk in the flat token batch
    num_tokens: int
    gather: torch.Tensor     # [layers, 2 * kv_heads * ctx] cache rows (K then V, head-major)
    ctx: int                 # start_pos + num_tokens
    mask: torch.Tensor       # [num_tokens * group, ctx] bool, True = may attend


class AttentionPlan:
    """Index tensors of one step; ``attend(layer, qkv)`` is called once per layer."""

    def __init__(self, cache: PagedKVCache, decodes: list[tuple[int, list[int]]],
                 prefills: list[tuple[int, int, list[int]]], positions: torch.Tensor,
                 tables: list[list[int]]) -> None:
        self.cache = cache
        c = cache
        dev = c.flat.device
        # Write indices for every new token: [layers, T, 2, kv_heads].
        pos = positions
        item_of_token = torch.repeat_interleave(torch.arange(len(tables)), torch.tensor(_lens(decodes, prefills)))
        blk = _pad_tables(tables)[item_of_token, pos // c.block_size]
        base = blk * c.s_block + (pos % c.block_size) * c.s_off
        self.write = (base[None, :, None, None] + c.layer_kv_head[:, None]).to(dev)
        self.num_decodes = len(decodes)
        self.decode_gather: torch.Tensor | None = None
        self.decode_mask: torch.Tensor | None = None
        if decodes:
            ctx = torch.tensor([p + 1 for p, _ in decodes])
            s = int(ctx.max())
            nb = -(-s // c.block_size)
            bt = _pad_tables([t[:nb] for _, t in decodes], nb)
            ar = torch.arange(s)
            base = bt[:, ar // c.block_size] * c.s_block + (ar % c.block_size) * c.s_off   # [B, S]
            idx = base[None, :, None, None, :] + c.layer_kv_head[:, None, :, :, None]       # [L, B, 2, H, S]
            self.decode_gather = idx.reshape(c.num_layers, -1).to(dev)
            self.decode_ctx = s
            self.decode_mask = (ar[None, :] < ctx[:, None]).view(len(decodes), 1, 1, s).to(dev)
        self.prefills: list[_Prefill] = []
        for row, start, n, table in _with_rows(prefills, len(decodes)):
            s = start + n
            ar = torch.arange(s)
            bt = torch.tensor(table[: -(-s // c.block_size)], dtype=torch.int64)
            base = bt[ar // c.block_size] * c.s_block + (ar % c.block_size) * c.s_off
            idx = base[None, None, None, :] + c.layer_kv_head[:, :, :, None]                   # [L, 2, H, S]
            qpos = torch.arange(start, s).repeat_interleave(c.group)
            mask = ar[None, :] <= qpos[:, None]
            self.prefills.append(_Prefill(row, n, idx.reshape(c.num_layers, -1).to(dev), s, mask.to(dev)))

    def attend(self, layer: int, qkv: torch.Tensor) -> torch.Tensor:
        """Write this layer's new K/V (already rotated) and return attention output [T, heads*D]."""
        c = self.cache
        t = qkv.shape[0]
        kv_new = qkv[:, c.q_width:].view(t, 2, c.num_kv_heads, c.head_dim)
        c.flat.index_put_((self.write[layer],), kv_new)
        outs = []
        if self.decode_gather is not None:
            b, s = self.num_decodes, self.decode_ctx
            kv = c.flat.index_select(0, self.decode_gather[layer]).view(b, 2, c.num_kv_heads, s, c.head_dim)
            q = qkv[:b, : c.q_width].view(b, c.num_kv_heads, c.group, c.head_dim)
            o = F.scaled_dot_product_attention(q, kv[:, 0], kv[:, 1], attn_mask=self.decode_mask)
            outs.append(o.reshape(b, c.q_width))
        for p in self.prefills:
            kv = c.flat.index_select(0, p.gather[layer]).view(2, 1, c.num_kv_heads, p.ctx, c.head_dim)
            q = qkv[p.row : p.row + p.num_tokens, : c.q_width].view(p.num_tokens, c.num_kv_heads, c.group, c.head_dim)
            q = q.transpose(0, 1).reshape(1, c.num_kv_heads, p.num_tokens * c.group, c.head_dim)
            o = F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=p.mask)
            o = o.view(c.num_kv_heads, p.num_tokens, c.group, c.head_dim).transpose(0, 1)
            outs.append(o.reshape(p.num_tokens, c.q_width))
        return outs[0] if len(outs) == 1 else torch.cat(outs)


class PagedKVCache:
    """Owns the cache tensor and the constants that address it."""

    def __init__(self, kv_cache: torch.Tensor, num_heads: int) -> None:
        nb, layers, two, bs, kvh, d = kv_cache.shape
        if two != 2:
            raise ValueError(f"kv_cache dim 2 must be 2 (K, V), got shape {tuple(kv_cache.shape)}")
        self.kv_cache = kv_cache
        self.flat = kv_cache.view(-1, d)
        self.num_blocks, self.num_layers, self.block_size = nb, layers, bs
        self.num_kv_heads, self.head_dim = kvh, d
        self.group = num_heads // kvh
        self.q_width = num_heads * d
        self.s_off = kvh
        self.s_block = layers * 2 * bs * kvh
        # offsets of (layer, kv, head) from a (block, offset) base: [L, 2, kv_heads]
        self.layer_kv_head = (torch.arange(layers)[:, None, None] * (2 * bs * kvh)
                              + torch.arange(2)[None, :, None] * (bs * kvh)
                              + torch.arange(kvh)[None, None, :])

    def plan(self, decodes: list[tuple[int, list[int]]], prefills: list[tuple[int, int, list[int]]],
             positions: torch.Tensor) -> AttentionPlan:
        """``decodes``: (position, block_table) per one-token item; ``prefills``: (start_pos,
        num_tokens, block_table); ``positions``: [T] position of every token, decodes first."""
        tables = [t for _, t in decodes] + [t for _, _, t in prefills]
        for table in tables:
            if table and (min(table) < 0 or max(table) >= self.num_blocks):
                raise ValueError(f"block table {table} has ids outside [0, {self.num_blocks})")
        return AttentionPlan(self, decodes, prefills, positions, tables)


def _lens(decodes: list, prefills: list) -> list[int]:
    return [1] * len(decodes) + [n for _, n, _ in prefills]


def _with_rows(prefills: list[tuple[int, int, list[int]]], first_row: int):
    row = first_row
    for start, n, table in prefills:
        yield row, start, n, table
        row += n


def _pad_tables(tables: list[list[int]], width: int | None = None) -> torch.Tensor:
    width = max(len(t) for t in tables) if width is None else width
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)

"""Host-side index arithmetic of the paged KV cache, shared by the attention plans.

A step's plan is worked out on the host (block tables are Python lists) and its index tensors
move to the cache's device once; every tensor here is made on ``HOST`` by name, never on torch's
default device (``tests/unit/test_device_hygiene.py``).

Cache rows: the cache ``[num_blocks, layers, 2, block_size, kv_heads, head_dim]`` viewed as
``[num_blocks * layers * 2 * block_size, kv_heads * head_dim]``; position ``p`` of a sequence
whose table is ``t`` keeps layer ``l``'s K in row
``t[p // block_size] * rows_per_block + l * 2 * block_size + p % block_size`` and V ``block_size``
rows further.
"""

from __future__ import annotations

import torch

HOST = torch.device("cpu")


def pad_tables(tables: list[list[int]], width: int | None = None) -> torch.Tensor:
    """Block tables as one ``[len(tables), width]`` int64 host tensor, padded with block 0."""
    width = max(len(t) for t in tables) if width is None else width
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64, device=HOST)


def layer_kv_rows(layers: int, block_size: int) -> torch.Tensor:
    """``[layers, 2]``: the row offset of each layer's K and V within a block."""
    return (torch.arange(layers, device=HOST)[:, None] * (2 * block_size)
            + torch.arange(2, device=HOST)[None, :] * block_size)


def write_rows(tables: list[list[int]], lens: list[int], positions: torch.Tensor, block_size: int,
               rows_per_block: int, kv_rows: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The rows each new token's K and V go to, per layer: ``[layers, T, 2]`` on ``device``.
    ``tables``/``lens``: each item's block table and new tokens, in row order; ``positions``: [T]
    host tensor; ``kv_rows``: ``layer_kv_rows``."""
    item_of_token = torch.repeat_interleave(torch.arange(len(tables), device=HOST), torch.tensor(lens, device=HOST))
    blk = pad_tables(tables)[item_of_token, positions // block_size]
    base = blk * rows_per_block + positions % block_size
    return (base[None, :, None] + kv_rows[:, None, :]).to(device)

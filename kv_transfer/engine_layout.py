"""The KV layout of a running engine, as the transfer layer describes it.

The layout says what the bytes mean (model, dtype, shape, block size), never where they live:
it is read from the cache tensor's shape and dtype, not from its device, so a cache on a GPU and
one in host memory with the same layout have the same identity (``KVLayout.compat_hash``), and a
GPU prefill worker can feed a CPU decode worker.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.kv_transfer.layout import KVLayout

if TYPE_CHECKING:
    import torch

    from pdserve.engine.llm_engine import LLMEngine


def model_identity(model_dir: str | Path) -> str:
    """A short id of a checkpoint that is equal on every host holding the same files:
    a digest of config.json plus the names and sizes of its weight files."""
    path = Path(model_dir)
    h = hashlib.blake2b(digest_size=8)
    h.update((path / "config.json").read_bytes())
    for f in sorted(path.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()


def layout_of(engine: LLMEngine) -> KVLayout:
    return layout_of_cache(model_identity(engine.config.model_dir), engine.runner.kv_cache)


def layout_of_cache(model_id: str, kv_cache: torch.Tensor) -> KVLayout:
    """The layout of a block-major cache tensor
    ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``; its device is not read."""
    shape = tuple(kv_cache.shape)
    if len(shape) != 6 or shape[2] != 2:
        raise ValueError(f"KV cache shape {shape} is not [blocks, layers, 2, block_size, kv_heads, head_dim]")
    num_blocks, num_layers, _, block_size, num_kv_heads, head_dim = (int(n) for n in shape)
    return KVLayout(model_id=model_id, dtype=str(kv_cache.dtype).removeprefix("torch."),
                    num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                    block_size=block_size, num_blocks=num_blocks)

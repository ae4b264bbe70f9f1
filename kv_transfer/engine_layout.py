"""The KV layout of a running engine, as the transfer layer describes it."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.kv_transfer.layout import KVLayout

if TYPE_CHECKING:
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
    spec = engine.spec
    return KVLayout(
        model_id=model_identity(engine.config.model_dir),
        dtype=engine.config.dtype,
        num_layers=spec.num_layers,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        block_size=engine.config.block_size,
        num_blocks=engine.runner.num_blocks,
    )

"""The KV cache layout both ends of a transfer must agree on, and block-run coalescing.

Each worker holds ONE contiguous tensor (in host memory or on a GPU), block-major:
``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``. One block (all layers'
K and V) is therefore one contiguous region of ``block_bytes`` bytes, and a run of
consecutive block ids is one contiguous region, which is what lets :func:`coalesce_runs`
turn a run into a single NIXL descriptor.

Pure Python: no torch, no NIXL.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

#: Bumped whenever the bytes on the wire (metadata envelope, TransferParams, notifications)
#: or their meaning change; peers with different versions refuse each other.
PROTOCOL_VERSION = 3  # 2: TransferParams lost its never-set src_blocks; 3: metadata names mem_type

#: Element size in bytes of each KV dtype we can move (names as torch spells them).
DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}

# Fields that make two layouts byte-compatible; num_blocks is a per-worker capacity.
_COMPAT_FIELDS = ("model_id", "dtype", "num_layers", "num_kv_heads", "head_dim", "block_size")


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape and dtype of one worker's KV cache tensor (see the module docstring)."""

    model_id: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int

    def __post_init__(self) -> None:
        if not self.model_id:
            raise ValueError("model_id must be non-empty")
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"dtype {self.dtype!r} not one of {sorted(DTYPE_SIZES)}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "num_blocks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        """The KV tensor's shape, block-major."""
        return (self.num_blocks, self.num_layers, 2, self.block_size, self.num_kv_heads,
                self.head_dim)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block: all layers' K and V for ``block_size`` tokens."""
        return (self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim
                * DTYPE_SIZES[self.dtype])

    @property
    def total_bytes(self) -> int:
        return self.block_bytes * self.num_blocks

    def compat_hash(self) -> str:
        """Digest of everything but ``num_blocks``: equal hashes mean interchangeable blocks."""
        fields = {name: getattr(self, name) for name in _COMPAT_FIELDS}
        blob = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def differences(self, other: KVLayout) -> list[str]:
        """Human-readable list of the compatibility fields that differ (empty if compatible)."""
        return [
            f"{name}: {getattr(self, name)!r} != {getattr(other, name)!r}"
            for name in _COMPAT_FIELDS
            if getattr(self, name) != getattr(other, name)
        ]

    def to_dict(self) -> dict[str, object]:
        return {
            "model_id": self.model_id,
            "dtype": self.dtype,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "block_size": self.block_size,
            "num_blocks": self.num_blocks,
        }

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> KVLayout:
        """Inverse of :meth:`to_dict`; raises ValueError on missing or bad fields."""
        try:
            fields = {name: data[name] for name in (*_COMPAT_FIELDS, "num_blocks")}
        except KeyError as exc:
            raise ValueError(f"KV layout is missing field {exc.args[0]!r}") from None
        return cls(**fields)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class BlockRun:
    """``length`` consecutive blocks from ``src_start`` copied to ``dst_start``: one descriptor."""

    src_start: int
    dst_start: int
    length: int


def coalesce_runs(src_blocks: list[int] | tuple[int, ...],
                  dst_blocks: list[int] | tuple[int, ...]) -> list[BlockRun]:
    """Merge (src, dst) pairs, in the order given, into runs where both ids step by +1.

    The caller has already checked that both lists have the same length.
    """
    runs: list[BlockRun] = []
    start = 0
    for i in range(1, len(src_blocks) + 1):
        if (i == len(src_blocks) or src_blocks[i] != src_blocks[i - 1] + 1
                or dst_blocks[i] != dst_blocks[i - 1] + 1):
            runs.append(BlockRun(src_blocks[start], dst_blocks[start], i - start))
            start = i
    return runs

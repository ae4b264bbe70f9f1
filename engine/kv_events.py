"""KV cache events: which prefix blocks an engine holds, for prefix-cache-aware routing.

A block manager emits ``STORED`` when a full block's K/V is computed and its chain hash becomes
hittable, and ``REMOVED`` when that hash is evicted (its block reused for other tokens). A
prefill worker publishes the drained events; the router folds them into its view of which worker
caches which prefix. Hashes are those of :func:`pdserve.engine.block_manager.chain_hashes`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class KVEventKind(str, enum.Enum):
    STORED = "stored"
    REMOVED = "removed"


@dataclass(frozen=True, slots=True)
class KVEvent:
    kind: KVEventKind
    block_hash: int

"""HostStaging: the host buffer a KV cache's transfers go through when NIXL cannot move the
cache's own memory (see ``kv_transfer/memory.py`` for when).

The buffer mirrors the cache block for block (same shape and dtype, in host memory, pinned
when the cache is on a GPU so the device copies run at full speed). Block ``b`` of the cache
is staged at block ``b`` of the mirror, so a staged agent advertises the mirror as its KV
region and a peer addresses blocks exactly as it would address the cache: the bytes on the
wire and the protocol do not change, and a staged peer and a direct one talk to each other.

Life of a staged transfer:

1. The agent registers the mirror (DRAM) with NIXL instead of the cache, once, and
   publishes the mirror's address in its metadata.
2. Sender side: before a write is posted, :meth:`HostStaging.stage_out` copies its source
   runs from the cache into the mirror (device to host; the copy has finished when it
   returns), and the write reads the mirror.
3. NIXL moves the bytes DRAM to DRAM (or into the peer's cache, if the peer is direct) and
   notifies the receiver.
4. Receiver side: when a WRITE notification names landed runs, :meth:`HostStaging.land`
   copies them from the mirror into the cache (host to device) before the receiver counts
   them as landed.
5. :meth:`HostStaging.close` drops the mirror after the agent deregistered it. Between
   transfers nothing is allocated: every transfer reuses the one mirror.

Cost: host memory equal to the cache (pinned on a GPU host). Staging is the fallback for a
NIXL without CUDA support; a NIXL that registers VRAM moves the cache directly.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.engine.errors import KVTransferError

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class StagingStats:
    """Blocks copied through the mirror, each way (for tests and ``describe``)."""

    blocks_out: int = 0   # cache -> mirror, before a write
    blocks_in: int = 0    # mirror -> cache, as writes land
    copies: int = 0       # copy calls (one per run of consecutive blocks)


class HostStaging:
    """A host mirror of one KV cache tensor; copies runs of blocks either way."""

    def __init__(self, kv_cache: torch.Tensor) -> None:
        import torch  # heavy; lazily

        self._cache = kv_cache
        pin = kv_cache.device.type == "cuda"  # pinning needs a CUDA runtime; a host cache has none
        self.host: torch.Tensor | None = torch.empty(
            tuple(kv_cache.shape), dtype=kv_cache.dtype, device="cpu", pin_memory=pin)
        self.pinned = pin
        self.stats = StagingStats()
        logger.info("KV staging: a %s host mirror of %d bytes for a %s cache",
                    "pinned" if pin else "pageable", self.nbytes, kv_cache.device)

    @property
    def nbytes(self) -> int:
        host = self._live()
        return host.numel() * host.element_size()

    def data_ptr(self) -> int:
        return self._live().data_ptr()

    def stage_out(self, runs: Iterable[tuple[int, int]]) -> None:
        """Copy each ``(start, length)`` run of cache blocks into the mirror; synchronous."""
        host = self._live()
        for start, length in runs:
            host[start:start + length].copy_(self._cache[start:start + length])
            self.stats.blocks_out += length
            self.stats.copies += 1

    def land(self, runs: Iterable[tuple[int, int]]) -> None:
        """Copy each landed ``(start, length)`` run from the mirror into the cache; synchronous."""
        host = self._live()
        for start, length in runs:
            self._cache[start:start + length].copy_(host[start:start + length])
            self.stats.blocks_in += length
            self.stats.copies += 1

    def close(self) -> None:
        """Drop the mirror (the agent deregisters it first); idempotent."""
        self.host = None

    @property
    def closed(self) -> bool:
        return self.host is None

    def _live(self) -> torch.Tensor:
        if self.host is None:
            raise KVTransferError("KV staging mirror is closed")
        return self.host

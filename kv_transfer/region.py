"""KVRegion: the memory one KV agent registers with NIXL, and how it was chosen.

1. :func:`check_tensor` refuses a cache NIXL cannot address (wrong shape or dtype for its
   layout, not contiguous, or on a device other than cpu or cuda) before any NIXL agent
   exists.
2. :func:`register_kv` reads the cache's memory type from the tensor (``memory.placement_of``)
   and asks ``memory.needs_staging`` whether to stage. A direct cache is registered as what it
   is (VRAM with its device id, or DRAM). If NIXL refuses a VRAM registration and the mode is
   ``auto``, the agent falls back to staging (logged); under ``never`` that is an error.
3. A staged cache is never registered: its host mirror (``staging.HostStaging``) is, as DRAM,
   and the region's address is the mirror's.
4. :func:`release_kv` deregisters the region and drops the mirror.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdserve.engine.errors import KVTransferError
from pdserve.kv_transfer.layout import KVLayout
from pdserve.kv_transfer.memory import (DRAM, MemoryPlacement, StagingMode, needs_staging,
                                        placement_of)
from pdserve.kv_transfer.staging import HostStaging

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

#: The only NIXL backend pdserve starts.
BACKEND = "UCX"


@dataclass(slots=True)
class KVRegion:
    """What NIXL moves for one agent: the cache itself, or its host mirror when staged."""

    placement: MemoryPlacement        # of the registered memory (DRAM when staged)
    cache_placement: MemoryPlacement  # of the cache tensor
    base_addr: int
    nbytes: int
    reg_descs: Any
    staging: HostStaging | None = None

    @property
    def staged(self) -> bool:
        return self.staging is not None

    def describe(self) -> str:
        """One line for logs and status, e.g. ``VRAM:0 direct`` or ``VRAM:0 staged via DRAM``."""
        cache = f"{self.cache_placement.mem_type}:{self.cache_placement.dev_id}"
        return f"{cache} staged via {DRAM}" if self.staged else f"{cache} direct"


def check_tensor(kv_cache: torch.Tensor, layout: KVLayout) -> None:
    """Raise ValueError unless ``kv_cache`` is the contiguous tensor ``layout`` describes, on a
    device NIXL can register."""
    placement_of(kv_cache)
    if not kv_cache.is_contiguous():
        raise ValueError("KV cache tensor must be contiguous")
    if tuple(kv_cache.shape) != layout.shape:
        raise ValueError(f"KV cache shape {tuple(kv_cache.shape)} != layout {layout.shape}")
    dtype = str(kv_cache.dtype).removeprefix("torch.")
    if dtype != layout.dtype:
        raise ValueError(f"KV cache dtype {dtype} != layout {layout.dtype}")


def register_kv(nixl: Any, kv_cache: torch.Tensor, mode: StagingMode) -> KVRegion:
    """Register ``kv_cache`` (or its host mirror) with ``nixl``'s UCX backend; see the module
    docstring. Raises KVTransferError when neither is possible under ``mode``."""
    cache_at = placement_of(kv_cache)
    nbytes = kv_cache.numel() * kv_cache.element_size()
    if not needs_staging(cache_at, mode, nixl.get_backend_mem_types(BACKEND)):
        try:
            descs = _register(nixl, kv_cache.data_ptr(), nbytes, cache_at)
        except Exception as exc:  # NIXL binding errors have no common base class
            if mode is StagingMode.NEVER or cache_at.mem_type == DRAM:
                raise KVTransferError(f"NIXL could not register the KV cache as "
                                      f"{cache_at.mem_type}: {exc}") from exc
            logger.warning("NIXL could not register the KV cache as %s:%d (%s); staging its "
                           "transfers through host memory", cache_at.mem_type, cache_at.dev_id, exc)
        else:
            return KVRegion(cache_at, cache_at, kv_cache.data_ptr(), nbytes, descs)
    staging = HostStaging(kv_cache)
    host_at = MemoryPlacement(DRAM)
    try:
        descs = _register(nixl, staging.data_ptr(), staging.nbytes, host_at)
    except Exception as exc:  # NIXL binding error
        staging.close()
        raise KVTransferError(f"NIXL could not register the KV staging buffer: {exc}") from exc
    return KVRegion(host_at, cache_at, staging.data_ptr(), staging.nbytes, descs, staging)


def release_kv(nixl: Any, region: KVRegion) -> None:
    """Deregister the region, then drop the mirror (if any)."""
    nixl.deregister_memory(region.reg_descs)
    if region.staging is not None:
        region.staging.close()


def _register(nixl: Any, addr: int, nbytes: int, at: MemoryPlacement) -> Any:
    return nixl.register_memory([(addr, nbytes, at.dev_id, "")], at.mem_type)

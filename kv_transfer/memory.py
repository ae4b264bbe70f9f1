"""Where a KV cache lives, as NIXL names it, and whether its transfers go through host staging.

NIXL registers memory by type: ``"DRAM"`` (host memory) or ``"VRAM"`` (a CUDA device, with
its device id). :func:`placement_of` reads the type from the tensor itself, so a cache on a
GPU is registered as VRAM and UCX may move it with cuda_copy, cuda_ipc or GPUDirect RDMA,
whichever it finds. :func:`needs_staging` decides, from the configured :class:`StagingMode`
and what the NIXL backend can register, whether a cache's blocks are instead copied through
host buffers (``kv_transfer/staging.py``) and moved DRAM to DRAM.

Pure Python: torch is never imported here (a tensor is only asked for its ``device``).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from enum import Enum
from typing import Any

from pdserve.engine.errors import KVTransferError

#: NIXL's names of the memory types we register (a backend reports them with a ``_SEG`` suffix).
DRAM = "DRAM"
VRAM = "VRAM"


class StagingMode(str, Enum):
    """When a KV cache's transfers go through host staging buffers.

    ``auto``: only when the cache is in VRAM and NIXL cannot register VRAM (a build without
    CUDA support, or the registration failed). ``never``: register the cache as it is, and
    fail if NIXL cannot. ``always``: stage every transfer, whatever the memory (a host cache
    too, which is how the staging path is tested on a machine without a GPU).
    """

    AUTO = "auto"
    NEVER = "never"
    ALWAYS = "always"


@dataclass(frozen=True, slots=True)
class MemoryPlacement:
    """A KV tensor's NIXL memory type and device id (0 for host memory)."""

    mem_type: str
    dev_id: int = 0

    def __post_init__(self) -> None:
        if self.mem_type not in (DRAM, VRAM):
            raise ValueError(f"mem_type must be {DRAM!r} or {VRAM!r}, got {self.mem_type!r}")
        if isinstance(self.dev_id, bool) or not isinstance(self.dev_id, int) or self.dev_id < 0:
            raise ValueError(f"dev_id must be an int >= 0, got {self.dev_id!r}")


def placement_of(tensor: Any) -> MemoryPlacement:
    """The memory type NIXL must register ``tensor`` as: DRAM for a CPU tensor, VRAM (with its
    device index) for a CUDA one. Any other device raises ValueError: NIXL cannot move it."""
    device = tensor.device
    if device.type == "cpu":
        return MemoryPlacement(DRAM)
    if device.type == "cuda":
        return MemoryPlacement(VRAM, 0 if device.index is None else int(device.index))
    raise ValueError(f"NIXL cannot register a KV cache on device {device} (only cpu or cuda)")


def supports(backend_mem_types: Collection[str], mem_type: str) -> bool:
    """Whether a NIXL backend's reported memory types (``"DRAM_SEG"``, ...) include ``mem_type``."""
    return mem_type in backend_mem_types or f"{mem_type}_SEG" in backend_mem_types


def needs_staging(placement: MemoryPlacement, mode: StagingMode,
                  backend_mem_types: Collection[str]) -> bool:
    """Whether transfers of a cache at ``placement`` go through host staging buffers.

    Raises KVTransferError when ``mode`` is NEVER and the backend cannot register the cache's
    memory type: the operator asked for direct transfers, and they cannot happen.
    """
    if mode is StagingMode.ALWAYS:
        return True
    if supports(backend_mem_types, placement.mem_type):
        return False
    if mode is StagingMode.NEVER or placement.mem_type == DRAM:
        raise KVTransferError(
            f"NIXL's backend cannot register {placement.mem_type} memory (it offers "
            f"{sorted(backend_mem_types)})" + (" and kv staging is 'never'"
                                               if mode is StagingMode.NEVER else ""))
    return True

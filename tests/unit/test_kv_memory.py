"""Where a KV cache lives for NIXL: the memory type read from the tensor, when transfers are staged
through a host mirror, what gets registered, and the layout identity that ignores the device.

No CUDA here: a GPU cache is a meta tensor whose only mocked attribute is ``device``, and NIXL is
a fake that records what it was asked to register.
"""

from __future__ import annotations

import logging

import pytest
import torch

from pdserve.engine.errors import KVTransferError
from pdserve.kv_transfer import KVAgentConfig, KVLayout
from pdserve.kv_transfer import region as region_mod
from pdserve.kv_transfer.engine_layout import layout_of_cache
from pdserve.kv_transfer.memory import (MemoryPlacement, StagingMode, needs_staging,
                                        placement_of)
from pdserve.kv_transfer.region import check_tensor, register_kv, release_kv
from pdserve.kv_transfer.staging import HostStaging
from pdserve.kv_transfer.wire import PeerInfo

SHAPE = (8, 2, 2, 4, 2, 8)  # blocks, layers, K/V, block_size, kv heads, head_dim
WITH_CUDA = ("DRAM_SEG", "VRAM_SEG")  # what NIXL's UCX backend reports when built with CUDA
WITHOUT_CUDA = ("DRAM_SEG",)


class OnCuda(torch.Tensor):
    """A meta tensor that says it lives on a CUDA device; nothing else is faked."""

    index = 0

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", self.index)


def cuda_tensor(index: int = 0, shape: tuple[int, ...] = SHAPE,
                dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    tensor = torch.empty(shape, dtype=dtype, device="meta").as_subclass(OnCuda)
    tensor.index = index
    return tensor


class FakeNixl:
    """Records registrations; refuses the memory types in ``refuse`` as NIXL would (raising)."""

    def __init__(self, mem_types: tuple[str, ...] = WITH_CUDA, refuse: tuple[str, ...] = ()) -> None:
        self.mem_types, self.refuse = mem_types, refuse
        self.registered: list[tuple[list[tuple[int, int, int, str]], str]] = []
        self.deregistered: list[object] = []

    def get_backend_mem_types(self, backend: str) -> list[str]:
        assert backend == "UCX"
        return list(self.mem_types)

    def register_memory(self, descs: list[tuple[int, int, int, str]], mem_type: str) -> object:
        if mem_type in self.refuse:
            raise RuntimeError("NIXL_ERR_BACKEND: cannot register")
        self.registered.append((descs, mem_type))
        return ("descs", len(self.registered))

    def deregister_memory(self, descs: object) -> None:
        self.deregistered.append(descs)


class FakeStaging:
    """Stands in for the pinned host mirror, which needs a CUDA runtime to allocate."""

    def __init__(self, kv_cache: torch.Tensor) -> None:
        self.nbytes = kv_cache.numel() * kv_cache.element_size()
        self.closed = False

    def data_ptr(self) -> int:
        return 0x7000_0000

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def fake_staging(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(region_mod, "HostStaging", FakeStaging)


# ---- the memory type comes from the tensor ------------------------------------------------
def test_a_cpu_tensor_is_dram_and_a_cuda_tensor_vram_with_its_device_id() -> None:
    assert placement_of(torch.zeros(SHAPE)) == MemoryPlacement("DRAM", 0)
    assert placement_of(cuda_tensor(0)) == MemoryPlacement("VRAM", 0)
    assert placement_of(cuda_tensor(3)) == MemoryPlacement("VRAM", 3)
    with pytest.raises(ValueError, match="meta"):
        placement_of(torch.empty(SHAPE, device="meta"))
    with pytest.raises(ValueError, match="mem_type"):
        MemoryPlacement("HBM")


@pytest.mark.parametrize("mem_type, mode, backend, staged", [
    ("DRAM", StagingMode.AUTO, WITH_CUDA, False),
    ("DRAM", StagingMode.AUTO, WITHOUT_CUDA, False),
    ("DRAM", StagingMode.ALWAYS, WITH_CUDA, True),      # how the staged path is tested on CPU
    ("VRAM", StagingMode.AUTO, WITH_CUDA, False),
    ("VRAM", StagingMode.AUTO, WITHOUT_CUDA, True),     # NIXL built without CUDA support
    ("VRAM", StagingMode.NEVER, WITH_CUDA, False),
    ("VRAM", StagingMode.ALWAYS, WITH_CUDA, True),
    ("VRAM", StagingMode.NEVER, WITHOUT_CUDA, "error"),
    ("DRAM", StagingMode.AUTO, (), "error"),            # staging needs DRAM itself
])
def test_when_transfers_are_staged(mem_type: str, mode: StagingMode, backend: tuple[str, ...],
                                   staged: bool | str) -> None:
    placement = MemoryPlacement(mem_type, 0)
    if staged == "error":
        with pytest.raises(KVTransferError, match=f"cannot register {mem_type}"):
            needs_staging(placement, mode, backend)
    else:
        assert needs_staging(placement, mode, backend) is staged


def test_the_staging_knob_takes_its_names_and_refuses_others() -> None:
    assert KVAgentConfig().staging is StagingMode.AUTO
    assert KVAgentConfig(staging="always").staging is StagingMode.ALWAYS  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="staging must be one of"):
        KVAgentConfig(staging="sometimes")  # type: ignore[arg-type]


# ---- what gets registered -----------------------------------------------------------------
def test_a_direct_cache_is_registered_as_what_it_is() -> None:
    host = torch.zeros(SHAPE)
    nixl = FakeNixl()
    region = register_kv(nixl, host, StagingMode.AUTO)
    assert nixl.registered == [([(host.data_ptr(), host.numel() * 4, 0, "")], "DRAM")]
    assert (region.base_addr, region.staged, region.describe()) == (host.data_ptr(), False, "DRAM:0 direct")

    nixl = FakeNixl()
    region = register_kv(nixl, cuda_tensor(2), StagingMode.AUTO)
    assert nixl.registered == [([(0, cuda_tensor().numel() * 2, 2, "")], "VRAM")]
    assert region.placement == region.cache_placement == MemoryPlacement("VRAM", 2)
    assert region.describe() == "VRAM:2 direct"
    release_kv(nixl, region)
    assert nixl.deregistered == [("descs", 1)]


def test_a_gpu_cache_nixl_cannot_register_is_staged_through_a_host_mirror(
        fake_staging: None, caplog: pytest.LogCaptureFixture) -> None:
    nbytes = cuda_tensor().numel() * 2
    for nixl, warned in [(FakeNixl(WITHOUT_CUDA), False),              # NIXL without CUDA support
                         (FakeNixl(WITH_CUDA, refuse=("VRAM",)), True)]:  # it refused the VRAM
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="pdserve.kv_transfer.region"):
            region = register_kv(nixl, cuda_tensor(1), StagingMode.AUTO)
        # only the mirror is registered, as DRAM, and peers address it in place of the cache
        assert nixl.registered == [([(0x7000_0000, nbytes, 0, "")], "DRAM")]
        assert region.base_addr == 0x7000_0000 and region.placement == MemoryPlacement("DRAM")
        assert region.cache_placement == MemoryPlacement("VRAM", 1)
        assert region.describe() == "VRAM:1 staged via DRAM"
        assert ("staging its transfers" in caplog.text) is warned
        release_kv(nixl, region)
        assert nixl.deregistered == [("descs", 1)] and region.staging.closed


def test_never_staging_fails_where_vram_cannot_be_registered(fake_staging: None) -> None:
    for nixl in (FakeNixl(WITHOUT_CUDA), FakeNixl(WITH_CUDA, refuse=("VRAM",))):
        with pytest.raises(KVTransferError, match="VRAM"):
            register_kv(nixl, cuda_tensor(), StagingMode.NEVER)
        assert nixl.registered == []


def test_a_host_cache_forced_to_stage_gets_a_pageable_mirror() -> None:
    host = torch.zeros(SHAPE)
    nixl = FakeNixl()
    region = register_kv(nixl, host, StagingMode.ALWAYS)
    mirror = region.staging
    assert isinstance(mirror, HostStaging) and not mirror.pinned
    assert region.base_addr == mirror.data_ptr() != host.data_ptr()
    assert nixl.registered == [([(mirror.data_ptr(), mirror.nbytes, 0, "")], "DRAM")]
    release_kv(nixl, region)
    assert mirror.closed


def test_check_tensor_refuses_what_nixl_cannot_address() -> None:
    layout = KVLayout("m", "float32", 2, 2, 8, 4, 8)
    check_tensor(torch.zeros(layout.shape), layout)
    for tensor, match in [(torch.zeros(layout.shape, device="meta"), "meta"),
                          (torch.zeros(layout.shape).transpose(0, 1), "contiguous"),
                          (torch.zeros(4, 2, 2, 4, 2, 8), "shape"),
                          (torch.zeros(layout.shape, dtype=torch.bfloat16), "dtype")]:
        with pytest.raises(ValueError, match=match):
            check_tensor(tensor, layout)


# ---- the staging mirror -------------------------------------------------------------------
def test_the_mirror_copies_runs_out_of_and_into_the_cache() -> None:
    cache = torch.randn(SHAPE)
    mirror = HostStaging(cache)
    mirror.stage_out([(1, 2), (6, 1)])  # a sender: blocks 1, 2 and 6 into the mirror
    assert torch.equal(mirror.host[1:3], cache[1:3]) and torch.equal(mirror.host[6], cache[6])
    mirror.host[4:6] = 7.0  # a peer's write landed in blocks 4 and 5
    before = cache.clone()
    mirror.land([(4, 2)])
    assert (cache[4:6] == 7.0).all()
    untouched = [b for b in range(SHAPE[0]) if b not in (4, 5)]
    assert torch.equal(cache[untouched], before[untouched])
    assert (mirror.stats.blocks_out, mirror.stats.blocks_in, mirror.stats.copies) == (3, 2, 3)
    mirror.close()
    assert mirror.closed and mirror.host is None
    with pytest.raises(KVTransferError, match="closed"):
        mirror.land([(0, 1)])


# ---- the identity is about the bytes, not where they live ---------------------------------
def test_a_cpu_cache_and_a_cuda_cache_of_one_layout_share_an_identity() -> None:
    on_cpu = layout_of_cache("model-x", torch.zeros(SHAPE, dtype=torch.bfloat16))
    on_gpu = layout_of_cache("model-x", cuda_tensor(1))
    assert on_cpu == on_gpu and on_cpu.compat_hash() == on_gpu.compat_hash()
    assert on_cpu.shape == SHAPE and on_cpu.dtype == "bfloat16"
    # a GPU peer's metadata says where its bytes live, and still matches a CPU worker's layout
    gpu_peer = PeerInfo("prefill-gpu", on_gpu, base_addr=0x7A00_0000, region_bytes=1 << 20,
                        dev_id=1, mem_type="VRAM")
    assert on_cpu.differences(gpu_peer.layout) == []
    # what the bytes mean still counts: another dtype is another identity
    other = layout_of_cache("model-x", cuda_tensor(1, dtype=torch.float32))
    assert other.compat_hash() != on_cpu.compat_hash() and on_cpu.differences(other)
    with pytest.raises(ValueError, match="not \\[blocks"):
        layout_of_cache("model-x", torch.zeros(8, 2, 3, 4, 2, 8))

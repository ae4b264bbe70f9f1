"""``torch.ops.pdserve.rms_norm`` and ``engine.layers.rms_norm`` against ``F.rms_norm``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine.layers import rms_norm


@pytest.fixture(scope="module", autouse=True)
def kernel(native_kernels):
    """Every test here needs the native library (skipped only where no compiler could build it)."""


# hidden sizes on and off the vector width; 1 row (decode) to a prefill chunk
@pytest.mark.parametrize("rows,hidden", [(1, 576), (7, 33), (64, 1024), (300, 16)])
def test_float32_matches_torch(rows: int, hidden: int) -> None:
    g = torch.Generator().manual_seed(rows * hidden)
    x, w = 3 * torch.randn(rows, hidden, generator=g), 1 + 0.1 * torch.randn(hidden, generator=g)
    torch.testing.assert_close(torch.ops.pdserve.rms_norm(x, w, 1e-5), F.rms_norm(x, (hidden,), w, 1e-5),
                               rtol=1e-6, atol=1e-6)


def test_bfloat16_within_one_rounding_of_torch() -> None:
    g = torch.Generator().manual_seed(3)
    x, w = (3 * torch.randn(2048, 576, generator=g)).bfloat16(), (1 + 0.1 * torch.randn(576, generator=g)).bfloat16()
    got, want = torch.ops.pdserve.rms_norm(x, w, 1e-6).float(), F.rms_norm(x, (576,), w, 1e-6).float()
    ulp = 2.0 ** (torch.floor(torch.log2(want.abs().clamp_min(1e-30))) - 7)   # one bf16 step at each value
    assert bool(((got - want).abs() <= ulp).all())
    assert float((got == want).float().mean()) > 0.99


def test_strided_rows_and_the_wrapper_falls_back_where_the_kernel_does_not_apply() -> None:
    g = torch.Generator().manual_seed(4)
    big, w = torch.randn(5, 100, generator=g), torch.randn(64, generator=g)
    x = big[:, 10:74]                                                    # row stride 100
    torch.testing.assert_close(rms_norm(x, w, 1e-5), F.rms_norm(x.contiguous(), (64,), w, 1e-5),
                               rtol=1e-6, atol=1e-6)
    half = x.half()                                                      # not a kernel dtype: torch's path
    torch.testing.assert_close(rms_norm(half, w.half(), 1e-5), F.rms_norm(half, (64,), w.half(), 1e-5))


def test_kernel_rejects_bad_shapes() -> None:
    with pytest.raises(RuntimeError, match="weight must be"):
        torch.ops.pdserve.rms_norm(torch.zeros(2, 8), torch.zeros(7), 1e-5)
    with pytest.raises(RuntimeError, match="same dtype"):
        torch.ops.pdserve.rms_norm(torch.zeros(2, 8), torch.zeros(8).bfloat16(), 1e-5)

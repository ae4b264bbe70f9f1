"""``torch.ops.pdserve.gemv`` (batch-1 matmul streaming the weight once) against ``torch.addmm``."""

from __future__ import annotations

import pytest
import torch



@pytest.fixture(scope="module", autouse=True)
def kernel(native_kernels):
    """Every test here needs the native library (skipped only where no compiler could build it)."""


# K not a multiple of 4 (the row-group tail) nor of the threads' split; N not a multiple of 16
@pytest.mark.parametrize("m,k,n", [(1, 576, 960), (1, 1538, 577), (3, 67, 40), (8, 5, 16)])
@pytest.mark.parametrize("add", [None, "bias", "residual"])
def test_float32_matches_addmm(m: int, k: int, n: int, add: str | None) -> None:
    g = torch.Generator().manual_seed(m * k + n)
    x, w = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
    extra = {None: None, "bias": torch.randn(n, generator=g), "residual": torch.randn(m, n, generator=g)}[add]
    want = torch.mm(x, w) if extra is None else torch.addmm(extra, x, w)
    torch.testing.assert_close(torch.ops.pdserve.gemv(x, w, extra), want, rtol=1e-5, atol=1e-4)


def test_bfloat16_and_strided_rows() -> None:
    g = torch.Generator().manual_seed(1)
    big = torch.randn(1, 900, generator=g).bfloat16()
    x, w = big[:, 100:676], torch.randn(576, 3072, generator=g).bfloat16()   # a column slice: row stride 900
    got = torch.ops.pdserve.gemv(x, w)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), (x.float() @ w.float()), rtol=2e-2, atol=5e-2)


def test_bad_shapes_refused() -> None:
    with pytest.raises(RuntimeError, match="1 to 8 rows"):
        torch.ops.pdserve.gemv(torch.zeros(9, 4), torch.zeros(4, 4))
    with pytest.raises(RuntimeError, match=r"\[K, N\]"):
        torch.ops.pdserve.gemv(torch.zeros(1, 4), torch.zeros(5, 4))
    with pytest.raises(RuntimeError, match="add must be"):
        torch.ops.pdserve.gemv(torch.zeros(1, 4), torch.zeros(4, 4), torch.zeros(3))

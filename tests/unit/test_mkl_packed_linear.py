"""The mkl_packed matmul backend (weights packed once by MKL): a layer's calls and the LM head equal
dense's, the caller's residual is never written, the selector offers and checks it, and the
engine's greedy tokens do not change with it."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import kernel_select as ks
from pdserve.engine import linear
from pdserve.engine.kernels import build
from pdserve.engine.linear import DenseLinear, LmHead, MixedLinear, MklPackedLinear, make_layer_linear
from pdserve.engine.loader import LayerWeights
from tests.kernel_checks import forced_backend_greedy_tokens


@pytest.fixture(scope="module", autouse=True)
def kernel():
    if not linear.mkl_packed_available():
        if build.compiler() is None:
            pytest.skip("no C++ compiler on this host: mkl_packed is not a candidate")
        assert torch.ops.pdserve.blas_packed_available(), "the kernel library is loaded but torch has no MKL"
    assert linear.mkl_packed_available()


def make_layer(hidden: int = 64, inter: int = 96, o_bias: bool = True) -> LayerWeights:
    gen = torch.Generator().manual_seed(7)
    r = lambda *s: torch.randn(*s, generator=gen) * 0.1  # noqa: E731
    return LayerWeights(input_norm=r(hidden), qkv=r(3 * hidden, hidden), qkv_bias=r(3 * hidden),
                        o=r(hidden, hidden), o_bias=r(hidden) if o_bias else None, post_norm=r(hidden),
                        gate_up=r(2 * inter, hidden), down=r(hidden, inter))


def calls(mm, m: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(m)
    h, a, x = (torch.randn(m, 64, generator=gen) for _ in range(3))
    return [mm.qkv(h), mm.o_add(a, x), mm.mlp_add(h, x)]


@pytest.mark.parametrize("o_bias", [True, False])
@pytest.mark.parametrize("m", [1, 3, 8, 32, 33, 300])
def test_layer_calls_match_dense(m: int, o_bias: bool) -> None:
    w = make_layer(o_bias=o_bias)
    for got, want in zip(calls(MklPackedLinear(w), m), calls(DenseLinear(w), m)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_residual_and_bias_are_added_without_writing_the_callers_tensors() -> None:
    w = make_layer(o_bias=False)
    mm = MklPackedLinear(w)
    a, x = torch.randn(5, 64), torch.randn(5, 64)
    x_before, bias_before = x.clone(), w.qkv_bias.clone()
    torch.testing.assert_close(mm.o_add(a, x), x_before + a @ w.o.t(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mm.qkv(a), a @ w.qkv.t() + w.qkv_bias, rtol=1e-5, atol=1e-5)
    assert torch.equal(x, x_before) and torch.equal(w.qkv_bias, bias_before)


def test_lm_head_and_mixed_layer() -> None:
    head = torch.randn(300, 64, generator=torch.Generator().manual_seed(3))
    x = torch.randn(7, 64)
    torch.testing.assert_close(LmHead(head, "mkl_packed")(x), LmHead(head, "dense")(x), rtol=1e-5, atol=1e-4)
    mixed = make_layer_linear(make_layer(), {"qkv": "mkl_packed", "o_add": "dense", "mlp_add": "mkl_packed"})
    assert isinstance(mixed, MixedLinear)
    part = mixed.qkv.__self__
    assert isinstance(part, MklPackedLinear) and part.o_p is None    # nothing held twice
    assert isinstance(make_layer_linear(make_layer(), dict.fromkeys(("qkv", "o_add", "mlp_add"), "mkl_packed")),
                      MklPackedLinear)


def test_bad_arguments_are_refused() -> None:
    wp = torch.ops.pdserve.blas_pack(torch.randn(16, 8))
    with pytest.raises(RuntimeError, match="smaller than"):
        torch.ops.pdserve.blas_packed_mm(torch.randn(2, 8), wp, 4096, None)
    with pytest.raises(RuntimeError, match=r"\[n\] or \[M, n\]"):
        torch.ops.pdserve.blas_packed_mm(torch.randn(2, 8), wp, 16, torch.zeros(3))
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.pdserve.blas_pack(torch.randn(16, 8, dtype=torch.bfloat16))


def test_selector_offers_mkl_packed_for_float32_only() -> None:
    w = make_layer()
    head = torch.randn(200, 64, generator=torch.Generator().manual_seed(1)) * 0.1
    candidates = ks.available_backends(torch.float32)
    assert "mkl_packed" in candidates
    assert "mkl_packed" not in ks.available_backends(torch.bfloat16)
    choice = ks.measure(w, head, torch.float32, candidates, "dense", repeats=2)
    assert not choice.rejected
    for op in ks.OPS:
        assert set(choice.timings_us[op]["mkl_packed"]) == {str(m) for m in ks.timed_m(op)}


def test_forced_mkl_packed_engine_greedy_tokens_match_dense(tiny_model) -> None:
    assert forced_backend_greedy_tokens(tiny_model, "mkl_packed") == forced_backend_greedy_tokens(tiny_model, "dense")


def test_forced_mkl_packed_needs_float32(tiny_model) -> None:
    from pdserve.engine.model_runner import ModelRunner

    with pytest.raises(ValueError, match="float32"):
        ModelRunner(tiny_model, dtype="bfloat16", num_blocks=4, linear_backend="mkl_packed")


def test_lm_head_is_timed_on_decode_rows_only() -> None:
    """The LM head runs on one row per sequence: it is timed (and chosen) at decode M only."""
    assert ks.timed_m("lm_head") == ks.DECODE_M
    assert ks.timed_m("mlp_add") == (*ks.DECODE_M, *ks.PREFILL_M)


def test_overlapping_rows_are_refused() -> None:
    wp = torch.ops.pdserve.blas_pack(torch.randn(16, 8))
    with pytest.raises(RuntimeError, match="overlap"):
        torch.ops.pdserve.blas_packed_mm(torch.randn(1, 8).expand(3, 8), wp, 16, None)

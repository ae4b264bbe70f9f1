"""The gemv matmul backend: a layer's calls and the LM head agree with dense, the selector offers
and checks it like the others, and the engine's greedy tokens do not change with it."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import kernel_select as ks
from pdserve.engine import linear
from pdserve.engine.kernels import build
from pdserve.engine.linear import (GEMV_MAX_ROWS, DenseLinear, GemvLinear, LmHead, MixedLinear,
                                   make_layer_linear)
from pdserve.engine.loader import LayerWeights
from tests.kernel_checks import forced_backend_greedy_tokens


@pytest.fixture(scope="module", autouse=True)
def kernel():
    if not linear.gemv_available() and build.compiler() is None:
        pytest.skip("no C++ compiler on this host: gemv is not a candidate")
    assert linear.gemv_available(), "gemv kernel not loadable although a compiler exists (run `make setup`)"


def make_layer(dtype: torch.dtype, hidden: int = 64, inter: int = 96, o_bias: bool = True) -> LayerWeights:
    gen = torch.Generator().manual_seed(7)
    r = lambda *s: (torch.randn(*s, generator=gen) * 0.1).to(dtype)  # noqa: E731
    return LayerWeights(input_norm=r(hidden), qkv=r(3 * hidden, hidden), qkv_bias=r(3 * hidden),
                        o=r(hidden, hidden), o_bias=r(hidden) if o_bias else None, post_norm=r(hidden),
                        gate_up=r(2 * inter, hidden), down=r(hidden, inter))


def calls(mm, m: int, dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(m)
    h, a, x = (torch.randn(m, 64, generator=gen).to(dtype) for _ in range(3))
    return [mm.qkv(h), mm.o_add(a, x), mm.mlp_add(h, x)]


@pytest.mark.parametrize("m", [1, 3, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1, 32])
def test_layer_calls_match_dense_fp32(m: int) -> None:
    w = make_layer(torch.float32)
    for got, want in zip(calls(GemvLinear(w), m, torch.float32), calls(DenseLinear(w), m, torch.float32)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m", [1, GEMV_MAX_ROWS])
def test_layer_calls_close_to_dense_bf16(m: int) -> None:
    w = make_layer(torch.bfloat16, o_bias=False)
    for got, want in zip(calls(GemvLinear(w), m, torch.bfloat16), calls(DenseLinear(w), m, torch.bfloat16)):
        assert got.dtype == torch.bfloat16
        assert float((got.float() - want.float()).abs().max()) <= 0.03 * float(want.float().abs().max())


def test_small_calls_really_run_the_kernel(monkeypatch) -> None:
    """Guards the tests above: M <= 8 goes through torch.ops.pdserve.gemv, larger M does not."""
    seen: list[int] = []
    real = torch.ops.pdserve.gemv
    mm = GemvLinear(make_layer(torch.float32))
    mm._gemv = lambda x, w, add: seen.append(x.shape[0]) or real(x, w, add)
    calls(mm, 1, torch.float32)
    assert seen == [1, 1, 1, 1]          # qkv, o_add, gate_up, down
    calls(mm, GEMV_MAX_ROWS + 1, torch.float32)
    assert seen == [1, 1, 1, 1]


def test_mixed_choice_holds_each_weight_once() -> None:
    w = make_layer(torch.float32)
    mixed = make_layer_linear(w, {"qkv": "gemv", "o_add": "dense", "mlp_add": "gemv"})
    assert isinstance(mixed, MixedLinear)
    assert isinstance(make_layer_linear(w, dict.fromkeys(("qkv", "o_add", "mlp_add"), "gemv")), GemvLinear)
    gemv_part = mixed.qkv.__self__
    assert isinstance(gemv_part, GemvLinear) and mixed.mlp_add.__self__ is gemv_part
    assert gemv_part.o_t is None and mixed.o_add.__self__.qkv_t is None   # nothing held twice
    for got, want in zip(calls(mixed, 1, torch.float32), calls(DenseLinear(w), 1, torch.float32)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m", [1, GEMV_MAX_ROWS, 20])
def test_lm_head_matches_dense(m: int) -> None:
    gen = torch.Generator().manual_seed(2)
    w, x = torch.randn(300, 64, generator=gen), torch.randn(m, 64, generator=gen)
    torch.testing.assert_close(LmHead(w, "gemv")(x), LmHead(w, "dense")(x), rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="lm_head backend"):
        LmHead(w, "fast")


def test_selector_offers_gemv_and_keeps_an_agreeing_candidate() -> None:
    w = make_layer(torch.float32)
    head = torch.randn(200, 64, generator=torch.Generator().manual_seed(1)) * 0.1
    candidates = ks.available_backends(torch.float32)
    assert "gemv" in candidates
    choice = ks.measure(w, head, torch.float32, candidates, "dense", repeats=2)
    assert not choice.rejected
    for op in ks.OPS:
        assert set(choice.timings_us[op]) == set(candidates)             # gemv timed like the others
        assert set(choice.timings_us[op]["gemv"]) == {str(m) for m in ks.timed_m(op)}
        assert choice.backends[op] in choice.timings_us[op]              # only an agreeing one is kept
    assert ks.pick({"dense": {"1": 10.0, "256": 100.0}, "gemv": {"1": 5.0, "256": 100.0}}, "dense") == "gemv"


def test_gemv_wrong_only_at_small_m_is_rejected() -> None:
    """gemv runs only at M <= 8: the agreement check must look there, not just at M 32 and 256."""
    w = make_layer(torch.float32)
    calls_ = ks._calls(w, torch.randn(200, 64) * 0.1, torch.float32, ["dense", "gemv"])
    good = calls_["qkv"]["gemv"]
    calls_["qkv"]["gemv"] = lambda m: good(m) * (1.5 if m <= GEMV_MAX_ROWS else 1.0)
    assert "M=1" in ks._disagreement(calls_, "qkv", "gemv", 1e-3)


def test_no_kernel_library_means_no_gemv_candidate(monkeypatch, tiny_model) -> None:
    from pdserve.engine import model_runner
    from pdserve.engine.model_runner import ModelRunner

    monkeypatch.setattr(linear, "gemv_available", lambda: False)
    monkeypatch.setattr(model_runner, "gemv_available", lambda: False)
    assert "gemv" not in ks.available_backends(torch.float32)
    with pytest.raises(ValueError, match="make setup"):
        ModelRunner(tiny_model, dtype="float32", num_blocks=4, linear_backend="gemv")


def test_cache_of_the_previous_format_is_not_reused(tmp_path) -> None:
    import json

    (tmp_path / ks.CACHE_FILE).write_text(json.dumps({"format": 1, "k": {"backends": {}}}))
    with ks.KernelCache(tmp_path).locked() as entries:
        assert entries == {"format": ks._FORMAT} and ks._FORMAT >= 2
    shapes = {"hidden": 64}
    assert ks.cache_key("float32", 2, shapes, ["dense"])[0] != ks.cache_key("float32", 2, shapes, ["dense", "gemv"])[0]


def test_forced_gemv_engine_greedy_tokens_match_dense(tiny_model) -> None:
    assert forced_backend_greedy_tokens(tiny_model, "gemv") == forced_backend_greedy_tokens(tiny_model, "dense")

"""Kernel selection: the pure choice rule, agreement checks, the cache, and forced backends."""

from __future__ import annotations

import json

import pytest
import torch

from pdserve.engine import kernel_select as ks
from pdserve.engine.linear import DenseLinear, MixedLinear, PackedLinear, make_layer_linear, packed_available
from pdserve.engine.loader import LayerWeights


def make_layer(dtype: torch.dtype = torch.float32, hidden: int = 64, inter: int = 96) -> tuple[LayerWeights, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    r = lambda *s: (torch.randn(*s, generator=gen) * 0.1).to(dtype)  # noqa: E731
    layer = LayerWeights(input_norm=r(hidden), qkv=r(3 * hidden, hidden), qkv_bias=r(3 * hidden), o=r(hidden, hidden),
                         o_bias=None, post_norm=r(hidden), gate_up=r(2 * inter, hidden), down=r(hidden, inter))
    return layer, r(200, hidden)


def test_default_kept_unless_another_is_clearly_faster():
    t = {"dense": {"1": 100.0, "256": 1000.0}, "packed": {"1": 97.0, "256": 990.0}}
    assert ks.pick(t, "dense") == "dense"            # 2% faster: noise, keep the default
    t["packed"] = {"1": 80.0, "256": 900.0}
    assert ks.pick(t, "dense") == "packed"           # 15% faster on average: switch
    assert ks.pick(t, "packed") == "packed"
    assert ks.pick({"dense": {"1": 5.0}}, "packed") == "dense"   # default rejected: the one left
    with pytest.raises(RuntimeError, match="no matmul backend"):
        ks.pick({}, "dense")


def test_a_backend_that_disagrees_with_float32_is_rejected():
    layer, head = make_layer()
    calls = ks._calls(layer, head, torch.float32, ["dense"])
    assert ks._disagreement(calls, "mlp_add", "dense", 1e-3) == ""
    calls["mlp_add"]["wrong"] = lambda m: calls["mlp_add"]["dense"](m) * 1.1
    assert "max error" in ks._disagreement(calls, "mlp_add", "wrong", 1e-3)


@pytest.mark.skipif(not packed_available(torch.bfloat16, torch.device("cpu")), reason="needs oneDNN packed linear")
def test_mixed_linear_matches_dense_per_call():
    layer, _ = make_layer(torch.bfloat16)
    gen = torch.Generator().manual_seed(4)
    h, a, x = (torch.randn(8, 64, generator=gen).bfloat16() for _ in range(3))
    mixed = make_layer_linear(layer, {"qkv": "packed", "o_add": "dense", "mlp_add": "packed"})
    assert isinstance(mixed, MixedLinear)
    assert isinstance(make_layer_linear(layer, dict.fromkeys(("qkv", "o_add", "mlp_add"), "dense")), DenseLinear)
    assert isinstance(make_layer_linear(layer, dict.fromkeys(("qkv", "o_add", "mlp_add"), "packed")), PackedLinear)
    dense = DenseLinear(layer)
    for got, want in ((mixed.qkv(h), dense.qkv(h)), (mixed.o_add(a, x), dense.o_add(a, x)),
                      (mixed.mlp_add(h, x), dense.mlp_add(h, x))):
        assert float((got.float() - want.float()).abs().max()) <= 0.03 * float(want.float().abs().max())
    with pytest.raises(ValueError, match="dense/packed"):
        make_layer_linear(layer, {"qkv": "fast", "o_add": "dense", "mlp_add": "dense"})


def test_choice_is_measured_once_then_read_from_the_cache(tmp_path):
    layer, head = make_layer()
    cache = ks.KernelCache(tmp_path)
    first = ks.select_kernels(layer, head, torch.float32, cache, repeats=2)
    assert first.source == "measured" and set(first.backends) == set(ks.OPS)
    assert all(set(first.timings_us[op]["dense"]) == {str(m) for m in ks.timed_m(op)} for op in ks.OPS)
    stored = json.loads((tmp_path / ks.CACHE_FILE).read_text())
    (entry,) = [v for k, v in stored.items() if k != "format"]
    assert entry["key"]["cpu"] and entry["key"]["dtype"] == "float32" and entry["key"]["shapes"]["hidden"] == 64
    second = ks.select_kernels(layer, head, torch.float32, cache, repeats=2)
    assert second.source == "cache" and second.backends == first.backends
    other_shape = ks.select_kernels(*make_layer(hidden=32), torch.float32, cache, repeats=2)
    assert other_shape.source == "measured"   # keyed by shape: a different model measures again


def test_forced_backends_skip_measurement(tiny_model):
    from pdserve.engine.model_runner import ModelRunner

    runner = ModelRunner(tiny_model, dtype="float32", num_blocks=4, linear_backend="dense")
    assert runner.kernels.source == "forced" and runner.linear_backend == "dense"
    info = runner.describe()
    assert info["dtype"] == "float32" and info["kernels"] == dict.fromkeys(ks.OPS, "dense")
    assert info["num_threads"] == torch.get_num_threads()
    with pytest.raises(ValueError, match="linear_backend"):
        ModelRunner(tiny_model, dtype="float32", num_blocks=4, linear_backend="fastest")

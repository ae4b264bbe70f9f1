"""The checkpoint loader: config parsing (both transformers 4 and 5 rope formats), sharded weights,
and one typed, actionable error for every kind of bad checkpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.engine.errors import ModelLoadError, UnsupportedModelError
from pdserve.engine.loader import load_model_spec, load_weights
from pdserve.engine.testmodel import ensure_model

LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 256}


@pytest.fixture(scope="module")
def tiny() -> Path:
    return ensure_model("tiny")


@pytest.fixture
def copy(tiny, tmp_path) -> Path:
    out = tmp_path / "model"
    shutil.copytree(tiny, out)
    return out


def _edit_config(model_dir: Path, **changes) -> None:
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    path.write_text(json.dumps(cfg))


def test_spec_of_tiny_llama(tiny):
    spec = load_model_spec(tiny)
    assert spec.architecture == "LlamaForCausalLM"
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (4, 4, 2, 64)
    assert spec.rope_scaling is None and not spec.attention_bias and not spec.tie_word_embeddings
    assert spec.eos_token_ids and all(isinstance(i, int) for i in spec.eos_token_ids)


def test_qwen2_has_qkv_bias():
    spec = load_model_spec(ensure_model("tiny", arch="qwen2"))
    assert spec.architecture == "Qwen2ForCausalLM" and spec.attention_bias


def test_rope_scaling_and_rope_parameters_give_the_same_spec(copy):
    _edit_config(copy, rope_scaling={"rope_type": "llama3", **LLAMA3}, rope_theta=500000.0)
    legacy = load_model_spec(copy)
    _edit_config(copy, rope_scaling=None, rope_theta=None,
                 rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3})
    v5 = load_model_spec(copy)
    assert legacy == v5
    assert v5.rope_theta == 500000.0 and v5.rope_scaling["rope_type"] == "llama3"


def test_sharded_checkpoint_loads_like_a_single_file(copy):
    tensors = load_file(copy / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for fname, part in shards.items():
        save_file({n: tensors[n] for n in part}, copy / fname)
    index = {"metadata": {}, "weight_map": {n: f for f, part in shards.items() for n in part}}
    (copy / "model.safetensors.index.json").write_text(json.dumps(index))
    (copy / "model.safetensors").unlink()
    spec = load_model_spec(copy)
    w = load_weights(copy, spec)
    torch.testing.assert_close(w.embed, tensors["model.embed_tokens.weight"])
    (copy / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="model-00002-of-00002.safetensors"):
        load_weights(copy, spec)


def test_missing_directory(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model_spec(tmp_path / "nope")


def test_missing_config(copy):
    (copy / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model_spec(copy)


def test_unknown_architecture_lists_supported(copy):
    _edit_config(copy, architectures=["GPT2LMHeadModel"])
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM") as info:
        load_model_spec(copy)
    assert "GPT2LMHeadModel" in str(info.value)


def test_unsupported_rope_type(copy):
    _edit_config(copy, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(UnsupportedModelError, match="yarn"):
        load_model_spec(copy)


def test_missing_weights_file(copy):
    (copy / "model.safetensors").unlink()
    spec = load_model_spec(copy)
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_weights(copy, spec)


def test_corrupt_safetensors(copy):
    (copy / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!" + b"\0" * 64)
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_weights(copy, load_model_spec(copy))


def test_truncated_safetensors(copy):
    path = copy / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_weights(copy, load_model_spec(copy))


def test_missing_tensor_is_named(copy):
    path = copy / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.2.mlp.up_proj.weight"]
    save_file(tensors, path)
    with pytest.raises(ModelLoadError, match=r"model\.layers\.2\.mlp\.up_proj\.weight"):
        load_weights(copy, load_model_spec(copy))


def test_wrong_shape_names_tensor_and_shapes(copy):
    _edit_config(copy, intermediate_size=700)
    with pytest.raises(ModelLoadError, match=r"mlp\.(gate|up|down)_proj\.weight has shape"):
        load_weights(copy, load_model_spec(copy))


def test_bad_config_field(copy):
    _edit_config(copy, hidden_size=None)
    with pytest.raises(ModelLoadError, match="hidden_size"):
        load_model_spec(copy)

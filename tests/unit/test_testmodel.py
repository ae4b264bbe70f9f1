"""The generated test models: loadable offline by transformers, deterministic, with a tokenizer
that round-trips any text and weights whose greedy output does not collapse."""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import threading
from pathlib import Path

import pytest
import torch

from pdserve.engine import testmodel
from pdserve.engine.testmodel import PRESETS, ModelPreset, ensure_model, make_model
from pdserve.engine.tokenizer_train import SPECIAL_TOKENS

# tests/conftest.py sets HF_HUB_OFFLINE=1 before transformers is imported: nothing here may download.

LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
PROMPTS = ["The lighthouse keeper walked", "def add(a, b):\n    return", "Über café 東京 😀 numbers: 1, 2, 3,"]


def _digests(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def _load(d: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, info = AutoModelForCausalLM.from_pretrained(
        d, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    return AutoTokenizer.from_pretrained(d), model.eval(), info


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """Two intra-op threads on a shared, busy 2-core machine run ~25x slower than one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("llama"), "tiny", "llama")


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("qwen2"), "tiny", "qwen2")


@pytest.fixture(scope="module")
def llama(llama_dir):
    return _load(llama_dir)


# ---- presets (pure logic) ----------------------------------------------------------------------


def test_presets_have_the_promised_shapes():
    tiny, small, medium = PRESETS["tiny"], PRESETS["small"], PRESETS["medium"]
    assert tiny.head_dim == small.head_dim == medium.head_dim == 64
    assert (small.hidden_size, small.num_layers, small.num_heads, small.num_kv_heads) == (576, 30, 9, 3)
    assert small.intermediate_size == 1536 and small.tie_word_embeddings and small.max_position_embeddings == 8192
    assert tiny.num_params() < 10_000_000
    assert 4 * medium.num_params() >= 1_500_000_000


def test_preset_rejects_bad_shapes():
    with pytest.raises(ValueError):
        ModelPreset("bad", 250, 2, 4, 2, 512, 4096, 4096, tie_word_embeddings=False)  # 250 % 4 != 0
    with pytest.raises(ValueError):
        ModelPreset("bad", 256, 2, 4, 3, 512, 4096, 4096, tie_word_embeddings=False)  # 4 % 3 != 0
    with pytest.raises(ValueError):
        ModelPreset("bad", 256, 0, 4, 2, 512, 4096, 4096, tie_word_embeddings=False)


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(ValueError, match="preset"):
        make_model(tmp_path, "huge")
    with pytest.raises(ValueError, match="arch"):
        make_model(tmp_path, "tiny", "mistral")
    with pytest.raises(ValueError, match="rope_scaling"):
        make_model(tmp_path, "tiny", rope_scaling={"factor": 8.0})
    assert not any(tmp_path.iterdir())


# ---- the checkpoint ----------------------------------------------------------------------------


def test_llama_loads_offline_with_exact_weight_names(llama_dir, llama):
    tok, model, info = llama
    assert type(model).__name__ == "LlamaForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert {p.name for p in llama_dir.iterdir()} >= {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    }
    cfg = json.loads((llama_dir / "config.json").read_text())
    assert cfg["vocab_size"] == len(tok) == PRESETS["tiny"].vocab_size
    assert sum(p.numel() for p in model.parameters()) == PRESETS["tiny"].num_params(cfg["vocab_size"])
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert (llama_dir / "model.safetensors").stat().st_size > 4 * PRESETS["tiny"].num_params()


def test_qwen2_has_biases_that_change_the_output(qwen2_dir):
    tok, model, info = _load(qwen2_dir)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"]
    attn = model.model.layers[0].self_attn
    assert all(b.abs().min() > 0 for b in (attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias))
    ids = tok("Biases matter here, or the test fails.", return_tensors="pt").input_ids
    assert ids[0, 0] != tok.bos_token_id  # qwen2 convention: nothing prepended
    with torch.inference_mode():
        before = model(ids).logits
        for layer in model.model.layers:
            layer.self_attn.q_proj.bias.zero_()
            layer.self_attn.v_proj.bias.zero_()
        after = model(ids).logits
    assert (before - after).abs().max() > 0.1


def test_same_arguments_give_byte_identical_files(tmp_path, llama_dir):
    again = _digests(make_model(tmp_path / "again", "tiny", "llama"))
    assert again == _digests(llama_dir)
    other_seed = _digests(make_model(tmp_path / "seed1", "tiny", "llama", seed=1))
    assert other_seed["model.safetensors"] != again["model.safetensors"]
    assert other_seed["tokenizer.json"] == again["tokenizer.json"]


def test_llama3_rope_scaling_reaches_transformers(tmp_path):
    from transformers import AutoConfig

    d = make_model(tmp_path, "tiny", "llama", rope_scaling=LLAMA3)
    assert json.loads((d / "config.json").read_text())["rope_scaling"] == {"rope_type": "llama3", **LLAMA3}
    cfg = AutoConfig.from_pretrained(d)
    params = getattr(cfg, "rope_parameters", None) or cfg.rope_scaling
    assert params["rope_type"] == "llama3" and params["factor"] == 8.0


# ---- tokenizer ---------------------------------------------------------------------------------


def _random_text(rng: random.Random, n: int) -> str:
    ranges = [
        (0x00, 0x7F),
        (0x80, 0x24F),
        (0x370, 0x4FF),
        (0x600, 0x6FF),
        (0x3040, 0x30FF),
        (0x4E00, 0x9FFF),
        (0xAC00, 0xD7A3),
        (0x1F300, 0x1FAFF),
        (0xE000, 0xF8FF),
        (0x10000, 0x10FFFF),
    ]
    out = []
    for _ in range(n):
        lo, hi = rng.choice(ranges)
        out.append(chr(rng.randint(lo, hi)))
    return "".join(out)


def test_tokenizer_round_trips_any_unicode(llama):
    tok = llama[0]
    rng = random.Random(7)
    samples = [_random_text(rng, rng.randint(1, 60)) for _ in range(300)]
    samples += [
        "",
        " ",
        "  leading and trailing  ",
        "\x00\x01\t\r\n\x7f",
        "e\u0301 vs \u00e9",
        "👨‍👩‍👧‍👦🇯🇵",
        "\ufeffBOM",
        "a<|im_end|>b",
        "line\r\nbreaks\n\n\n",
        "1234567890" * 5,
    ]
    for s in samples:
        ids = tok.encode(s, add_special_tokens=False)
        assert tok.decode(ids) == s, repr(s)
        assert all(0 <= i < len(tok) for i in ids)


def test_special_tokens_and_bos_convention(llama):
    tok = llama[0]
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (SPECIAL_TOKENS[0], SPECIAL_TOKENS[1], SPECIAL_TOKENS[4])
    ids = tok.encode("hello world")
    assert ids[0] == tok.bos_token_id and ids[1:] == tok.encode("hello world", add_special_tokens=False)
    assert tok.encode("<|im_start|>", add_special_tokens=False) == [2]


def test_chat_template_renders_chatml(llama):
    tok = llama[0]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|begin_of_text|><|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    )
    no_prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert not no_prompt.endswith("assistant\n")
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}]
    assert "Hi there<|im_end|>" in tok.apply_chat_template(parts, tokenize=False)
    ids = tok.encode(text, add_special_tokens=False)
    assert ids.count(tok.bos_token_id) == 1 and ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3


# ---- the weights behave like a model worth testing against -------------------------------------


def test_greedy_output_does_not_collapse(llama):
    tok, model, _ = llama
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=48, min_new_tokens=48, do_sample=False)
        new = out[0, ids.shape[1] :].tolist()
        assert len(new) == 48 and len(set(new)) >= 12, (prompt, new)


def test_logits_are_finite_with_clear_top1_gaps(llama):
    tok, model, _ = llama
    ids = tok(" ".join(PROMPTS), return_tensors="pt").input_ids
    with torch.inference_mode():
        logits = model(ids).logits[0]
        bf16 = model.to(torch.bfloat16)(ids).logits[0].float()
        model.to(torch.float32)
    assert torch.isfinite(logits).all() and torch.isfinite(bf16).all()
    top2 = logits.topk(2, dim=-1).values
    gaps = top2[:, 0] - top2[:, 1]
    assert gaps.median() > 0.1 and (gaps > 0.01).float().mean() > 0.8
    assert 1.0 < logits.std() < 20.0
    assert torch.corrcoef(torch.stack([logits.flatten(), bf16.flatten()]))[0, 1] > 0.95


# ---- the cache ---------------------------------------------------------------------------------


def test_ensure_model_generates_once_and_survives_a_race(tmp_path, monkeypatch):
    calls = []
    real = testmodel.make_model

    def counting(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(testmodel, "make_model", counting)
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(ensure_model("tiny", cache_dir=tmp_path))) for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(results) == 3 and len(set(results)) == 1 and len(calls) == 1
    assert (results[0] / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == [results[0].name]
    assert ensure_model("tiny", cache_dir=tmp_path) == results[0] and len(calls) == 1


def test_cache_key_changes_with_generator_version_and_options(monkeypatch):
    key = testmodel.cache_key("tiny")
    assert testmodel.cache_key("tiny", rope_scaling=LLAMA3) != key
    assert testmodel.cache_key("tiny", "qwen2") != key and testmodel.cache_key("tiny", seed=1) != key
    monkeypatch.setattr(testmodel, "GENERATOR_VERSION", testmodel.GENERATOR_VERSION + 1)
    assert testmodel.cache_key("tiny") != key


def test_default_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("PDSERVE_MODEL_CACHE", str(tmp_path))
    assert testmodel.default_cache_dir() == tmp_path
    monkeypatch.delenv("PDSERVE_MODEL_CACHE")
    repo = Path(testmodel.__file__).resolve().parents[1]
    assert testmodel.default_cache_dir() == repo / ".cache" / "models"


# ---- CLI ---------------------------------------------------------------------------------------


def test_cli_writes_a_model_and_prints_one_line(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    testmodel.add_make_model_args(parser)
    args = parser.parse_args(["--preset", "tiny", "--arch", "qwen2", "--out", str(tmp_path / "m"), "--seed", "3"])
    assert testmodel.run_make_model(args) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "qwen2/tiny" in out[0] and str(tmp_path / "m") in out[0]
    assert (tmp_path / "m" / "model.safetensors").is_file()
    with pytest.raises(SystemExit):
        parser.parse_args(["--preset", "huge", "--out", "x"])

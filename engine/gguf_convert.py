"""GGUF checkpoints (Llama and Qwen2 architectures) turned into Hugging Face directories.

pdserve's loader reads Hugging Face directories (``engine/loader.py``); a GGUF file is converted
once into one, in the model cache, and served from there. ``convert_gguf``:

1. reads the file's metadata and tensor table (the ``gguf`` package; the weights stay memory-mapped);
2. checks the architecture (``general.architecture``: ``llama`` or ``qwen2``), that every tensor has
   a name this converter maps and a type it can dequantize, and refuses anything else with
   ``UnsupportedModelError`` naming the tensor and type;
3. writes ``config.json`` and ``generation_config.json`` from the metadata;
4. dequantizes every tensor to float32 (then the chosen dtype), undoes llama.cpp's row permutation
   of the Llama q/k projections (its RoPE pairs dimensions ``2i, 2i+1``; Hugging Face's pairs
   ``i, i + d/2``), and writes ``model.safetensors``;
5. rebuilds the tokenizer (vocabulary, merges, special tokens) and its chat template from the
   metadata with transformers' GGUF tokenizer converter and saves it beside the weights.

The output depends only on the file and the dtype (no timestamps, no randomness), so a second
conversion writes the same bytes. ``ensure_gguf_model`` caches it under the model cache.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pdserve.engine.errors import ModelLoadError, UnsupportedModelError
from pdserve.engine.model_cache import cached_model, default_cache_dir

logger = logging.getLogger(__name__)

CONVERTER_VERSION = 1   # part of the cache key: bump when the output of a conversion changes
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
ARCHITECTURES = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2")}

# GGUF tensor name -> Hugging Face name; "{i}" is the layer index.
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def _gguf():
    try:
        import gguf
    except ImportError as exc:  # a dependency of pdserve: only a broken install lacks it
        raise ModelLoadError("reading GGUF files needs the 'gguf' package (run `make setup`)") from exc
    return gguf


@dataclass(frozen=True, slots=True)
class GGUFFile:
    """A GGUF file's metadata (plain Python values) and tensors, checked for conversion."""

    path: Path
    arch: str
    metadata: dict[str, Any]
    tensors: dict[str, Any]        # HF name -> gguf ReaderTensor

    def meta(self, key: str, default: Any = None, *, arch_key: bool = True) -> Any:
        return self.metadata.get(f"{self.arch}.{key}" if arch_key else key, default)

    def need(self, key: str) -> Any:
        full = f"{self.arch}.{key}"
        if full not in self.metadata:
            raise ModelLoadError(f"{self.path}: GGUF metadata lacks {full!r}")
        return self.metadata[full]


def read_gguf(path: str | Path) -> GGUFFile:
    """Open ``path`` and check that it can be converted (architecture, tensor names and types)."""
    gguf = _gguf()
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {path} does not exist")
    try:
        reader = gguf.GGUFReader(str(path), "r")
    except Exception as exc:  # the reader raises ValueError, struct errors, OSError on bad files
        raise ModelLoadError(f"{path}: not a readable GGUF file: {exc}") from exc
    metadata: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        try:
            metadata[name] = field.contents()
        except Exception as exc:
            raise ModelLoadError(f"{path}: metadata field {name!r} cannot be read: {exc}") from exc
    arch = metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(f"{path}: GGUF architecture {arch!r} is not supported "
                                    f"(supported: {', '.join(sorted(ARCHITECTURES))})")
    tensors: dict[str, Any] = {}
    for t in reader.tensors:
        hf = _hf_name(t.name)
        if hf is None:
            raise UnsupportedModelError(f"{path}: tensor {t.name!r} has no Hugging Face counterpart in a "
                                        f"{arch} model (rope_freqs and other extras are not supported)")
        if not _can_dequantize(gguf, t.tensor_type):
            raise UnsupportedModelError(f"{path}: tensor {t.name!r} is of type {t.tensor_type.name}, which "
                                        "the gguf package cannot dequantize; convert the file with another "
                                        "quantisation (F32, F16, BF16, Q8_0, Q4_0/1, Q5_0/1 and the K-quants work)")
        tensors[hf] = t
    return GGUFFile(path, arch, metadata, tensors)


def _hf_name(name: str) -> str | None:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{int(parts[1])}.{_LAYER_NAMES[parts[2]]}"
    return None


def _can_dequantize(gguf: Any, qtype: Any) -> bool:
    plain = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
    return qtype in plain or qtype in gguf.quants._type_traits


def hf_config(f: GGUFFile, dtype: str) -> dict[str, Any]:
    """``config.json`` for the converted directory."""
    arch_name, model_type = ARCHITECTURES[f.arch]
    heads = int(f.need("attention.head_count"))
    hidden = int(f.need("embedding_length"))
    embed = f.tensors.get("model.embed_tokens.weight")
    if embed is None:
        raise ModelLoadError(f"{f.path}: no token_embd.weight tensor")
    vocab = int(embed.shape[1])  # GGUF shapes list the fastest-moving dimension first
    head_dim = int(f.meta("attention.key_length") or hidden // heads)
    cfg: dict[str, Any] = {
        "architectures": [arch_name],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(f.need("feed_forward_length")),
        "num_hidden_layers": int(f.need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(f.meta("attention.head_count_kv") or heads),
        "head_dim": head_dim,
        "max_position_embeddings": int(f.need("context_length")),
        "rms_norm_eps": _f32(f.meta("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": _f32(f.meta("rope.freq_base", 10000.0)),
        "vocab_size": vocab,
        "hidden_act": "silu",
        "tie_word_embeddings": "lm_head.weight" not in f.tensors,
        "torch_dtype": dtype,
    }
    if f.arch == "llama":
        cfg["attention_bias"] = "model.layers.0.self_attn.q_proj.bias" in f.tensors
        cfg["mlp_bias"] = False
    rope_dims = f.meta("rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim:
        raise UnsupportedModelError(f"{f.path}: partial rotary embeddings (rope.dimension_count {rope_dims} "
                                    f"of head_dim {head_dim}) are not supported")
    scaling = f.meta("rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise UnsupportedModelError(f"{f.path}: rope scaling {scaling!r} is not supported (only 'linear')")
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(f.need("rope.scaling.factor"))}
    for key, hf in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                    ("padding_token_id", "pad_token_id")):
        value = f.meta(f"tokenizer.ggml.{key}", arch_key=False)
        if value is not None:
            cfg[hf] = int(value)
    return cfg


def _f32(value: Any) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(value)))


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order: within each head, rows ``(2i, 2i+1)`` go back to ``(i, i+d/2)``."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_tensors(f: GGUFFile, cfg: dict[str, Any], dtype: str,
               progress: Callable[[str], None] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor dequantized, in Hugging Face names, shapes and row order."""
    gguf = _gguf()
    out: dict[str, torch.Tensor] = {}
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    for name in sorted(f.tensors):
        t = f.tensors[name]
        try:
            w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        except Exception as exc:
            raise ModelLoadError(f"{f.path}: tensor for {name} ({t.tensor_type.name}) could not be "
                                 f"dequantized: {exc}") from exc
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        if w.size != int(np.prod(shape)):
            raise ModelLoadError(f"{f.path}: tensor for {name} holds {w.size} values, its shape says {shape}")
        w = w.reshape(shape)
        if f.arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = _unpermute(w, heads)
        elif f.arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = _unpermute(w, kv_heads)
        out[name] = torch.from_numpy(np.require(w, requirements=["C", "W"])).to(DTYPES[dtype])
        if progress is not None:
            progress(name)
    return out


def _save_tokenizer(f: GGUFFile, out: Path) -> None:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(f.path.parent), gguf_file=f.path.name, local_files_only=True)
    except Exception as exc:  # transformers raises many types for tokenizers it cannot rebuild
        raise UnsupportedModelError(f"{f.path}: the tokenizer in its metadata cannot be rebuilt "
                                    f"(tokenizer.ggml.model {f.meta('tokenizer.ggml.model', arch_key=False)!r}): "
                                    f"{exc}") from exc
    template = f.meta("tokenizer.chat_template", arch_key=False)
    if template and not getattr(tok, "chat_template", None):
        tok.chat_template = template
    tok.save_pretrained(str(out))


def convert_gguf(path: str | Path, out: str | Path, dtype: str = "float32") -> Path:
    """Write a Hugging Face directory converted from the GGUF file ``path`` as ``out`` (which must
    not exist, or be empty); returns ``out``. It is built beside ``out`` and renamed into place
    when complete, so a failed conversion leaves nothing behind."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    f = read_gguf(path)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ModelLoadError(f"{out} exists and is not an empty directory; give a new directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        _write_hf(f, tmp, dtype)
        tmp.chmod(0o755)
        os.rename(tmp, out)   # replaces an empty directory
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write_hf(f: GGUFFile, out: Path, dtype: str) -> None:
    from safetensors.torch import save_file

    cfg = hf_config(f, dtype)
    tensors = hf_tensors(f, cfg, dtype)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in cfg}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")
    _save_tokenizer(f, out)
    logger.info("converted %s (%s, %d tensors) into %s (%s)", f.path, f.arch, len(tensors), out, dtype)


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def gguf_cache_key(path: Path, dtype: str) -> str:
    """Cache directory name: the file's name and content digest, the dtype and the converter version."""
    stem = "".join(c if c.isalnum() or c in "-_." else "-" for c in path.stem.lower())[:60]
    return f"gguf-{stem}-{dtype}-c{CONVERTER_VERSION}-{file_digest(path)[:12]}"


def ensure_gguf_model(path: str | Path, dtype: str = "float32", cache_dir: str | Path | None = None) -> Path:
    """The converted directory of ``path`` in the model cache, converting it on first use (a file
    lock serialises processes that race; the result is renamed into place only when complete)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {path} does not exist")
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final, _ = cached_model(root, gguf_cache_key(path, dtype), lambda tmp: _write_hf(read_gguf(path), tmp, dtype))
    return final

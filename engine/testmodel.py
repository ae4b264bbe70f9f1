"""Deterministic random-weight test models in Hugging Face format (``pdserve make-model``).

``make_model`` writes config.json, model.safetensors (fp32), generation_config.json and the
tokenizer files of ``tokenizer_train`` into a directory that ``transformers`` loads offline
(``LlamaForCausalLM`` or ``Qwen2ForCausalLM``). Same arguments give byte-identical files: each
tensor is drawn from its own ``torch.Generator`` seeded by (seed, tensor name).

Initialisation: the usual N(0, 0.02) makes a random model repeat one token forever. Here each
matrix is scaled to its fan-in. Queries and keys are larger (attention-logit std ~4), so attention
is peaked and depends on content and position, which makes KV-cache bugs visible. Attention adds
less to the residual stream than the MLP, because attention averages over positions and, stacked
30 layers deep, would otherwise push every position towards one shared vector (one repeated
token). Embeddings are small next to the layers' outputs, so a tied head does not simply predict
the current token again. RMSNorm weights are jittered around 1 (an engine that ignores them gets
other logits) and the head is scaled for a logit std of ~4: clear top-1/top-2 gaps, finite in bf16.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pdserve.engine.model_cache import cached_model, default_cache_dir  # noqa: F401  (re-exported)
from pdserve.engine import tokenizer_train as tt

logger = logging.getLogger(__name__)

GENERATOR_VERSION = 2  # bump when the output of make_model changes for the same arguments
ARCHES: tuple[str, ...] = ("llama", "qwen2")
_EMBED_STD = 0.3
_QK_GAIN = 2.0  # query/key element std; attention-logit std is about _QK_GAIN**2
_ATTN_OUT_GAIN = 1.0  # o_proj std * sqrt(fan_in)
_MLP_OUT_GAIN = 2.0  # down_proj std * sqrt(fan_in)
_LOGIT_STD = 4.0
_NORM_JITTER = 0.2  # RMSNorm weights are uniform in [1 - j, 1 + j]
_BIAS_STD = 0.5  # qwen2 q/k/v biases


@dataclass(frozen=True, slots=True)
class ModelPreset:
    """Shape of one generated model; ``vocab_size`` is the tokenizer's training target."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        sizes = (self.hidden_size, self.num_layers, self.num_heads, self.num_kv_heads, self.intermediate_size)
        if min(sizes) <= 0 or self.max_position_embeddings <= 0 or self.rope_theta <= 0:
            raise ValueError(f"preset {self.name!r}: sizes must be positive")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(f"preset {self.name!r}: heads must divide hidden_size and kv heads divide heads")
        if self.vocab_size < 512:
            raise ValueError(f"preset {self.name!r}: vocab_size must be >= 512")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def num_params(self, vocab_size: int | None = None, *, qkv_bias: bool = False) -> int:
        """Parameter count for a vocabulary size (default: the preset's target)."""
        v, h, d = vocab_size or self.vocab_size, self.hidden_size, self.head_dim
        q, kv = self.num_heads * d, self.num_kv_heads * d
        layer = h * q * 2 + h * kv * 2 + 3 * h * self.intermediate_size + 2 * h
        layer += (q + 2 * kv) if qkv_bias else 0
        return self.num_layers * layer + h + v * h * (1 if self.tie_word_embeddings else 2)


PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        ModelPreset("tiny", 256, 4, 4, 2, 768, 4096, 4096, tie_word_embeddings=False),
        ModelPreset("small", 576, 30, 9, 3, 1536, 8192, 8192, tie_word_embeddings=True),
        ModelPreset("medium", 1024, 26, 16, 8, 4096, 8192, 8192, tie_word_embeddings=False),
    )
}


def _check_args(preset: str, arch: str, rope_scaling: dict | None) -> ModelPreset:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    if arch not in ARCHES:
        raise ValueError(f"unknown arch {arch!r}; choose one of {list(ARCHES)}")
    if rope_scaling is not None:
        need = {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
        if rope_scaling.get("rope_type", "llama3") != "llama3" or not need <= rope_scaling.keys():
            raise ValueError(f"rope_scaling must be a llama3-style dict with keys {sorted(need)}")
    return PRESETS[preset]


def _tensor_specs(p: ModelPreset, vocab: int, arch: str) -> list[tuple[str, tuple[int, ...], str, float]]:
    """(name, shape, kind, scale) for every tensor, in the order they are written."""
    h, q, kv, inter = p.hidden_size, p.num_heads * p.head_dim, p.num_kv_heads * p.head_dim, p.intermediate_size
    specs: list[tuple[str, tuple[int, ...], str, float]] = [
        ("model.embed_tokens.weight", (vocab, h), "normal", _EMBED_STD)
    ]
    for i in range(p.num_layers):
        pre = f"model.layers.{i}."
        specs += [
            (pre + "input_layernorm.weight", (h,), "norm", 1.0),
            (pre + "self_attn.q_proj.weight", (q, h), "normal", _QK_GAIN / math.sqrt(h)),
            (pre + "self_attn.k_proj.weight", (kv, h), "normal", _QK_GAIN / math.sqrt(h)),
            (pre + "self_attn.v_proj.weight", (kv, h), "normal", 1.0 / math.sqrt(h)),
            (pre + "self_attn.o_proj.weight", (h, q), "normal", _ATTN_OUT_GAIN / math.sqrt(q)),
            (pre + "post_attention_layernorm.weight", (h,), "norm", 1.0),
            (pre + "mlp.gate_proj.weight", (inter, h), "normal", 1.0 / math.sqrt(h)),
            (pre + "mlp.up_proj.weight", (inter, h), "normal", 1.0 / math.sqrt(h)),
            (pre + "mlp.down_proj.weight", (h, inter), "normal", _MLP_OUT_GAIN / math.sqrt(inter)),
        ]
        if arch == "qwen2":
            specs += [
                (pre + f"self_attn.{n}_proj.bias", (d,), "normal", _BIAS_STD)
                for n, d in (("q", q), ("k", kv), ("v", kv))
            ]
    if p.tie_word_embeddings:  # logits = embed @ norm(h): the final norm sets their scale
        specs.append(("model.norm.weight", (h,), "norm", _LOGIT_STD / (_EMBED_STD * math.sqrt(h))))
    else:
        specs.append(("model.norm.weight", (h,), "norm", 1.0))
        specs.append(("lm_head.weight", (vocab, h), "normal", _LOGIT_STD / math.sqrt(h)))
    return sorted(specs)


def _make_tensor(name: str, shape: tuple[int, ...], kind: str, scale: float, seed: int):  # -> torch.Tensor
    import torch

    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    if kind == "norm":
        jitter = torch.rand(shape, generator=gen, dtype=torch.float32) * (2 * _NORM_JITTER) - _NORM_JITTER
        return (1.0 + jitter) * scale
    return torch.randn(shape, generator=gen, dtype=torch.float32) * scale


def _write_safetensors(path: Path, specs: list, seed: int) -> int:
    """Stream tensors into a safetensors file one at a time; returns the data bytes written."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, _, _ in specs:
        nbytes = 4 * math.prod(shape)
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, shape, kind, scale in specs:
            f.write(_make_tensor(name, shape, kind, scale, seed).numpy().astype("<f4", copy=False).tobytes())
    return offset


def _dump(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _config(p: ModelPreset, arch: str, vocab: int, ids: tt.SpecialTokenIds, rope_scaling: dict | None) -> dict:
    cfg: dict[str, object] = {
        "architectures": ["LlamaForCausalLM" if arch == "llama" else "Qwen2ForCausalLM"],
        "model_type": arch,
        "attention_dropout": 0.0,
        "bos_token_id": ids.bos,
        "eos_token_id": [ids.eos, ids.im_end],
        "pad_token_id": ids.pad,
        "head_dim": p.head_dim,
        "hidden_act": "silu",
        "hidden_size": p.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": p.intermediate_size,
        "max_position_embeddings": p.max_position_embeddings,
        "num_attention_heads": p.num_heads,
        "num_hidden_layers": p.num_layers,
        "num_key_value_heads": p.num_kv_heads,
        "rms_norm_eps": 1e-5 if arch == "llama" else 1e-6,
        "rope_scaling": None if rope_scaling is None else {"rope_type": "llama3", **rope_scaling},
        "rope_theta": p.rope_theta,
        "tie_word_embeddings": p.tie_word_embeddings,
        "torch_dtype": "float32",
        "use_cache": True,
        "vocab_size": vocab,
    }
    if arch == "llama":
        cfg.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    else:
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=p.num_layers)
    return cfg


def make_model(
    out_dir: str | Path,
    preset: str = "tiny",
    arch: str = "llama",
    seed: int = 0,
    *,
    rope_scaling: dict | None = None,
) -> Path:
    """Write a random-weight checkpoint into ``out_dir`` (created; our files overwritten); return it.

    ``rope_scaling`` is a llama3-style dict (factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings) written into config.json as ``rope_scaling``.
    """
    p = _check_args(preset, arch, rope_scaling)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with_bos = arch == "llama"
    tok = tt.train_tokenizer(p.vocab_size, with_bos=with_bos)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    ids = tt.special_token_ids(tok)
    tt.write_tokenizer_files(out, tok, with_bos=with_bos, model_max_length=p.max_position_embeddings)
    _dump(out / "config.json", _config(p, arch, vocab, ids, rope_scaling))
    gen_cfg = {
        "bos_token_id": ids.bos,
        "eos_token_id": [ids.eos, ids.im_end],
        "pad_token_id": ids.pad,
        "do_sample": False,
    }
    _dump(out / "generation_config.json", gen_cfg)
    nbytes = _write_safetensors(out / "model.safetensors", _tensor_specs(p, vocab, arch), seed)
    logger.info("wrote %s %s (seed %d, vocab %d, %d weight bytes) to %s", arch, preset, seed, vocab, nbytes, out)
    return out


def cache_key(preset: str, arch: str = "llama", *, seed: int = 0, rope_scaling: dict | None = None) -> str:
    """Directory name of a cached model; changes with GENERATOR_VERSION, the corpus and the options."""
    _check_args(preset, arch, rope_scaling)
    init = [_EMBED_STD, _QK_GAIN, _ATTN_OUT_GAIN, _MLP_OUT_GAIN, _LOGIT_STD, _NORM_JITTER, _BIAS_STD]
    extra = json.dumps([tt.corpus_digest(), rope_scaling, init], sort_keys=True)
    return f"{arch}-{preset}-s{seed}-g{GENERATOR_VERSION}-{hashlib.sha256(extra.encode()).hexdigest()[:10]}"


def ensure_model(
    preset: str,
    arch: str = "llama",
    cache_dir: str | Path | None = None,
    *,
    seed: int = 0,
    rope_scaling: dict | None = None,
) -> Path:
    """Return a cached model directory, generating it on first use.

    Safe when several processes race: a file lock serialises generation, and the model is built
    in a temporary directory that is renamed into place only when complete.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    key = cache_key(preset, arch, seed=seed, rope_scaling=rope_scaling)
    final, built = cached_model(root, key, lambda tmp: make_model(tmp, preset, arch, seed, rope_scaling=rope_scaling))
    if built:
        logger.info("generated test model %s", final)
    return final


def add_make_model_args(parser: argparse.ArgumentParser) -> None:
    """Add the ``pdserve make-model`` options to ``parser``."""
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="model shape (default: tiny)")
    parser.add_argument("--arch", choices=ARCHES, default="llama", help="architecture (default: llama)")
    parser.add_argument("--out", required=True, type=Path, help="directory to write the checkpoint into")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default: 0)")


def run_make_model(args: argparse.Namespace) -> int:
    """CLI action: generate the model and print a one-line summary; returns the exit code."""
    start = time.perf_counter()
    try:
        out = make_model(args.out, args.preset, args.arch, args.seed)
    except (ValueError, OSError) as e:
        print(f"make-model: error: {e}", file=sys.stderr)
        return 2
    cfg = json.loads((out / "config.json").read_text())
    p = PRESETS[args.preset]
    n = p.num_params(cfg["vocab_size"], qkv_bias=args.arch == "qwen2")
    print(
        f"wrote {args.arch}/{args.preset} seed={args.seed}: {n / 1e6:.1f}M params, {4 * n / 1e6:.1f} MB fp32, "
        f"vocab {cfg['vocab_size']}, in {time.perf_counter() - start:.1f}s -> {out}"
    )
    return 0

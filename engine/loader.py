"""Read a Hugging Face Llama-family checkpoint: config.json -> ModelSpec, safetensors -> ModelWeights.

Supported architectures share one forward pass (GQA, RMSNorm, SwiGLU, RoPE): Llama, Mistral, Qwen2
(q/k/v biases). Every failure raises ``ModelLoadError`` (or ``UnsupportedModelError``) naming the
file and field to fix. At load time q/k/v are fused into one weight and gate/up into another, so the
forward pass runs two matmuls where the checkpoint has five.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pdserve.engine.errors import ModelLoadError, UnsupportedModelError

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """The shape of a checkpoint, as the runner and the KV layout need it."""

    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "vocab_size", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelSpec.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope(cfg: dict[str, Any], path: Path) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) from transformers 4 (rope_theta + rope_scaling) or 5
    (rope_parameters) configs."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or None
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if scaling is None and params.get("rope_type", params.get("type", "default")) != "default":
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling is None:
        return theta, None
    scaling = dict(scaling)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    scaling["rope_type"] = rope_type
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"{path}: rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    if rope_type == "default":
        return theta, None
    need = ["factor"] + (["low_freq_factor", "high_freq_factor", "original_max_position_embeddings"]
                         if rope_type == "llama3" else [])
    missing = [k for k in need if k not in scaling]
    if missing:
        raise ModelLoadError(f"{path}: rope scaling {rope_type!r} lacks field(s) {missing}")
    return theta, scaling


def load_model_spec(model_dir: str | Path) -> ModelSpec:
    """Parse ``model_dir/config.json`` (and generation_config.json for extra EOS ids)."""
    root = Path(model_dir)
    if not root.is_dir():
        raise ModelLoadError(f"model directory {root} does not exist or is not a directory")
    path = root / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{path} not found: a Hugging Face checkpoint needs config.json")
    cfg = _read_json(path)
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise UnsupportedModelError(
            f"{path}: architectures={archs!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"{path}: hidden_act={cfg['hidden_act']!r}; only 'silu' is supported")
    if cfg.get("mlp_bias"):
        raise UnsupportedModelError(f"{path}: mlp_bias=true is not supported")
    theta, scaling = _rope(cfg, path)
    eos = list(_ids(cfg.get("eos_token_id")))
    gen_path = root / "generation_config.json"
    if gen_path.is_file():
        eos += [i for i in _ids(_read_json(gen_path).get("eos_token_id")) if i not in eos]
    try:
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        max_pos = int(cfg.get("max_position_embeddings", 2048))
        window = cfg.get("sliding_window")
        if window and cfg.get("use_sliding_window", arch == "MistralForCausalLM") and window < max_pos:
            logger.info("%s: sliding_window=%d is not implemented; capping the context at it", path, window)
            max_pos = int(window)
        return ModelSpec(
            architecture=arch,
            hidden_size=hidden,
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            max_position_embeddings=max_pos,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            eos_token_ids=tuple(eos),
            bos_token_id=cfg.get("bos_token_id"),
        )
    except KeyError as exc:
        raise ModelLoadError(f"{path} lacks required field {exc.args[0]!r}") from exc
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"{path}: invalid value: {exc}") from exc


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor      # [hidden]
    qkv: torch.Tensor             # [(heads + 2 * kv_heads) * head_dim, hidden]
    qkv_bias: torch.Tensor | None
    o: torch.Tensor               # [hidden, heads * head_dim]
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor       # [hidden]
    gate_up: torch.Tensor         # [2 * intermediate, hidden]
    down: torch.Tensor            # [hidden, intermediate]


@dataclass(slots=True)
class ModelWeights:
    embed: torch.Tensor           # [vocab, hidden]
    layers: list[LayerWeights]
    norm: torch.Tensor            # [hidden]
    lm_head: torch.Tensor         # [vocab, hidden]; the same tensor as embed when tied


def _expected_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    h, d, inter = spec.hidden_size, spec.head_dim, spec.intermediate_size
    q, kv = spec.num_heads * d, spec.num_kv_heads * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab_size, h),
                                          "model.norm.weight": (h,)}
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, h)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                   p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                   p + "mlp.down_proj.weight": (h, inter)}
        if spec.attention_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,)}
    return shapes


def _weight_files(root: Path) -> dict[str, Path]:
    """Map every tensor name to the safetensors file holding it."""
    from safetensors import SafetensorError, safe_open

    index = root / "model.safetensors.index.json"
    single = root / "model.safetensors"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{index} lacks a 'weight_map' object")
        files = {name: root / fname for name, fname in weight_map.items()}
        for f in sorted(set(files.values())):
            if not f.is_file():
                raise ModelLoadError(f"{index} names shard {f.name}, which is missing from {root}")
        return files
    if not single.is_file():
        raise ModelLoadError(f"no weights in {root}: expected model.safetensors or "
                             "model.safetensors.index.json (only safetensors checkpoints are supported)")
    try:
        with safe_open(str(single), framework="pt") as f:
            return {name: single for name in f.keys()}
    except (SafetensorError, OSError) as exc:
        raise ModelLoadError(f"{single} is not a valid safetensors file ({exc}); re-download or "
                             "re-save the checkpoint") from exc


def load_weights(model_dir: str | Path, spec: ModelSpec, dtype: str = "float32",
                 device: str = "cpu") -> ModelWeights:
    """Read, validate (names and shapes) and fuse the checkpoint's tensors."""
    from safetensors import SafetensorError, safe_open

    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    root = Path(model_dir)
    files = _weight_files(root)
    shapes = _expected_shapes(spec)
    missing = [n for n in shapes if n not in files]
    if missing:
        raise ModelLoadError(f"checkpoint {root} lacks {len(missing)} tensor(s) the "
                             f"{spec.architecture} config implies, e.g. {missing[:5]}")
    wanted = list(shapes)
    optional = [n for n in files if n.endswith("self_attn.o_proj.bias")]  # Llama attention_bias=true
    by_file: dict[Path, list[str]] = {}
    for name in wanted + optional:
        by_file.setdefault(files[name], []).append(name)
    tensors: dict[str, torch.Tensor] = {}
    target = _DTYPES[dtype]
    for path, names in by_file.items():
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in names:
                    tensors[name] = f.get_tensor(name).to(dtype=target, device=device)
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise ModelLoadError(f"cannot read tensors from {path} ({exc}); the file may be truncated "
                                 "or corrupt") from exc
    for name, shape in shapes.items():
        if tuple(tensors[name].shape) != shape:
            raise ModelLoadError(f"{files[name]}: tensor {name} has shape {tuple(tensors[name].shape)}, "
                                 f"but config.json implies {shape}")
    return _fuse(tensors, spec)


def _fuse(t: dict[str, torch.Tensor], spec: ModelSpec) -> ModelWeights:
    layers = []
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        bias = (torch.cat([t.pop(a + x + "_proj.bias") for x in "qkv"]) if spec.attention_bias else None)
        layers.append(LayerWeights(
            input_norm=t.pop(p + "input_layernorm.weight"),
            qkv=torch.cat([t.pop(a + x + "_proj.weight") for x in "qkv"]).contiguous(),
            qkv_bias=bias,
            o=t.pop(a + "o_proj.weight").contiguous(),
            o_bias=t.pop(a + "o_proj.bias", None),
            post_norm=t.pop(p + "post_attention_layernorm.weight"),
            gate_up=torch.cat([t.pop(p + "mlp.gate_proj.weight"), t.pop(p + "mlp.up_proj.weight")]).contiguous(),
            down=t.pop(p + "mlp.down_proj.weight").contiguous(),
        ))
    embed = t.pop("model.embed_tokens.weight").contiguous()
    lm_head = embed if spec.tie_word_embeddings else t.pop("lm_head.weight").contiguous()
    return ModelWeights(embed=embed, layers=layers, norm=t.pop("model.norm.weight"), lm_head=lm_head)

"""Cost accounting and the printed table of ``pdserve bench engine``.

Weight bytes per decoded token (the batch-1 roofline's denominator) count every parameter the
forward pass *streams*: all decoder-layer tensors, the final norm and the LM head. The embedding
table is excluded: a decode step gathers one row of it per token, it does not read it whole. With
tied embeddings the shared matrix is counted once, as the LM head (the logits read all of it).
The KV cache read per token is reported apart (``kv_bytes_per_token``) and not in the roofline.

Prefill FLOPs of one ``L``-token prompt: ``2 * layer_matmul_params * L`` for the projections,
``2 * vocab * hidden`` for the LM head of the one sampled token, and the causal attention
``4 * num_heads * head_dim * L * (L + 1) / 2`` per layer (QK^T and PV over the lower triangle only:
the useful work, whatever an implementation spends on masked positions).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

_ELEM_BYTES = {"float32": 4, "bfloat16": 2}


@dataclass(frozen=True, slots=True)
class ModelCost:
    name: str
    total_params: int
    embed_params: int
    lm_head_params: int          # equal to embed_params when tied
    layer_matmul_params: int     # 2-D weights inside the decoder layers
    streamed_params: int         # read once per decode step: everything except the embedding gather
    tied: bool
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    def weight_bytes_per_token(self, dtype: str) -> int:
        return self.streamed_params * _ELEM_BYTES[dtype]

    def kv_bytes_per_token(self, dtype: str) -> int:
        """K and V of one position, all layers (written once, read by every later step)."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * _ELEM_BYTES[dtype]

    def prefill_flops(self, num_tokens: int) -> float:
        n = num_tokens
        proj = 2.0 * self.layer_matmul_params * n
        head = 2.0 * self.lm_head_params
        attn = self.num_layers * 4.0 * self.num_heads * self.head_dim * n * (n + 1) / 2
        return proj + head + attn

    def to_dict(self) -> dict:
        return asdict(self)


def model_cost(model_dir: str | Path, name: str) -> ModelCost:
    """Count parameters from the safetensors headers (no weights are loaded)."""
    header = _safetensors_shapes(Path(model_dir) / "model.safetensors")
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    numel = {k: _prod(v) for k, v in header.items()}
    total = sum(numel.values())
    embed = numel["model.embed_tokens.weight"]
    tied = "lm_head.weight" not in numel
    lm_head = embed if tied else numel["lm_head.weight"]
    layer_mm = sum(n for k, n in numel.items() if k.startswith("model.layers.") and len(header[k]) == 2)
    streamed = total - embed + (lm_head if tied else 0)
    heads = cfg["num_attention_heads"]
    return ModelCost(
        name=name, total_params=total, embed_params=embed, lm_head_params=lm_head,
        layer_matmul_params=layer_mm, streamed_params=streamed, tied=tied,
        num_layers=cfg["num_hidden_layers"], num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads", heads),
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
    )


def _safetensors_shapes(path: Path) -> dict[str, list[int]]:
    with path.open("rb") as f:
        n = int.from_bytes(f.read(8), "little")
        meta = json.loads(f.read(n))
    return {k: v["shape"] for k, v in meta.items() if k != "__metadata__"}


def _prod(shape: list[int]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def format_table(result: dict) -> str:
    """A readable summary of one ``bench engine`` result (all dtypes)."""
    lines = [
        (f"pdserve bench engine  {result['date']}  torch {result['torch_version']}  "
         f"threads {result['threads']}  cpu {result['cpu_model']} x{result['cpu_count']}  "
         f"load avg {result['load_avg_start']:.1f} -> {result['load_avg_end']:.1f}"),
        f"copy bandwidth {result['hw']['copy_gbs']:.1f} GB/s (read+write), read {result['hw']['read_gbs']:.1f} GB/s; "
        + ", ".join(f"matmul {d} {g:.0f} GFLOP/s" for d, g in result["hw"]["matmul_gflops"].items()),
    ]
    for dtype, r in result["by_dtype"].items():
        lines.append("")
        lines.append(f"== {dtype} ==")
        m = r["medium"]
        lines.append(
            f"medium batch-1 decode: {_fmt(m['decode_tok_s'])} tok/s, roofline {_fmt(m['roofline_tok_s'])} tok/s "
            f"({m['weight_bytes_per_token'] / 1e6:.0f} MB/token) -> decode_roofline_ratio "
            f"{_fmt(r['decode_roofline_ratio'], '.2f')}; transformers {_fmt(m.get('hf_decode_tok_s'))} tok/s"
        )
        lines.append(
            f"  read of a weight-sized buffer between steps: {_fmt(m['roofline_interleaved_tok_s'])} /s -> "
            f"decode_roofline_ratio_interleaved {_fmt(r['decode_roofline_ratio_interleaved'], '.2f')}"
        )
        s = r["small"]
        lines.append(f"small decode (prompt {s['prompt_len']}, {s['decode_tokens']} tokens, median step, "
                     f"{s.get('attention_backend', 'sdpa')} attention):")
        lines.append(f"  {'batch':>5} {'pdserve':>9} {'runner':>9} {'overhead':>8} {'HF':>9} {'vs HF':>6}  (tok/s)")
        for row in s["decode"]:
            lines.append(
                f"  {row['batch']:>5} {_fmt(row['tok_s']):>9} {_fmt(row['runner_tok_s']):>9} "
                f"{_fmt(row['engine_overhead_frac'] * 100, '.0f') + '%':>8} {_fmt(row.get('hf_tok_s')):>9} "
                f"{_fmt(row.get('vs_hf'), '.2f'):>6}"
            )
        if any("native_over_sdpa" in row for row in s["decode"]):
            lines.append("  native attention over sdpa (same prompts, stepped in turn): " + ", ".join(
                f"batch {row['batch']} {row['native_over_sdpa']:.2f}x" for row in s["decode"]))
        lines.append(f"small prefill (one prompt, best of {s['prefill_repeats']}):")
        lines.append(f"  {'tokens':>6} {'pdserve':>9} {'HF':>9} {'vs HF':>6} {'GFLOP/s':>8} {'of peak':>7}")
        for row in s["prefill"]:
            lines.append(
                f"  {row['tokens']:>6} {_fmt(row['tok_s']):>9} {_fmt(row.get('hf_tok_s')):>9} "
                f"{_fmt(row.get('vs_hf'), '.2f'):>6} {_fmt(row['gflops'], '.0f'):>8} "
                f"{_fmt(row['matmul_ratio'], '.2f'):>7}"
            )
        lines.append(
            f"headline: decode_roofline_ratio {_fmt(r['decode_roofline_ratio'], '.2f')}, "
            f"decode_batch32_over_batch1 {_fmt(r['decode_batch32_over_batch1'], '.1f')}, "
            f"prefill_matmul_ratio {_fmt(r['prefill_matmul_ratio'], '.2f')}, "
            f"vs_hf_decode_batch1 {_fmt(r['vs_hf_decode_batch1'], '.2f')}, "
            f"vs_hf_decode_batch32 {_fmt(r['vs_hf_decode_batch32'], '.2f')}"
        )
    return "\n".join(lines)

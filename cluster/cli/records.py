"""A request's phase record as the commands print it (``pdserve generate``, ``pdserve demo``)."""

from __future__ import annotations


def format_phase_record(phase: dict, load_s: float | None = None) -> str:
    """Ollama-style lines: load, prefill N tokens in T s = X tokens/s, decode M tokens in T s = Y tokens/s."""
    lines = []
    if load_s is not None:
        lines.append(f"load:    {load_s:.2f} s")
    prompt = phase.get("prompt_tokens", 0)
    cached = phase.get("cached_prompt_tokens", 0)
    pre = phase.get("prefill_s") or 0.0
    computed = prompt - cached
    rate = f" = {computed / pre:.0f} tokens/s" if pre > 0 else ""
    lines.append(f"queue:   {phase.get('queue_s', 0.0):.3f} s")
    lines.append(f"prefill: {prompt} tokens ({cached} cached) in {pre:.3f} s{rate}")
    if phase.get("kv_bytes"):
        lines.append(f"kv:      {phase['kv_bytes'] / 1e6:.2f} MB moved in {phase.get('kv_transfer_s', 0.0):.4f} s")
    if phase.get("ttft_s") is not None:
        lines.append(f"ttft:    {phase['ttft_s']:.3f} s")
    out = phase.get("output_tokens", 0)
    dec = phase.get("decode_s") or 0.0
    drate = f" = {phase['decode_tokens_per_s']:.1f} tokens/s" if phase.get("decode_tokens_per_s") else ""
    lines.append(f"decode:  {out} tokens in {dec:.3f} s{drate}")
    lines.append(f"total:   {phase.get('total_s', 0.0):.3f} s, finish: {phase.get('finish_reason')}")
    return "\n".join(lines)

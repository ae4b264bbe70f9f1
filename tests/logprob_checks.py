"""Reference logprobs from transformers, and the rank check they allow.

A rank is 1 + the number of vocabulary tokens with a strictly higher logprob. Two correct
computations of the same logits (different threads, chunking or kernels) differ by ~1e-5, so
tokens whose logprobs lie that close may swap places: a random-weight model has thousands of
tokens within 1e-3 of each other. ``rank_band`` gives the ranks such a difference allows.
"""

from __future__ import annotations

from pathlib import Path

import torch


def transformers_logprobs(model_dir: str | Path, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] float32 log-softmax of transformers' logits for the prompt ``ids``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def rank_band(row: torch.Tensor, token: int, tol: float) -> range:
    """Ranks ``token`` may have when ``row`` is known to within ``tol``."""
    x = float(row[token])
    lo = int((row > x + tol).sum()) + 1
    hi = int((row > x - tol).sum()) + 1
    return range(lo, hi + 1)

"""Turns logits into tokens: greedy, temperature, top-k, top-p, per-request seeds, logprobs."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pdserve.engine.sequence import Sequence


def _step_seed(seed: int, step: int) -> int:
    """A seed for one sampling step, so a seeded request draws the same tokens even after a
    preemption or a migration to another worker (the draw depends only on seed and position)."""
    digest = hashlib.blake2b(f"{seed}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


class Sampler:
    """Stateless apart from one generator for unseeded requests."""

    def __init__(self, seed: int = 0) -> None:
        self._rng = torch.Generator().manual_seed(seed)

    @torch.inference_mode()
    def sample(
        self, logits: torch.Tensor, seqs: list[Sequence]
    ) -> tuple[list[int], list[dict[int, float] | None]]:
        """``logits`` is float32 ``[len(seqs), vocab]``; returns one token (and optional logprobs) per row."""
        logits = logits.float()
        if logits.device.type != "cpu":
            logits = logits.cpu()
        greedy_rows = [i for i, s in enumerate(seqs) if s.params.greedy]
        tokens: list[int] = [0] * len(seqs)
        if greedy_rows:
            if len(greedy_rows) == len(seqs):
                tokens = logits.argmax(dim=-1).tolist()
            else:
                picked = logits[greedy_rows].argmax(dim=-1).tolist()
                for i, tok in zip(greedy_rows, picked):
                    tokens[i] = tok
        for i, seq in enumerate(seqs):
            if not seq.params.greedy:
                tokens[i] = self._sample_row(logits[i], seq)
        logprobs: list[dict[int, float] | None] = [None] * len(seqs)
        want = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        if want:
            lp = torch.log_softmax(logits[want], dim=-1)
            for row, i in enumerate(want):
                k = seqs[i].params.logprobs or 0
                entry = {tokens[i]: float(lp[row, tokens[i]])}
                if k > 0:
                    vals, idx = lp[row].topk(k)
                    for v, t in zip(vals.tolist(), idx.tolist()):
                        entry.setdefault(t, v)
                logprobs[i] = entry
        return tokens, logprobs

    def _sample_row(self, row: torch.Tensor, seq: Sequence) -> int:
        p = seq.params
        scores = row / p.temperature
        if p.top_k > 0 and p.top_k < scores.numel():
            kth = torch.topk(scores, p.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_scores, order = torch.sort(scores, descending=True)
            probs = torch.softmax(sorted_scores, dim=-1)
            cum = probs.cumsum(dim=-1)
            # Drop a token when the mass before it already reaches top_p (always keeps the first).
            drop = (cum - probs) >= p.top_p
            sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
            scores = torch.full_like(scores, float("-inf")).scatter(0, order, sorted_scores)
        probs = torch.softmax(scores, dim=-1)
        if p.seed is not None:
            gen = torch.Generator().manual_seed(_step_seed(p.seed, len(seq.output_token_ids)))
        else:
            gen = self._rng
        return int(torch.multinomial(probs, 1, generator=gen).item())

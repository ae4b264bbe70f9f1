"""The model runner: the only engine component that touches torch.

``execute(items)`` runs one engine step: the tokens of every item are flattened into one
``[T, hidden]`` activation (so each weight is read once per step, whatever the batch), K/V of the
new tokens are written into the paged cache, attention reads each item's context through its block
table, and logits come back only for items that sample (float32, in item order).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from pdserve.engine.attention import PagedKVCache
from pdserve.engine.layers import DecoderLayer, RotaryTables, rms_norm
from pdserve.engine.cuda_numerics import disable_tf32
from pdserve.engine.dtype_probe import resolve_dtype
from pdserve.engine.kernel_select import KernelCache, KernelChoice, forced, select_kernels
from pdserve.engine.kv_index import HOST
from pdserve.engine.linear import LmHead, gemv_available, mkl_packed_available, packed_available
from pdserve.engine.loader import ModelSpec, load_model_spec, load_weights
from pdserve.engine.row_buckets import buckets_up_to, row_bucket

logger = logging.getLogger(__name__)

__all__ = ["ForwardItem", "ModelRunner", "ModelSpec", "load_model_spec"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class StepInterrupted(Exception):
    """``execute_scored``'s ``stop`` said so between two layers; the step's results are void."""


@dataclass(slots=True)
class ForwardItem:
    """Compute positions ``[start_pos, start_pos + len(token_ids))`` of one sequence, writing their
    K/V through ``block_table``; earlier positions are read from the cache."""

    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sample: bool
    # vLLM's prompt_logprobs: score row i against ``score_targets[i]`` (the token that follows it),
    # keeping the ``score_top`` most likely alternatives too.
    score_targets: list[int] | None = None
    score_top: int = 0
    score_from: int = 0  # the item's row the first target belongs to


class ModelRunner:
    """Loads a checkpoint and owns the KV cache ``[num_blocks, layers, 2, block_size, kv_heads, head_dim]``."""

    def __init__(self, model_dir: str | Path, *, dtype: str = "auto", device: str = "cpu",
                 block_size: int = 16, num_blocks: int | None = None, kv_cache_memory_gb: float = 1.0,
                 num_threads: int | None = None, linear_backend: str = "auto",
                 attention_backend: str = "auto") -> None:
        """``dtype``: "float32", "bfloat16" or "auto" (bf16 where this machine computes it natively,
        see ``engine/dtype_probe.py``).
        ``linear_backend``: "dense" (torch matmuls), "packed" (oneDNN-packed weights with fused
        epilogues, CPU only), "gemv" (the C++ few-row kernel for calls of <= 8 rows, dense above; CPU,
        needs the kernel library), "mkl_packed" (float32 weights packed once by MKL; CPU, needs the
        kernel library and a torch with MKL) or "auto" (each matmul call timed on this machine's real shapes at
        start, the fastest that agrees with float32 kept and cached: ``engine/kernel_select.py``).
        ``attention_backend``: "native" (C++ decode attention reading the paged cache in place),
        "sdpa" (gather + torch SDPA), "flex" or "varlen" (packed contexts, ``engine/attention_packed.py``)
        or "auto" (native when its library is built, on CPU; else sdpa).
        ``device``: every tensor the runner makes is placed on it (or on the host, for a step's
        plan), never on torch's default device."""
        if linear_backend not in ("auto", "dense", "packed", "gemv", "mkl_packed"):
            raise ValueError(f"linear_backend must be 'auto', 'dense', 'packed', 'gemv' or 'mkl_packed', got {linear_backend!r}")
        if dtype not in (*_DTYPES, "auto"):
            raise ValueError(f"dtype must be 'auto', 'float32' or 'bfloat16', got {dtype!r}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        self.num_threads = torch.get_num_threads()
        self.dtype_name = dtype = resolve_dtype(dtype, torch.device(device).type)
        self.spec = spec = load_model_spec(model_dir)
        self.dtype, self.device, self.block_size = _DTYPES[dtype], torch.device(device), block_size
        if self.device.type == "cuda":
            disable_tf32()   # dtype float32 means IEEE float32 (engine/cuda_numerics.py)
        elem = torch.finfo(self.dtype).bits // 8
        self.kv_block_bytes = spec.num_layers * 2 * block_size * spec.num_kv_heads * spec.head_dim * elem
        if num_blocks is None:
            if kv_cache_memory_gb <= 0:
                raise ValueError(f"kv_cache_memory_gb must be > 0, got {kv_cache_memory_gb}")
            num_blocks = int(kv_cache_memory_gb * (1 << 30)) // self.kv_block_bytes
        if num_blocks < 2:
            raise ValueError(f"KV cache too small: {num_blocks} block(s) of {self.kv_block_bytes} bytes; "
                             "raise kv_cache_memory_gb or num_blocks")
        self.num_blocks = num_blocks
        self.weights = load_weights(model_dir, spec, dtype, device)
        self.kernels = self._choose_kernels(linear_backend)
        self.linear_backend = self.kernels.summary
        # the layers keep their own (transposed or packed) copies; drop each plain one as we go
        self.layers = [DecoderLayer(self.weights.layers.pop(0), spec, self.kernels.backends)
                       for _ in range(spec.num_layers)]
        self.lm_head = LmHead(self.weights.lm_head, self.kernels.backends["lm_head"])
        # oneDNN builds a kernel per matmul shape (bf16, and float32 "packed"): run each step's
        # matmuls at a few fixed row counts (engine/row_buckets.py)
        self.bucket_rows = self.device.type == "cpu" and (
            self.dtype != torch.float32 or "packed" in self.kernels.backends.values())
        self.rope = RotaryTables(spec, spec.max_position_embeddings, self.dtype, device)
        # zeros, not empty: masked-out padding rows must never hold NaN (0 * NaN poisons attention)
        self.kv_cache = torch.zeros(num_blocks, spec.num_layers, 2, block_size, spec.num_kv_heads,
                                    spec.head_dim, dtype=self.dtype, device=self.device)
        self._cache = PagedKVCache(self.kv_cache, spec.num_heads, attention_backend)
        self.attention_backend = self._cache.backend
        if attention_backend == "auto":
            self._cache.choose_fresh_prefill()
        logger.info("model %s loaded: %d layers, %s, %d threads, matmuls %s, %s attention, "
                    "%d KV blocks of %d bytes", spec.architecture, spec.num_layers, dtype, self.num_threads,
                    self.kernels.describe(), self.attention_backend, num_blocks, self.kv_block_bytes)

    def _choose_kernels(self, linear_backend: str) -> KernelChoice:
        if linear_backend == "dense" or self.device.type != "cpu":
            return forced("dense")
        if linear_backend == "packed":
            if not packed_available(self.dtype, self.device):
                raise ValueError("linear_backend='packed' needs a CPU with oneDNN's packed linear")
            return forced("packed")
        if linear_backend == "gemv":
            if not gemv_available():
                raise ValueError("linear_backend='gemv' needs the C++ kernel library (run `make setup`)")
            return forced("gemv")
        if linear_backend == "mkl_packed":
            if self.dtype != torch.float32 or not mkl_packed_available():
                raise ValueError("linear_backend='mkl_packed' needs float32, the C++ kernel library "
                                 "(run `make setup`) and a torch built with MKL")
            return forced("mkl_packed")
        return select_kernels(self.weights.layers[0], self.weights.lm_head, self.dtype, KernelCache())

    def use_attention(self, backend: str) -> None:
        """Attend with ``backend`` from the next step on, over the same cache and weights (the GPU
        check times each candidate on one loaded model). Call between steps."""
        self._cache = PagedKVCache(self.kv_cache, self.spec.num_heads, backend)
        self.attention_backend = self._cache.backend

    def describe(self) -> dict[str, object]:
        """What this runner resolved at start: dtype, threads, matmul kernels, attention."""
        return {"dtype": self.dtype_name, "num_threads": self.num_threads, "linear_backend": self.linear_backend,
                "kernels": dict(self.kernels.backends), "kernels_source": self.kernels.source,
                "attention_backend": self.attention_backend, "fresh_prefill_attention": self._cache.fresh_prefill,
                "fresh_prefill_timings_ms": dict(self._cache.fresh_prefill_timings_ms)}

    def execute(self, items: list[ForwardItem]) -> torch.Tensor:
        """Run one step; returns float32 logits ``[number of items with sample=True, vocab]``."""
        return self.execute_scored(items)[0]

    @torch.inference_mode()
    def execute_scored(self, items: list[ForwardItem], stop: Callable[[], bool] | None = None,
                       ) -> tuple[torch.Tensor, dict[int, tuple[list, list]]]:
        """``execute``, plus for each item with ``score_targets`` (by its index): the logprob entries
        (target and top alternatives) and the target's rank, one per target. ``stop`` is asked
        between layers; when it says True the step ends with ``StepInterrupted`` (K/V written so
        far are those the step would write again)."""
        scores: dict[int, tuple[list, list]] = {}
        if not items:
            return torch.empty(0, self.spec.vocab_size, device=self.device), scores
        order, max_pos = self._check_and_order(items)
        decodes, prefills, token_ids, positions = [], [], [], []
        last_row: dict[int, int] = {}
        for i in order:
            it = items[i]
            n = len(it.token_ids)
            token_ids += it.token_ids
            positions += range(it.start_pos, it.start_pos + n)
            last_row[i] = len(token_ids) - 1
            if n == 1:
                decodes.append((it.start_pos, it.block_table))
            else:
                prefills.append((it.start_pos, n, it.block_table))
        pos = torch.tensor(positions, dtype=torch.int64, device=HOST)
        plan = self._cache.plan(decodes, prefills, pos)
        pos_dev = pos.to(self.device)
        cos, sin = self.rope.lookup(pos_dev, max_pos)
        ids = torch.tensor(token_ids, dtype=torch.int64, device=HOST)
        if int(ids.min()) < 0 or int(ids.max()) >= self.spec.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.spec.vocab_size}), "
                             f"got {int(ids.min())}..{int(ids.max())}")
        x = F.embedding(ids.to(self.device), self.weights.embed)
        t = x.shape[0]
        x = self._to_bucket(x)
        for i, layer in enumerate(self.layers):
            if stop is not None and stop():
                raise StepInterrupted()
            x = layer.forward(x, cos, sin, plan, i, t)
        x = x[:t]
        for i, it in enumerate(items):
            if it.score_targets:
                first = last_row[i] - len(it.token_ids) + 1 + it.score_from
                scores[i] = self._score(x[first:first + len(it.score_targets)], it.score_targets, it.score_top)
        rows = [last_row[i] for i, it in enumerate(items) if it.sample]
        if not rows:
            return torch.empty(0, self.spec.vocab_size, device=self.device), scores
        if rows != list(range(x.shape[0])):
            x = x[torch.tensor(rows, device=self.device)]
        x = rms_norm(x, self.weights.norm, self.spec.rms_norm_eps)
        return self._head(x).float(), scores

    def _to_bucket(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` with zero rows added up to its row bucket when the matmuls are bucketed."""
        n = x.shape[0]
        padded = row_bucket(n) if self.bucket_rows else n
        return x if padded == n else F.pad(x, (0, 0, 0, padded - n))

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        """The output projection of ``x``'s rows, run at their bucket's row count when bucketed."""
        return self.lm_head(self._to_bucket(x))[: x.shape[0]]

    _SCORE_ROWS = 128  # rows of [rows, vocab] float32 logits held at once while scoring a prompt

    def _score(self, hidden: torch.Tensor, targets: list[int], top: int) -> tuple[list, list]:
        entries: list[dict[int, float]] = []
        ranks: list[int] = []
        for lo in range(0, len(targets), self._SCORE_ROWS):
            h = rms_norm(hidden[lo:lo + self._SCORE_ROWS], self.weights.norm, self.spec.rms_norm_eps)
            lp = torch.log_softmax(self._head(h).float(), dim=-1).cpu()
            tgt = torch.tensor(targets[lo:lo + self._SCORE_ROWS], dtype=torch.int64, device=HOST)
            picked = lp.gather(1, tgt[:, None])[:, 0]
            ranks += ((lp > picked[:, None]).sum(dim=1) + 1).tolist()
            tops = lp.topk(top, dim=-1) if top else None
            for r, (t, v) in enumerate(zip(tgt.tolist(), picked.tolist())):
                entry = {t: v}
                if tops is not None:
                    for tv, ti in zip(tops.values[r].tolist(), tops.indices[r].tolist()):
                        entry.setdefault(ti, tv)
                entries.append(entry)
        return entries, ranks

    def warm_up(self, max_batched_tokens: int, max_seqs: int, max_len: int) -> float:
        """Run the two step shapes a first burst meets, on scratch KV blocks, before any request:
        one prefill step of ``max_batched_tokens`` tokens (sequences of up to 256 tokens, capped
        by ``max_len``) and one decode step of ``max_seqs`` sequences. oneDNN plans these shapes
        and the allocator grows to the step's working set here instead of inside the first burst's
        steps (measured: the first burst after a start ran ~15% slower without this). The blocks
        it wrote are zeroed again, so no request ever sees its values. Returns the seconds taken."""
        t0 = time.perf_counter()
        seq_len = max(1, min(256, max_batched_tokens, max_len - 1))
        per_seq = -(-(seq_len + 1) // self.block_size)
        n_seqs = max(1, -(-max_batched_tokens // seq_len))
        # Scratch tables over the first blocks; they wrap (and sequences share blocks) when the cache
        # is smaller than the burst: the values written are garbage either way and are zeroed below.
        tables = [[(s * per_seq + b) % self.num_blocks for b in range(per_seq)] for s in range(n_seqs)]
        left, prefill = max_batched_tokens, []
        for table in tables:
            n = min(seq_len, left)
            left -= n
            prefill.append(ForwardItem([0] * n, 0, table, True))
        self.execute(prefill)
        self.execute([ForwardItem([0], len(prefill[i % n_seqs].token_ids), tables[i % n_seqs], True)
                      for i in range(max_seqs)])
        used = sorted({b for table in tables for b in table})
        self.kv_cache[torch.tensor(used, device=self.device)] = 0
        built = self._build_row_buckets(max_batched_tokens, max_seqs) if self.bucket_rows else 0
        elapsed = time.perf_counter() - t0
        logger.info("warm-up: a %d-token prefill step and a %d-sequence decode step%s in %.2f s",
                    max_batched_tokens, max_seqs,
                    f", the matmuls at {built} row counts" if built else "", elapsed)
        return elapsed

    @torch.inference_mode()
    def _build_row_buckets(self, max_batched_tokens: int, max_seqs: int) -> int:
        """One layer's matmuls at every row count a step of up to ``max_batched_tokens`` tokens runs
        them at, and the output projection at every count up to ``max_seqs`` rows: oneDNN builds
        (and keeps) a kernel per shape, and the layers share shapes, so one layer builds them all.
        Returns how many row counts."""
        mm, hidden = self.layers[0].mm, self.spec.hidden_size
        attn = self.spec.num_heads * self.spec.head_dim
        counts = buckets_up_to(max(max_batched_tokens, max_seqs))
        for m in counts:
            h = torch.zeros(m, hidden, dtype=self.dtype, device=self.device)
            mm.qkv(h)
            mm.o_add(torch.zeros(m, attn, dtype=self.dtype, device=self.device), h)
            mm.mlp_add(h, h)
        for m in buckets_up_to(max_seqs):
            self.lm_head(torch.zeros(m, hidden, dtype=self.dtype, device=self.device))
        return len(counts)

    def _check_and_order(self, items: list[ForwardItem]) -> tuple[list[int], int]:
        """Validate items; return their indices, one-token (decode) items first, and the end
        position of the longest one."""
        limit = self.rope.max_positions
        max_end = 0
        for it in items:
            n = len(it.token_ids)
            end = it.start_pos + n
            if n == 0 or it.start_pos < 0:
                raise ValueError(f"ForwardItem needs >= 1 token and start_pos >= 0, got {n} tokens at {it.start_pos}")
            if end > limit:
                raise ValueError(f"positions up to {end} exceed the model's context of {limit}")
            if len(it.block_table) * self.block_size < end:
                raise ValueError(f"block table of {len(it.block_table)} blocks cannot hold {end} positions "
                                 f"(block_size {self.block_size})")
            max_end = max(max_end, end)
        order = ([i for i, it in enumerate(items) if len(it.token_ids) == 1]
                 + [i for i, it in enumerate(items) if len(it.token_ids) > 1])
        return order, max_end

    def read_blocks(self, block_ids: list[int]) -> bytes:
        """Raw bytes of whole KV blocks (diagnostics and tests compare what was sent and what landed)."""
        if any(isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < self.num_blocks for b in block_ids):
            from pdserve.engine.errors import InvalidRequestError

            raise InvalidRequestError(f"block ids must be integers in [0, {self.num_blocks}), got {block_ids[:8]}")
        blocks = self.kv_cache[block_ids].contiguous().cpu()
        return blocks.view(-1).view(torch.uint8).numpy().tobytes()

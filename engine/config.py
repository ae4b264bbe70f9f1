"""Internal engine configuration (frozen dataclasses; user-facing config lives in pdserve.cluster.config)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class EngineMode(str, enum.Enum):
    COLOCATED = "colocated"   # prefill and decode in one engine
    PREFILL = "prefill"       # prefill-only: stop after the first token, keep blocks for transfer
    DECODE = "decode"         # decode worker: admits transferred KV, can also prefill locally


class SchedulingPolicy(str, enum.Enum):
    CONTINUOUS = "continuous"  # iteration-level batching (the default)
    STATIC = "static"          # request-level batches; kept only as a benchmark baseline


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    enable_chunked_prefill: bool = True
    policy: SchedulingPolicy = SchedulingPolicy.CONTINUOUS
    # A step takes a second (third, ...) prompt only while its prompt tokens are under this many;
    # the first prompt chunk of a step may still use the whole budget. None: pack up to the budget.
    prefill_pack_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.prefill_pack_tokens is not None and self.prefill_pack_tokens < 1:
            raise ValueError(f"prefill_pack_tokens must be >= 1, got {self.prefill_pack_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "without chunked prefill, max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len}) "
                "so that any prompt fits in one step"
            )


# The most the ``structured.max_depth`` setting may allow: xgrammar's schema parse grows with the
# cube of the depth (a 256-deep array schema: 0.8 s), and Python's json nests ~1,000 at most.
MAX_DEPTH_CEILING = 256


@dataclass(frozen=True, slots=True)
class StructuredLimits:
    """Bounds on a request's grammar (``structured`` in the cluster config): a spec nested deeper
    than ``max_depth`` is refused before it is parsed, and one whose compile takes longer than
    ``compile_timeout_s`` is refused when that time is up (``engine/grammar_process.py``)."""

    compile_timeout_s: float = 5.0
    max_depth: int = 64

    def __post_init__(self) -> None:
        if not self.compile_timeout_s > 0:
            raise ValueError(f"compile_timeout_s must be > 0, got {self.compile_timeout_s}")
        if self.max_depth < 2:
            raise ValueError(f"max_depth must be >= 2, got {self.max_depth}")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model_dir: str
    dtype: str = "auto"               # "auto" (bf16 where the CPU computes it natively) | "float32" | "bfloat16"
    device: str = "cpu"               # "cpu" | "cuda"
    block_size: int = 16
    num_blocks: int | None = None     # None: derived from kv_cache_memory_gb
    kv_cache_memory_gb: float = 1.0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the checkpoint's max_position_embeddings
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    policy: SchedulingPolicy = SchedulingPolicy.CONTINUOUS
    mode: EngineMode = EngineMode.COLOCATED
    num_threads: int | None = None    # torch intra-op threads; None leaves torch's default
    linear_backend: str = "auto"      # "auto" (timed per machine, engine/kernel_select.py) | "dense" | "packed" | "gemv" | "mkl_packed"
    # "auto" | "native" (C++, reads the paged cache in place; CPU) | "sdpa" (gather + torch SDPA) |
    # "flex" | "varlen" (packed contexts: FlexAttention, flash varlen; engine/attention_packed.py)
    attention_backend: str = "auto"
    # KV transfers through a host mirror of the cache (kv_transfer/staging.py): "auto" only where
    # NIXL cannot register the cache's device memory, "never" (fail instead), "always".
    kv_staging: str = "auto"
    seed: int = 0
    # Produce text deltas for every request. Off in the workers: the router detokenizes, and the
    # engine then decodes text only for requests with stop strings.
    detokenize: bool = True
    # Decode workers' ITL target (slo.itl_ms): while sequences decode, a step takes at most the
    # prompt tokens that fit in this target beside them (measured decode step time and prefill
    # rate); None: no cap beyond max_num_batched_tokens. Needs chunked prefill.
    itl_target_ms: float | None = None
    # See SchedulerConfig.prefill_pack_tokens (a burst of short prompts finishes one or two at a
    # time instead of all together at the end of one long step).
    prefill_pack_tokens: int | None = None
    # Run one full prefill step and one full decode step on scratch blocks at start (see
    # ModelRunner.warm_up), so the first requests do not pay for planning those shapes.
    warm_up: bool = False
    # Structured outputs: the grammar compile budget and the spec's nesting bound.
    structured: StructuredLimits = StructuredLimits()

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"dtype must be 'auto', 'float32' or 'bfloat16', got {self.dtype!r}")
        if self.linear_backend not in ("auto", "dense", "packed", "gemv", "mkl_packed"):
            raise ValueError(f"linear_backend must be 'auto', 'dense', 'packed', 'gemv' or 'mkl_packed', "
                             f"got {self.linear_backend!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.itl_target_ms is not None and not self.itl_target_ms > 0:
            raise ValueError(f"itl_target_ms must be > 0, got {self.itl_target_ms}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2, got {self.num_blocks}")
        if self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.attention_backend not in ("auto", "native", "sdpa", "flex", "varlen"):
            raise ValueError("attention_backend must be 'auto', 'native', 'sdpa', 'flex' or 'varlen', "
                             f"got {self.attention_backend!r}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")

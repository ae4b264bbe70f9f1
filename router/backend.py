"""What the router talks to: one ``Backend`` that generates tokens for validated requests.

The router owns text (tokenization, chat templates, detokenization, stop strings); a backend
sees only token ids. Implementations: ``LocalEngineBackend`` (one in-process engine, the
colocated deployment and the tests) and the disaggregated prefill/decode client.

Contract of ``Backend.generate``: an async generator that yields zero or more ``TokenDelta``
and then exactly one ``Finished``, after which it returns. A failure is reported as
``Finished(finish_reason="error", error=...)``, never raised, so the caller always learns the
phase record. Closing the generator early (``aclose``, task cancellation) must release every
resource the request holds, as ``abort`` does.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from pdserve.engine.errors import PdserveError
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import Priority

FINISH_REASONS = ("stop", "length", "abort", "error")

# Keys that a backend adds to ``PhaseRecord.to_dict()`` in ``Finished.phase``.
PHASE_EXTRA_DEFAULTS: dict[str, object] = {
    "kv_bytes": 0,
    "kv_transfer_s": 0.0,
    "prefill_worker": "",
    "decode_worker": "",
}


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the router must know about the served model."""

    name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    tokenizer_dir: str

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("model name must be non-empty")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {self.vocab_size}")


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: Priority = Priority.INTERACTIVE
    deadline: float | None = None  # time.monotonic() deadline, or None


@dataclass(frozen=True, slots=True)
class TokenDelta:
    """One or more new tokens of a request, with their logprobs when asked for."""

    token_ids: list[int]
    logprobs: list[dict[int, float]] | None = None


@dataclass(frozen=True, slots=True)
class Finished:
    """The end of a request: why, and the phase record (``PhaseRecord.to_dict()`` + extras)."""

    finish_reason: str
    phase: dict = field(default_factory=dict)
    error: PdserveError | None = None

    def __post_init__(self) -> None:
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason must be one of {FINISH_REASONS}, got {self.finish_reason!r}")


@runtime_checkable
class Backend(Protocol):
    def model_info(self) -> ModelInfo: ...

    def generate(self, req: GenerateRequest) -> AsyncIterator[TokenDelta | Finished]: ...

    async def abort(self, request_id: str) -> None: ...

    async def health(self) -> bool: ...


def complete_phase(phase: dict | None, **extra: object) -> dict:
    """A phase dict with every key the APIs report, filling the backend extras' defaults."""
    out: dict = dict(PHASE_EXTRA_DEFAULTS)
    if phase:
        out.update(phase)
    out.update(extra)
    return out

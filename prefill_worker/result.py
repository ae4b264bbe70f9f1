"""What a prefill worker returns to the router for one request (crosses processes via Ray)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(slots=True)
class PrefillResult:
    """The first token and what it cost.

    ``finish_reason`` is ``"prefilled"`` when the KV landed on the decode worker and decoding
    should continue there; ``"stop"``/``"length"`` when the request already ended at its first
    token (nothing to decode); ``"error"``/``"abort"`` when it failed (see ``error``).
    """

    request_id: str
    worker_id: str
    finish_reason: str
    first_token_id: int | None = None
    first_token_logprobs: dict[int, float] | None = None
    error: str | None = None
    # Set when the error is the request's own (see ``StepOutput.error_code``): not retried.
    error_code: str | None = None
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    queue_s: float = 0.0
    prefill_s: float = 0.0
    kv_bytes: int = 0
    kv_blocks: int = 0
    kv_descriptors: int = 0
    kv_transfer_s: float = 0.0
    # Transfer time not hidden behind prefill compute: DONE sent minus first token ready.
    kv_exposed_s: float = 0.0
    # The prefill worker's blocks that were sent (they stay in its prefix cache afterwards).
    src_blocks: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.finish_reason in ("prefilled", "stop", "length")

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

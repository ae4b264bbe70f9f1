"""What crosses the process boundary between the router's side and the workers, typed.

Workers run as Ray actors in their own processes; the router, the pool manager, the planner
and ``pdserve status`` read what they report. Every field that crosses is named here, once: a
worker returns a ``WorkerStats``, never a dict, so a renamed field fails where it is read
(an ``AttributeError`` in a test) instead of reading as 0 and making a busy worker look idle.

``CONTRACT_VERSION`` changes when a field changes meaning or is removed (adding one with a
default does not change it); a reader that meets another version refuses it by name.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field, replace

CONTRACT_VERSION = 1


class WorkerRole(enum.StrEnum):
    """The pool a worker serves in (the engine's own mode is ``EngineMode``)."""

    PREFILL = "prefill"
    DECODE = "decode"


def as_role(role: object) -> WorkerRole:
    """``WorkerRole`` from itself, its string, or another enum with the same values."""
    return WorkerRole(getattr(role, "value", role))


@dataclass(frozen=True, slots=True)
class WorkerStats:
    """One worker's report (``worker.stats()``), read by the router's pool view, the pool manager,
    the planner and ``pdserve status``."""

    worker_id: str
    role: WorkerRole
    # the engine (engine.llm_engine.EngineStats)
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_blocks: int
    kv_usage: float
    prefix_hit_rate: float
    generated_tokens: int
    prompt_tokens_computed: int
    prefill_compute_s: float
    prefill_budget_tokens: int | None
    max_prefill_tokens_with_decodes: int
    # the worker process and its NIXL agent
    kv_open_transfers: int
    kv_mailboxes: int
    started_at: float
    niceness: int
    pid: int
    transfer_timeout_s: float | None
    # what the runner resolved at start (engine.model_runner.ModelRunner.describe)
    dtype: str = ""
    num_threads: int = 0
    linear_backend: str = ""
    kernels: dict[str, str] = field(default_factory=dict)
    kernels_source: str = ""
    attention_backend: str = ""
    # role-specific: prefill jobs in flight; decode reservations, recent ITL, expired reservations
    in_flight: int = 0
    reservations: int = 0
    itl_ms: float | None = None
    expired_reservations: int = 0
    # of num_running + num_waiting and kv_usage, the batch-priority part (the planner lets it wait)
    num_batch_seqs: int = 0
    batch_kv_usage: float = 0.0
    # where it runs (filled by the Ray actor classes)
    node_id: str = ""
    node_ip: str = ""
    cores: list[int] | None = None
    pinning: str = ""
    version: int = CONTRACT_VERSION

    def __post_init__(self) -> None:
        if self.version != CONTRACT_VERSION:
            raise ValueError(f"worker {self.worker_id} reports contract version {self.version}; this "
                             f"router reads version {CONTRACT_VERSION}: run one pdserve version everywhere")
        object.__setattr__(self, "role", as_role(self.role))

    @property
    def busy(self) -> bool:
        """Holds any request: running, waiting, a prefill job in flight or a KV reservation."""
        return bool(self.num_running or self.num_waiting or self.in_flight or self.reservations)

    @property
    def holds_anything(self) -> bool:
        """Busy, or still holding a NIXL transfer handle or mailbox (tests: nothing leaked)."""
        return self.busy or bool(self.kv_open_transfers or self.kv_mailboxes)

    @property
    def produced_tokens(self) -> int:
        """The tokens this worker's role produces: prompt tokens for prefill, generated for decode."""
        return self.prompt_tokens_computed if self.role is WorkerRole.PREFILL else self.generated_tokens

    def to_dict(self) -> dict[str, object]:
        """Plain JSON-able values (status output)."""
        d = asdict(self)
        d["role"] = str(self.role)
        return d


@dataclass(frozen=True, slots=True)
class RequestPhase:
    """One request's phase record: what it spent its time on, where it ran and what moved.

    The engine fills the timings (``Sequence.phase_record``); the backend that served the request
    adds the workers, the KV moved and the attempts; ``Serving`` sets the final finish reason; the
    HTTP and gRPC APIs, the request log, the metrics and ``pdserve`` print this one record (as
    ``to_dict()`` on the wire). Times are seconds; ``None`` where a phase did not happen."""

    queue_s: float = 0.0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    prefill_s: float = 0.0
    prefill_tokens_per_s: float | None = None
    ttft_s: float | None = None
    output_tokens: int = 0
    decode_s: float = 0.0
    decode_tokens_per_s: float | None = None
    total_s: float = 0.0
    preemptions: int = 0
    finish_reason: str | None = None
    # where it ran and what moved (the backend's part)
    prefill_worker: str = ""
    decode_worker: str = ""
    kv_bytes: int = 0
    kv_transfer_s: float = 0.0
    kv_exposed_s: float = 0.0
    attempts: int = 1
    migrations: int = 0        # times its output went on elsewhere by recomputing (prompt + tokens so far)
    kv_migrations: int = 0     # times its KV moved to another decode worker and decoding went on there

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    def but(self, **changes: object) -> RequestPhase:
        """A copy with ``changes`` (the record is frozen)."""
        return replace(self, **changes)


_PHASE_FIELDS = frozenset(RequestPhase.__slots__)


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request as it ended, seen from the router: what the router's metrics record and what
    the request log (Redis, read by ``pdserve requests tail``) keeps, as ``to_dict()``.

    ``outcome`` is the finish reason (``stop``/``length``), the error's type, or ``cancelled``
    when the client left first; ``phase`` is None when the request ended before a worker ran it
    (refused at admission). ``itl_s``, the gaps between the chunks the client was sent, feeds
    the metrics and is not logged."""

    request_id: str
    client_request_id: str
    api: str
    outcome: str
    priority: str = "interactive"
    max_tokens: int = 0
    time: float = 0.0
    error: str | None = None
    phase: RequestPhase | None = None
    itl_s: tuple[float, ...] = ()
    owner: str = ""   # the tenant: its API key's owner id (``router/auth.py``); "" anonymous or not known

    @property
    def finish_reason(self) -> str | None:
        return None if self.phase is None else self.phase.finish_reason

    def to_dict(self) -> dict[str, object]:
        """The request log's entry: the identity, outcome and limits, then the phase's fields."""
        out: dict[str, object] = {
            "request_id": self.request_id, "client_request_id": self.client_request_id, "api": self.api,
            "outcome": self.outcome, "finish_reason": self.finish_reason, "error": self.error,
            "priority": self.priority, "max_tokens": self.max_tokens, "time": self.time}
        if self.owner:
            out["owner"] = self.owner
        if self.phase is not None:
            out.update(self.phase.to_dict())
            out["finish_reason"] = self.phase.finish_reason
        return out

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> RequestRecord:
        """A logged entry read back (unknown keys, written by a newer router, are ignored)."""
        phase_fields = {k: v for k, v in d.items() if k in _PHASE_FIELDS}
        phase = RequestPhase(**phase_fields) if "total_s" in phase_fields else None
        return cls(request_id=str(d.get("request_id", "")), client_request_id=str(d.get("client_request_id") or ""),
                   api=str(d.get("api", "")), outcome=str(d.get("outcome") or d.get("finish_reason") or ""),
                   priority=str(d.get("priority", "interactive")), max_tokens=int(d.get("max_tokens") or 0),
                   time=float(d.get("time") or 0.0), error=d.get("error"), phase=phase,
                   owner=str(d.get("owner") or ""))


@dataclass(frozen=True, slots=True)
class PromptLogprobs:
    """vLLM's ``prompt_logprobs``: for each prompt token after the first, its log-probability given
    the tokens before it, the top alternatives at that position and its rank (1 = most likely).
    ``entries[i]`` and ``ranks[i]`` are prompt token ``i + 1``'s (token id -> logprob, the prompt
    token always included)."""

    entries: tuple[dict[int, float], ...]
    ranks: tuple[int, ...]


@dataclass(slots=True)
class PrefillResult:
    """What a prefill worker returns to the router for one request: the first token and what it cost.

    ``finish_reason`` is ``"prefilled"`` when the KV landed on the decode worker and decoding
    should continue there; ``"stop"``/``"length"`` when the request already ended at its first
    token (nothing to decode); ``"error"``/``"abort"`` when it failed (see ``error``).
    """

    request_id: str
    worker_id: str
    finish_reason: str
    first_token_id: int | None = None
    first_token_logprobs: dict[int, float] | None = None
    prompt_logprobs: PromptLogprobs | None = None
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


@dataclass(slots=True)
class StepOutput:
    """What one engine step produced for one request: the token batch a decode worker hands the
    router (``DecodeWorker.take_outputs``) and a prefill worker's progress inside its process."""

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[dict[int, float]] | None = None
    text_delta: str = ""
    finished: bool = False
    finish_reason: str | None = None
    phase: RequestPhase | None = None
    error: str | None = None
    # Set when the error is the request's own (``engine.errors.request_error`` rebuilds it): it
    # would fail the same way on any worker, so it is not retried elsewhere.
    error_code: str | None = None
    # Prompt tokens whose K/V are computed so far (prefill-only mode streams blocks as they complete).
    num_computed_tokens: int = 0
    # With the request's first token, when it asked for them (SamplingParams.prompt_logprobs).
    prompt_logprobs: PromptLogprobs | None = None
    # Set on the last output a decode worker sends for a request whose KV it moved to another
    # decode worker (live migration): that worker's id; the request's next outputs come from it.
    moved_to: str | None = None
    moved_blocks: list[int] | None = None   # with ``moved_to``: the blocks it holds there (the ledger's record)

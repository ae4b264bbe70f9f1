"""Typed errors shared by every layer of pdserve.

Each error type carries one gRPC status name and one HTTP status; the router maps them in
one place (``pdserve.router.errors``). Library code raises these, never bare ``Exception``.
"""

from __future__ import annotations


class PdserveError(Exception):
    """Base of all pdserve errors."""

    grpc_status: str = "INTERNAL"
    http_status: int = 500
    error_type: str = "internal_error"


class InvalidRequestError(PdserveError, ValueError):
    """The caller sent something malformed or out of range; the message says what to fix."""

    grpc_status = "INVALID_ARGUMENT"
    http_status = 400
    error_type = "invalid_request_error"


class SamplingError(InvalidRequestError):
    """This request's sampling gave no valid distribution (logits or probabilities not finite, or
    nothing left after filtering). It is the request's own fault: it fails alone, with a 400, and
    another worker would fail the same way, so the router does not retry it."""

    code = "sampling_failed"


class GrammarError(InvalidRequestError):
    """This request's structured output could not be made into a grammar: malformed, or over a
    ``structured`` limit (its compile ran past ``structured.compile_timeout_s``). Reported by the
    engine after the request was queued (grammars compile off the step loop); a 400, not retried."""

    code = "grammar_refused"


class EngineStepError(PdserveError):
    """A step failed for the whole batch (e.g. the forward pass raised); every request in it
    ended with this error. One that fails the same way on a second worker is not retried again."""

    code = "engine_step_failed"


# Codes of errors that belong to the request, not to the worker that ran it. Workers report a
# request's failure as ``(error message, error_code)``; the router rebuilds the typed error here.
_REQUEST_ERRORS: dict[str, type[InvalidRequestError]] = {SamplingError.code: SamplingError,
                                                          GrammarError.code: GrammarError}


def request_error(code: str | None, message: str) -> InvalidRequestError | None:
    """The typed error a worker reported by ``code``, or None when the code names none."""
    cls = _REQUEST_ERRORS.get(code or "")
    return cls(message) if cls is not None else None


class ModelNotFoundError(PdserveError):
    """A request named a model this deployment does not serve."""

    grpc_status = "NOT_FOUND"
    http_status = 404
    error_type = "not_found_error"


class ModelLoadError(PdserveError):
    """A checkpoint directory is missing files, corrupt, or of an unsupported architecture."""

    grpc_status = "FAILED_PRECONDITION"
    http_status = 500
    error_type = "model_load_error"


class UnsupportedModelError(ModelLoadError):
    """The checkpoint's architecture is not one the model runner implements."""


class OverloadedError(PdserveError):
    """Admission refused: a bounded queue is full. Retry after ``retry_after_s``."""

    grpc_status = "RESOURCE_EXHAUSTED"
    http_status = 429
    error_type = "rate_limit_error"

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class OutOfBlocksError(PdserveError):
    """Not enough free KV blocks to reserve for a request."""

    grpc_status = "RESOURCE_EXHAUSTED"
    http_status = 503
    error_type = "capacity_error"


class DeadlineExceededError(PdserveError):
    """The request's deadline passed before it completed."""

    grpc_status = "DEADLINE_EXCEEDED"
    http_status = 504
    error_type = "timeout_error"


class WorkerUnavailableError(PdserveError):
    """No worker that could serve the request is alive."""

    grpc_status = "UNAVAILABLE"
    http_status = 503
    error_type = "service_unavailable"


class KVTransferError(PdserveError):
    """Moving KV blocks between workers failed (timeout, peer lost, aborted)."""

    grpc_status = "UNAVAILABLE"
    http_status = 503
    error_type = "kv_transfer_error"


class CompatibilityError(KVTransferError):
    """Two workers' KV layouts or protocol versions differ; nothing was transferred."""

    grpc_status = "FAILED_PRECONDITION"
    http_status = 500
    error_type = "compatibility_error"


class AuthenticationError(PdserveError):
    """Missing or wrong API key."""

    grpc_status = "UNAUTHENTICATED"
    http_status = 401
    error_type = "authentication_error"

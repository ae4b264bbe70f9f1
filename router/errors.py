"""The one place that turns pdserve errors into gRPC status codes and HTTP responses.

Every ``pdserve.engine.errors.PdserveError`` names its gRPC status and HTTP status; this module
reads them, adds the OpenAI error body (``{"error": {"message", "type", "param", "code"}}``),
and wraps anything else as an internal error whose message does not leak internals.
Two router-only refinements live here too: ``InvalidParameterError`` (an invalid request that
names the offending field) and ``RequestTooLargeError`` (HTTP 413).
"""

from __future__ import annotations

import logging
import math

import grpc

from pdserve.engine.errors import (
    AuthenticationError,
    InvalidRequestError,
    ModelNotFoundError,
    OverloadedError,
    PdserveError,
)

logger = logging.getLogger(__name__)


class InvalidParameterError(InvalidRequestError):
    """An invalid request whose fault lies in one named field (``param``), e.g. ``max_tokens``."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class RequestTooLargeError(InvalidRequestError):
    """The request body is larger than the server accepts."""

    http_status = 413

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.code = "request_too_large"


class RouteNotFoundError(PdserveError):
    """No such HTTP path on this server."""

    grpc_status = "UNIMPLEMENTED"
    http_status = 404
    error_type = "invalid_request_error"


class MethodNotAllowedError(RouteNotFoundError):
    """The path exists but not with this HTTP method; ``allowed`` goes into the ``Allow`` header."""

    http_status = 405

    def __init__(self, message: str, allowed: tuple[str, ...]) -> None:
        super().__init__(message)
        self.allowed = allowed
        self.code = "method_not_allowed"


class UnsupportedMediaTypeError(InvalidRequestError):
    """The body's Content-Type or Content-Encoding is not one this server reads (HTTP 415)."""

    http_status = 415

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.code = "unsupported_media_type"


class BodyTimeoutError(InvalidRequestError):
    """The client did not send its whole body in time (HTTP 408; the connection is closed)."""

    http_status = 408

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.code = "request_timeout"


class StreamNotFoundError(PdserveError):
    """A request resuming a stream (``Last-Event-ID``) names no stream any decode worker still
    knows (HTTP 404): it ended longer ago than the workers keep streams, or never existed."""

    grpc_status = "NOT_FOUND"
    http_status = 404
    error_type = "not_found_error"


class DuplicateRequestIdError(PdserveError):
    """The client's ``request_id`` names one of its requests that is still running (HTTP 409)."""

    grpc_status = "ALREADY_EXISTS"
    http_status = 409
    error_type = "invalid_request_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.param = "request_id"
        self.code = "duplicate_request_id"


_DEFAULT_CODES: tuple[tuple[type[PdserveError], str], ...] = (
    (ModelNotFoundError, "model_not_found"),
    (OverloadedError, "rate_limit_exceeded"),
    (AuthenticationError, "invalid_api_key"),
)


def as_pdserve_error(exc: BaseException) -> PdserveError:
    """``exc`` itself when it is a PdserveError, else an internal error with a generic message."""
    if isinstance(exc, PdserveError):
        return exc
    logger.error("internal error: %r", exc, exc_info=exc)
    wrapped = PdserveError("internal server error; the server log has the details")
    wrapped.__cause__ = exc
    return wrapped


def grpc_status_code(exc: BaseException) -> grpc.StatusCode:
    name = as_pdserve_error(exc).grpc_status
    try:
        return grpc.StatusCode[name]
    except KeyError:
        logger.error("unknown gRPC status name %r on %s; using INTERNAL", name, type(exc).__name__)
        return grpc.StatusCode.INTERNAL


def http_status(exc: BaseException) -> int:
    return as_pdserve_error(exc).http_status


def error_code(exc: BaseException) -> str | None:
    err = as_pdserve_error(exc)
    code = getattr(err, "code", None)
    if code is not None:
        return code
    for cls, default in _DEFAULT_CODES:
        if isinstance(err, cls):
            return default
    return None


def openai_error_body(exc: BaseException) -> dict:
    """The OpenAI-shaped JSON body for an error response."""
    err = as_pdserve_error(exc)
    return {
        "error": {
            "message": str(err) or type(err).__name__,
            "type": err.error_type,
            "param": getattr(err, "param", None),
            "code": error_code(err),
        }
    }


def retry_after_seconds(exc: BaseException) -> int | None:
    """Whole seconds for a ``Retry-After`` header, or None when retrying later does not help."""
    if isinstance(exc, OverloadedError):
        return max(1, math.ceil(exc.retry_after_s))
    return None


def grpc_trailing_metadata(exc: BaseException) -> tuple[tuple[str, str], ...]:
    """Trailing metadata for a failed call: ``retry-after-ms`` when the server was overloaded."""
    if isinstance(exc, OverloadedError):
        return (("retry-after-ms", str(max(1, int(exc.retry_after_s * 1000)))),)
    return ()


class ResourceNotFoundError(PdserveError):
    """A file or batch id this server does not know (404, OpenAI's ``not_found_error``)."""

    grpc_status = "NOT_FOUND"
    http_status = 404
    error_type = "not_found_error"

"""API keys: ``Authorization: Bearer <key>`` on HTTP and as gRPC metadata.

Keys are compared in constant time (``hmac.compare_digest``) against every configured key, so
the time taken says nothing about which key, or how much of one, matched. No keys configured
means authentication is off.

Each configured key is also a tenant: ``check`` returns the matched key's *owner id*, an HMAC of
the key (keyed by a fixed context string, so every router derives the same id with no shared
secret), never the key itself nor the header as sent (``Bearer k`` and ``bearer  k`` are one
owner). The Batch API files every file and batch under it. Without keys every client is the
anonymous owner (``ANONYMOUS``, the empty id).
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from pdserve.engine.errors import AuthenticationError

ANONYMOUS = ""  # the owner of every request when no keys are configured
_OWNER_CONTEXT = b"pdserve owner id v1"


def owner_id(key: str) -> str:
    """The stable, non-reversible tenant id of an API key (32 hex digits)."""
    return hmac.new(_OWNER_CONTEXT, key.encode("utf-8"), "sha256").hexdigest()[:32]


class ApiKeyAuth:
    def __init__(self, keys: Iterable[str] = ()) -> None:
        cleaned = [k.strip() for k in keys if k and k.strip()]
        self._keys = [k.encode("utf-8") for k in cleaned]
        self._owners = [owner_id(k) for k in cleaned]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def check(self, authorization: str | None) -> str:
        """The owner id of the configured key the header value carries (``ANONYMOUS`` when no keys
        are configured); ``AuthenticationError`` unless it carries one. Every key is compared."""
        if not self._keys:
            return ANONYMOUS
        if not authorization:
            raise AuthenticationError("missing API key: send the header 'Authorization: Bearer <key>'")
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise AuthenticationError("malformed Authorization header: expected 'Bearer <key>'")
        given = token.strip().encode("utf-8")
        owner = None
        for key, oid in zip(self._keys, self._owners):
            if hmac.compare_digest(given, key):
                owner = oid
        if owner is None:
            raise AuthenticationError("invalid API key")
        return owner


def server_ssl_context(cert_file: str, key_file: str):  # -> ssl.SSLContext
    """A TLS server context (TLS 1.2+) for the HTTP API from PEM certificate and key files."""
    import ssl

    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert_file, key_file)
    return ctx


def grpc_server_credentials(cert_file: str, key_file: str):  # -> grpc.ServerCredentials
    """TLS credentials for the gRPC API from PEM certificate and key files."""
    from pathlib import Path

    import grpc

    return grpc.ssl_server_credentials([(Path(key_file).read_bytes(), Path(cert_file).read_bytes())])

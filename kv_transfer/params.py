"""TransferParams: what the decode side tells the prefill side about one request's transfer.

The decode worker builds it when it reserves blocks (``KVReceiver.params()``); it crosses
processes (router, Ray, Redis) as ``to_bytes()`` JSON, and the prefill worker's ``KVSender``
checks it with :meth:`TransferParams.check_compatible` and :meth:`check_blocks` before a
single byte moves.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from pdserve.engine.errors import CompatibilityError, InvalidRequestError
from pdserve.kv_transfer.layout import PROTOCOL_VERSION, KVLayout

_FIELDS = ("protocol_version", "compat_hash", "request_id", "dst_blocks", "dst_agent", "expires_at")


def _block_ids(name: str, value: object) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)):
        raise InvalidRequestError(f"{name} must be a list of block ids, got {type(value).__name__}")
    for block in value:
        if isinstance(block, bool) or not isinstance(block, int) or block < 0:
            raise InvalidRequestError(f"{name} holds {block!r}, not a non-negative int block id")
    return tuple(value)


@dataclass(frozen=True, slots=True)
class TransferParams:
    """One request's transfer, as the receiver reserved it: where the blocks go. The sender
    chooses its source blocks chunk by chunk, as its prefill computes them (``KVSender.write``)."""

    request_id: str
    dst_agent: str
    dst_blocks: tuple[int, ...]
    compat_hash: str
    protocol_version: int = field(default=PROTOCOL_VERSION)
    # Wall-clock time (epoch seconds) after which the sender must not write: the receiver may
    # give the blocks to another request once it has passed. 0 means no expiry.
    expires_at: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise InvalidRequestError("request_id must be a non-empty string")
        if not isinstance(self.dst_agent, str) or not self.dst_agent:
            raise InvalidRequestError("dst_agent must be a non-empty string")
        if not isinstance(self.compat_hash, str) or not self.compat_hash:
            raise InvalidRequestError("compat_hash must be a non-empty string")
        object.__setattr__(self, "dst_blocks", _block_ids("dst_blocks", self.dst_blocks))
        if not self.dst_blocks:
            raise InvalidRequestError("dst_blocks is empty: nothing to transfer")
        if len(set(self.dst_blocks)) != len(self.dst_blocks):
            raise InvalidRequestError("dst_blocks repeats a block id")
        if isinstance(self.expires_at, bool) or not isinstance(self.expires_at, (int, float)) \
                or self.expires_at < 0:
            raise InvalidRequestError(f"expires_at must be epoch seconds >= 0, got {self.expires_at!r}")

    def check_compatible(self, layout: KVLayout) -> None:
        """Raise CompatibilityError unless made for this protocol and ``layout``'s hash."""
        if self.protocol_version != PROTOCOL_VERSION:
            raise CompatibilityError(
                f"request {self.request_id}: protocol version {self.protocol_version} != "
                f"local {PROTOCOL_VERSION}")
        if self.compat_hash != layout.compat_hash():
            raise CompatibilityError(
                f"request {self.request_id}: KV layout hash {self.compat_hash} != local "
                f"{layout.compat_hash()} (model/dtype/shape differ)")

    def check_blocks(self, dst_num_blocks: int) -> None:
        """Raise InvalidRequestError if a destination block id is outside the receiver's cache
        (each write's source blocks are checked against the sender's as it posts them)."""
        check_block_range("dst_blocks", self.dst_blocks, dst_num_blocks)

    def to_bytes(self) -> bytes:
        return json.dumps({
            "protocol_version": self.protocol_version,
            "compat_hash": self.compat_hash,
            "request_id": self.request_id,
            "dst_blocks": list(self.dst_blocks),
            "dst_agent": self.dst_agent,
            "expires_at": self.expires_at,
        }, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> TransferParams:
        """Parse :meth:`to_bytes` output; a foreign protocol version raises CompatibilityError."""
        try:
            obj = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InvalidRequestError(f"TransferParams is not valid JSON: {exc}") from None
        if not isinstance(obj, dict):
            raise InvalidRequestError("TransferParams must be a JSON object")
        version = obj.get("protocol_version")
        if version != PROTOCOL_VERSION:
            raise CompatibilityError(
                f"TransferParams protocol version {version!r} != local {PROTOCOL_VERSION}")
        if set(obj) != set(_FIELDS):
            raise InvalidRequestError(
                f"TransferParams fields {sorted(obj)} != expected {sorted(_FIELDS)}")
        return cls(
            request_id=obj["request_id"],
            dst_agent=obj["dst_agent"],
            dst_blocks=obj["dst_blocks"],
            compat_hash=obj["compat_hash"],
            protocol_version=version,
            expires_at=obj["expires_at"],
        )

    def expired(self, now: float | None = None) -> bool:
        """True once the receiver may have reused the blocks: writing now would be unsafe."""
        return bool(self.expires_at) and (time.time() if now is None else now) >= self.expires_at


def check_block_range(name: str, blocks: tuple[int, ...] | list[int], num_blocks: int) -> None:
    """Raise InvalidRequestError if any id in ``blocks`` is outside ``[0, num_blocks)``."""
    bad = [block for block in blocks if not 0 <= block < num_blocks]
    if bad:
        raise InvalidRequestError(
            f"{name} has block ids {bad[:8]} outside [0, {num_blocks})")

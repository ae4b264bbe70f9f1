"""Bytes exchanged between KV agents: the metadata envelope and the notification messages.

Metadata envelope (``KVAgent.metadata()``), published once per worker (the router hands it to its peers)::

    b"PDKVMD" | u16 protocol version | u32 header length | header JSON | NIXL agent metadata

The header names the agent, its :class:`KVLayout`, and where its KV region lives (address,
NIXL memory type and device id: a GPU cache is VRAM, a host cache or a staging mirror DRAM),
so a peer can check compatibility and address blocks without another round trip. Where the
bytes live is not part of the compatibility check: a GPU worker and a CPU worker with the same
layout exchange blocks.

Notifications ride NIXL's notification channel as ``b"pdkv<version> " + JSON``. Anything
without that prefix is not ours and is ignored (logged), never raised into a caller.
"""

from __future__ import annotations

import json
import logging
import struct
from dataclasses import dataclass
from enum import Enum

from pdserve.engine.errors import CompatibilityError, KVTransferError
from pdserve.kv_transfer.layout import PROTOCOL_VERSION, KVLayout
from pdserve.kv_transfer.memory import DRAM, MemoryPlacement

logger = logging.getLogger(__name__)

_MD_MAGIC = b"PDKVMD"
_MD_HEAD = struct.Struct(">HI")
_NOTIF_PREFIX = f"pdkv{PROTOCOL_VERSION} ".encode()


@dataclass(frozen=True, slots=True)
class PeerInfo:
    """What a peer's metadata tells us: its name, layout, and KV region (address, NIXL memory
    type and device id)."""

    name: str
    layout: KVLayout
    base_addr: int
    region_bytes: int
    dev_id: int = 0
    mem_type: str = DRAM

    def __post_init__(self) -> None:
        MemoryPlacement(self.mem_type, self.dev_id)  # raises ValueError on a bad pair


def encode_metadata(info: PeerInfo, nixl_metadata: bytes) -> bytes:
    header = json.dumps({
        "agent": info.name,
        "layout": info.layout.to_dict(),
        "base_addr": info.base_addr,
        "region_bytes": info.region_bytes,
        "dev_id": info.dev_id,
        "mem_type": info.mem_type,
    }, separators=(",", ":")).encode()
    return _MD_MAGIC + _MD_HEAD.pack(PROTOCOL_VERSION, len(header)) + header + nixl_metadata


def decode_metadata(data: bytes) -> tuple[PeerInfo, bytes]:
    """Split an envelope into (PeerInfo, NIXL metadata); refuse other protocol versions."""
    if not data.startswith(_MD_MAGIC) or len(data) < len(_MD_MAGIC) + _MD_HEAD.size:
        raise KVTransferError("peer metadata is not a pdserve KV agent envelope")
    version, header_len = _MD_HEAD.unpack_from(data, len(_MD_MAGIC))
    if version != PROTOCOL_VERSION:
        raise CompatibilityError(
            f"peer KV protocol version {version} != local {PROTOCOL_VERSION}")
    start = len(_MD_MAGIC) + _MD_HEAD.size
    try:
        header = json.loads(data[start:start + header_len])
        info = PeerInfo(
            name=str(header["agent"]),
            layout=KVLayout.from_dict(header["layout"]),
            base_addr=int(header["base_addr"]),
            region_bytes=int(header["region_bytes"]),
            dev_id=int(header["dev_id"]),
            mem_type=str(header["mem_type"]),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise KVTransferError(f"peer metadata header is malformed: {exc}") from None
    return info, data[start + header_len:]


class NotifKind(str, Enum):
    """Notification kinds; the comment says who sends each to whom."""

    WRITE = "write"                    # sender -> receiver, attached to a write: these runs landed
    DONE = "done"                      # sender -> receiver: every write landed; counts attached
    SENDER_ABORT = "sender_abort"      # sender -> receiver: stopped; no write is in flight
    RECEIVER_ABORT = "receiver_abort"  # receiver -> sender: stop writing

    @property
    def to_sender(self) -> bool:
        return self is NotifKind.RECEIVER_ABORT


@dataclass(frozen=True, slots=True)
class Notif:
    """One notification. ``runs`` are (dst_start, length) pairs; counts are for DONE."""

    kind: NotifKind
    request_id: str
    seq: int = 0
    runs: tuple[tuple[int, int], ...] = ()
    writes: int = 0
    blocks: int = 0
    nbytes: int = 0
    reason: str = ""

    def to_bytes(self) -> bytes:
        body = {"k": self.kind.value, "r": self.request_id}
        if self.seq:
            body["s"] = self.seq
        if self.runs:
            body["b"] = [list(run) for run in self.runs]
        if self.kind is NotifKind.DONE:
            body.update(w=self.writes, n=self.blocks, x=self.nbytes)
        if self.reason:
            body["why"] = self.reason
        return _NOTIF_PREFIX + json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Notif | None:
        """Parse a notification; None (and a log line) for anything that is not ours."""
        if not data.startswith(_NOTIF_PREFIX):
            logger.warning("ignoring foreign KV notification %r", data[:40])
            return None
        try:
            body = json.loads(data[len(_NOTIF_PREFIX):])
            return cls(
                kind=NotifKind(body["k"]),
                request_id=str(body["r"]),
                seq=int(body.get("s", 0)),
                runs=tuple((int(start), int(length)) for start, length in body.get("b", ())),
                writes=int(body.get("w", 0)),
                blocks=int(body.get("n", 0)),
                nbytes=int(body.get("x", 0)),
                reason=str(body.get("why", "")),
            )
        except (ValueError, KeyError, TypeError) as exc:
            logger.warning("ignoring malformed KV notification %r: %s", data[:40], exc)
            return None

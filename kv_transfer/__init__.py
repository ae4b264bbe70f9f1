"""pdserve.kv_transfer: moving KV blocks between workers over NIXL (UCX), PUSH style.

``KVAgent`` owns a worker's NIXL agent and KV tensor (host or GPU memory, registered as what it
is, or staged through a host mirror: ``StagingMode``); ``KVSender`` (prefill side) writes one
request's blocks into the blocks a ``KVReceiver`` (decode side) reserved. ``TransferParams``
is what crosses from the decode side to the prefill side. NIXL (and torch) are imported only
when an agent is created, so importing this package is cheap.
"""

from __future__ import annotations

from pdserve.kv_transfer.agent import KVAgent, KVAgentConfig
from pdserve.kv_transfer.layout import PROTOCOL_VERSION, BlockRun, KVLayout, coalesce_runs
from pdserve.kv_transfer.memory import MemoryPlacement, StagingMode
from pdserve.kv_transfer.params import TransferParams
from pdserve.kv_transfer.receiver import KVReceiver, RecvState, RecvStats
from pdserve.kv_transfer.sender import KVSender, SendState, SendStats

__all__ = [
    "PROTOCOL_VERSION",
    "BlockRun",
    "KVAgent",
    "KVAgentConfig",
    "KVLayout",
    "KVReceiver",
    "MemoryPlacement",
    "KVSender",
    "RecvState",
    "RecvStats",
    "SendState",
    "SendStats",
    "StagingMode",
    "TransferParams",
    "coalesce_runs",
]

"""KVAgent: one NIXL agent (UCX backend) owning a worker's whole KV cache tensor.

The agent registers the KV tensor once, with the memory type it really has (VRAM with its
device id for a CUDA cache, DRAM for a host one; ``kv_transfer/region.py``) or, when NIXL
cannot move that memory, a host mirror that every transfer is staged through
(``kv_transfer/staging.py``; ``KVAgentConfig.staging``). It publishes :meth:`KVAgent.metadata`,
loads peers' metadata (refusing incompatible layouts), posts block writes as coalesced descriptors, and
routes incoming notifications to the sender or receiver of the request they name: one NIXL
agent's notification queue holds every request's messages, so :meth:`pump` drains it and
files each message in a per-request mailbox.

Progress: by default no NIXL progress thread is started (it busy-polls a whole core, which a
2-core host cannot spare); transfers then advance whenever this process calls into the agent
(``pump``, ``xfer_state``), so the owners poll their senders/receivers regularly.
One lock serialises every NIXL call, so the agent may be used from several threads.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdserve.engine.errors import CompatibilityError, KVTransferError
from pdserve.kv_transfer.layout import BlockRun, KVLayout
from pdserve.kv_transfer.memory import VRAM, StagingMode
from pdserve.kv_transfer.region import BACKEND, KVRegion, check_tensor, register_kv, release_kv
from pdserve.kv_transfer.wire import Notif, PeerInfo, decode_metadata, encode_metadata

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

Mailbox = deque  # deque[tuple[str, Notif]]: (peer agent name, message)


@dataclass(frozen=True, slots=True)
class KVAgentConfig:
    """NIXL agent options. ``progress_thread`` trades a busy core for progress without polling;
    ``staging`` says when transfers go through a host mirror of the cache (``StagingMode``;
    its value as a string is accepted too)."""

    progress_thread: bool = False
    num_threads: int = 0
    staging: StagingMode = StagingMode.AUTO

    def __post_init__(self) -> None:
        if self.num_threads < 0:
            raise ValueError(f"num_threads must be >= 0, got {self.num_threads}")
        try:
            object.__setattr__(self, "staging", StagingMode(self.staging))
        except ValueError:
            raise ValueError(f"staging must be one of {[m.value for m in StagingMode]}, "
                             f"got {self.staging!r}") from None


@dataclass(frozen=True, slots=True)
class PostedWrite:
    """A write handed to NIXL: its handle plus what it moves."""

    handle: Any
    descriptors: int
    nbytes: int


class KVAgent:
    """Owns one NIXL agent and the registration of one KV cache tensor."""

    def __init__(self, name: str, kv_cache: torch.Tensor, layout: KVLayout,
                 config: KVAgentConfig | None = None) -> None:
        check_tensor(kv_cache, layout)
        from nixl._api import nixl_agent, nixl_agent_config  # heavy; lazily

        config = config or KVAgentConfig()
        self.name = name
        self.layout = layout
        self._kv_cache = kv_cache
        self._lock = threading.RLock()
        started = time.perf_counter()
        self._nixl: Any = nixl_agent(name, nixl_agent_config(
            enable_prog_thread=config.progress_thread, num_threads=config.num_threads,
            backends=[BACKEND]))
        if BACKEND not in self._nixl.backends:
            raise KVTransferError("NIXL UCX backend failed to start (see UCX logs)")
        self.region: KVRegion = register_kv(self._nixl, kv_cache, config.staging)
        self.startup_seconds = time.perf_counter() - started
        self._peers: dict[str, PeerInfo] = {}
        self._mailboxes: dict[tuple[bool, str], Mailbox] = {}
        self._open_handles: set[int] = set()
        self.notifs_dropped = 0
        logger.info("KV agent %s up in %.3fs: %d blocks x %d bytes registered, %s", name,
                    self.startup_seconds, layout.num_blocks, layout.block_bytes,
                    self.region.describe())

    # ---- peers -------------------------------------------------------------------------
    def metadata(self) -> bytes:
        """NIXL metadata plus our layout and KV address, for peers' :meth:`add_peer`."""
        region = self.region
        info = PeerInfo(self.name, self.layout, region.base_addr, self.layout.total_bytes,
                        region.placement.dev_id, region.placement.mem_type)
        with self._lock:
            return encode_metadata(info, self._live().get_agent_metadata())

    def add_peer(self, peer_metadata: bytes) -> str:
        """Load a peer's metadata; CompatibilityError (naming each difference) if layouts differ."""
        info, nixl_md = decode_metadata(peer_metadata)
        diffs = self.layout.differences(info.layout)
        if diffs:
            raise CompatibilityError(
                f"KV agent {info.name} is incompatible with {self.name}: " + "; ".join(diffs))
        with self._lock:
            if info.name in self._peers:
                self.remove_peer(info.name)
            loaded = self._live().add_remote_agent(nixl_md)
            name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            if name != info.name:
                self._live().remove_remote_agent(name)
                raise KVTransferError(f"metadata names agent {info.name} but NIXL loaded {name}")
            self._peers[name] = info
            try:  # connect now rather than inside the first transfer
                self._nixl.make_connection(name)
            except Exception as exc:  # NIXL binding error; the first write retries anyway
                logger.warning("KV agent %s could not pre-connect to %s: %s", self.name, name, exc)
        logger.info("KV agent %s added peer %s (%d blocks)", self.name, name,
                    info.layout.num_blocks)
        return name

    def remove_peer(self, name: str) -> None:
        """Forget a peer and disconnect from it; its in-flight writes then fail."""
        with self._lock:
            if self._peers.pop(name, None) is not None:
                self._live().remove_remote_agent(name)

    def peer(self, name: str) -> PeerInfo:
        info = self._peers.get(name)
        if info is None:
            raise KVTransferError(f"KV agent {self.name} has no peer named {name!r}")
        return info

    def has_peer(self, name: str) -> bool:
        return name in self._peers

    # ---- writes ------------------------------------------------------------------------
    def post_write(self, peer: str, runs: list[BlockRun], notif: Notif) -> PostedWrite:
        """Start one NIXL WRITE of ``runs`` (one descriptor each) into ``peer``; non-blocking.

        ``notif`` is delivered to the peer after all of this write's bytes have landed. A staged
        agent first copies the source runs into its host mirror; a direct VRAM agent first waits
        for the device's queued work, so NIXL reads blocks the engine has finished writing.
        """
        import numpy as np

        info = self.peer(peer)
        size = self.layout.block_bytes
        region = self.region
        local = np.array([(region.base_addr + r.src_start * size, r.length * size,
                           region.placement.dev_id) for r in runs], dtype=np.uint64)
        remote = np.array([(info.base_addr + r.dst_start * size, r.length * size, info.dev_id)
                           for r in runs], dtype=np.uint64)
        if region.staging is not None:  # outside the lock: a copy, no NIXL call
            region.staging.stage_out((r.src_start, r.length) for r in runs)
        elif region.placement.mem_type == VRAM:
            _wait_for_device(region.placement.dev_id)
        with self._lock:
            nixl = self._live()
            try:
                handle = nixl.initialize_xfer(
                    "WRITE", nixl.get_xfer_descs(local, region.placement.mem_type),
                    nixl.get_xfer_descs(remote, info.mem_type), peer, notif.to_bytes())
            except Exception as exc:  # NIXL binding errors (e.g. NIXL_ERR_NOT_FOUND)
                raise KVTransferError(f"NIXL could not prepare a write to {peer}: {exc}") from exc
            self._open_handles.add(id(handle))
            try:
                status = nixl.transfer(handle)
            except Exception as exc:  # e.g. NIXL_ERR_REMOTE_DISCONNECT: the peer died
                status = "ERR"
                error = exc
            else:
                error = None
        if status == "ERR":
            self.release_xfer(handle)
            if error is not None:
                raise KVTransferError(f"NIXL write to {peer} failed: {error}") from error
            raise KVTransferError(f"NIXL refused to post a write to {peer}")
        return PostedWrite(handle, len(runs), sum(r.length for r in runs) * size)

    def land(self, runs: tuple[tuple[int, int], ...]) -> None:
        """The receiver's hook for ``(dst_start, length)`` runs a WRITE notification says
        landed: a staged agent copies them from its host mirror into the cache; otherwise
        they are already there and nothing happens."""
        if self.region.staging is not None:
            self.region.staging.land(runs)  # raises KVTransferError once the agent is closed

    def xfer_state(self, handle: Any) -> str:
        """"DONE", "PROC" or "ERR" for a posted write (advances progress)."""
        with self._lock:
            return self._live().check_xfer_state(handle)

    def release_xfer(self, handle: Any) -> bool:
        """Release (cancelling if still in flight); False if NIXL could not release it yet."""
        with self._lock:
            try:
                self._live().release_xfer_handle(handle)
            except Exception as exc:  # NIXL raises its own binding error types
                logger.warning("KV agent %s could not release a transfer yet: %s", self.name, exc)
                return False
            self._open_handles.discard(id(handle))
            return True

    @property
    def open_handles(self) -> int:
        """Transfer handles posted and not yet released (0 when nothing leaked)."""
        return len(self._open_handles)

    # ---- notifications -----------------------------------------------------------------
    def send_notif(self, peer: str, notif: Notif) -> bool:
        """Send a standalone notification; False (logged) if the peer is unknown or gone."""
        with self._lock:
            if peer not in self._peers:
                logger.info("KV agent %s cannot notify %s (not a peer): %s", self.name, peer,
                            notif.kind.value)
                return False
            try:
                self._live().send_notif(peer, notif.to_bytes())
            except Exception as exc:  # NIXL binding error: the peer is unreachable
                logger.warning("KV agent %s failed to notify %s: %s", self.name, peer, exc)
                return False
            return True

    def subscribe(self, request_id: str, *, to_sender: bool) -> Mailbox:
        """Open the mailbox of the sender (or receiver) of ``request_id`` in this process."""
        key = (to_sender, request_id)
        with self._lock:
            if key in self._mailboxes:
                role = "sender" if to_sender else "receiver"
                raise KVTransferError(f"request {request_id} already has a {role} here")
            box: Mailbox = deque()
            self._mailboxes[key] = box
            return box

    def unsubscribe(self, request_id: str, *, to_sender: bool) -> None:
        with self._lock:
            self._mailboxes.pop((to_sender, request_id), None)

    @property
    def subscriptions(self) -> int:
        """Open mailboxes (0 when every sender/receiver was closed)."""
        return len(self._mailboxes)

    def pump(self) -> int:
        """Drain NIXL's notifications into mailboxes; returns how many were delivered."""
        with self._lock:
            if self._nixl is None:
                return 0
            incoming = self._nixl.get_new_notifs()
            delivered = 0
            for peer, messages in incoming.items():
                peer_name = peer.decode() if isinstance(peer, bytes) else str(peer)
                for raw in messages:
                    notif = Notif.from_bytes(raw)
                    if notif is None:
                        self.notifs_dropped += 1
                        continue
                    box = self._mailboxes.get((notif.kind.to_sender, notif.request_id))
                    if box is None:
                        logger.debug("KV agent %s: no mailbox for %s of %s", self.name,
                                     notif.kind.value, notif.request_id)
                        self.notifs_dropped += 1
                        continue
                    box.append((peer_name, notif))
                    delivered += 1
            return delivered

    # ---- life cycle --------------------------------------------------------------------
    def close(self) -> None:
        """Disconnect peers, deregister the KV tensor and destroy the NIXL agent; idempotent."""
        with self._lock:
            if self._nixl is None:
                return
            if self._open_handles or self._mailboxes:
                logger.warning("KV agent %s closing with %d open transfers, %d mailboxes",
                               self.name, len(self._open_handles), len(self._mailboxes))
            for name in list(self._peers):
                self.remove_peer(name)
            release_kv(self._nixl, self.region)
            self._nixl = None
            self._mailboxes.clear()
        logger.info("KV agent %s closed", self.name)

    @property
    def closed(self) -> bool:
        return self._nixl is None

    def __enter__(self) -> KVAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _live(self) -> Any:
        if self._nixl is None:
            raise KVTransferError(f"KV agent {self.name} is closed")
        return self._nixl


def _wait_for_device(dev_id: int) -> None:
    """Block until CUDA device ``dev_id`` has run the work queued on it (the engine's writes
    into the blocks about to be read)."""
    import torch  # only a VRAM agent gets here, so torch and CUDA are already loaded

    torch.cuda.synchronize(dev_id)

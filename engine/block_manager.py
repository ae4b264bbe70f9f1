"""Paged KV block manager: refcounted blocks, prefix caching by chain hash, LRU reuse.

Every block is in exactly one of four states:

1. free (never used, or freed without a hash): in ``_free``, refcount 0;
2. cached-free: refcount 0 but its chain hash is registered, so a later prompt can hit it; kept in
   an LRU (``_cached_free``) and evicted (hash removed, ``REMOVED`` event) only when a block is
   needed and no plain free block is left;
3. in use: refcount >= 1, in the block table of that many sequences (shared prefix blocks);
4. reserved: refcount 1, held for a KV transfer into this engine until ``adopt`` or ``release``.

A block's hash is registered only by :meth:`BlockManager.commit`, once every token of the block
has its K/V computed; allocation never registers a hash, so no sequence can hit a block that is
allocated but still being prefilled.
"""

from __future__ import annotations

import hashlib
import logging
import struct
from collections import OrderedDict, deque
from collections.abc import Sequence as SequenceABC

from pdserve.engine.errors import OutOfBlocksError
from pdserve.engine.kv_events import KVEvent, KVEventKind
from pdserve.engine.sequence import Sequence

logger = logging.getLogger(__name__)

_NO_PARENT = b"\x00"
_HAS_PARENT = b"\x01"


def chain_hashes(token_ids: SequenceABC[int], block_size: int, parent: int | None = None) -> list[int]:
    """Hashes of the FULL blocks of ``token_ids``; each covers its parent's hash and its own tokens.

    blake2b with an 8-byte digest, read as an unsigned little-endian int: the same in every process
    (the router computes these for routing, workers for caching). A trailing partial block has no hash.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    out: list[int] = []
    for i in range(len(token_ids) // block_size):
        block = token_ids[i * block_size : (i + 1) * block_size]
        h = hashlib.blake2b(digest_size=8)
        h.update(_NO_PARENT if parent is None else _HAS_PARENT + parent.to_bytes(8, "little"))
        h.update(struct.pack(f"<{block_size}I", *block))
        parent = int.from_bytes(h.digest(), "little")
        out.append(parent)
    return out


def salt_root(salt: str | None) -> int | None:
    """The parent hash a request's first block chains from: None without ``cache_salt``, else a
    hash of the salt, so only requests with the same salt can hit each other's cached blocks."""
    if salt is None:
        return None
    h = hashlib.blake2b(b"pdserve cache_salt\x00" + salt.encode("utf-8", "surrogatepass"), digest_size=8)
    return int.from_bytes(h.digest(), "little")


class BlockManager:
    """Owns ``num_blocks`` KV blocks of ``block_size`` tokens; pure bookkeeping, no tensors.

    ``max_pending_events`` bounds the KV events kept until :meth:`drain_events` (an engine nobody
    drains must not grow without bound); the oldest are dropped and counted in ``events_dropped``.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        *,
        max_pending_events: int = 100_000,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._refcount = [0] * num_blocks
        self._block_hash: list[int | None] = [None] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._cached_free: OrderedDict[int, None] = OrderedDict()   # LRU first
        self._hash_to_block: dict[int, int] = {}
        self._reserved: set[int] = set()
        # request_id -> chain hashes of that sequence's full blocks computed so far (while allocated).
        self._seq_hashes: dict[str, list[int]] = {}
        # One-entry memo so can_allocate() followed by allocate() hashes the prompt once.
        self._memo: tuple[Sequence, int, list[int]] | None = None
        self._events: deque[KVEvent] = deque(maxlen=max_pending_events)
        self.events_dropped = 0
        self.prefix_hit_tokens = 0
        self.prefix_query_tokens = 0

    # ------------------------------------------------------------------ stats
    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now: never-used/unhashed free plus cached-but-unreferenced."""
        return len(self._free) + len(self._cached_free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._cached_free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    @property
    def hit_rate(self) -> float:
        """Prefix-cache hit tokens / queried tokens over every allocate() so far (0.0 before any)."""
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0

    def all_free(self) -> bool:
        """True when no block is referenced by a sequence or a reservation."""
        return self.num_free_blocks == self.num_blocks and not self._reserved

    def ref_count(self, block_id: int) -> int:
        return self._refcount[block_id]

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------ allocation
    def _hashes_for(self, seq: Sequence) -> list[int]:
        if not self.enable_prefix_caching:
            return []
        n = seq.num_tokens
        if self._memo is not None and self._memo[0] is seq and self._memo[1] == n:
            return self._memo[2]
        hashes = chain_hashes(seq.token_ids, self.block_size, salt_root(seq.params.cache_salt))
        self._memo = (seq, n, hashes)
        return hashes

    def _hit_blocks(self, seq: Sequence, hashes: list[int]) -> list[int]:
        """Cached blocks for the leading hashes, leaving at least one token to compute (none for a
        request that wants its prompt's logprobs: those need every prompt position computed)."""
        if seq.params.prompt_logprobs is not None:
            return []
        limit = (seq.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for h in hashes[:limit]:
            block = self._hash_to_block.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def cached_prefix_tokens(self, seq: Sequence) -> int:
        """What :meth:`allocate` would set ``seq.num_computed_tokens`` to now (no side effects)."""
        return len(self._hit_blocks(seq, self._hashes_for(seq))) * self.block_size

    def can_allocate(self, seq: Sequence) -> bool:
        hashes = self._hashes_for(seq)
        hits = self._hit_blocks(seq, hashes)
        revived = sum(1 for b in hits if self._refcount[b] == 0)
        fresh = self.blocks_needed(seq.num_tokens) - len(hits)
        return fresh + revived <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> None:
        """Give ``seq`` blocks for all its tokens, sharing cached prefix blocks; see the module doc."""
        if seq.block_table:
            raise ValueError(f"sequence {seq.request_id!r} already holds blocks")
        if not self.can_allocate(seq):
            raise OutOfBlocksError(
                f"sequence {seq.request_id!r} needs {self.blocks_needed(seq.num_tokens)} blocks, "
                f"{self.num_free_blocks} free"
            )
        hashes = self._hashes_for(seq)
        hits = self._hit_blocks(seq, hashes)
        for block in hits:
            if self._refcount[block] == 0:
                del self._cached_free[block]
            self._refcount[block] += 1
        table = hits + self._take(self.blocks_needed(seq.num_tokens) - len(hits))
        seq.block_table = table
        cached = len(hits) * self.block_size
        seq.num_computed_tokens = cached
        seq.num_hashed_blocks = len(hits)
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = cached
        if self.enable_prefix_caching:
            self._seq_hashes[seq.request_id] = list(hashes)
        self.prefix_query_tokens += seq.num_tokens
        self.prefix_hit_tokens += cached

    def can_append(self, seq: Sequence) -> bool:
        return self.blocks_needed(seq.num_tokens) - len(seq.block_table) <= self.num_free_blocks

    def append_slot(self, seq: Sequence) -> None:
        """Extend ``seq.block_table`` so it covers ``seq.num_tokens`` tokens."""
        need = self.blocks_needed(seq.num_tokens) - len(seq.block_table)
        if need > 0:
            if need > self.num_free_blocks:
                raise OutOfBlocksError(f"sequence {seq.request_id!r} needs {need} more blocks, none free")
            seq.block_table.extend(self._take(need))

    def commit(self, seq: Sequence) -> None:
        """Register the chain hashes of ``seq``'s blocks whose K/V are now fully computed."""
        full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if not self.enable_prefix_caching:
            seq.num_hashed_blocks = max(seq.num_hashed_blocks, full)
            return
        if full <= seq.num_hashed_blocks:
            return
        hashes = self._seq_hashes.setdefault(seq.request_id, [])
        if len(hashes) < full:
            bs = self.block_size
            parent = hashes[-1] if hashes else salt_root(seq.params.cache_salt)
            start = len(hashes)
            tokens = [seq.token_at(p) for p in range(start * bs, full * bs)]
            hashes.extend(chain_hashes(tokens, bs, parent))
        for i in range(seq.num_hashed_blocks, full):
            h, block = hashes[i], seq.block_table[i]
            if h in self._hash_to_block or self._block_hash[block] is not None:
                continue  # another block already caches these tokens: ours stays unhashed
            self._hash_to_block[h] = block
            self._block_hash[block] = h
            self._emit(KVEventKind.STORED, h)
        seq.num_hashed_blocks = full

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references; hashed blocks stay hittable (LRU) until evicted."""
        # Tail blocks first, so the LRU evicts the end of a prefix chain before its head.
        for block in reversed(seq.block_table):
            self._decref(block)
        seq.block_table = []
        seq.num_hashed_blocks = 0
        seq.num_computed_tokens = 0
        self._seq_hashes.pop(seq.request_id, None)

    # ------------------------------------------------------ KV transfer (decode side)
    def reserve(self, n: int) -> list[int]:
        """Take ``n`` raw blocks for a KV transfer into this engine."""
        if n < 0:
            raise ValueError(f"cannot reserve a negative number of blocks ({n})")
        if n > self.num_free_blocks:
            raise OutOfBlocksError(f"need {n} KV blocks, {self.num_free_blocks} free")
        blocks = self._take(n)
        self._reserved.update(blocks)
        return blocks

    def release(self, block_ids: list[int]) -> None:
        """Give back reserved blocks that never became a sequence's."""
        self._check_reserved(block_ids)
        for block in block_ids:
            self._reserved.discard(block)
            self._decref(block)

    def adopt(self, seq: Sequence, block_ids: list[int]) -> None:
        """Make reserved blocks ``seq``'s block table; the caller sets ``num_computed_tokens``."""
        if seq.block_table:
            raise ValueError(f"sequence {seq.request_id!r} already holds blocks")
        self._check_reserved(block_ids)
        self._reserved.difference_update(block_ids)
        seq.block_table = list(block_ids)
        seq.num_hashed_blocks = 0

    def _check_reserved(self, block_ids: list[int]) -> None:
        unknown = [b for b in block_ids if b not in self._reserved]
        if unknown or len(set(block_ids)) != len(block_ids):
            raise ValueError(f"blocks {unknown or block_ids} are not (uniquely) reserved")

    # ------------------------------------------------------------- routing info
    def drain_events(self) -> list[KVEvent]:
        events = list(self._events)
        self._events.clear()
        return events

    def longest_cached_prefix(self, hashes: list[int]) -> int:
        """How many leading ``hashes`` are cached here (computed, in use or cached-free)."""
        n = 0
        for h in hashes:
            if h not in self._hash_to_block:
                break
            n += 1
        return n

    # ------------------------------------------------------------------ internals
    def _take(self, n: int) -> list[int]:
        """Pop ``n`` blocks (plain free first, then evict LRU cached) and reference them once."""
        out: list[int] = []
        for _ in range(n):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._cached_free.popitem(last=False)
                h = self._block_hash[block]
                if h is not None:
                    del self._hash_to_block[h]
                    self._block_hash[block] = None
                    self._emit(KVEventKind.REMOVED, h)
            self._refcount[block] = 1
            out.append(block)
        return out

    def _decref(self, block: int) -> None:
        if self._refcount[block] <= 0:
            raise RuntimeError(f"block {block} freed more often than it was referenced")
        self._refcount[block] -= 1
        if self._refcount[block] == 0:
            if self._block_hash[block] is not None:
                self._cached_free[block] = None
            else:
                self._free.append(block)

    def _emit(self, kind: KVEventKind, block_hash: int) -> None:
        if len(self._events) == self._events.maxlen:
            self.events_dropped += 1
            if self.events_dropped == 1:
                logger.warning("KV events are not being drained; dropping the oldest")
        self._events.append(KVEvent(kind, block_hash))

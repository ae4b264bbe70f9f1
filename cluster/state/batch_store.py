"""The Batch API's durable state in Redis (``router/batch_api.py`` defines what it holds).

Keys under one namespace (``pdserve`` by default):

* ``{ns}:file:{id}``: hash with ``meta`` (JSON); ``{ns}:file:{id}:content``: the bytes, read back in
  slices of ``CHUNK_BYTES`` (a 64 MiB value read at once is copied whole three times inside the
  Redis client, holding the GIL: the router's event loop would stall). Files stored before hold
  their bytes in the hash's ``content`` field, read at once;
* ``{ns}:batch:{id}``: the batch object (JSON, without its counts); ``{ns}:batch:{id}:counts``:
  hash ``completed`` / ``failed``; ``{ns}:batch:{id}:items``: list of the input lines;
  ``{ns}:batch:{id}:results``: hash item index -> ``{"ok", "line"}`` (JSON);
* ``{ns}:batches``: sorted set of batch ids by creation time; ``{ns}:batches:owner:{owner}``: the
  same for one API key's batches (keyed owners only: the anonymous owner's are read from
  ``{ns}:batches``); ``{ns}:batches:active``: the set of batches not yet finalized.
* Item leases, so that the runners of several routers run each item once: ``{ns}:batch:{id}:lease:{i}``
  holds the runner that claimed item ``i`` (``SET NX PX``: it expires unless renewed), ``{ns}:batch:{id}:leased``
  the indexes that may hold a lease, ``{ns}:batch:{id}:claims`` hash index -> times claimed (2 or
  more: an item taken over from a runner that died or stalled past its lease), and
  ``{ns}:batch:{id}:finalize`` the runner that writes the batch's output (``SET NX PX``).

A file's or batch's ``owner`` is the owner id of the API key that made it (``router/auth.py``);
objects stored before owners existed have none and belong to the anonymous owner.

A result is recorded with ``HSETNX`` and its count added in the same Lua call, so an item run
twice (its router died after running it, before recording it) is counted and kept once.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator

import redis

from pdserve.cluster.state.redis_guard import RedisUnavailableError
from pdserve.router.auth import ANONYMOUS
from pdserve.router.batch_input import is_batch_id, is_file_id

CHUNK_BYTES = 1 << 20

_RECORD = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 1 then
  redis.call('HINCRBY', KEYS[2], ARGV[3], 1)
  return 1
end
return 0
"""

# KEYS: results, leased, claims; ARGV: lease key prefix, holder, lease ms, want, total, start, max scan.
# Claims up to ``want`` items with no result and no live lease, scanning at most ``max scan``
# indexes from ``start`` (wrapping); returns the next start, then the claimed indexes.
_CLAIM = """
local prefix, holder, ttl = ARGV[1], ARGV[2], ARGV[3]
local want, total, i, budget = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local got = {}
local scanned = 0
while scanned < budget and scanned < total and #got < want do
  if redis.call('HEXISTS', KEYS[1], i) == 0 and redis.call('SET', prefix .. i, holder, 'NX', 'PX', ttl) then
    redis.call('SADD', KEYS[2], i)
    redis.call('HINCRBY', KEYS[3], i, 1)
    got[#got + 1] = i
  end
  i = (i + 1) % total
  scanned = scanned + 1
end
table.insert(got, 1, i)
return got
"""

# ARGV: lease key prefix, holder, lease ms, indexes...; renews the holder's leases, returns the
# indexes whose lease it no longer holds (expired, or taken over).
_RENEW = """
local lost = {}
for n = 4, #ARGV do
  local key = ARGV[1] .. ARGV[n]
  if redis.call('GET', key) == ARGV[2] then
    redis.call('PEXPIRE', key, ARGV[3])
  else
    lost[#lost + 1] = ARGV[n]
  end
end
return lost
"""

# KEYS: leased; ARGV: lease key prefix, holder, index.
_RELEASE = """
local key = ARGV[1] .. ARGV[3]
if redis.call('GET', key) == ARGV[2] then
  redis.call('DEL', key)
  redis.call('SREM', KEYS[1], ARGV[3])
end
return 0
"""

# KEYS: leased; ARGV: lease key prefix. The leases still live (expired ones are forgotten).
_LIVE = """
local live = 0
for _, i in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  if redis.call('EXISTS', ARGV[1] .. i) == 1 then
    live = live + 1
  else
    redis.call('SREM', KEYS[1], i)
  end
end
return live
"""


def _unavailable(fn):
    """A Redis that cannot be reached is the client's 503 (retry), never a 500."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise RedisUnavailableError(f"the Batch API's store (Redis) is unavailable: {exc}; retry shortly") from None

    return call


class RedisBatchStore:
    def __init__(self, client: redis.Redis, namespace: str = "pdserve") -> None:
        self.r = client
        self.ns = namespace
        self._record = client.register_script(_RECORD)
        self._claim = client.register_script(_CLAIM)
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)
        self._live = client.register_script(_LIVE)

    def _k(self, *parts: str) -> str:
        return ":".join((self.ns, *parts))

    # ------------------------------------------------------------------ files
    @_unavailable
    def put_file(self, meta: dict, content: bytes) -> None:
        with self.r.pipeline(transaction=True) as p:
            p.set(self._k("file", meta["id"], "content"), content)
            p.hset(self._k("file", meta["id"]), "meta", json.dumps(meta))
            p.execute()

    @_unavailable
    def file(self, file_id: str) -> dict | None:
        if not is_file_id(file_id):
            return None
        raw = self.r.hget(self._k("file", file_id), "meta")
        return None if raw is None else json.loads(raw)

    @_unavailable
    def file_content(self, file_id: str) -> bytes | None:
        chunks = self.file_chunks(file_id)
        return None if chunks is None else b"".join(chunks)

    @_unavailable
    def file_chunks(self, file_id: str, chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes] | None:
        """The file's bytes in slices of ``chunk_bytes``, each read when the iterator gets to it
        (its reads raise ``RedisUnavailableError`` as the other calls do); None for no such file."""
        if not is_file_id(file_id):
            return None
        key = self._k("file", file_id, "content")
        size = self.r.strlen(key)
        if size == 0:   # a file stored before the bytes had a key of their own (or none)
            legacy = self.r.hget(self._k("file", file_id), "content")
            return None if legacy is None else iter((legacy,))

        def slices() -> Iterator[bytes]:
            for start in range(0, size, chunk_bytes):
                yield _unavailable(self.r.getrange)(key, start, min(size, start + chunk_bytes) - 1)

        return slices()

    # ---------------------------------------------------------------- batches
    @_unavailable
    def put_batch(self, batch: dict, items: list[str]) -> None:
        bid = batch["id"]
        doc = {k: v for k, v in batch.items() if k != "request_counts"}
        with self.r.pipeline(transaction=True) as p:
            p.set(self._k("batch", bid), json.dumps({**doc, "total": batch["request_counts"]["total"]}))
            p.hset(self._k("batch", bid, "counts"), mapping={"completed": 0, "failed": 0})
            if items:
                p.rpush(self._k("batch", bid, "items"), *items)
            p.zadd(self._k("batches"), {bid: batch["created_at"]})
            if batch.get("owner", ANONYMOUS) != ANONYMOUS:
                p.zadd(self._k("batches", "owner", batch["owner"]), {bid: batch["created_at"]})
            if batch["status"] not in ("failed", "completed", "cancelled", "expired"):
                p.sadd(self._k("batches", "active"), bid)
            p.execute()

    @_unavailable
    def batch(self, batch_id: str) -> dict | None:
        if not is_batch_id(batch_id):   # never a key of another kind (``batch_x:counts``)
            return None
        raw = self.r.get(self._k("batch", batch_id))
        if raw is None:
            return None
        doc = json.loads(raw)
        counts = self.r.hgetall(self._k("batch", batch_id, "counts"))
        total = doc.pop("total")
        doc["request_counts"] = {"total": total, "completed": int(counts.get(b"completed", 0)),
                                 "failed": int(counts.get(b"failed", 0))}
        return doc

    @_unavailable
    def batches(self, limit: int, after: str | None = None, owner: str = ANONYMOUS) -> list[dict]:
        """``owner``'s batches, newest first; ``after`` is the id the previous page ended with."""
        index = self._k("batches", "owner", owner) if owner != ANONYMOUS else self._k("batches")
        ids = [i.decode() for i in self.r.zrevrange(index, 0, -1)]
        if after is not None and after in ids:
            ids = ids[ids.index(after) + 1:]
        out: list[dict] = []
        for i in ids:   # the anonymous owner's index holds every batch: keep its own
            b = self.batch(i)
            if b is not None and b.get("owner", ANONYMOUS) == owner:
                out.append(b)
                if len(out) == limit:
                    break
        return out

    @_unavailable
    def update_batch(self, batch_id: str, changes: dict) -> dict | None:
        key = self._k("batch", batch_id)
        with self.r.pipeline() as p:
            while True:
                try:
                    p.watch(key)
                    raw = p.get(key)
                    if raw is None:
                        p.reset()
                        return None
                    doc = {**json.loads(raw), **changes}
                    p.multi()
                    p.set(key, json.dumps(doc))
                    if doc["status"] in ("failed", "completed", "cancelled", "expired"):
                        p.srem(self._k("batches", "active"), batch_id)
                    p.execute()
                    break
                except redis.WatchError:
                    continue
        return self.batch(batch_id)

    @_unavailable
    def item(self, batch_id: str, index: int) -> str:
        raw = self.r.lindex(self._k("batch", batch_id, "items"), index)
        if raw is None:
            raise KeyError(f"batch {batch_id} has no item {index}")
        return raw.decode()

    @_unavailable
    def items(self, batch_id: str) -> list[str]:
        return [raw.decode() for raw in self.r.lrange(self._k("batch", batch_id, "items"), 0, -1)]

    @_unavailable
    def record_result(self, batch_id: str, index: int, line: str, ok: bool) -> bool:
        stored = json.dumps({"ok": ok, "line": line})
        return bool(self._record(keys=[self._k("batch", batch_id, "results"), self._k("batch", batch_id, "counts")],
                                 args=[index, stored, "completed" if ok else "failed"]))

    @_unavailable
    def results(self, batch_id: str) -> list[tuple[int, str, bool]]:
        out = []
        for i, raw in self.r.hgetall(self._k("batch", batch_id, "results")).items():
            rec = json.loads(raw)
            out.append((int(i), rec["line"], bool(rec["ok"])))
        return out

    @_unavailable
    def active_batches(self) -> list[str]:
        return sorted(i.decode() for i in self.r.smembers(self._k("batches", "active")))

    # ----------------------------------------------------------------- leases
    def _lease_prefix(self, batch_id: str) -> str:
        return self._k("batch", batch_id, "lease", "")

    @_unavailable
    def claim_items(self, batch_id: str, holder: str, lease_s: float, want: int, total: int, start: int,
                    max_scan: int = 2000) -> tuple[list[int], int]:
        """Lease up to ``want`` items that have no result and no live lease to ``holder``, looking
        at most at ``max_scan`` indexes from ``start``: (the claimed indexes, where to look next)."""
        if want <= 0 or total <= 0:
            return [], start
        got = self._claim(keys=[self._k("batch", batch_id, "results"), self._k("batch", batch_id, "leased"),
                                self._k("batch", batch_id, "claims")],
                          args=[self._lease_prefix(batch_id), holder, max(1, int(lease_s * 1000)), want, total,
                                start % total, max_scan])
        return [int(i) for i in got[1:]], int(got[0])

    @_unavailable
    def renew_items(self, batch_id: str, holder: str, lease_s: float, indexes: list[int]) -> list[int]:
        """Extend ``holder``'s leases; returns the indexes whose lease it lost."""
        if not indexes:
            return []
        lost = self._renew(args=[self._lease_prefix(batch_id), holder, max(1, int(lease_s * 1000)), *indexes])
        return [int(i) for i in lost]

    @_unavailable
    def release_item(self, batch_id: str, holder: str, index: int) -> None:
        self._release(keys=[self._k("batch", batch_id, "leased")], args=[self._lease_prefix(batch_id), holder, index])

    @_unavailable
    def live_leases(self, batch_id: str) -> int:
        """Items of the batch that some runner holds a live lease on."""
        return int(self._live(keys=[self._k("batch", batch_id, "leased")], args=[self._lease_prefix(batch_id)]))

    @_unavailable
    def claims(self, batch_id: str) -> dict[int, int]:
        """Item index -> how many times a runner claimed it (operators, tests)."""
        return {int(i): int(n) for i, n in self.r.hgetall(self._k("batch", batch_id, "claims")).items()}

    @_unavailable
    def claim_finalize(self, batch_id: str, holder: str, lease_s: float) -> bool:
        """Whether ``holder`` may write the batch's output: the first to ask, until its lease expires."""
        return bool(self.r.set(self._k("batch", batch_id, "finalize"), holder, nx=True,
                               px=max(1, int(lease_s * 1000))))

"""The Batch API's durable state in Redis (``router/batch_api.py`` defines what it holds).

Keys under one namespace (``pdserve`` by default):

* ``{ns}:file:{id}``: hash with ``meta`` (JSON) and ``content`` (the bytes);
* ``{ns}:batch:{id}``: the batch object (JSON, without its counts); ``{ns}:batch:{id}:counts``:
  hash ``completed`` / ``failed``; ``{ns}:batch:{id}:items``: list of the input lines;
  ``{ns}:batch:{id}:results``: hash item index -> ``{"ok", "line"}`` (JSON);
* ``{ns}:batches``: sorted set of batch ids by creation time; ``{ns}:batches:active``: the set of
  batches not yet finalized.

A result is recorded with ``HSETNX`` and its count added in the same Lua call, so an item run
twice (its router died after running it, before recording it) is counted and kept once.
"""

from __future__ import annotations

import functools
import json

import redis

from pdserve.cluster.redis_guard import RedisUnavailableError

_RECORD = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 1 then
  redis.call('HINCRBY', KEYS[2], ARGV[3], 1)
  return 1
end
return 0
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

    def _k(self, *parts: str) -> str:
        return ":".join((self.ns, *parts))

    # ------------------------------------------------------------------ files
    @_unavailable
    def put_file(self, meta: dict, content: bytes) -> None:
        self.r.hset(self._k("file", meta["id"]), mapping={"meta": json.dumps(meta), "content": content})

    @_unavailable
    def file(self, file_id: str) -> dict | None:
        raw = self.r.hget(self._k("file", file_id), "meta")
        return None if raw is None else json.loads(raw)

    @_unavailable
    def file_content(self, file_id: str) -> bytes | None:
        return self.r.hget(self._k("file", file_id), "content")

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
            if batch["status"] not in ("failed", "completed", "cancelled", "expired"):
                p.sadd(self._k("batches", "active"), bid)
            p.execute()

    @_unavailable
    def batch(self, batch_id: str) -> dict | None:
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
    def batches(self, limit: int, after: str | None = None) -> list[dict]:
        """Newest first; ``after`` is the id the previous page ended with."""
        ids = [i.decode() for i in self.r.zrevrange(self._k("batches"), 0, -1)]
        if after is not None and after in ids:
            ids = ids[ids.index(after) + 1:]
        return [b for b in (self.batch(i) for i in ids[:limit]) if b is not None]

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
    def pending_items(self, batch_id: str, total: int) -> list[int]:
        done = {int(i) for i in self.r.hkeys(self._k("batch", batch_id, "results"))}
        return [i for i in range(total) if i not in done]

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

"""The worker registry in Redis: who serves, where to reach them, and whether they are alive.

Per worker, under ``{namespace}:worker:``:

- ``{id}``: a hash holding the ``WorkerRecord`` (NIXL metadata stored as raw bytes) and the last
  stats. It expires ``retain_dead_s`` after the last heartbeat, so a dead worker stays
  inspectable for a while and then disappears on its own.
- ``{id}:alive``: the last heartbeat's server time, expiring ``ttl_s`` after it. A worker whose
  key expired is not alive.

and ``{namespace}:workers``, the set of registered ids (stale ids are dropped while listing).
"""

from __future__ import annotations

import enum
import json
import time
from dataclasses import asdict, dataclass, field, replace

import redis

from pdserve.cluster.redis_server import connect
from pdserve.engine.errors import PdserveError

SCHEMA_VERSION = 1


class RegistryError(PdserveError):
    """A registry record is unreadable (e.g. written by an incompatible pdserve version)."""


class WorkerRole(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"

    def serves(self, role: WorkerRole) -> bool:
        """True if a worker of this role can take work of ``role`` (BOTH takes either)."""
        return self is role or self is WorkerRole.BOTH


@dataclass(frozen=True, slots=True)
class WorkerStats:
    """Live load figures a worker publishes with each heartbeat."""

    free_blocks: int = 0
    running: int = 0
    waiting: int = 0
    tokens_per_s: float = 0.0
    prefix_hit_rate: float = 0.0

    def __post_init__(self) -> None:
        if min(self.free_blocks, self.running, self.waiting) < 0 or self.tokens_per_s < 0:
            raise ValueError(f"worker stats cannot be negative: {self}")
        if not 0.0 <= self.prefix_hit_rate <= 1.0:
            raise ValueError(f"prefix_hit_rate must be in [0, 1], got {self.prefix_hit_rate}")

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> WorkerStats:
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class WorkerRecord:
    """How to reach one worker and what its KV cache looks like.

    ``alive`` and ``last_heartbeat_at`` are filled in by ``Registry`` on read and ignored on
    write.
    """

    worker_id: str
    role: WorkerRole
    node_address: str
    actor_name: str
    nixl_agent_name: str
    nixl_metadata: bytes
    kv_compat_hash: str
    num_blocks: int
    block_size: int
    started_at: float = field(default_factory=time.time)
    stats: WorkerStats = field(default_factory=WorkerStats)
    alive: bool | None = None
    last_heartbeat_at: float | None = None

    def __post_init__(self) -> None:
        if not self.worker_id or not isinstance(self.worker_id, str):
            raise ValueError(f"worker_id must be a non-empty string, got {self.worker_id!r}")
        object.__setattr__(self, "role", WorkerRole(self.role))
        if not isinstance(self.nixl_metadata, bytes):
            kind = type(self.nixl_metadata).__name__
            raise ValueError(f"nixl_metadata must be bytes, got {kind}")
        if self.num_blocks < 0 or self.block_size <= 0:
            raise ValueError(
                f"bad KV shape: num_blocks={self.num_blocks}, block_size={self.block_size}"
            )

    def to_fields(self) -> dict[str, bytes | str]:
        return {
            "schema_version": str(SCHEMA_VERSION),
            "worker_id": self.worker_id,
            "role": self.role.value,
            "node_address": self.node_address,
            "actor_name": self.actor_name,
            "nixl_agent_name": self.nixl_agent_name,
            "nixl_metadata": self.nixl_metadata,
            "kv_compat_hash": self.kv_compat_hash,
            "num_blocks": str(self.num_blocks),
            "block_size": str(self.block_size),
            "started_at": repr(float(self.started_at)),
            "stats": json.dumps(asdict(self.stats)),
        }

    @classmethod
    def from_fields(cls, raw: dict[bytes, bytes]) -> WorkerRecord:
        version = raw.get(b"schema_version", b"?").decode()
        if version != str(SCHEMA_VERSION):
            raise RegistryError(
                f"worker record {raw.get(b'worker_id', b'?').decode()!r} has schema_version "
                f"{version!r}; this pdserve reads version {SCHEMA_VERSION} only "
                "(are two pdserve versions sharing one Redis?)"
            )

        def text(name: str) -> str:
            return raw[name.encode()].decode()

        return cls(
            worker_id=text("worker_id"),
            role=WorkerRole(text("role")),
            node_address=text("node_address"),
            actor_name=text("actor_name"),
            nixl_agent_name=text("nixl_agent_name"),
            nixl_metadata=raw[b"nixl_metadata"],
            kv_compat_hash=text("kv_compat_hash"),
            num_blocks=int(text("num_blocks")),
            block_size=int(text("block_size")),
            started_at=float(text("started_at")),
            stats=WorkerStats.from_dict(json.loads(text("stats"))),
        )


# KEYS: record, alive. ARGV: stats json, ttl ms, retain ms. Refreshes only a registered worker.
_HEARTBEAT = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local t = redis.call('TIME')
local now = t[1] .. '.' .. string.format('%06d', tonumber(t[2]))
redis.call('HSET', KEYS[1], 'stats', ARGV[1], 'heartbeat_at', now)
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('SET', KEYS[2], now, 'PX', ARGV[2])
return 1
"""


def _ttl_ms(ttl_s: float) -> int:
    if not ttl_s > 0:
        raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
    return max(1, int(ttl_s * 1000))


class Registry:
    """Register, heartbeat, look up and list workers (see the module doc for the keys)."""

    def __init__(
        self, client_or_url: redis.Redis | str, namespace: str = "pdserve", *,
        retain_dead_s: float = 3600.0,
    ) -> None:
        if not namespace:
            raise ValueError("namespace must be non-empty")
        self.client = connect(client_or_url)
        self.namespace = namespace
        self.retain_dead_ms = _ttl_ms(retain_dead_s)
        self._ids = f"{namespace}:workers"
        self._heartbeat = self.client.register_script(_HEARTBEAT)

    def _record_key(self, worker_id: str) -> str:
        return f"{self.namespace}:worker:{worker_id}"

    def _alive_key(self, worker_id: str) -> str:
        return f"{self.namespace}:worker:{worker_id}:alive"

    def register(self, record: WorkerRecord, ttl_s: float) -> None:
        """Write (or overwrite) a worker's record and mark it alive for ``ttl_s``."""
        ttl = _ttl_ms(ttl_s)
        key = self._record_key(record.worker_id)
        pipe = self.client.pipeline(transaction=True)
        pipe.delete(key)
        now = repr(time.time())
        pipe.hset(key, mapping={**record.to_fields(), "heartbeat_at": now})
        pipe.pexpire(key, max(ttl, self.retain_dead_ms))
        pipe.sadd(self._ids, record.worker_id)
        pipe.set(self._alive_key(record.worker_id), now, px=ttl)
        pipe.execute()

    def heartbeat(
        self, worker_id: str, stats: WorkerStats | dict[str, object], ttl_s: float
    ) -> bool:
        """Publish stats and stay alive ``ttl_s`` longer.

        Returns False when the worker's record is gone (never registered, deregistered, or
        lost with Redis data): the worker should ``register`` again.
        """
        ttl = _ttl_ms(ttl_s)
        if isinstance(stats, dict):
            stats = WorkerStats.from_dict(stats)
        keys = [self._record_key(worker_id), self._alive_key(worker_id)]
        args = [json.dumps(asdict(stats)), ttl, max(ttl, self.retain_dead_ms)]
        return bool(self._heartbeat(keys=keys, args=args))

    def get(self, worker_id: str) -> WorkerRecord | None:
        found = self._read([worker_id.encode()])
        return found[0] if found else None

    def list_workers(
        self, role: WorkerRole | str | None = None, alive_only: bool = True
    ) -> list[WorkerRecord]:
        """Workers sorted by id; ``role`` keeps those that can serve it (BOTH serves either)."""
        wanted = WorkerRole(role) if role is not None else None
        ids = sorted(self.client.smembers(self._ids))
        records = self._read(ids)
        return [r for r in records
                if (wanted is None or r.role.serves(wanted)) and (r.alive or not alive_only)]

    def deregister(self, worker_id: str) -> bool:
        """Remove a worker; returns False if it was not registered."""
        pipe = self.client.pipeline(transaction=True)
        pipe.delete(self._record_key(worker_id), self._alive_key(worker_id))
        pipe.srem(self._ids, worker_id)
        deleted, _ = pipe.execute()
        return bool(deleted)

    def _read(self, ids: list[bytes]) -> list[WorkerRecord]:
        pipe = self.client.pipeline(transaction=False)
        for wid in ids:
            pipe.hgetall(self._record_key(wid.decode()))
            pipe.get(self._alive_key(wid.decode()))
        replies = pipe.execute()
        out, stale = [], []
        for wid, raw, beat in zip(ids, replies[0::2], replies[1::2]):
            if not raw:
                stale.append(wid)
                continue
            last = raw.get(b"heartbeat_at")
            out.append(replace(WorkerRecord.from_fields(raw), alive=beat is not None,
                               last_heartbeat_at=float(last) if last is not None else None))
        if stale:
            self.client.srem(self._ids, *stale)
        return out

"""The KV handoff ledger: who holds which KV blocks for which request, kept in Redis.

Life of one entry (one placement attempt of one request):

1. ``reserve``: the decode worker reserves blocks under a lease -> RESERVED (decode side holds).
2. ``transition(TRANSFERRING, prefill_worker_id=...)``: a prefill worker
   starts moving KV; from here both sides hold blocks.
3. ``transition(LANDED)``: the transfer is confirmed; the prefill side no longer holds blocks.
4. ``transition(DECODING)``: the request joined the decode batch (also straight from RESERVED
   when the decode worker prefilled locally, with no transfer).
5. ``move_decode``: while DECODING, the request's KV moved to another decode worker (live
   migration on drain): the entry names the new holder and its blocks, in the same state.
6. ``transition(FREED)``: the decode side released its blocks. The entry is terminal, leaves the
   lease index and is kept ``freed_ttl_s`` seconds for operators, then expires on its own
   (``forget`` deletes it at once).

Any non-terminal state may go to FAILED (blocks may still be held on either side); FAILED ->
FREED once every side has released. RESERVED, LANDED and DECODING may go to FREED directly
(abort), and so may TRANSFERRING when the prefill itself ended the request (EOS or
``max_tokens`` at its first token: the prefill side released its blocks and no KV was sent, the
decode side's reservation is aborted). Every change is one Lua script, so concurrent writers cannot interleave, and an illegal
change raises ``InvalidTransitionError``. Every non-terminal entry sits in a sorted set scored by
its lease deadline (Redis server clock, epoch seconds), so ``expired()`` is one range query.
A retried request must use a new ``request_id`` per attempt (e.g. ``f"{rid}#2"``).
"""

from __future__ import annotations

import enum
import json
import logging
from dataclasses import dataclass, field

import redis

from pdserve.cluster.state.redis_server import connect
from pdserve.engine.errors import PdserveError
from pdserve.router.ledger_port import LedgerState  # noqa: F401  (the ledger's states; re-exported)

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1


class LedgerError(PdserveError):
    """The ledger refused an operation or holds data this version cannot read."""


class EntryNotFoundError(LedgerError):
    """No ledger entry exists for the request id."""

    grpc_status = "NOT_FOUND"
    http_status = 404


class InvalidTransitionError(LedgerError):
    """The requested state change is not allowed from the entry's current state."""

    grpc_status = "FAILED_PRECONDITION"
    http_status = 409


class Side(enum.Enum):
    """Which end of the handoff holds blocks."""

    PREFILL = "prefill"
    DECODE = "decode"


S = LedgerState
#: Legal moves, source -> targets. FREED is the only terminal state.
TRANSITIONS: dict[LedgerState, frozenset[LedgerState]] = {
    S.RESERVED: frozenset({S.TRANSFERRING, S.DECODING, S.FAILED, S.FREED}),
    S.TRANSFERRING: frozenset({S.LANDED, S.FAILED, S.FREED}),
    S.LANDED: frozenset({S.DECODING, S.FAILED, S.FREED}),
    S.DECODING: frozenset({S.FAILED, S.FREED}),
    S.FAILED: frozenset({S.FREED}),
    S.FREED: frozenset(),
}
_SOURCES = {to: " " + " ".join(sorted(s.value for s, tos in TRANSITIONS.items() if to in tos)) + " "
            for to in LedgerState}


@dataclass(frozen=True, slots=True)
class LedgerEntry:
    """One request's KV blocks on both sides of a handoff, as last read from Redis."""

    request_id: str
    state: LedgerState
    decode_worker_id: str
    decode_blocks: tuple[int, ...]
    decode_held: bool
    prefill_worker_id: str | None
    prefill_blocks: tuple[int, ...]
    prefill_held: bool
    lease_deadline: float
    timestamps: dict[LedgerState, float] = field(default_factory=dict)
    error: str | None = None
    kv_moves: int = 0  # times its KV moved to another decode worker (``move_decode``)

    def holds(self, side: Side) -> bool:
        return self.decode_held if side is Side.DECODE else self.prefill_held

    def worker(self, side: Side) -> str | None:
        return self.decode_worker_id if side is Side.DECODE else self.prefill_worker_id

    def held_sides(self) -> tuple[Side, ...]:
        return tuple(s for s in (Side.PREFILL, Side.DECODE) if self.holds(s))

    @classmethod
    def from_hash(cls, raw: dict[bytes, bytes]) -> LedgerEntry:
        f = {k.decode(): v.decode() for k, v in raw.items()}
        version = f.get("v")
        if version != str(SCHEMA_VERSION):
            raise LedgerError(
                f"ledger entry {f.get('rid')!r} has schema_version {version!r}; this pdserve "
                f"reads version {SCHEMA_VERSION} only (mixed pdserve versions on one Redis?)"
            )
        return cls(
            request_id=f["rid"],
            state=LedgerState(f["state"]),
            decode_worker_id=f["dw"],
            decode_blocks=tuple(json.loads(f["db"])),
            decode_held=f["dh"] == "1",
            prefill_worker_id=f["pw"] or None,
            prefill_blocks=tuple(json.loads(f["pb"])),
            prefill_held=f["ph"] == "1",
            lease_deadline=float(f["deadline"]),
            timestamps={LedgerState(k[2:]): float(v) for k, v in f.items() if k.startswith("t:")},
            error=f["err"] or None,
            kv_moves=int(f.get("moves", "0")),
        )


# Shared Lua prelude. KEYS[1] = entry hash, KEYS[2] = lease zset; held-block sets are named
# from a prefix (single-instance Redis; not Redis Cluster safe, which pdserve does not use).
_PRELUDE = """
local function fmt(x) return string.format('%.6f', x) end
local function clock(arg)
  if arg and arg ~= '' then return tonumber(arg) end
  local t = redis.call('TIME'); return tonumber(t[1]) + tonumber(t[2]) / 1e6
end
local function drop_hold(prefix, rid, flag, wid)
  redis.call('HSET', KEYS[1], flag, '0')
  if wid and wid ~= '' then redis.call('SREM', prefix .. wid, rid) end
end
"""

# ARGV: rid, decode worker, decode blocks json, lease_s, held prefix, schema version
_RESERVE = _PRELUDE + """
local st = redis.call('HGET', KEYS[1], 'state')
if st and st ~= 'FREED' then return {'EXISTS', st} end
redis.call('DEL', KEYS[1])
local t = clock(nil)
local dl = t + tonumber(ARGV[4])
redis.call('HSET', KEYS[1], 'v', ARGV[6], 'rid', ARGV[1], 'state', 'RESERVED', 'dw', ARGV[2],
  'db', ARGV[3], 'dh', '1', 'pw', '', 'pb', '[]', 'ph', '0', 'deadline', fmt(dl), 'err', '',
  't:RESERVED', fmt(t))
redis.call('ZADD', KEYS[2], fmt(dl), ARGV[1])
redis.call('SADD', ARGV[5] .. ARGV[2], ARGV[1])
return {'OK', redis.call('HGETALL', KEYS[1])}
"""

# ARGV: rid, to, allowed sources (" A B "), expected source or '', prefill worker or '',
#       prefill blocks json or '', error or '', lease_s or '', held prefix, freed ttl seconds
_TRANSITION = _PRELUDE + """
local rid, to = ARGV[1], ARGV[2]
local st = redis.call('HGET', KEYS[1], 'state')
if not st then return {'MISSING'} end
if not string.find(ARGV[3], ' ' .. st .. ' ', 1, true) then return {'INVALID', st} end
if ARGV[4] ~= '' and ARGV[4] ~= st then return {'INVALID', st} end
local t = clock(nil)
local pw = redis.call('HGET', KEYS[1], 'pw')
if ARGV[5] ~= '' then
  if redis.call('HGET', KEYS[1], 'ph') == '1' and pw ~= ARGV[5] then
    return {'CONFLICT', pw}
  end
  pw = ARGV[5]
  redis.call('HSET', KEYS[1], 'pw', pw, 'pb', ARGV[6], 'ph', '1')
  redis.call('SADD', ARGV[9] .. pw, rid)
end
redis.call('HSET', KEYS[1], 'state', to, 't:' .. to, fmt(t))
if ARGV[7] ~= '' then redis.call('HSET', KEYS[1], 'err', ARGV[7]) end
if to == 'LANDED' or to == 'DECODING' or to == 'FREED' then drop_hold(ARGV[9], rid, 'ph', pw) end
if to == 'FREED' then
  drop_hold(ARGV[9], rid, 'dh', redis.call('HGET', KEYS[1], 'dw'))
  redis.call('ZREM', KEYS[2], rid)
  redis.call('EXPIRE', KEYS[1], tonumber(ARGV[10]))
elseif ARGV[8] ~= '' then
  local dl = t + tonumber(ARGV[8])
  redis.call('HSET', KEYS[1], 'deadline', fmt(dl))
  redis.call('ZADD', KEYS[2], fmt(dl), rid)
end
return {'OK', redis.call('HGETALL', KEYS[1])}
"""

# ARGV: rid, lease_s
_RENEW = _PRELUDE + """
local st = redis.call('HGET', KEYS[1], 'state')
if not st then return {'MISSING'} end
if st == 'FREED' then return {'INVALID', st} end
local dl = clock(nil) + tonumber(ARGV[2])
redis.call('HSET', KEYS[1], 'deadline', fmt(dl))
redis.call('ZADD', KEYS[2], fmt(dl), ARGV[1])
return {'OK', redis.call('HGETALL', KEYS[1])}
"""

# Take over cleanup of an entry: only when its lease passed (or, with a dead worker given, when
# no other reaper holds a live cleanup lease). ARGV: rid, now or '', claim_s, reason,
# dead worker or '', held prefix
_CLAIM = _PRELUDE + """
local rid = ARGV[1]
local st = redis.call('HGET', KEYS[1], 'state')
if not st or st == 'FREED' then redis.call('ZREM', KEYS[2], rid); return {'GONE'} end
local t = clock(ARGV[2])
local dl = tonumber(redis.call('HGET', KEYS[1], 'deadline'))
local dead = ARGV[5]
if dl > t and (dead == '' or st == 'FAILED') then return {'LIVE', st} end
local ndl = t + tonumber(ARGV[3])
redis.call('HSET', KEYS[1], 'deadline', fmt(ndl))
redis.call('ZADD', KEYS[2], fmt(ndl), rid)
if st ~= 'FAILED' then
  redis.call('HSET', KEYS[1], 'state', 'FAILED', 't:FAILED', fmt(clock(nil)), 'err', ARGV[4])
end
if dead ~= '' then
  if redis.call('HGET', KEYS[1], 'dw') == dead then drop_hold(ARGV[6], rid, 'dh', dead) end
  if redis.call('HGET', KEYS[1], 'pw') == dead then drop_hold(ARGV[6], rid, 'ph', dead) end
end
return {'OK', st, redis.call('HGETALL', KEYS[1])}
"""

# ARGV: rid, new decode worker, its blocks json, held prefix
_MOVE_DECODE = _PRELUDE + """
local rid = ARGV[1]
local st = redis.call('HGET', KEYS[1], 'state')
if not st then return {'MISSING'} end
if st ~= 'DECODING' then return {'INVALID', st} end
local old = redis.call('HGET', KEYS[1], 'dw')
redis.call('SREM', ARGV[4] .. old, rid)
redis.call('HSET', KEYS[1], 'dw', ARGV[2], 'db', ARGV[3], 'dh', '1')
redis.call('HINCRBY', KEYS[1], 'moves', 1)
redis.call('SADD', ARGV[4] .. ARGV[2], rid)
return {'OK', redis.call('HGETALL', KEYS[1])}
"""

# ARGV: rid, side flag ('dh'|'ph'), worker field ('dw'|'pw'), held prefix
_MARK_RELEASED = _PRELUDE + """
local st = redis.call('HGET', KEYS[1], 'state')
if not st then return {'MISSING'} end
drop_hold(ARGV[4], ARGV[1], ARGV[2], redis.call('HGET', KEYS[1], ARGV[3]))
return {'OK', redis.call('HGETALL', KEYS[1])}
"""


def _pairs(flat: list[bytes]) -> dict[bytes, bytes]:
    return dict(zip(flat[0::2], flat[1::2]))


def _check_id(name: str, value: str) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string, got {value!r}")


def _check_lease(lease_s: float) -> None:
    if not lease_s > 0:
        raise ValueError(f"lease_s must be > 0, got {lease_s}")


def _blocks_json(blocks: list[int] | tuple[int, ...]) -> str:
    if any(not isinstance(b, int) or isinstance(b, bool) or b < 0 for b in blocks):
        raise ValueError(f"block ids must be non-negative ints, got {list(blocks)!r}")
    return json.dumps(list(blocks), separators=(",", ":"))


class KVLedger:
    """Records every request's KV blocks through their handoff states (see the module doc)."""

    def __init__(
        self,
        client_or_url: redis.Redis | str,
        namespace: str = "pdserve",
        *,
        freed_ttl_s: int = 3600,
    ) -> None:
        _check_id("namespace", namespace)
        if freed_ttl_s < 1:
            raise ValueError(f"freed_ttl_s must be >= 1, got {freed_ttl_s}")
        self.client = connect(client_or_url)
        self.namespace = namespace
        self.freed_ttl_s = int(freed_ttl_s)
        self._leases = f"{namespace}:ledger:leases"
        self._held_prefix = f"{namespace}:ledger:held:"
        self._scripts = {
            name: self.client.register_script(src)
            for name, src in (("reserve", _RESERVE), ("transition", _TRANSITION), ("renew", _RENEW),
                              ("claim", _CLAIM), ("mark", _MARK_RELEASED),
                              ("move", _MOVE_DECODE))
        }

    def _key(self, request_id: str) -> str:
        return f"{self.namespace}:ledger:req:{request_id}"

    def _run(self, script: str, request_id: str, *args: object) -> list:
        return self._scripts[script](keys=[self._key(request_id), self._leases],
                                     args=[request_id, *args])

    def _result(self, request_id: str, to: LedgerState | None, reply: list) -> LedgerEntry:
        status = reply[0].decode()
        if status == "OK":
            return LedgerEntry.from_hash(_pairs(reply[-1]))
        if status == "MISSING":
            raise EntryNotFoundError(f"no ledger entry for request {request_id!r}")
        if status == "CONFLICT":
            raise InvalidTransitionError(
                f"request {request_id!r}: prefill blocks are still held on {reply[1].decode()!r}"
            )
        current = reply[1].decode()
        target = f" to {to.value}" if to is not None else ""
        raise InvalidTransitionError(f"request {request_id!r}: cannot move from {current}{target}")

    # -- writers ---------------------------------------------------------------------------
    def reserve(
        self, request_id: str, decode_worker_id: str, decode_blocks: list[int], lease_s: float
    ) -> LedgerEntry:
        """Record blocks reserved on the decode worker. A FREED entry of that id is replaced."""
        _check_id("request_id", request_id)
        _check_id("decode_worker_id", decode_worker_id)
        _check_lease(lease_s)
        reply = self._run("reserve", request_id, decode_worker_id, _blocks_json(decode_blocks),
                          repr(float(lease_s)), self._held_prefix, SCHEMA_VERSION)
        if reply[0] == b"EXISTS":
            state = reply[1].decode()
            raise LedgerError(f"request {request_id!r} already has a live entry ({state})")
        return self._result(request_id, LedgerState.RESERVED, reply)

    def transition(
        self,
        request_id: str,
        to_state: LedgerState,
        *,
        prefill_worker_id: str | None = None,
        prefill_blocks: list[int] | None = None,
        error: str | None = None,
        lease_s: float | None = None,
        expect_state: LedgerState | None = None,
    ) -> LedgerEntry:
        """Move an entry to ``to_state`` atomically; raise ``InvalidTransitionError`` if illegal.

        ``prefill_worker_id`` (only with TRANSFERRING or FAILED) records that the prefill worker
        holds blocks for the request, ``prefill_blocks`` which ones when the caller knows (the
        router does not: the prefill worker picks them chunk by chunk). ``lease_s`` sets a new deadline from now, otherwise the
        old one stays; a caller that fails an entry and cleans it up itself should pass one, or
        a reaper may take the cleanup over. ``expect_state`` makes this a compare-and-set.
        """
        _check_id("request_id", request_id)
        to_state = LedgerState(to_state)
        if prefill_blocks is not None and prefill_worker_id is None:
            raise ValueError("prefill_blocks need the prefill_worker_id that holds them")
        if prefill_worker_id is not None and to_state not in (S.TRANSFERRING, S.FAILED):
            raise ValueError(
                f"prefill blocks go with TRANSFERRING or FAILED, not {to_state.value}"
            )
        if lease_s is not None:
            _check_lease(lease_s)
        pw = prefill_worker_id or ""
        if prefill_worker_id is not None:
            _check_id("prefill_worker_id", prefill_worker_id)
        pb = _blocks_json(prefill_blocks or []) if prefill_worker_id is not None else ""
        reply = self._run(
            "transition", request_id, to_state.value, _SOURCES[to_state],
            expect_state.value if expect_state is not None else "", pw, pb, error or "",
            "" if lease_s is None else repr(float(lease_s)), self._held_prefix, self.freed_ttl_s,
        )
        entry = self._result(request_id, to_state, reply)
        logger.debug("ledger %s -> %s", request_id, to_state.value)
        return entry

    def move_decode(self, request_id: str, decode_worker_id: str, decode_blocks: list[int]) -> LedgerEntry:
        """Record that a DECODING request's KV moved to ``decode_worker_id`` (its ``decode_blocks``
        there): the old holder no longer holds it, the new one does; the state stays DECODING.
        Raises ``InvalidTransitionError`` from any other state."""
        _check_id("request_id", request_id)
        _check_id("decode_worker_id", decode_worker_id)
        reply = self._run("move", request_id, decode_worker_id, _blocks_json(decode_blocks), self._held_prefix)
        entry = self._result(request_id, None, reply)
        logger.debug("ledger %s: KV moved to %s", request_id, decode_worker_id)
        return entry

    def renew(self, request_id: str, lease_s: float) -> LedgerEntry:
        """Push a live entry's lease deadline to now + ``lease_s``."""
        _check_lease(lease_s)
        return self._result(request_id, None, self._run("renew", request_id, repr(float(lease_s))))

    def claim_for_cleanup(
        self, request_id: str, *, claim_s: float, reason: str, now: float | None = None,
        dead_worker_id: str | None = None,
    ) -> tuple[LedgerState, LedgerEntry] | None:
        """Atomically fail an entry whose lease passed and lease its cleanup to the caller.

        With ``dead_worker_id`` the lease need not have passed, and that worker's side is
        marked released (its blocks died with it). Returns the state before the claim and the
        entry, or None if the entry is gone, live, or another reaper holds its cleanup.
        """
        _check_lease(claim_s)
        reply = self._run("claim", request_id, "" if now is None else repr(float(now)),
                          repr(float(claim_s)), reason, dead_worker_id or "", self._held_prefix)
        if reply[0] != b"OK":
            return None
        return LedgerState(reply[1].decode()), LedgerEntry.from_hash(_pairs(reply[2]))

    def mark_released(self, request_id: str, side: Side) -> LedgerEntry:
        """Record that one side's blocks were given back (the entry keeps its state)."""
        flag, wid = ("dh", "dw") if side is Side.DECODE else ("ph", "pw")
        return self._result(request_id, None,
                            self._run("mark", request_id, flag, wid, self._held_prefix))

    def forget(self, request_id: str) -> bool:
        """Delete a FREED entry now instead of after ``freed_ttl_s``; False if there was none."""
        entry = self.get(request_id)
        if entry is None:
            return False
        if entry.state is not LedgerState.FREED:
            raise LedgerError(
                f"request {request_id!r} is {entry.state.value}, not FREED; not forgotten"
            )
        return bool(self.client.delete(self._key(request_id)))

    # -- readers ---------------------------------------------------------------------------
    def get(self, request_id: str) -> LedgerEntry | None:
        raw = self.client.hgetall(self._key(request_id))
        return LedgerEntry.from_hash(raw) if raw else None

    def _entries(self, request_ids: list[bytes]) -> list[LedgerEntry]:
        pipe = self.client.pipeline(transaction=False)
        for rid in request_ids:
            pipe.hgetall(self._key(rid.decode()))
        return [LedgerEntry.from_hash(raw) for raw in pipe.execute() if raw]

    def expired(self, now: float | None = None) -> list[LedgerEntry]:
        """Non-terminal entries (FAILED included) whose lease deadline is at or before ``now``.

        ``now`` defaults to the Redis server's clock, the clock deadlines are written in.
        """
        if now is None:
            sec, usec = self.client.time()
            now = sec + usec / 1e6
        ids = self.client.zrangebyscore(self._leases, "-inf", repr(float(now)))
        return [e for e in self._entries(ids) if e.state is not LedgerState.FREED]

    def active(self) -> list[LedgerEntry]:
        """Every entry not yet FREED, soonest deadline first (for leak checks and operators)."""
        return self._entries(self.client.zrange(self._leases, 0, -1))

    def held_by(self, worker_id: str) -> list[LedgerEntry]:
        """Entries that still hold blocks on ``worker_id``, on either side."""
        ids = sorted(self.client.smembers(self._held_prefix + worker_id))
        return [e for e in self._entries(ids)
                if (e.decode_held and e.decode_worker_id == worker_id)
                or (e.prefill_held and e.prefill_worker_id == worker_id)]

"""Leader election for the control plane: one lease in Redis, held by one router at a time.

The control plane (the planner, the pool manager's scaling and replacements, the KV-ledger
reaper) must run in exactly one place, yet must not die with the process that runs it. Every
router that may lead holds a ``LeaderLease`` on the same key and calls ``tick`` every third of
the lease:

* nobody holds the key: ``SET key holder NX PX lease`` makes this router the leader, and the
  lease's **epoch** (a counter in Redis, one more per new leader) goes up;
* it holds the key: one script renews it only if the value is still its own id;
* another router holds it: it stays a follower and tries again on its next tick.

A leader that cannot renew (Redis unreachable, or another router took the key after this one
stalled past its lease) steps down at once. So two leaders can overlap by at most the time one
stalled process takes to notice, and every write that must not come from a stale leader can
carry the epoch (a fencing token). ``release`` hands the lease back on a clean stop, so the next
leader takes over at its next tick instead of after the lease runs out.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import redis

logger = logging.getLogger(__name__)

_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


@dataclass(frozen=True, slots=True)
class LeaseState:
    """What one ``tick`` found: whether this holder leads, since which epoch, and who leads."""

    leader: bool
    epoch: int | None
    holder: str | None
    changed: bool  # this holder became leader, or stopped being one, on this tick


class LeaderLease:
    def __init__(self, client: redis.Redis, key: str, holder_id: str, lease_s: float) -> None:
        if not holder_id:
            raise ValueError("holder_id must not be empty")
        if not lease_s > 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        self.client = client
        self.key = key
        self.epoch_key = f"{key}:epoch"
        self.holder_id = holder_id
        self.lease_ms = max(1, int(lease_s * 1000))
        self.leader = False
        self.epoch: int | None = None
        self.since: float | None = None  # time.monotonic() when this holder last became leader
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)

    def tick(self) -> LeaseState:
        """Renew the lease if this holder has it, take it if nobody does. Redis errors propagate
        after stepping down (a leader that cannot reach Redis cannot know it still leads)."""
        was = self.leader
        try:
            if self.leader and self._renew(keys=[self.key], args=[self.holder_id, self.lease_ms]) == 1:
                return LeaseState(True, self.epoch, self.holder_id, False)
            if self.leader:
                logger.warning("control-plane lease %s lost (epoch %s): stepping down", self.key, self.epoch)
                self._step_down()
            if self.client.set(self.key, self.holder_id, nx=True, px=self.lease_ms):
                self.epoch = int(self.client.incr(self.epoch_key))
                self.leader = True
                self.since = time.monotonic()
                logger.info("control-plane lease %s taken by %s (epoch %d)", self.key, self.holder_id, self.epoch)
                return LeaseState(True, self.epoch, self.holder_id, True)
            return LeaseState(False, None, self.holder(), was)
        except redis.RedisError:
            if self.leader:
                logger.warning("control-plane lease %s: Redis unreachable, stepping down", self.key)
                self._step_down()
            raise

    def holder(self) -> str | None:
        raw = self.client.get(self.key)
        return raw.decode() if isinstance(raw, bytes) else raw

    def release(self) -> bool:
        """Give the lease back if this holder has it (a clean stop): True when it was deleted."""
        held = self.leader
        self._step_down()
        if not held:
            return False
        try:
            return self._release(keys=[self.key], args=[self.holder_id]) == 1
        except redis.RedisError as exc:  # it expires on its own
            logger.info("control-plane lease %s not released (%s): it expires in %.1f s", self.key, exc,
                        self.lease_ms / 1000)
            return False

    def _step_down(self) -> None:
        self.leader = False
        self.epoch = None
        self.since = None

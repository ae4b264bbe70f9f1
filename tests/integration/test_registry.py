"""Worker registry against a real Redis: records, binary NIXL metadata, heartbeats, expiry."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from pdserve.cluster.registry import (
    Registry,
    RegistryError,
    WorkerRecord,
    WorkerRole,
    WorkerStats,
)

pytestmark = pytest.mark.slow

ALL_BYTES = bytes(range(256)) * 4 + b"\x00\r\n\xff"


def make_record(worker_id: str = "dec-0", role: str = "decode", **overrides) -> WorkerRecord:
    fields = dict(
        worker_id=worker_id, role=role, node_address="127.0.0.1", actor_name=f"pdserve:{worker_id}",
        nixl_agent_name=f"agent-{worker_id}", nixl_metadata=ALL_BYTES, kv_compat_hash="c0ffee",
        num_blocks=512, block_size=16, started_at=1_700_000_000.25,
    )
    fields.update(overrides)
    return WorkerRecord(**fields)


def wait_until(predicate, timeout_s: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture
def registry(redis_client, redis_namespace) -> Registry:
    return Registry(redis_client, redis_namespace)


def test_register_get_round_trips_every_field_and_binary_metadata(registry: Registry) -> None:
    record = make_record(stats=WorkerStats(free_blocks=500, running=3, waiting=1,
                                           tokens_per_s=812.5, prefix_hit_rate=0.25))
    registry.register(record, ttl_s=30)
    got = registry.get("dec-0")
    assert got.nixl_metadata == ALL_BYTES
    assert got.alive is True and got.last_heartbeat_at == pytest.approx(time.time(), abs=5)
    assert got.role is WorkerRole.DECODE
    assert replace(got, alive=None, last_heartbeat_at=None) == record
    assert registry.get("missing") is None


def test_heartbeat_expiry_marks_worker_dead_and_heartbeat_revives(registry: Registry) -> None:
    registry.register(make_record("dec-0"), ttl_s=0.3)
    registry.register(make_record("dec-1"), ttl_s=30)
    assert [w.worker_id for w in registry.list_workers()] == ["dec-0", "dec-1"]

    wait_until(lambda: [w.worker_id for w in registry.list_workers()] == ["dec-1"],
               what="dec-0's heartbeat to expire")
    everyone = {w.worker_id: w.alive for w in registry.list_workers(alive_only=False)}
    assert everyone == {"dec-0": False, "dec-1": True}

    assert registry.heartbeat("dec-0", {"free_blocks": 7, "running": 2}, ttl_s=30) is True
    revived = registry.get("dec-0")
    assert revived.alive is True
    assert revived.stats == WorkerStats(free_blocks=7, running=2)


def test_heartbeat_keeps_a_worker_alive_past_its_first_ttl(registry: Registry) -> None:
    registry.register(make_record(), ttl_s=0.3)
    stop_at = time.monotonic() + 0.9
    while time.monotonic() < stop_at:
        assert registry.heartbeat("dec-0", WorkerStats(running=1), ttl_s=0.3)
        assert [w.worker_id for w in registry.list_workers()] == ["dec-0"]
        time.sleep(0.1)


def test_heartbeat_of_unregistered_worker_asks_for_registration(registry: Registry) -> None:
    assert registry.heartbeat("ghost", WorkerStats(), ttl_s=5) is False
    assert registry.list_workers(alive_only=False) == []


def test_role_filter_counts_both_as_either(registry: Registry) -> None:
    registry.register(make_record("p", role="prefill"), ttl_s=30)
    registry.register(make_record("d", role=WorkerRole.DECODE), ttl_s=30)
    registry.register(make_record("b", role="both"), ttl_s=30)
    ids = lambda role: [w.worker_id for w in registry.list_workers(role=role)]  # noqa: E731
    assert ids("prefill") == ["b", "p"]
    assert ids(WorkerRole.DECODE) == ["b", "d"]
    assert ids("both") == ["b"]
    assert ids(None) == ["b", "d", "p"]


def test_deregister_removes_everything(registry: Registry, redis_client) -> None:
    registry.register(make_record(), ttl_s=30)
    assert registry.deregister("dec-0") is True
    assert registry.deregister("dec-0") is False
    assert registry.get("dec-0") is None and registry.list_workers(alive_only=False) == []
    assert list(redis_client.scan_iter(match=f"{registry.namespace}:*")) == []


def test_dead_worker_record_is_dropped_after_retention(redis_client, redis_namespace) -> None:
    registry = Registry(redis_client, redis_namespace, retain_dead_s=0.4)
    registry.register(make_record(), ttl_s=0.2)
    wait_until(lambda: registry.list_workers(alive_only=False) == [], what="record retention")
    assert redis_client.scard(f"{redis_namespace}:workers") == 0  # stale id pruned
    assert registry.heartbeat("dec-0", WorkerStats(), ttl_s=1) is False


def test_unknown_schema_version_is_refused(registry: Registry, redis_client) -> None:
    registry.register(make_record(), ttl_s=30)
    redis_client.hset(f"{registry.namespace}:worker:dec-0", "schema_version", "2")
    with pytest.raises(RegistryError, match="schema_version '2'"):
        registry.get("dec-0")


@pytest.mark.parametrize("bad", [
    {"worker_id": ""}, {"role": "router"}, {"nixl_metadata": "not-bytes"},
    {"num_blocks": -1}, {"block_size": 0},
])
def test_bad_records_are_refused(bad: dict) -> None:
    with pytest.raises(ValueError):
        make_record(**bad)


def test_bad_stats_and_ttls_are_refused(registry: Registry) -> None:
    with pytest.raises(ValueError):
        WorkerStats(prefix_hit_rate=1.5)
    with pytest.raises(ValueError):
        WorkerStats(free_blocks=-1)
    with pytest.raises(ValueError):
        registry.register(make_record(), ttl_s=0)

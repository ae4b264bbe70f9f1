"""KV handoff ledger against a real Redis: state machine, leases, indexes, restart survival."""

from __future__ import annotations

import os
import threading
import time

import pytest
import redis

from pdserve.cluster.state.ledger import (
    TRANSITIONS,
    EntryNotFoundError,
    InvalidTransitionError,
    KVLedger,
    LedgerError,
    LedgerState,
    Side,
)
from pdserve.cluster.state.redis_server import EmbeddedRedis, connect
from pdserve.cluster.state.redis_supervisor import RedisSupervisor
from pdserve.engine.errors import PdserveError

S = LedgerState

# The shortest legal path from a fresh reservation to each state.
PATH_TO = {
    S.RESERVED: [],
    S.TRANSFERRING: [S.TRANSFERRING],
    S.LANDED: [S.TRANSFERRING, S.LANDED],
    S.DECODING: [S.TRANSFERRING, S.LANDED, S.DECODING],
    S.FAILED: [S.FAILED],
    S.FREED: [S.FREED],
}
LEGAL = [(a, b) for a in S for b in sorted(TRANSITIONS[a], key=lambda s: s.value)]
ILLEGAL = [(a, b) for a in S for b in S if b not in TRANSITIONS[a]]


@pytest.fixture
def ledger(redis_client, redis_namespace) -> KVLedger:
    return KVLedger(redis_client, redis_namespace)


def drive_to(ledger: KVLedger, rid: str, state: LedgerState) -> None:
    ledger.reserve(rid, "dec-0", [4, 5, 6], lease_s=30)
    for step in PATH_TO[state]:
        extra = {}
        if step is S.TRANSFERRING:
            extra = {"prefill_worker_id": "pre-0", "prefill_blocks": [1, 2]}
        ledger.transition(rid, step, **extra)


def assert_nothing_leaked(ledger: KVLedger, *workers: str) -> None:
    assert ledger.active() == []
    for worker in workers:
        assert ledger.held_by(worker) == []


def test_handoff_lifecycle_records_holders_and_timestamps(ledger: KVLedger) -> None:
    e = ledger.reserve("r1", "dec-0", [7, 8], lease_s=30)
    assert (e.state, e.decode_blocks) == (S.RESERVED, (7, 8))
    assert (e.decode_held, e.prefill_held) == (True, False)
    assert [x.request_id for x in ledger.held_by("dec-0")] == ["r1"]

    e = ledger.transition("r1", S.TRANSFERRING, prefill_worker_id="pre-0", prefill_blocks=[3, 9])
    assert (e.prefill_worker_id, e.prefill_blocks, e.prefill_held) == ("pre-0", (3, 9), True)
    assert [x.request_id for x in ledger.held_by("pre-0")] == ["r1"]

    e = ledger.transition("r1", S.LANDED)  # transfer confirmed: prefill side let go
    assert e.prefill_held is False and e.decode_held is True
    assert ledger.held_by("pre-0") == []

    e = ledger.transition("r1", S.DECODING)
    e = ledger.transition("r1", S.FREED)
    assert e.held_sides() == ()
    assert set(e.timestamps) == {S.RESERVED, S.TRANSFERRING, S.LANDED, S.DECODING, S.FREED}
    stamps = [e.timestamps[s] for s in (S.RESERVED, S.TRANSFERRING, S.LANDED, S.DECODING, S.FREED)]
    assert stamps == sorted(stamps)
    assert_nothing_leaked(ledger, "dec-0", "pre-0")


@pytest.mark.parametrize(("src", "dst"), LEGAL, ids=lambda s: s.value)
def test_every_legal_transition(ledger: KVLedger, src: LedgerState, dst: LedgerState) -> None:
    drive_to(ledger, "r", src)
    entry = ledger.transition("r", dst, error="boom" if dst is S.FAILED else None)
    assert entry.state is dst
    assert ledger.get("r").state is dst
    if dst is S.FAILED:
        assert entry.error == "boom"
    if dst is not S.FREED:
        ledger.transition("r", S.FAILED if dst is not S.FAILED else S.FREED)
        if ledger.get("r").state is S.FAILED:
            ledger.transition("r", S.FREED)
    assert_nothing_leaked(ledger, "dec-0", "pre-0")


@pytest.mark.parametrize(("src", "dst"), ILLEGAL, ids=lambda s: s.value)
def test_every_illegal_transition_raises_and_changes_nothing(
    ledger: KVLedger, src: LedgerState, dst: LedgerState
) -> None:
    drive_to(ledger, "r", src)
    before = ledger.get("r")
    with pytest.raises(InvalidTransitionError) as info:
        ledger.transition("r", dst)
    assert isinstance(info.value, PdserveError)
    assert src.value in str(info.value)
    assert ledger.get("r") == before


def test_missing_duplicate_and_reuse_of_freed_id(ledger: KVLedger) -> None:
    with pytest.raises(EntryNotFoundError):
        ledger.transition("nope", S.FREED)
    assert ledger.get("nope") is None
    ledger.reserve("r", "dec-0", [1], lease_s=30)
    with pytest.raises(LedgerError, match="live entry"):
        ledger.reserve("r", "dec-1", [2], lease_s=30)
    ledger.transition("r", S.FREED)
    again = ledger.reserve("r", "dec-1", [2], lease_s=30)  # a FREED entry may be replaced
    assert (again.decode_worker_id, again.state) == ("dec-1", S.RESERVED)
    assert set(again.timestamps) == {S.RESERVED}
    ledger.transition("r", S.FREED)
    assert_nothing_leaked(ledger, "dec-0", "dec-1")


def test_compare_and_set_lets_only_the_expected_state_move(ledger: KVLedger) -> None:
    ledger.reserve("r", "dec-0", [1], lease_s=30)
    with pytest.raises(InvalidTransitionError):
        ledger.transition("r", S.FREED, expect_state=S.FAILED)
    ledger.transition("r", S.FAILED, expect_state=S.RESERVED)
    ledger.transition("r", S.FREED, expect_state=S.FAILED)
    assert_nothing_leaked(ledger, "dec-0")


def test_second_prefill_cannot_take_over_held_prefill_blocks(ledger: KVLedger) -> None:
    drive_to(ledger, "r", S.TRANSFERRING)
    with pytest.raises(InvalidTransitionError, match="pre-0"):
        ledger.transition("r", S.FAILED, prefill_worker_id="pre-1", prefill_blocks=[5])
    assert ledger.get("r").state is S.TRANSFERRING
    with pytest.raises(ValueError):
        ledger.transition("r", S.LANDED, prefill_worker_id="pre-1", prefill_blocks=[5])


def test_bad_arguments_are_refused(ledger: KVLedger) -> None:
    for bad in ([-1], [1.5], [True]):
        with pytest.raises(ValueError):
            ledger.reserve("r", "dec-0", bad, lease_s=1)
    with pytest.raises(ValueError):
        ledger.reserve("r", "dec-0", [1], lease_s=0)
    with pytest.raises(ValueError):
        ledger.reserve("", "dec-0", [1], lease_s=1)
    assert ledger.active() == []


def test_short_lease_expires_and_renew_pushes_it_back(ledger: KVLedger) -> None:
    ledger.reserve("short", "dec-0", [1], lease_s=0.3)
    ledger.reserve("long", "dec-0", [2], lease_s=30)
    assert ledger.expired() == []
    deadline = time.monotonic() + 5
    while not ledger.expired():
        assert time.monotonic() < deadline, "0.3 s lease never expired"
        time.sleep(0.05)
    assert [e.request_id for e in ledger.expired()] == ["short"]
    renewed = ledger.renew("short", 30)
    assert renewed.lease_deadline > time.time() + 20
    assert ledger.expired() == []
    assert {e.request_id for e in ledger.expired(now=time.time() + 60)} == {"short", "long"}
    ledger.transition("short", S.FREED)
    assert [e.request_id for e in ledger.expired(now=time.time() + 60)] == ["long"]
    with pytest.raises(InvalidTransitionError):
        ledger.renew("short", 5)


def test_freed_entries_are_kept_with_a_ttl_and_can_be_forgotten(
    ledger: KVLedger, redis_client
) -> None:
    ledger.reserve("r", "dec-0", [1], lease_s=30)
    with pytest.raises(LedgerError, match="not FREED"):
        ledger.forget("r")
    ledger.transition("r", S.FREED)
    ttl = redis_client.ttl(f"{ledger.namespace}:ledger:req:r")
    assert 0 < ttl <= ledger.freed_ttl_s
    assert ledger.forget("r") is True
    assert ledger.get("r") is None and ledger.forget("r") is False


def test_unknown_schema_version_is_refused(ledger: KVLedger, redis_client) -> None:
    ledger.reserve("r", "dec-0", [1], lease_s=30)
    redis_client.hset(f"{ledger.namespace}:ledger:req:r", "v", "99")
    with pytest.raises(LedgerError, match="schema_version '99'"):
        ledger.get("r")


def test_mark_released_updates_the_worker_index(ledger: KVLedger) -> None:
    drive_to(ledger, "r", S.TRANSFERRING)
    ledger.transition("r", S.FAILED, error="transfer timeout", lease_s=30)
    entry = ledger.mark_released("r", Side.PREFILL)
    assert entry.held_sides() == (Side.DECODE,)
    assert ledger.held_by("pre-0") == [] and len(ledger.held_by("dec-0")) == 1
    ledger.transition("r", S.FREED)
    assert_nothing_leaked(ledger, "dec-0", "pre-0")


def test_a_decoding_entry_moves_to_another_decode_worker(ledger: KVLedger) -> None:
    drive_to(ledger, "r", S.DECODING)
    entry = ledger.move_decode("r", "dec-1", [7, 8])
    assert (entry.state, entry.decode_worker_id, entry.decode_blocks, entry.kv_moves) == (S.DECODING, "dec-1", (7, 8), 1)
    # the reaper looks for the blocks on the new holder only
    assert ledger.held_by("dec-0") == [] and [e.request_id for e in ledger.held_by("dec-1")] == ["r"]
    assert ledger.move_decode("r", "dec-2", [1]).kv_moves == 2
    ledger.transition("r", S.FREED)
    assert_nothing_leaked(ledger, "dec-0", "dec-1", "dec-2", "pre-0")
    # only a DECODING entry moves; a missing one is not found
    drive_to(ledger, "q", S.LANDED)
    with pytest.raises(InvalidTransitionError, match="cannot move from LANDED"):
        ledger.move_decode("q", "dec-1", [1])
    assert ledger.get("q").decode_worker_id == "dec-0"
    with pytest.raises(EntryNotFoundError):
        ledger.move_decode("nope", "dec-1", [1])


def test_ledger_survives_a_redis_restart_mid_run(tmp_path) -> None:
    server = EmbeddedRedis(password="s3cret", data_dir=tmp_path / "redis").start()
    client = connect(server.url)
    try:
        ledger = KVLedger(client, "restart")
        drive_to(ledger, "r", S.TRANSFERRING)
        port = server.port

        server.stop()  # graceful: the AOF is flushed
        restarter = threading.Timer(0.3, server.start)
        restarter.start()
        # Issued while the server is down: the client's retries carry it over the restart.
        t0 = time.monotonic()
        entry = ledger.transition("r", S.LANDED)
        assert time.monotonic() - t0 >= 0.2  # it really waited for the server to come back
        restarter.join(timeout=10)
        assert server.port == port and server.is_running()
        assert entry.state is S.LANDED and entry.decode_blocks == (4, 5, 6)

        server.restart()
        assert ledger.get("r").state is S.LANDED  # read back from the AOF
        ledger.transition("r", S.DECODING)
        ledger.transition("r", S.FREED)
        assert_nothing_leaked(ledger, "dec-0", "pre-0")
    finally:
        client.close()
        server.stop()
    assert not server.is_running()


def test_embedded_server_binds_loopback_requires_its_password_and_cleans_up() -> None:
    with pytest.raises(ValueError, match="refusing to bind"):
        EmbeddedRedis(host="0.0.0.0")
    server = EmbeddedRedis(password="pw").start()
    data_dir, pid = server.data_dir, server.pid
    try:
        assert server.last_start_s is not None and server.last_start_s < 10
        client = connect(server.url)
        assert client.config_get("bind") == {"bind": "127.0.0.1"}
        client.close()
        anonymous = connect(f"redis://127.0.0.1:{server.port}/0")
        with pytest.raises(redis.AuthenticationError):
            anonymous.ping()
        anonymous.close()
    finally:
        server.stop()
    assert not data_dir.exists()  # a temporary data dir goes with the server
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_wrong_password_fails_fast_instead_of_retrying(redis_server: EmbeddedRedis) -> None:
    client = connect(f"redis://:wrong@127.0.0.1:{redis_server.port}/0")
    t0 = time.monotonic()
    with pytest.raises(redis.AuthenticationError):
        client.ping()
    assert time.monotonic() - t0 < 1.0
    client.close()


def test_password_given_apart_from_the_url_is_used(redis_server: EmbeddedRedis) -> None:
    """An external Redis is configured as ``url`` + ``password`` (k8s: PDSERVE_REDIS_PASSWORD);
    the password must reach AUTH without ever being written into the URL."""
    assert redis_server.password is not None and redis_server.password not in redis_server.address_url
    client = connect(redis_server.address_url, password=redis_server.password)
    try:
        assert client.ping() is True
    finally:
        client.close()
    with pytest.raises(ValueError, match="rediss://"):
        connect(redis_server.address_url, ssl_ca_file="/nonexistent/ca.pem")
    # redis.tls_ca_file reaches the TLS connections (no server here: nothing is dialled).
    tls = connect("rediss://127.0.0.1:6380/1", password="pw", ssl_ca_file="/etc/pdserve/ca.pem")
    kwargs = tls.connection_pool.connection_kwargs
    assert tls.connection_pool.connection_class is redis.SSLConnection
    assert kwargs["ssl_ca_certs"] == "/etc/pdserve/ca.pem" and kwargs["ssl_cert_reqs"] == "required"
    assert kwargs["password"] == "pw"


def test_supervisor_restarts_a_killed_server_with_its_ledger(tmp_path) -> None:
    """Crash (SIGKILL) -> the supervisor logs and starts it again on the same port -> the
    ledger written before the crash is read back from the AOF -> work goes on."""
    server = EmbeddedRedis(password="s3cret", data_dir=tmp_path / "redis", appendonly=True).start()
    supervisor = RedisSupervisor(server, check_interval_s=0.1).start()
    client = connect(server.url)
    try:
        ledger = KVLedger(client, "supervised")
        drive_to(ledger, "r", S.TRANSFERRING)
        time.sleep(1.2)  # appendfsync everysec: let the AOF reach the disk
        port, pid = server.port, server.pid
        os.kill(pid, 9)  # a crash, not a stop: nobody but the supervisor starts it again
        deadline = time.monotonic() + 15
        while supervisor.restarts == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert supervisor.restarts == 1 and server.is_running()
        assert server.port == port and server.pid != pid
        assert ledger.get("r").state is S.TRANSFERRING  # the ledger survived the crash
        ledger.transition("r", S.LANDED)
        ledger.transition("r", S.DECODING)
        ledger.transition("r", S.FREED)
        assert_nothing_leaked(ledger, "dec-0", "pre-0")
    finally:
        supervisor.stop()
        client.close()
        server.stop()
    assert not server.is_running()


def test_the_routers_handoff_steps_land_in_the_ledger(redis_client, redis_namespace, caplog) -> None:
    """The steps ``DisaggBackend`` records through ``LedgerSink`` (``cluster/control/ledger_writer``)
    each land: a step the ledger refused would only be logged, so this reads every one back."""
    import asyncio
    import logging

    from pdserve.cluster.control.ledger_writer import LedgerWriter
    from pdserve.cluster.state.redis_guard import RedisGuard

    ledger = KVLedger(redis_client, redis_namespace)
    guard = RedisGuard(redis_client)
    writer = LedgerWriter(ledger, guard, lease_s=30.0)

    async def handoff() -> list[tuple[LedgerState, str, bool]]:
        seen = []
        await writer.reserve("req#1", "dec-0", [4, 5], 30.0)
        for step, extra in ((S.TRANSFERRING, {"prefill_worker_id": "pre-0"}), (S.LANDED, {}),
                            (S.DECODING, {}), (S.FREED, {})):
            await writer.transition("req#1", step, **extra)
            e = ledger.get("req#1")
            seen.append((e.state, e.prefill_worker_id, e.prefill_held))
            if step is S.DECODING:  # a live KV migration to another decode worker
                await writer.move("req#1", "dec-1", [9])
                e = ledger.get("req#1")
                seen.append((e.state, e.decode_worker_id, e.decode_blocks))
        return seen

    try:
        with caplog.at_level(logging.INFO, logger="pdserve.cluster.control.ledger_writer"):
            seen = asyncio.run(handoff())
    finally:
        guard.close()
    assert seen == [(S.TRANSFERRING, "pre-0", True), (S.LANDED, "pre-0", False),
                    (S.DECODING, "pre-0", False), (S.DECODING, "dec-1", (9,)), (S.FREED, "pre-0", False)]
    assert not [r for r in caplog.records if "skipped" in r.message or "failed" in r.message]

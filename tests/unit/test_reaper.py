"""Lease reaper logic, driven against a real (embedded, ~50 ms to start) Redis ledger."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest

from pdserve.cluster.state.ledger import KVLedger, LedgerState, Side
from pdserve.cluster.control.reaper import LeaseReaper
from pdserve.cluster.state.redis_server import connect

S = LedgerState
LATER = 3600.0  # seconds added to "now" to make 30 s leases look expired without sleeping


class Releases:
    """A release callback that counts calls and answers as told per worker."""

    def __init__(self, answers: dict[str, object] | None = None) -> None:
        self.calls: Counter[tuple[str, str, Side]] = Counter()
        self.answers = answers or {}
        self._lock = threading.Lock()

    def __call__(self, worker_id: str, request_id: str, side: Side) -> bool:
        with self._lock:
            self.calls[(worker_id, request_id, side)] += 1
        answer = self.answers.get(worker_id, True)
        if isinstance(answer, Exception):
            raise answer
        return bool(answer)


@pytest.fixture
def ledger(redis_client, redis_namespace) -> KVLedger:
    return KVLedger(redis_client, redis_namespace)


def transferring(
    ledger: KVLedger, rid: str, lease_s: float = 30, dec: str = "dec-0", pre: str = "pre-0"
) -> None:
    ledger.reserve(rid, dec, [1, 2], lease_s=lease_s)
    ledger.transition(rid, S.TRANSFERRING, prefill_worker_id=pre, prefill_blocks=[8, 9])


def test_expired_lease_releases_both_sides_then_frees(ledger: KVLedger) -> None:
    transferring(ledger, "r", lease_s=0.3)
    ledger.reserve("live", "dec-0", [3], lease_s=30)
    release = Releases()
    reaper = LeaseReaper(ledger, release)
    deadline = time.monotonic() + 5
    reaped = reaper.reap_once()
    while not reaped:
        assert time.monotonic() < deadline, "0.3 s lease was never reaped"
        time.sleep(0.05)
        reaped = reaper.reap_once()

    [r] = reaped
    assert (r.request_id, r.previous_state, r.freed, r.pending) == ("r", S.TRANSFERRING, True, ())
    assert set(r.released) == {Side.PREFILL, Side.DECODE}
    assert release.calls == Counter(
        {("pre-0", "r", Side.PREFILL): 1, ("dec-0", "r", Side.DECODE): 1}
    )
    entry = ledger.get("r")
    assert entry.state is S.FREED and entry.error == "lease expired in TRANSFERRING"
    assert S.FAILED in entry.timestamps
    assert reaper.reap_once() == []  # idempotent
    assert [e.request_id for e in ledger.active()] == ["live"]
    ledger.transition("live", S.FREED)
    assert ledger.active() == [] and ledger.held_by("pre-0") == [] and ledger.held_by("dec-0") == []


def test_live_and_landed_entries_release_only_what_they_hold(ledger: KVLedger) -> None:
    transferring(ledger, "landed")
    ledger.transition("landed", S.LANDED)  # the prefill side already let go
    release = Releases()
    reaper = LeaseReaper(ledger, release)
    assert reaper.reap_once() == []  # 30 s lease not yet passed
    [r] = reaper.reap_once(now=time.time() + LATER)
    assert r.released == (Side.DECODE,) and r.freed
    assert list(release.calls) == [("dec-0", "landed", Side.DECODE)]
    assert ledger.active() == []


@pytest.mark.parametrize("answer", [False, RuntimeError("worker unreachable")])
def test_refused_release_is_retried_for_that_side_only(ledger: KVLedger, answer: object) -> None:
    transferring(ledger, "r")
    release = Releases({"pre-0": answer})
    reaper = LeaseReaper(ledger, release, claim_s=30)
    now = time.time() + LATER

    [first] = reaper.reap_once(now=now)
    assert (first.released, first.pending, first.freed) == ((Side.DECODE,), (Side.PREFILL,), False)
    assert ledger.get("r").state is S.FAILED
    assert reaper.reap_once(now=now) == []  # our own cleanup lease is still running

    release.answers["pre-0"] = True
    [second] = reaper.reap_once(now=now + 60)  # cleanup lease ran out: claimed again
    assert second.previous_state is S.FAILED
    assert (second.released, second.freed) == ((Side.PREFILL,), True)
    assert release.calls[("dec-0", "r", Side.DECODE)] == 1
    assert release.calls[("pre-0", "r", Side.PREFILL)] == 2
    assert ledger.active() == []


def test_reap_dead_decode_worker_releases_only_the_prefill_side(ledger: KVLedger) -> None:
    transferring(ledger, "mid-transfer")
    ledger.reserve("reserved-only", "dec-0", [5], lease_s=30)
    transferring(ledger, "other-decode", dec="dec-1")
    release = Releases()
    reaped = LeaseReaper(ledger, release).reap_worker("dec-0")

    assert sorted(r.request_id for r in reaped) == ["mid-transfer", "reserved-only"]
    assert all(r.freed and r.reason == "worker dec-0 lost" for r in reaped)
    assert list(release.calls) == [("pre-0", "mid-transfer", Side.PREFILL)]
    assert ledger.held_by("dec-0") == []
    assert [e.request_id for e in ledger.active()] == ["other-decode"]  # untouched
    assert ledger.get("other-decode").state is S.TRANSFERRING


def test_reap_dead_prefill_worker_releases_the_decode_side(ledger: KVLedger) -> None:
    transferring(ledger, "r")
    release = Releases()
    [r] = LeaseReaper(ledger, release).reap_worker("pre-0")
    assert r.released == (Side.DECODE,) and r.freed
    assert list(release.calls) == [("dec-0", "r", Side.DECODE)]
    assert ledger.active() == []


def test_two_reapers_racing_release_every_block_exactly_once(redis_url, redis_namespace) -> None:
    clients = [connect(redis_url) for _ in range(2)]
    ledgers = [KVLedger(c, redis_namespace) for c in clients]
    try:
        n = 60
        for i in range(n):
            transferring(ledgers[0], f"r{i}", pre=f"pre-{i % 3}", dec=f"dec-{i % 2}")
        release = Releases()
        reapers = [LeaseReaper(lg, release) for lg in ledgers]
        now = time.time() + LATER
        barrier = threading.Barrier(2, timeout=10)
        results: list[list] = [[], []]

        def run(k: int) -> None:
            barrier.wait()
            results[k] = reapers[k].reap_once(now=now)

        threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert not any(t.is_alive() for t in threads)

        won = [r.request_id for rs in results for r in rs]
        assert sorted(won) == sorted(f"r{i}" for i in range(n))  # each claimed by one reaper
        assert len(release.calls) == 2 * n and set(release.calls.values()) == {1}
        assert ledgers[0].active() == []
    finally:
        for c in clients:
            c.close()


def test_claim_s_must_be_positive(ledger: KVLedger) -> None:
    with pytest.raises(ValueError):
        LeaseReaper(ledger, Releases(), claim_s=0)

"""The control plane's lease and the worker registry, against a real Redis server."""

from __future__ import annotations

import threading
import time


from pdserve.cluster.control.leader import LeaderLease
from pdserve.cluster.state.worker_registry import RouterRecord, WorkerRecord, WorkerRegistry



def lease(client, ns: str, holder: str, lease_s: float = 0.5) -> LeaderLease:
    return LeaderLease(client, f"{ns}:control-plane", holder, lease_s)


def test_one_leader_at_a_time_and_the_epoch_fences_each_new_one(redis_client, redis_namespace) -> None:
    a, b = lease(redis_client, redis_namespace, "a"), lease(redis_client, redis_namespace, "b")
    first = a.tick()
    assert first.leader and first.changed and first.epoch == 1
    follower = b.tick()
    assert not follower.leader and follower.holder == "a"
    assert a.tick() == first.__class__(True, 1, "a", False)   # renewed, nothing changed
    # a stalls past its lease: b takes over with a higher epoch; a finds out at its next tick
    time.sleep(0.7)
    taken = b.tick()
    assert taken.leader and taken.epoch == 2
    lost = a.tick()
    assert not lost.leader and lost.changed and lost.holder == "b" and a.epoch is None
    assert b.release() and b.holder() is None
    assert not a.release()   # it does not hold it: nothing deleted
    assert a.tick().epoch == 3


def test_renewal_keeps_the_lease_past_its_length(redis_client, redis_namespace) -> None:
    a, b = lease(redis_client, redis_namespace, "a", 0.6), lease(redis_client, redis_namespace, "b", 0.6)
    assert a.tick().leader
    for _ in range(8):   # 1.6 s of ticks every 0.2 s (a third of the lease)
        time.sleep(0.2)
        assert a.tick().leader
        assert not b.tick().leader


def test_contenders_racing_elect_exactly_one(redis_client, redis_namespace) -> None:
    leases = [lease(redis_client, redis_namespace, f"r{i}", 5.0) for i in range(8)]
    barrier = threading.Barrier(len(leases))
    results: dict[str, bool] = {}

    def contend(lz: LeaderLease) -> None:
        barrier.wait()
        results[lz.holder_id] = lz.tick().leader

    threads = [threading.Thread(target=contend, args=(lz,)) for lz in leases]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sum(results.values()) == 1, results


def test_registry_lists_workers_and_live_routers(redis_client, redis_namespace) -> None:
    reg = WorkerRegistry(redis_client, redis_namespace)
    reg.add(WorkerRecord("decode-0-abc", "decode", "pdserve-decode-decode-0-abc", "ns"))
    reg.add(WorkerRecord("prefill-0-def", "prefill", "pdserve-prefill-prefill-0-def", "ns"))
    reg.set_draining("decode-0-abc", True)
    reg.set_draining("no-such-worker", True)   # a worker removed meanwhile: nothing happens
    workers = reg.workers()
    assert set(workers) == {"decode-0-abc", "prefill-0-def"}
    assert workers["decode-0-abc"].draining and not workers["prefill-0-def"].draining
    assert workers["decode-0-abc"].registered_at > 0
    reg.remove("prefill-0-def")
    assert set(reg.workers()) == {"decode-0-abc"}
    now = time.time()
    reg.heartbeat(RouterRecord("r1", "http://127.0.0.1:1", "127.0.0.1:2", True, 1, "h", now))
    reg.heartbeat(RouterRecord("r2", "http://127.0.0.1:3", "127.0.0.1:4", False, 2, "h", now - 60))
    assert [r.router_id for r in reg.routers(now)] == ["r1"]
    assert redis_client.hlen(reg.routers_key) == 1   # the stale record was deleted

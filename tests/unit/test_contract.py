"""The typed records that cross between workers and the router (``engine/contract.py``)."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from factories import worker_stats
from pdserve.engine.contract import CONTRACT_VERSION, WorkerRole, WorkerStats, as_role


def test_busy_counts_every_kind_of_held_request() -> None:
    assert not worker_stats().busy
    for name in ("num_running", "num_waiting", "in_flight", "reservations"):
        assert worker_stats(**{name: 1}).busy, name
    assert worker_stats(kv_mailboxes=1).holds_anything and not worker_stats(kv_mailboxes=1).busy


def test_a_renamed_field_fails_loudly_instead_of_reading_zero() -> None:
    with pytest.raises(TypeError):
        worker_stats(num_runing=3)          # a typo is refused at the writer
    with pytest.raises(AttributeError):
        worker_stats().num_runing           # noqa: B018 and at the reader


def test_roles_and_versions() -> None:
    assert as_role("decode") is WorkerRole.DECODE and as_role(WorkerRole.PREFILL) is WorkerRole.PREFILL
    assert worker_stats(role="decode").role is WorkerRole.DECODE
    with pytest.raises(ValueError):
        worker_stats(role="mixed")
    with pytest.raises(ValueError, match="contract version"):
        worker_stats(version=CONTRACT_VERSION + 1)


def test_it_crosses_a_process_boundary_and_reads_as_plain_values() -> None:
    s = worker_stats(role="decode", generated_tokens=7, cores=[0, 1], kernels={"qkv": "packed"})
    assert pickle.loads(pickle.dumps(s)) == s
    d = s.to_dict()
    assert d["role"] == "decode" and d["cores"] == [0, 1] and s.produced_tokens == 7
    assert set(d) == {f.name for f in dataclasses.fields(WorkerStats)}


def test_the_status_document_reads_back_as_it_was_written() -> None:
    from pdserve.cluster.status import BatchStatus, ClusterStatus, PoolStatus, WorkerStatus

    w = WorkerStatus("decode-0", "decode", alive=True, draining=False, responsive=True, kv_usage=0.25, running=3,
                     waiting=1, tokens_per_s=41.5, inflight_requests=4, num_threads=2, cores=[0, 1],
                     kernels={"qkv": "gemv"}, itl_ms=12.5, expired_reservations=1)
    cs = ClusterStatus(pools={"decode": PoolStatus(1, 0, [])}, workers=[w], migrations=2,
                       batches=[BatchStatus("batch_1", "in_progress")])
    assert ClusterStatus.from_dict(cs.to_dict()) == cs
    newer = cs.to_dict()
    newer["workers"][0]["some_new_field"] = 1              # a newer head's document still reads
    assert ClusterStatus.from_dict(newer).workers[0] == w

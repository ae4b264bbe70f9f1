"""A decode worker serves several routers: each request's outputs go only to the router that
sent it, and a router that stops taking its outputs (it died) has its requests aborted and
their blocks freed, while the other router's streams go on. One decode worker in this process,
with its real engine and NIXL agent, prefilling and decoding locally."""

from __future__ import annotations

import time

import pytest

from disagg_helpers import engine_config
from pdserve.decode_worker.worker import DecodeWorker
from pdserve.engine.config import EngineMode
from pdserve.engine.sampling_params import SamplingParams
from waiting import wait_until

pytestmark = pytest.mark.timeout(120)


def collect(worker: DecodeWorker, owner: str, ids: set[str], timeout_s: float = 60.0) -> dict[str, list]:
    """Take ``owner``'s outputs until every request in ``ids`` finished; every output must be one of them."""
    got: dict[str, list] = {rid: [] for rid in ids}
    done: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while done != ids and time.monotonic() < deadline:
        for out in worker.take_outputs(0.2, owner):
            assert out.request_id in ids, f"{owner} got {out.request_id}, a request of another router"
            got[out.request_id].append(out)
            if out.finished:
                done.add(out.request_id)
    assert done == ids, f"not finished: {ids - done}"
    return got


def test_outputs_go_to_the_router_that_sent_the_request(tiny_model) -> None:
    worker = DecodeWorker("d-owners", engine_config(tiny_model, mode=EngineMode.DECODE))
    try:
        params = SamplingParams(max_tokens=6, temperature=0.0)
        worker.generate_local("a1", list(range(5, 25)), params, owner="router-a")
        worker.generate_local("b1", list(range(5, 25)), params, owner="router-b")
        worker.generate_local("a2", list(range(7, 30)), params, owner="router-a")
        a = collect(worker, "router-a", {"a1", "a2"})
        b = collect(worker, "router-b", {"b1"})
        tokens = {rid: [t for o in outs for t in o.new_token_ids] for rid, outs in {**a, **b}.items()}
        assert tokens["a1"] == tokens["b1"] and len(tokens["a1"]) == 6   # same prompt, same greedy tokens
        assert len(tokens["a2"]) == 6
        assert worker.take_outputs(0.0, "") == []   # nothing went to the default outbox
        assert worker.blocks_in_use() == 0
    finally:
        worker.shutdown()


def test_a_router_that_stops_taking_outputs_loses_only_its_requests(tiny_model) -> None:
    worker = DecodeWorker("d-gone", engine_config(tiny_model, mode=EngineMode.DECODE), owner_gone_after_s=1.0)
    try:
        long = SamplingParams(max_tokens=3000, temperature=0.0, ignore_eos=True)
        worker.generate_local("dead-1", list(range(5, 25)), long, owner="router-dead")
        worker.generate_local("dead-2", list(range(5, 40)), long, owner="router-dead")
        worker.generate_local("live-1", list(range(5, 25)), SamplingParams(max_tokens=40, temperature=0.0,
                                                                            ignore_eos=True), owner="router-live")
        assert worker.take_outputs(0.3, "router-dead")   # it took outputs once, then died
        # the live router keeps taking; the dead one's requests are aborted about 1 s after its last take
        live = collect(worker, "router-live", {"live-1"})
        assert live["live-1"][-1].finish_reason == "length"
        assert sum(len(o.new_token_ids) for o in live["live-1"]) == 40
        wait_until(lambda: worker.blocks_in_use() == 0, 20.0, what="the dead router's blocks freed")
        assert worker.owners_gone == 1
        assert worker.engine.scheduler.get("dead-1") is None and worker.engine.scheduler.get("dead-2") is None
    finally:
        worker.shutdown()

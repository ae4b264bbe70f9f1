"""Redis goes away while the cluster serves: no request fails, none gets a wrong token, and the
ledger is consistent once Redis is back. ``make test`` runs a 4 s outage; ``make test-all`` also
the 30 s one whose figures docs/reliability.md quotes (longer than the ledger's leases).

Life cycle:

1. A ``RouterService`` (one prefill, one decode Ray worker, NIXL between them) uses a Redis
   server of its own (password, AOF), started by this test.
2. Fault-free greedy references: each prompt once through the router, before the outage.
3. Bounded load: ``Outage.requests`` short greedy requests, one every ``Outage.spacing_s`` through
   the real HTTP router; Redis is SIGKILLed ``Outage.kill_at_s`` into the load and started again
   (same port, same AOF) ``Outage.outage_s`` later.
4. Every request succeeded with exactly the reference tokens; requests during the outage were
   not slowed down by Redis (the guard fails fast); the head's status publisher and request
   log degraded instead of failing.
5. Redis back: the ledger writer replays what the outage deferred and renews live leases, the
   reaper runs, and at the end no worker holds a block and no ledger entry is live.

Figures (requests, failures, outage, latencies) are printed for docs/reliability.md.

The embedded server of a head started by ``pdserve up`` (restarted by the head's supervisor, with
its random password, which no argv or log shows) is killed in ``test_cli_ops.py``.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
from cluster_helpers import ClusterHarness, cluster_config, wait_until
from pdserve.cluster.state.redis_server import EmbeddedRedis, connect
from pdserve.cluster.state.request_log import RequestLog

pytestmark = pytest.mark.timeout(300)

PROMPTS = [f"Request {i} asks the router about {topic}:" for i, topic in
           enumerate(("ledgers", "leases", "blocks", "outages", "replays", "reapers"))]
GEN = 8
CONCURRENCY = 8


@dataclass(frozen=True)
class Outage:
    requests: int
    spacing_s: float
    kill_at_s: float
    outage_s: float

    @property
    def expected_during(self) -> int:
        """Requests that must start while Redis is down: most of those the spacing puts there."""
        return int(0.6 * self.outage_s / self.spacing_s)


OUTAGES = [pytest.param(Outage(requests=16, spacing_s=0.4, kill_at_s=1.5, outage_s=4.0), id="4s"),
           pytest.param(Outage(requests=64, spacing_s=0.6, kill_at_s=3.0, outage_s=30.0), id="30s",  # ~38 s of load
                        marks=pytest.mark.long)]


def complete(h: ClusterHarness, prompt: str, timeout_s: float = 60.0) -> list[int]:
    body = {"model": h.model_name, "prompt": prompt, "max_tokens": GEN, "temperature": 0, "ignore_eos": True}
    req = urllib.request.Request(h.http_url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return list(json.loads(resp.read())["pdserve"]["token_ids"])


@pytest.mark.parametrize("o", OUTAGES)
def test_a_redis_outage_under_load_fails_no_request_and_leaks_nothing(o: Outage, tiny_model, ray_session, tmp_path):
    server = EmbeddedRedis(password=f"pw-{uuid.uuid4().hex[:12]}", data_dir=tmp_path / "redis",
                           appendonly=True).start()
    h = ClusterHarness(cluster_config(tiny_model), server.url)
    try:
        h.start()
        ref = {p: complete(h, p) for p in PROMPTS}
        assert all(len(t) == GEN for t in ref.values())
        h.assert_nothing_held()

        results: list[dict] = []
        lock = threading.Lock()

        def one(i: int) -> None:
            prompt = PROMPTS[i % len(PROMPTS)]
            t0 = time.monotonic()
            try:
                tokens, error = complete(h, prompt), None
            except Exception as exc:  # recorded: the test asserts there are none
                tokens, error = [], repr(exc)
            with lock:
                results.append({"i": i, "start": t0, "s": time.monotonic() - t0, "ok": tokens == ref[prompt],
                                "error": error})

        outage: dict[str, float] = {}

        def redis_outage() -> None:
            time.sleep(o.kill_at_s)
            outage["down"] = time.monotonic()
            server.kill()  # SIGKILL: no goodbye to the clients
            time.sleep(o.outage_s)
            server.start()  # same port, password and AOF (a Redis pod coming back)
            outage["up"] = time.monotonic()

        t_load = time.monotonic()
        killer = threading.Thread(target=redis_outage, daemon=True)
        killer.start()
        status_during: list[bool] = []
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            futures = []
            for i in range(o.requests):
                time.sleep(max(0.0, t_load + i * o.spacing_s - time.monotonic()))
                futures.append(pool.submit(one, i))
                if i == o.requests // 2:  # mid-outage: the status publisher degrades, no exception
                    status_during.append(h.call(h.service.publish_status("pdserve-test:status")))
            for f in futures:
                f.result(timeout=120)
        killer.join(timeout=o.outage_s + 30)
        load_s = time.monotonic() - t_load

        failed = [r for r in results if r["error"] is not None]
        wrong = [r for r in results if r["error"] is None and not r["ok"]]
        during = [r for r in results if outage["down"] <= r["start"] < outage["up"]]
        before_after = [r for r in results if r not in during]
        p50_during = statistics.median(r["s"] for r in during)
        p50_other = statistics.median(r["s"] for r in before_after)
        max_during = max(r["s"] for r in during)
        print(f"\nredis outage: {len(results)} requests over {load_s:.1f} s, {len(during)} during a "
              f"{outage['up'] - outage['down']:.1f} s outage; failed {len(failed)}, wrong tokens {len(wrong)}; "
              f"latency p50 {p50_during:.3f} s during / {p50_other:.3f} s outside, max during {max_during:.3f} s")
        assert len(results) == o.requests
        assert failed == [], failed[:5]
        assert wrong == [], wrong[:5]
        assert len(during) >= o.expected_during, "the outage must cover most of the load"
        # Fail fast, no waiting on a dead Redis: requests during the outage are as quick as the others.
        assert max_during < 5.0 and p50_during < p50_other + 0.5, (p50_during, p50_other, max_during)

        guard = h.service.redis_guard
        stats = guard.stats()
        print(f"redis guard: {stats}")
        assert stats.outages == 1 and stats.up
        assert stats.dropped.get("ledger", 0) > 0 and stats.dropped.get("request_log", 0) > 0
        assert status_during == [False]  # skipped while down, not raised

        # Redis back: the deferred ledger steps are written, the reaper frees the rest.
        wait_until(lambda: not h.service.ledger_writer.needs_resync(), 20.0, "ledger resynced")
        assert h.service.ledger_writer.backlog == 0
        h.assert_nothing_held()

        # The request log works again after the outage.
        log = RequestLog(connect(server.url), stream=h.service.request_log.stream)
        logged = len(log)
        complete(h, PROMPTS[0])
        wait_until(lambda: len(log) > logged, 10.0, "a request logged after the outage")
        assert h.call(h.service.publish_status("pdserve-test:status")) is True
    finally:
        h.stop()
        server.stop()


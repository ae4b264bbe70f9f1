"""Two routers of one cluster with an elected control plane, and the leader's process killed
mid-traffic (``SIGKILL``).

Router A runs in a process of its own (``elected_router_proc.py``) and starts first, so it
leads: it starts the workers (detached Ray actors, listed in Redis). Router B runs in this
process and follows: it routes to the workers the registry lists. Both stream a long greedy
completion; A is killed while both streams are under way. Then:

* B's stream completes token-identical to the engine alone (the workers kept serving);
* the client of A's stream resumes it on B at once (its X-Request-Id and ``Last-Event-ID``,
  the id of the last event it got): the stream, still decoding on its worker, is stopped there
  and continued by migration, and the rest comes token-identical; once ended, it is resumed
  (twice) from what its decode worker kept, generating nothing again;
* B takes the control plane over within the lease and adopts the same workers (none
  restarted);
* A's ledger entries are reaped by the new leader: no block and no ledger entry is left;
* the new leader acts: a decode worker killed afterwards is replaced, and requests through B
  still give the engine's tokens.
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from cluster_helpers import ClusterHarness, cluster_config, greedy, reference_engine, wait_until

pytestmark = pytest.mark.timeout(600)

LEASE_S = 3.0
LEDGER_LEASE_S = 6.0
PROMPT = "Two routers share the workers, and either of them may lead the control plane:"
GEN = 1200
PROC = Path(__file__).with_name("elected_router_proc.py")


def start_router(model_dir: Path, redis_url: str, namespace: str, log: Path) -> tuple[subprocess.Popen, dict]:
    import ray

    tests_dir = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, ROUTER_RAY_ADDRESS=ray.get_runtime_context().gcs_address, ROUTER_REDIS_URL=redis_url,
               PYTHONPATH=os.pathsep.join(filter(None, [tests_dir, os.environ.get("PYTHONPATH")])))
    with open(log, "ab") as err:
        proc = subprocess.Popen([sys.executable, str(PROC), str(model_dir), namespace, str(LEASE_S),
                                 str(LEDGER_LEASE_S)], stdout=subprocess.PIPE, stderr=err, env=env)
    line: list[bytes] = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(240)
    if not line or not line[0]:
        proc.kill()
        raise AssertionError(f"router A did not start; its log:\n{log.read_text()[-3000:]}")
    return proc, json.loads(line[0])


def stream(base_url: str, model: str, max_tokens: int, progress: list[int]) -> list[int]:
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    tokens: list[int] = []
    for chunk in client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True}):
        tokens.extend(((chunk.model_extra or {}).get("pdserve") or {}).get("token_ids", []))
        progress[0] = len(tokens)
    return tokens


def sse(base_url: str, model: str, max_tokens: int, request_id: str, tokens: list[int],
        last_event_id: int | None = None, phase: dict | None = None) -> tuple[bool, int | None, str | None]:
    """Stream as an EventSource does (Accept: text/event-stream, event ids), appending token ids to
    ``tokens`` (and the phase record to ``phase``); returns (whether [DONE] came, the last event id,
    the finish reason). A broken connection ends it early instead of raising; an HTTP error
    raises with its body."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream", "X-Request-Id": request_id}
    if last_event_id is not None:
        headers["Last-Event-ID"] = str(last_event_id)
    req = urllib.request.Request(base_url + "/v1/completions", json.dumps(body).encode(), headers)
    last_id, finish = None, None
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if line.startswith("id: "):
                    last_id = int(line[4:])
                elif line == "data: [DONE]":
                    return True, last_id, finish
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    tokens.extend((event.get("pdserve") or {}).get("token_ids", []))
                    if phase is not None:
                        phase.update((event.get("pdserve") or {}).get("phase") or {})
                    finish = (event.get("choices") or [{}])[0].get("finish_reason") or finish
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"HTTP {exc.code}: {exc.read()[:500]!r}") from None
    except (OSError, http.client.HTTPException):
        pass
    return False, last_id, finish


def test_the_leader_dies_mid_traffic(tiny_model, ray_session, redis_server, redis_namespace, tmp_path) -> None:
    config = cluster_config(tiny_model, **{"control_plane.election": True, "control_plane.lease_s": LEASE_S,
                                           "router.worker_dead_after_s": 10.0})
    engine = reference_engine(config)
    ids = list(engine.stopper.tokenizer(PROMPT)["input_ids"])
    ref = engine.generate([ids], greedy(GEN))[0]
    del engine
    proc, a = start_router(tiny_model, redis_server.url, redis_namespace, tmp_path / "router-a.log")
    b = ClusterHarness(config, redis_server.url, redis_namespace=redis_namespace)
    try:
        assert a["leader"], a
        b.start()
        assert not b.service.is_leader
        before = {wid: m.role for wid, m in b.service.pool.members.items()}
        assert sorted(before.values()) == ["decode", "prefill"], before

        # one stream on each router; A dies once both are under way
        progress_b, on_a_tokens = [0], []
        with ThreadPoolExecutor(2) as pool:
            on_b = pool.submit(stream, b.http_url, b.model_name, GEN, progress_b)
            on_a = pool.submit(sse, a["http"], b.model_name, GEN, "stream-on-a", on_a_tokens)
            wait_until(lambda: len(on_a_tokens) >= 10 and progress_b[0] >= 10, 60.0, "both streams under way")
            proc.kill()
            killed_at = time.monotonic()
            proc.wait(10)
            done, last_id, _ = on_a.result(60)
            assert not done and len(on_a_tokens) < GEN, "the killed router's stream cannot have completed"
            assert last_id == len(on_a_tokens), (last_id, len(on_a_tokens))   # each event's id: tokens so far
            # at once, the client of the dead router resumes its stream on B (still decoding on its
            # worker: it is stopped there and continued by migration): the rest, token-identical
            rest: list[int] = []
            phase: dict = {}
            done, last_id, finish = sse(b.http_url, b.model_name, GEN, "stream-on-a", rest,
                                        last_event_id=len(on_a_tokens), phase=phase)
            assert done and finish == "length" and on_a_tokens + rest == ref, (len(on_a_tokens), len(rest))
            assert last_id == GEN and phase["migrations"] == 1, phase
            assert on_b.result(120) == ref   # the workers served B through the switch
        # a stream that ended is resumed from what its worker kept, without generating again, and
        # can be resumed more than once
        for _ in range(2):
            tail: list[int] = []
            phase = {}
            assert sse(b.http_url, b.model_name, GEN, "stream-on-a", tail, last_event_id=GEN - 5, phase=phase)[0]
            assert tail == ref[-5:] and phase["migrations"] == 0, phase
        # ... and over gRPC (the same scope: no API keys here)
        import grpc
        from pdserve.proto import pdserve_pb2 as pb
        from pdserve.proto import pdserve_pb2_grpc as pb_grpc

        with grpc.insecure_channel(b.grpc_target) as channel:
            sampling = pb.SamplingParams(max_tokens=GEN, temperature=0, ignore_eos=True)
            replies = list(pb_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(
                request_id="stream-on-a", text=PROMPT, sampling=sampling, resume_from=GEN - 3), timeout=60))
            assert [t for r in replies for t in r.token_ids] == ref[-3:]
            with pytest.raises(grpc.RpcError) as no_id:
                list(pb_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(
                    text=PROMPT, sampling=sampling, resume_from=3), timeout=60))
            assert no_id.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in no_id.value.details()
        gone = urllib.request.Request(b.http_url + "/v1/completions", json.dumps(
            {"model": b.model_name, "prompt": PROMPT, "max_tokens": 4, "stream": True}).encode(),
            {"Content-Type": "application/json", "X-Request-Id": "never-started", "Last-Event-ID": "3"})
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(gone, timeout=30)
        assert missing.value.code == 404 and b"never-started" in missing.value.read()

        wait_until(lambda: b.service.is_leader, 3 * LEASE_S + 10.0, "router B leads the control plane")
        takeover_s = time.monotonic() - killed_at
        assert takeover_s < LEASE_S + 10.0, takeover_s
        assert b.service.takeovers == 1
        assert {wid: m.role for wid, m in b.service.pool.members.items()} == before   # adopted, none restarted
        assert set(b.service.manager.pools["decode"].handles) | set(b.service.manager.pools["prefill"].handles) \
            == set(before)
        status = b.service.status().to_dict()["control_plane"]
        assert status["leader"] and status["router_id"] == b.service.router_id

        # A's request: aborted by its decode worker, its ledger entry reaped by the new leader
        b.assert_nothing_held(timeout_s=60.0)

        # the new leader acts: a dead decode worker is replaced (the pool's minimum is 1)
        (victim,) = b.members("decode")
        b.kill(victim)
        wait_until(lambda: any(m.worker_id != victim.worker_id and m.view.routable for m in b.members("decode")),
                   180.0, "a replacement decode worker")
        listed = set(b.service.registry.workers())
        assert victim.worker_id not in listed and len(listed) == 2, listed
        assert stream(b.http_url, b.model_name, 32, [0]) == ref[:32]
        b.assert_nothing_held(timeout_s=60.0)
    finally:
        if proc.poll() is None:
            proc.kill()
        b.stop()

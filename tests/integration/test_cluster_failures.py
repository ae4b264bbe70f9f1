"""Failures the disaggregated cluster absorbs, end to end: worker processes crashed (``SIGKILL``)
or frozen (``SIGSTOP``) while they hold a request, seen through the unmodified ``openai``
client and gRPC on 127.0.0.1.

One ``RouterService`` starts with two prefill and three decode workers (minimum one each, so
the pool manager replaces a worker only when a pool is empty); a test that needs more live
workers than earlier kills left adds them first. Each test kills the worker that holds its
request, checks that the client's tokens are exactly the engine's (no duplicate, no gap) and
what the phase record says about attempts and migrations, and ends by checking that the
surviving workers hold no block and the ledger has no live entry.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest
from cluster_helpers import ClusterHarness, cluster_config, greedy, reference_engine, wait_until
from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(360)

# Long enough that prefilling it in 64-token chunks leaves time to kill a worker meanwhile.
LONG_PROMPT = "Twelve cooks read the whole ticket at once, then each one starts a different dish. " * 90
SHORT_PROMPT = "Migration keeps the stream going:"
GEN = 16
MID = 120  # tokens of the stream a decode worker dies in the middle of
KILL_AFTER = 10


@pytest.fixture(scope="module")
def cluster(tiny_model, ray_session, redis_server):
    config = cluster_config(tiny_model, **{"prefill.initial_replicas": 2, "prefill.max_replicas": 2,
                                           "decode.initial_replicas": 3, "decode.max_replicas": 3})
    h = ClusterHarness(config, redis_server.url)
    h.begin_start()  # the workers load while the references are computed
    try:
        engine = reference_engine(config)
        tok = engine.stopper.tokenizer
        long_ids, short_ids = (list(tok(p)["input_ids"]) for p in (LONG_PROMPT, SHORT_PROMPT))
        assert len(long_ids) > 1500
        ref = {LONG_PROMPT: engine.generate([long_ids], greedy(GEN))[0],
               SHORT_PROMPT: engine.generate([short_ids], greedy(MID))[0]}
        h.wait_started()
        h.ref = ref
        yield h
    finally:
        h.stop()


def extra(obj) -> dict:
    return (obj.model_extra or {}).get("pdserve") or {}


def stream_tokens(h: ClusterHarness, prompt: str, max_tokens: int, on_chunk=None) -> tuple[list[int], dict]:
    """Stream a greedy completion; ``on_chunk(n, tokens)`` runs after each chunk. Returns tokens, phase."""
    stream = h.openai().completions.create(model=h.model_name, prompt=prompt, max_tokens=max_tokens,
                                           temperature=0, stream=True, extra_body={"ignore_eos": True})
    tokens: list[int] = []
    phase: dict = {}
    for n, chunk in enumerate(stream, 1):
        tokens.extend(extra(chunk).get("token_ids", []))
        phase = extra(chunk).get("phase") or phase
        if on_chunk is not None:
            on_chunk(n, tokens)
    return tokens, phase


def kill_during_prefill(h: ClusterHarness, role: str) -> str:
    """Stream LONG_PROMPT; while it is being prefilled, kill the ``role`` worker that holds it."""
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(stream_tokens, h, LONG_PROMPT, GEN)
        h.wait_busy("prefill", timeout_s=30.0, poll_s=0.001)
        victim = h.busy_member(role)
        assert victim is not None and h.busy_member("prefill") is not None, "the prefill ended too soon"
        h.kill(victim)
        tokens, phase = future.result(timeout=120)
    assert tokens == h.ref[LONG_PROMPT], "the retried request's tokens differ from the engine's"
    assert phase["attempts"] >= 2 and phase["migrations"] == 0, phase
    assert victim.worker_id not in (phase["prefill_worker"], phase["decode_worker"])
    # The retry still goes through the prefill pool: the surviving prefill worker is not blamed.
    assert phase["prefill_worker"].startswith("prefill-") and phase["kv_bytes"] > 0, phase
    return victim.worker_id


def test_prefill_worker_lost_mid_prefill_is_retried_elsewhere(cluster: ClusterHarness) -> None:
    cluster.ensure_replicas("prefill", 2)
    cluster.ensure_replicas("decode", 1)
    retries = cluster.service.backend.retries
    kill_during_prefill(cluster, "prefill")
    assert cluster.service.backend.retries > retries
    cluster.assert_nothing_held()


def test_decode_worker_lost_before_the_first_token_is_retried(cluster: ClusterHarness) -> None:
    cluster.ensure_replicas("prefill", 1)
    cluster.ensure_replicas("decode", 2)
    kill_during_prefill(cluster, "decode")
    cluster.assert_nothing_held()


def test_decode_worker_lost_mid_stream_is_migrated_without_gap_or_duplicate(cluster: ClusterHarness) -> None:
    cluster.ensure_replicas("prefill", 1)
    cluster.ensure_replicas("decode", 2)
    killed: list[str] = []

    def kill_holder(n: int, tokens: list[int]) -> None:
        if n == KILL_AFTER:
            victim = cluster.busy_member("decode")
            assert victim is not None and len(tokens) < MID
            cluster.kill(victim)
            killed.append(victim.worker_id)

    migrations = cluster.service.backend.migrations
    tokens, phase = stream_tokens(cluster, SHORT_PROMPT, MID, kill_holder)
    assert killed, "the stream ended before a worker was killed"
    assert tokens == cluster.ref[SHORT_PROMPT], "the migrated stream has a gap, a duplicate or a wrong token"
    assert phase["migrations"] == 1 and phase["attempts"] == 2, phase
    assert phase["output_tokens"] == MID and phase["decode_worker"] != killed[0]
    assert cluster.service.backend.migrations == migrations + 1
    cluster.assert_nothing_held()


def test_a_constrained_stream_keeps_its_grammar_across_a_migration(cluster: ClusterHarness) -> None:
    """The new attempt continues after the tokens the client already got: its grammar consumes
    them, its seeded draws and its frequency penalty go on from them, so the migrated stream is
    token for token the engine's uninterrupted output."""
    import re

    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.engine.structured import StructuredOutput

    cluster.ensure_replicas("prefill", 1)
    cluster.ensure_replicas("decode", 2)
    regex = "[a-z]{20}( [a-z]{20}){20}"
    engine = reference_engine(cluster.config)
    ids = list(engine.stopper.tokenizer(SHORT_PROMPT)["input_ids"])
    expected = engine.generate([ids], SamplingParams(max_tokens=MID, temperature=0.8, seed=5, frequency_penalty=0.3,
                                                     structured=StructuredOutput("regex", regex)))[0]
    assert len(expected) > 2 * KILL_AFTER
    killed: list[str] = []
    migrations = cluster.service.backend.migrations
    stream = cluster.openai().completions.create(model=cluster.model_name, prompt=SHORT_PROMPT, max_tokens=MID,
                                                 temperature=0.8, seed=5, frequency_penalty=0.3, stream=True,
                                                 extra_body={"guided_regex": regex})
    tokens: list[int] = []
    text, phase = "", {}
    for n, chunk in enumerate(stream, 1):
        tokens.extend(extra(chunk).get("token_ids", []))
        text += chunk.choices[0].text if chunk.choices else ""
        phase = extra(chunk).get("phase") or phase
        if n == KILL_AFTER:
            victim = cluster.busy_member("decode")
            assert victim is not None
            cluster.kill(victim)
            killed.append(victim.worker_id)
    assert killed and phase["migrations"] == 1, phase
    assert tokens == expected, "the migrated stream left its grammar or changed its tokens"
    assert re.fullmatch(r"[a-z]{20}( [a-z]{20}){0,20}( [a-z]{0,20})?|[a-z]{0,20}", text.strip()), text
    assert cluster.service.backend.migrations == migrations + 1
    cluster.assert_nothing_held()


@contextlib.contextmanager
def liveness(h: ClusterHarness, stats_timeout_s: float, dead_after_s: float):
    """Shorter liveness thresholds on the router's pool for one test."""
    pool = h.service.pool
    saved = pool.stats_timeout_s, pool.dead_after_s
    pool.stats_timeout_s, pool.dead_after_s = stats_timeout_s, dead_after_s
    try:
        yield
    finally:
        pool.stats_timeout_s, pool.dead_after_s = saved


def process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_decode_loss_after_prefill_reuses_the_prefill_workers_kv(cluster: ClusterHarness) -> None:
    """The decode worker dies right after the prompt was prefilled and its first token sent: the
    migration goes back to the prefill worker that did it, whose prefix cache still holds the
    prompt's KV, so almost nothing is computed again; the client's tokens are unchanged. (The
    router's KV-event view usually already points there; the retry's preference for the previous
    prefill worker, unit-tested in test_routing_policy, covers a retry routed before it does.)"""
    cluster.ensure_replicas("prefill", 2)
    cluster.ensure_replicas("decode", 3)
    killed: list[str] = []

    def kill_after_first(n: int, tokens: list[int]) -> None:
        if n == 1:
            victim = cluster.busy_member("decode")
            assert victim is not None
            cluster.kill(victim)
            killed.append(victim.worker_id)

    tokens, phase = stream_tokens(cluster, LONG_PROMPT, GEN, kill_after_first)
    assert killed, "no decode worker held the stream after its first token"
    assert tokens == cluster.ref[LONG_PROMPT]
    assert phase["migrations"] == 1 and phase["attempts"] == 2, phase
    # the second prefill found the prompt's blocks cached (1,500+ tokens; whole 16-token blocks)
    assert phase["cached_prompt_tokens"] >= 1400, phase
    cluster.assert_nothing_held()


def test_a_briefly_frozen_worker_gets_no_new_requests_then_serves_again(cluster: ClusterHarness) -> None:
    cluster.ensure_replicas("prefill", 1)
    cluster.ensure_replicas("decode", 2)
    frozen, other = cluster.members("decode")[:2]
    pid = frozen.view.stats.pid
    with liveness(cluster, stats_timeout_s=1.0, dead_after_s=60.0):
        os.kill(pid, signal.SIGSTOP)
        try:
            wait_until(lambda: not frozen.view.routable, 10.0, "the frozen worker taken out of routing")
            assert frozen.view.alive  # not declared dead: it may come back
            tokens, phase = stream_tokens(cluster, SHORT_PROMPT, MID)
            assert tokens == cluster.ref[SHORT_PROMPT] and phase["decode_worker"] == other.worker_id
        finally:
            os.kill(pid, signal.SIGCONT)
        wait_until(lambda: frozen.view.routable, 15.0, "the worker routable again once it answers")
    assert frozen.view.alive and not process_gone(pid)
    cluster.assert_nothing_held()


def test_a_prompt_waits_in_the_router_while_no_prefill_worker_answers(cluster: ClusterHarness) -> None:
    """With every prefill worker silent (frozen), a prompt that needs one waits in the router: it is
    not prefilled on a decode worker, where it would stall that worker's streams; once a prefill
    worker answers again the request is served there, token-identical."""
    cluster.ensure_replicas("prefill", 2)
    cluster.ensure_replicas("decode", 3)
    frozen = cluster.members("prefill")
    pids = [m.view.stats.pid for m in frozen]
    backend = cluster.service.backend
    waits = backend.prefill_waits
    with liveness(cluster, stats_timeout_s=1.0, dead_after_s=60.0):
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            wait_until(lambda: not any(m.view.routable for m in frozen), 10.0, "both prefill workers silent")
            with ThreadPoolExecutor(1) as pool:
                future = pool.submit(stream_tokens, cluster, SHORT_PROMPT, MID)
                wait_until(lambda: backend.prefill_waits > waits, 10.0, "the request waiting for a prefill worker")
                assert not future.done()
                for pid in pids:
                    os.kill(pid, signal.SIGCONT)
                tokens, phase = future.result(timeout=60)
        finally:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
    assert tokens == cluster.ref[SHORT_PROMPT]
    assert phase["prefill_worker"] in {m.worker_id for m in frozen}, phase
    assert phase["attempts"] == 1, phase
    cluster.assert_nothing_held()


def test_the_wait_for_a_prefill_worker_ends_with_503_after_prefill_wait_s(cluster: ClusterHarness) -> None:
    cluster.ensure_replicas("prefill", 2)
    cluster.ensure_replicas("decode", 3)
    frozen = cluster.members("prefill")
    pids = [m.view.stats.pid for m in frozen]
    backend = cluster.service.backend
    saved, backend.prefill_wait_s = backend.prefill_wait_s, 1.0
    try:
        with liveness(cluster, stats_timeout_s=1.0, dead_after_s=60.0):
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            try:
                wait_until(lambda: not any(m.view.routable for m in frozen), 10.0, "both prefill workers silent")
                t0 = time.monotonic()
                with pytest.raises(openai.APIStatusError) as info:
                    cluster.openai().completions.create(model=cluster.model_name, prompt=SHORT_PROMPT, max_tokens=4)
                waited = time.monotonic() - t0
            finally:
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGCONT)
    finally:
        backend.prefill_wait_s = saved
    assert info.value.status_code == 503 and "prefill worker" in str(info.value), info.value
    assert 1.0 <= waited < 10.0, waited
    wait_until(lambda: all(m.view.routable for m in frozen), 15.0, "the prefill workers routable again")
    cluster.assert_nothing_held()


def test_a_hung_decode_worker_is_killed_and_its_stream_migrated(cluster: ClusterHarness) -> None:
    cluster.ensure_replicas("prefill", 1)
    cluster.ensure_replicas("decode", 2)
    frozen: list = []

    def freeze_holder(n: int, tokens: list[int]) -> None:
        if n == KILL_AFTER:
            victim = cluster.busy_member("decode")
            assert victim is not None and len(tokens) < MID
            frozen.append((victim, victim.view.stats.pid))
            os.kill(frozen[0][1], signal.SIGSTOP)  # alive to the OS and to Ray, but silent

    migrations = cluster.service.backend.migrations
    with liveness(cluster, stats_timeout_s=1.0, dead_after_s=4.0):
        try:
            tokens, phase = stream_tokens(cluster, SHORT_PROMPT, MID, freeze_holder)
        finally:
            if frozen and not process_gone(frozen[0][1]):
                os.kill(frozen[0][1], signal.SIGCONT)
    assert frozen, "the stream ended before a worker was frozen"
    victim, pid = frozen[0]
    assert tokens == cluster.ref[SHORT_PROMPT], "the migrated stream has a gap, a duplicate or a wrong token"
    assert phase["migrations"] == 1 and phase["decode_worker"] != victim.worker_id, phase
    assert cluster.service.backend.migrations == migrations + 1
    assert not victim.view.alive and victim.worker_id not in cluster.service.manager.pools["decode"].handles
    wait_until(lambda: process_gone(pid), 30.0, "the hung worker's process killed")
    cluster.assert_nothing_held()


def test_no_decode_worker_left_is_an_explicit_error_until_one_is_replaced(cluster: ClusterHarness) -> None:
    cluster.ensure_replicas("prefill", 1)
    cluster.ensure_replicas("decode", 1)
    client = cluster.openai()

    def kill_all_decode(n: int, tokens: list[int]) -> None:
        if n == KILL_AFTER:
            for member in cluster.members("decode"):
                cluster.kill(member)

    # Mid-stream: the headers went out, so the failure arrives as an error event.
    with pytest.raises(openai.APIError, match="no worker|no decode worker"):
        stream_tokens(cluster, SHORT_PROMPT, MID, kill_all_decode)
    # New requests while the replacement starts: 503 and UNAVAILABLE, with an actionable message.
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model=cluster.model_name, prompt=SHORT_PROMPT, max_tokens=4)
    assert info.value.status_code == 503 and "decode worker" in str(info.value)
    with grpc.insecure_channel(cluster.grpc_target) as channel:
        with pytest.raises(grpc.RpcError) as rpc:
            list(pb_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(text=SHORT_PROMPT), timeout=30))
        assert rpc.value.code() is grpc.StatusCode.UNAVAILABLE
    # The pool manager brings the empty pool back to its minimum; requests succeed again.
    cluster.wait_no_pending()
    cluster.wait_routable("decode", 1, 180.0)
    tokens, phase = stream_tokens(cluster, SHORT_PROMPT, MID)
    assert tokens == cluster.ref[SHORT_PROMPT] and phase["attempts"] == 1
    cluster.assert_nothing_held()

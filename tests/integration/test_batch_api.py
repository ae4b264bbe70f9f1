"""The Batch API end to end with the unmodified ``openai`` client: a real HTTP server on
127.0.0.1, a real engine (tiny model), the files, batches and results in a real Redis with
persistence on (its own server, so the test may restart it).

Results are matched by ``custom_id`` to the same requests sent one by one; a cancel stops the
remaining items; the runner is killed and replaced mid-batch, a router process running a few
hundred items is SIGKILLed and replaced, and Redis is restarted mid-batch,
and every item is still answered exactly once. Three router processes share a batch and run each
item once; one killed mid-batch has its items taken over when their leases expire.

Tenants: a second HTTP server on the same engine and store wants API keys; two keys through the
``openai`` client and ``pdserve batch`` each see only their own files and batches (another's is a
404 that says no more than an unknown id's). Malformed input (ids that name other Redis keys,
a 10,000-character filename, a line nested 5,000 deep, an unpaired surrogate) is a 4xx, and
creating a batch from a 64 MiB file does not stall the server's event loop.
"""

from __future__ import annotations

import asyncio
import io
import json
import threading
import time

import openai
import pytest

from pdserve.cluster.state.batch_store import RedisBatchStore
from pdserve.cluster.state.redis_server import EmbeddedRedis, connect
from pdserve.cluster.state.request_log import RequestLog
from pdserve.cluster.head.router_service import _RequestLogWriter
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.tokenizer import load_tokenizer
from pdserve.router.auth import ApiKeyAuth, owner_id
from pdserve.router.batch_runner import BatchRunner
from pdserve.router.http_server import start_http_server
from pdserve.router.local_backend import LocalEngineBackend
from pdserve.router.serving import Serving

pytestmark = pytest.mark.timeout(300)

PROMPTS = [f"Item {i} of the nightly review batch says" for i in range(40)]
GEN = 6
KEY_A, KEY_B = "tenant-a-key-0123456789", "tenant-b-key-9876543210"


class Stack:
    def __init__(self, tiny_model, data_dir) -> None:
        self.redis = EmbeddedRedis(password="batch-pw", data_dir=data_dir).start()
        self.client = connect(self.redis.url)
        self.store = RedisBatchStore(self.client, namespace="bt")
        self.request_log = RequestLog(self.client, stream="bt:requests")   # what `pdserve requests tail` reads
        self.engine = LLMEngine(EngineConfig(model_dir=str(tiny_model), num_blocks=512, max_num_seqs=16,
                                             warm_up=False))
        self.backend = LocalEngineBackend(self.engine, model_name="tiny")
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="batch-test", daemon=True)
        self.thread.start()
        self.serving = self.call(self._serving())
        self.server = self.call(start_http_server(self.serving, batches=self.store))
        self.keyed = self.call(start_http_server(self.serving, batches=self.store, auth=ApiKeyAuth([KEY_A, KEY_B])))
        self.runner: BatchRunner | None = None
        self.runner_task = None
        self.start_runner()

    async def _serving(self) -> Serving:
        return Serving(self.backend, tokenizer=load_tokenizer(self.engine.config.model_dir),
                       observers=[_RequestLogWriter(self.request_log)])

    def call(self, coro, timeout: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start_runner(self, max_concurrent: int = 4, lease_s: float = 15.0) -> None:
        async def go():
            self.runner = BatchRunner(self.serving, self.store, poll_s=0.05, max_concurrent=max_concurrent,
                                      lease_s=lease_s)
            self.runner_task = asyncio.get_running_loop().create_task(self.runner.run())
        self.call(go())

    def kill_runner(self) -> None:
        """The router's death, as far as the batch is concerned: its runner and the items it was
        running stop where they are; nothing they had not recorded is kept."""
        async def go():
            self.runner_task.cancel()
            await asyncio.gather(self.runner_task, return_exceptions=True)
            await self.runner.close()
        self.call(go())

    def openai(self, key: str | None = None) -> openai.OpenAI:
        """A client of the open server, or with ``key`` of the server that wants API keys."""
        base = (self.server if key is None else self.keyed).base_url
        return openai.OpenAI(base_url=base + "/v1", api_key=key or "none", max_retries=3, timeout=30)

    def close(self) -> None:
        self.kill_runner()
        self.call(self.server.stop())
        self.call(self.keyed.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.backend.close()
        self.client.close()
        self.redis.stop()


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory):
    s = Stack(tiny_model, tmp_path_factory.mktemp("redis"))
    yield s
    s.close()


def jsonl(lines: list[dict]) -> io.BytesIO:
    buf = io.BytesIO(("\n".join(json.dumps(x) for x in lines) + "\n").encode())
    buf.name = "input.jsonl"
    return buf


def requests(prompts: list[str], tag: str) -> list[dict]:
    return [{"custom_id": f"{tag}-{i}", "method": "POST", "url": "/v1/completions",
             "body": {"model": "tiny", "prompt": p, "max_tokens": GEN, "temperature": 0, "ignore_eos": True}}
            for i, p in enumerate(prompts)]


def submit(client: openai.OpenAI, lines: list[dict]):
    return client.batches.create(input_file_id=client.files.create(file=jsonl(lines), purpose="batch").id,
                                 endpoint="/v1/completions", completion_window="24h")


def wait_completed(client: openai.OpenAI, batch_id: str, count: int, end: float) -> None:
    """Until ``count`` items of the batch have a result (by the monotonic instant ``end``)."""
    while client.batches.retrieve(batch_id).request_counts.completed < count:
        assert time.monotonic() < end, f"batch {batch_id}: fewer than {count} results in time"
        time.sleep(0.05)


def wait_status(client: openai.OpenAI, batch_id: str, statuses: set[str], timeout_s: float = 120.0):
    end = time.monotonic() + timeout_s
    while True:
        b = client.batches.retrieve(batch_id)
        if b.status in statuses:
            return b
        assert time.monotonic() < end, f"batch {batch_id} still {b.status}: {b.request_counts}"
        time.sleep(0.1)


def results(client: openai.OpenAI, file_id: str | None) -> dict[str, dict]:
    if file_id is None:
        return {}
    lines = client.files.content(file_id).content.decode().splitlines()
    out = {}
    for line in lines:
        rec = json.loads(line)
        assert rec["custom_id"] not in out, f"{rec['custom_id']} answered twice"
        out[rec["custom_id"]] = rec
    return out


def test_a_batch_runs_and_matches_the_requests_sent_one_by_one(stack: Stack) -> None:
    client = stack.openai()
    lines = requests(PROMPTS, "a")
    f = client.files.create(file=jsonl(lines), purpose="batch")
    assert f.purpose == "batch" and f.bytes > 0 and client.files.retrieve(f.id).id == f.id
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h",
                              metadata={"job": "nightly"})
    assert b.status == "in_progress" and b.request_counts.total == len(PROMPTS) and b.metadata == {"job": "nightly"}
    done = wait_status(client, b.id, {"completed"})
    assert (done.request_counts.completed, done.request_counts.failed) == (len(PROMPTS), 0)
    out = results(client, done.output_file_id)
    assert set(out) == {x["custom_id"] for x in lines} and done.error_file_id is None
    for line in lines[:8]:  # the same requests, one by one
        body = dict(line["body"])
        extra = {"ignore_eos": body.pop("ignore_eos")}
        alone = client.completions.create(**body, extra_body=extra)
        got = out[line["custom_id"]]["response"]
        assert got["status_code"] == 200 and got["body"]["choices"][0]["text"] == alone.choices[0].text
        assert got["body"]["pdserve"]["token_ids"] == alone.pdserve["token_ids"]
    assert b.id in [x.id for x in client.batches.list(limit=100).data]
    # the batch's tokens in the router's metrics: counted, and as a rate over the last minute
    import urllib.request

    with urllib.request.urlopen(stack.server.base_url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and line[0] != "#"}
    assert values['pdserve_router_batch_completion_tokens_total{model="tiny"}'] >= len(PROMPTS) * GEN
    assert values['pdserve_router_batch_output_tokens_per_second{model="tiny"}'] >= len(PROMPTS) * GEN / 60.0
    assert values['pdserve_router_requests_finished_total{model="tiny",api="batch",outcome="length"}'] >= len(PROMPTS)
    assert stack.engine.block_manager.all_free() or wait_free(stack)


def wait_free(stack: Stack) -> bool:
    end = time.monotonic() + 10
    while not stack.engine.block_manager.all_free():
        assert time.monotonic() < end
        time.sleep(0.05)
    return True


def test_bad_lines_fail_the_batch_naming_each_line(stack: Stack) -> None:
    client = stack.openai()
    good = requests(PROMPTS[:2], "v")
    bad = [good[0], {"custom_id": "v-0", "method": "POST", "url": "/v1/completions", "body": {}},
           {"custom_id": "x", "method": "POST", "url": "/v1/embeddings", "body": {}}, "not an object"]
    buf = io.BytesIO(("\n".join(json.dumps(x) for x in bad) + "\n{broken\n").encode())
    buf.name = "bad.jsonl"
    f = client.files.create(file=buf, purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    assert b.status == "failed"
    assert [(e.line, e.code) for e in b.errors.data] == [(2, "duplicate_custom_id"), (3, "invalid_url"),
                                                          (4, "invalid_request"), (5, "invalid_json")]
    for kwargs, words in ((dict(input_file_id="file-nope", endpoint="/v1/completions", completion_window="24h"),
                           "no file"),
                          (dict(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h"), "endpoint"),
                          (dict(input_file_id=f.id, endpoint="/v1/completions", completion_window="1h"),
                           "completion_window")):
        with pytest.raises((openai.BadRequestError, openai.NotFoundError), match=words):
            client.batches.create(**kwargs)
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=jsonl(good), purpose="fine-tune")
    # a request that fails on its own goes to the error file, the others to the output
    mixed = good + [{"custom_id": "v-bad", "method": "POST", "url": "/v1/completions",
                     "body": {"model": "tiny", "prompt": "x", "max_tokens": 10 ** 6}}]
    b = client.batches.create(input_file_id=client.files.create(file=jsonl(mixed), purpose="batch").id,
                              endpoint="/v1/completions", completion_window="24h")
    done = wait_status(client, b.id, {"completed"})
    assert (done.request_counts.completed, done.request_counts.failed) == (2, 1)
    err = results(client, done.error_file_id)["v-bad"]["response"]
    assert err["status_code"] == 400 and "max_tokens" in err["body"]["error"]["message"]


def test_cancel_stops_the_remaining_items(stack: Stack) -> None:
    client = stack.openai()
    lines = [dict(x, body=dict(x["body"], max_tokens=60)) for x in requests(PROMPTS * 3, "c")]
    b = submit(client, lines)
    wait_completed(client, b.id, 3, time.monotonic() + 60)
    assert client.batches.cancel(b.id).status == "cancelling"
    done = wait_status(client, b.id, {"cancelled"})
    out, errs = results(client, done.output_file_id), results(client, done.error_file_id)
    assert len(out) == done.request_counts.completed < len(lines)
    assert set(out) | set(errs) == {x["custom_id"] for x in lines} and not set(out) & set(errs)
    assert all(e["error"]["code"] == "batch_cancelled" for e in errs.values() if e["response"] is None)
    with pytest.raises(openai.BadRequestError, match="only a running batch"):
        client.batches.cancel(b.id)
    wait_free(stack)


def test_batch_items_take_no_admission_slot_but_a_clients_batch_priority_does(stack: Stack) -> None:
    """The runner's items run outside the router's admission (the runner bounds them), so a batch
    never makes an interactive request wait for a slot; a client's own request with
    ``priority: batch`` is admitted like any other (it is not the runner's to bound)."""
    client = stack.openai()
    lines = [dict(x, body=dict(x["body"], max_tokens=60)) for x in requests(PROMPTS * 2, "adm")]
    b = submit(client, lines)
    end = time.monotonic() + 60
    while stack.runner.running == 0:
        assert time.monotonic() < end, "the batch never started"
        time.sleep(0.01)
    assert stack.serving.admission.in_flight == 0
    stream = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=60, stream=True,
                                       extra_body={"priority": "batch", "ignore_eos": True})
    next(iter(stream))
    assert stack.serving.admission.in_flight == 1 and stack.runner.running > 0
    stream.close()
    wait_status(client, b.id, {"completed"})
    wait_free(stack)


def test_router_and_redis_restarts_mid_batch_answer_every_item_once(stack: Stack) -> None:
    client = stack.openai()
    lines = [dict(x, body=dict(x["body"], max_tokens=24)) for x in requests(PROMPTS * 2, "r")]
    b = submit(client, lines)
    end = time.monotonic() + 60
    wait_completed(client, b.id, 5, end)
    stack.kill_runner()           # the router dies mid-batch ...
    before = client.batches.retrieve(b.id).request_counts.completed
    assert before < len(lines)
    stack.start_runner()          # ... and a new one picks up what has no result
    wait_completed(client, b.id, before + 5, end)
    stack.redis.restart()         # Redis restarts mid-batch (AOF on): the runner waits and goes on
    done = wait_status(client, b.id, {"completed"})
    assert (done.request_counts.completed, done.request_counts.failed) == (len(lines), 0)
    out = results(client, done.output_file_id)
    assert set(out) == {x["custom_id"] for x in lines}     # every item, each once (results() checks)
    wait_free(stack)


def test_a_killed_router_process_mid_batch_answers_every_item_once(stack: Stack, tiny_model) -> None:
    """A few hundred items through a router process of their own (HTTP, batch runner and local
    engine in one process, the batch in the test's Redis): the process is SIGKILLed mid-batch and a
    new one started; every item is answered exactly once, with the engine's own tokens."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from pdserve.engine.sampling_params import SamplingParams

    script = Path(__file__).with_name("batch_router_proc.py")
    env = dict(os.environ, BATCH_REDIS_URL=stack.redis.url, BATCH_REDIS_PASSWORD=stack.redis.password,
               BATCH_LEASE_S="3")   # the dead router's leased items are taken over 3 s after it died

    def start() -> tuple[subprocess.Popen, openai.OpenAI]:
        proc = subprocess.Popen([sys.executable, str(script), str(tiny_model), "bk"], env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), url
        proc.stdout.readline()   # its lease holder
        return proc, openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=3, timeout=30)

    prompts = [f"Review {i} of the few hundred says" for i in range(240)]
    lines = requests(prompts, "k")
    first, client = start()
    try:
        b = submit(client, lines)
        wait_completed(client, b.id, 30, time.monotonic() + 120)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(30)
    second, client = start()
    try:
        before = client.batches.retrieve(b.id).request_counts.completed
        assert 30 <= before < len(lines)              # killed mid-batch
        done = wait_status(client, b.id, {"completed"}, timeout_s=240)
        assert (done.request_counts.completed, done.request_counts.failed) == (len(lines), 0)
        out = results(client, done.output_file_id)      # each custom_id once (results() checks)
    finally:
        second.send_signal(signal.SIGKILL)
        second.wait(30)
    assert set(out) == {x["custom_id"] for x in lines}
    tok = load_tokenizer(tiny_model)
    # float32 on both sides (batch_router_proc.py): in bf16 a row's tokens depend on its batch
    alone = LLMEngine(EngineConfig(model_dir=str(tiny_model), num_blocks=512, max_num_seqs=32, warm_up=False,
                                   dtype="float32"))
    expected = alone.generate([list(tok(p)["input_ids"]) for p in prompts],
                              SamplingParams(max_tokens=GEN, temperature=0.0, ignore_eos=True))
    for i, want in enumerate(expected):
        assert out[f"k-{i}"]["response"]["body"]["pdserve"]["token_ids"] == want, i


def test_without_a_store_the_batch_api_says_why(tiny_model) -> None:
    """A server started without the cluster's Redis answers 404 with the reason."""
    engine = LLMEngine(EngineConfig(model_dir=str(tiny_model), num_blocks=64, warm_up=False))
    backend = LocalEngineBackend(engine, model_name="tiny")

    async def go():
        server = await start_http_server(Serving(backend, tokenizer=load_tokenizer(tiny_model)))
        try:
            client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)
            with pytest.raises(openai.NotFoundError, match="needs the cluster's Redis"):
                await client.batches.list()
        finally:
            await server.stop()

    asyncio.run(go())
    backend.close()


def test_the_operator_cli_submits_watches_and_fetches(stack: Stack, tmp_path) -> None:
    import subprocess
    import sys

    src = tmp_path / "chat.jsonl"
    lines = [{"custom_id": f"cli-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "tiny", "messages": [{"role": "user", "content": p}], "max_tokens": 4,
                       "temperature": 0}} for i, p in enumerate(PROMPTS[:6])]
    src.write_text("\n".join(json.dumps(x) for x in lines) + "\n")

    def cli(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pdserve", "batch", *argv, "--url", stack.server.base_url],
                              capture_output=True, text=True, timeout=120)

    sub = cli("submit", str(src))
    assert sub.returncode == 0, sub.stderr
    batch_id = sub.stdout.strip()
    watch = cli("status", batch_id, "--watch")
    assert watch.returncode == 0 and "6/6 (0 failed) completed" in watch.stdout, watch.stdout + watch.stderr
    out = tmp_path / "out.jsonl"
    assert cli("results", batch_id, "-o", str(out)).returncode == 0
    got = {json.loads(x)["custom_id"] for x in out.read_text().splitlines()}
    assert got == {x["custom_id"] for x in lines}
    assert batch_id in cli("list").stdout
    bad = cli("status", "batch_nope")
    assert bad.returncode == 1 and "404" in bad.stderr and "no batch" in bad.stderr


# ------------------------------------------------------------------------------------- tenants
def http(stack: Stack, method: str, path: str, *, authorization: str | None = None, body: bytes | None = None,
         content_type: str = "application/json", keyed: bool = True) -> tuple[int, bytes]:
    """A raw request (the cases the ``openai`` client cannot send): (status, body)."""
    import urllib.error
    import urllib.request

    headers = {"Content-Type": content_type} if body is not None else {}
    if authorization is not None:
        headers["Authorization"] = authorization
    base = (stack.keyed if keyed else stack.server).base_url
    req = urllib.request.Request(base + path, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def upload(stack: Stack, content: bytes, filename: str, key: str = KEY_A) -> tuple[int, bytes]:
    boundary = "pdserve-test-boundary"
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{filename}\"\r\n"
            f"Content-Type: application/jsonl\r\n\r\n").encode() + content + f"\r\n--{boundary}--\r\n".encode()
    return http(stack, "POST", "/v1/files", authorization=f"Bearer {key}", body=body,
                content_type=f"multipart/form-data; boundary={boundary}")


def not_found_alike(call, theirs: str, unknown: str) -> None:
    """``call`` on another tenant's id is the same 404 as on an id that does not exist."""
    with pytest.raises(openai.NotFoundError) as got:
        call(theirs)
    with pytest.raises(openai.NotFoundError) as none:
        call(unknown)
    assert got.value.response.json() == json.loads(none.value.response.text.replace(unknown, theirs))


def test_two_keys_are_two_tenants_that_never_see_each_others_files_or_batches(stack: Stack) -> None:
    import uuid

    a, b = stack.openai(KEY_A), stack.openai(KEY_B)
    lines_a = requests(PROMPTS[:3], "ta")
    fa = a.files.create(file=jsonl(lines_a), purpose="batch")
    ba = a.batches.create(input_file_id=fa.id, endpoint="/v1/completions", completion_window="24h")
    bb = submit(b, requests(PROMPTS[3:5], "tb"))
    done_a, done_b = wait_status(a, ba.id, {"completed"}), wait_status(b, bb.id, {"completed"})
    assert set(results(a, done_a.output_file_id)) == {x["custom_id"] for x in lines_a}
    assert "owner" not in done_a.model_dump() and "owner" not in a.files.retrieve(fa.id).model_dump()
    # a long one of A's, still running while B tries to cancel it
    running = submit(a, [dict(x, body=dict(x["body"], max_tokens=60)) for x in requests(PROMPTS * 2, "tr")])

    unknown_file, unknown_batch = f"file-{uuid.uuid4().hex}", f"batch_{uuid.uuid4().hex}"
    for call, theirs, unknown in (
            (b.files.retrieve, fa.id, unknown_file),                       # A's prompts
            (b.files.content, fa.id, unknown_file),
            (b.files.retrieve, done_a.output_file_id, unknown_file),       # A's completions
            (b.files.content, done_a.output_file_id, unknown_file),
            (b.batches.retrieve, ba.id, unknown_batch),
            (b.batches.cancel, running.id, unknown_batch),
            (lambda fid: b.batches.create(input_file_id=fid, endpoint="/v1/completions", completion_window="24h"),
             fa.id, unknown_file)):
        not_found_alike(call, theirs, unknown)
    assert a.batches.retrieve(running.id).status == "in_progress"     # B's cancel did nothing
    listed_a = {x.id for x in a.batches.list(limit=100).data}
    listed_b = {x.id for x in b.batches.list(limit=100).data}
    assert {ba.id, running.id} <= listed_a and bb.id not in listed_a
    assert listed_b == {bb.id}
    # the key's owner, however the header spells it; no key, no entry
    for spelling in (f"Bearer {KEY_A}", f"bearer   {KEY_A}", f"  BEARER {KEY_A} "):
        status, body = http(stack, "GET", f"/v1/batches/{ba.id}", authorization=spelling)
        assert status == 200 and json.loads(body)["id"] == ba.id
    assert http(stack, "GET", f"/v1/batches/{ba.id}")[0] == 401
    # without keys everyone is the anonymous owner (the earlier tests' batches are its own), who
    # owns neither tenant's objects, and whose batches are no tenant's
    anon = stack.openai()
    not_found_alike(anon.batches.retrieve, ba.id, unknown_batch)
    not_found_alike(anon.files.content, done_b.output_file_id, unknown_file)
    assert not {x.id for x in anon.batches.list(limit=100).data} & (listed_a | listed_b)
    assert a.batches.cancel(running.id).status == "cancelling"
    wait_status(a, running.id, {"cancelled"})
    wait_free(stack)
    # the operator's request log shows every tenant's items, each with its owner id
    end = time.monotonic() + 10
    while True:
        logged = {e["client_request_id"]: e for e in stack.request_log.tail(5000) if e.get("api") == "batch"}
        if {"ta-0", "ta-1", "ta-2", "tb-0", "tb-1"} <= set(logged) or time.monotonic() > end:
            break
        time.sleep(0.1)
    assert [logged[f"ta-{i}"].get("owner") for i in range(3)] == [owner_id(KEY_A)] * 3
    assert [logged[f"tb-{i}"].get("owner") for i in range(2)] == [owner_id(KEY_B)] * 2
    assert "owner" not in logged["a-0"]   # the first test's, through the server without keys


def test_the_operator_cli_works_per_key(stack: Stack, tmp_path) -> None:
    import os
    import subprocess
    import sys

    theirs = submit(stack.openai(KEY_A), requests(PROMPTS[:2], "cli-a"))
    src = tmp_path / "mine.jsonl"
    src.write_text("\n".join(json.dumps(x) for x in requests(PROMPTS[2:4], "cli-b")) + "\n")

    def cli(key: str | None, *argv: str) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if k != "PDSERVE_API_KEY"}
        if key is not None:
            env["PDSERVE_API_KEY"] = key   # the key from the environment, never argv
        return subprocess.run([sys.executable, "-m", "pdserve", "batch", *argv, "--url", stack.keyed.base_url],
                              capture_output=True, text=True, timeout=120, env=env)

    sub = cli(KEY_B, "submit", str(src))
    assert sub.returncode == 0, sub.stderr
    mine = sub.stdout.strip()
    assert cli(KEY_B, "status", mine, "--watch").returncode == 0
    listed = cli(KEY_B, "list").stdout
    assert mine in listed and theirs.id not in listed
    assert mine not in cli(KEY_A, "list").stdout
    for action in ("status", "results", "cancel"):
        got = cli(KEY_B, action, theirs.id)
        assert got.returncode == 1 and f"404 no batch '{theirs.id}'" in got.stderr, got.stderr
    refused = cli(None, "list")
    assert refused.returncode == 1 and "401" in refused.stderr and "missing API key" in refused.stderr
    wait_status(stack.openai(KEY_A), theirs.id, {"completed"})


# ---------------------------------------------------------------------------- malformed input
def test_ids_that_name_other_redis_keys_are_404_not_500(stack: Stack) -> None:
    a = stack.openai(KEY_A)
    b = submit(a, requests(PROMPTS[:2], "ids"))
    auth = f"Bearer {KEY_A}"
    for suffix in (":counts", ":items", ":results", ":lease:0", ":claims"):
        for method, path in (("GET", f"/v1/batches/{b.id}{suffix}"), ("POST", f"/v1/batches/{b.id}{suffix}/cancel")):
            status, body = http(stack, method, path, authorization=auth)
            assert status == 404 and "no batch" in json.loads(body)["error"]["message"], (path, status, body)
            status, _ = http(stack, method, path, keyed=False)
            assert status == 404, (path, status)
    for bad in (f"{b.id}:counts", "batch_nope", b.id.upper()):
        status, body = http(stack, "GET", f"/v1/batches?after={bad}", authorization=auth)
        assert status == 400 and json.loads(body)["error"]["param"] == "after"
    for path in (f"/v1/files/{b.input_file_id}:x", f"/v1/files/{b.input_file_id}:x/content"):
        assert http(stack, "GET", path, authorization=auth)[0] == 404
    wait_status(a, b.id, {"completed"})


def test_malformed_uploads_are_400_naming_the_limit(stack: Stack) -> None:
    good = ("\n".join(json.dumps(x) for x in requests(PROMPTS[:1], "up")) + "\n").encode()
    for name_length, words in ((300, "300 characters; at most 255"), (10_000, "at most 255 characters")):
        status, body = upload(stack, good, "f" * name_length)
        assert status == 400 and words in json.loads(body)["error"]["message"], body[:300]
    a = stack.openai(KEY_A)
    deep = json.dumps(requests(PROMPTS[:1], "deep")[0]).replace(json.dumps(PROMPTS[0]), "[" * 5000 + "]" * 5000)
    with pytest.raises(openai.BadRequestError, match="line 2 nests arrays and objects more than 64 levels"):
        a.files.create(file=io.BytesIO(good + deep.encode() + b"\n"), purpose="batch")
    lone = [dict(requests(PROMPTS[:1], "s")[0], custom_id="\ud800")]
    with pytest.raises(openai.BadRequestError, match="line 1 has an unpaired surrogate"):
        a.files.create(file=jsonl(lone), purpose="batch")
    in_prompt = requests(["a \udfff b"], "s2")
    with pytest.raises(openai.BadRequestError, match="unpaired surrogate"):
        a.files.create(file=jsonl(in_prompt), purpose="batch")


def test_lines_holding_u2028_or_u0085_are_one_request_each(stack: Stack) -> None:
    a = stack.openai(KEY_A)
    lines = requests([f"First part{sep}second part of item {i}" for i, sep in enumerate(
        ["\u2028", "\u0085", "\u2029", "\x1c"])], "sep")
    buf = io.BytesIO(("\n".join(json.dumps(x, ensure_ascii=False) for x in lines) + "\n").encode())
    b = a.batches.create(input_file_id=a.files.create(file=buf, purpose="batch").id, endpoint="/v1/completions",
                         completion_window="24h")
    assert b.status == "in_progress" and b.request_counts.total == len(lines), b.errors
    done = wait_status(a, b.id, {"completed"})
    assert (done.request_counts.completed, done.request_counts.failed) == (len(lines), 0)
    assert set(results(a, done.output_file_id)) == {x["custom_id"] for x in lines}


class LoopLag:
    """The server loop's longest stall: a task sleeping 5 ms at a time, measuring how late it wakes."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.worst = 0.0
        self._task = None

    async def _probe(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t = loop.time()
            await asyncio.sleep(0.005)
            self.worst = max(self.worst, loop.time() - t - 0.005)

    def __enter__(self) -> LoopLag:
        async def go():
            self._task = asyncio.get_running_loop().create_task(self._probe())
        self.stack.call(go())
        return self

    def __exit__(self, *exc) -> None:
        async def go():
            self._task.cancel()
        self.stack.call(go())


def test_a_64_mib_batch_is_created_without_stalling_the_event_loop(stack: Stack) -> None:
    a = stack.openai(KEY_A)
    body = {"model": "tiny", "prompt": "p" * 1200, "max_tokens": 1, "temperature": 0}
    text = "\n".join(json.dumps({"custom_id": f"big-{i}", "method": "POST", "url": "/v1/completions", "body": body})
                     for i in range(47_500)) + "\n"
    content = text.encode()
    assert 60 * 2 ** 20 < len(content) <= 64 * 2 ** 20
    buf = io.BytesIO(content)
    buf.name = "big.jsonl"
    with LoopLag(stack) as upload_lag:
        f = a.files.create(file=buf, purpose="batch")
    with LoopLag(stack) as create_lag:
        t0 = time.monotonic()
        b = a.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
        took = time.monotonic() - t0
    print(f"64 MiB file: upload stalled the loop at most {upload_lag.worst * 1000:.0f} ms; creation "
          f"{create_lag.worst * 1000:.0f} ms (creation took {took:.2f} s)")
    assert b.status == "in_progress" and b.request_counts.total == 47_500
    assert create_lag.worst < 0.1 and upload_lag.worst < 0.1, (create_lag.worst, upload_lag.worst)
    a.batches.cancel(b.id)
    wait_status(a, b.id, {"cancelled"}, timeout_s=240)
    wait_free(stack)


# ------------------------------------------------------------------------ several routers
def test_a_runner_that_lost_an_items_lease_drops_it_and_the_item_is_answered_once(stack: Stack) -> None:
    """A runner stalled past its lease finds, at its next renewal, that another runner has the item:
    it drops it (no second result), and the item is run by the lease's holder (here: nobody, so
    it is claimed again once that lease expires)."""
    stack.kill_runner()
    stack.start_runner(lease_s=1.5)          # renewed every 0.5 s
    try:
        client = stack.openai()
        lines = [dict(x, body=dict(x["body"], max_tokens=400)) for x in requests(PROMPTS[:8], "lost")]
        b = submit(client, lines)
        end = time.monotonic() + 60
        while not (held := [k for k in stack.client.keys(f"bt:batch:{b.id}:lease:*")
                            if stack.client.get(k) == stack.runner.holder.encode()]):
            assert time.monotonic() < end, "no item started"
            time.sleep(0.01)
        index = int(held[0].rsplit(b":", 1)[1])
        stack.client.set(held[0], "another-runner", px=3000)     # taken over while this one "stalled"
        while (b.id, index) in stack.runner._running:
            assert time.monotonic() < end, "the runner kept an item whose lease it lost"
            time.sleep(0.01)
        assert index not in {i for i, _, _ in stack.store.results(b.id)}   # dropped, not answered
        done = wait_status(client, b.id, {"completed"})
        assert set(results(client, done.output_file_id)) == {x["custom_id"] for x in lines}
        assert stack.store.claims(b.id)[index] == 2
    finally:
        stack.kill_runner()
        stack.start_runner()
    wait_free(stack)


def test_three_routers_run_each_item_once_and_take_over_a_killed_ones_items(stack: Stack, tiny_model,
                                                                             tmp_path) -> None:
    """Three router processes, each with its batch runner, share the batches of one Redis: each
    item runs once (the routers' own request counters add up to the item count, and the store
    counts one claim per item); one SIGKILLed mid-batch leaves leases that expire, and its items
    are taken over (claimed twice), the batch still answered exactly once."""
    import os
    import signal
    import subprocess
    import sys
    import urllib.request
    from pathlib import Path

    store = RedisBatchStore(stack.client, namespace="tri")
    script = Path(__file__).with_name("batch_router_proc.py")
    env = dict(os.environ, BATCH_REDIS_URL=stack.redis.url, BATCH_REDIS_PASSWORD=stack.redis.password,
               BATCH_LEASE_S="6")
    procs = [subprocess.Popen([sys.executable, str(script), str(tiny_model), "tri"], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=(tmp_path / f"router{i}.log").open("w"))
             for i in range(3)]

    def batch_requests(url: str) -> float:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
            return sum(float(x.split()[-1]) for x in resp.read().decode().splitlines()
                       if x.startswith("pdserve_router_requests_finished_total{") and 'api="batch"' in x)

    def held(batch_id: str, holder: str) -> set[int]:
        out = set()
        for key in stack.client.keys(f"tri:batch:{batch_id}:lease:*"):
            if stack.client.get(key) == holder.encode():
                out.add(int(key.rsplit(b":", 1)[1]))
        return out

    try:
        urls, holders = [], []
        for p in procs:
            urls.append(p.stdout.readline().strip())
            holders.append(p.stdout.readline().strip())
            assert urls[-1].startswith("http://127.0.0.1:"), urls[-1]
        client = openai.OpenAI(base_url=urls[0] + "/v1", api_key="none", max_retries=3, timeout=30)
        # 1. three runners, each item once
        lines = requests([f"Shared item {i} reads" for i in range(60)], "tri")
        b = submit(client, lines)
        done = wait_status(client, b.id, {"completed"}, timeout_s=240)
        assert set(results(client, done.output_file_id)) == {x["custom_id"] for x in lines}
        assert store.claims(b.id) == {i: 1 for i in range(len(lines))}
        ran = [batch_requests(u) for u in urls]
        print(f"60 items over three routers: {ran}")
        assert sum(ran) == len(lines)
        # 2. one router killed mid-batch: its items wait for their leases to expire, then run elsewhere
        lines = [dict(x, body=dict(x["body"], max_tokens=24)) for x in requests(
            [f"Long item {i} reads" for i in range(150)], "tk")]
        b = submit(client, lines)
        end = time.monotonic() + 120
        while len(held(b.id, holders[2])) < 3:
            assert time.monotonic() < end, "the third router never ran three items at once"
            time.sleep(0.01)
        procs[2].send_signal(signal.SIGKILL)
        procs[2].wait(30)
        answered = {i for i, _, _ in store.results(b.id)}
        orphans = held(b.id, holders[2]) - answered   # running when it died: never released, no result
        assert orphans
        done = wait_status(client, b.id, {"completed"}, timeout_s=240)
        out = results(client, done.output_file_id)    # each custom_id once (results() checks)
        assert set(out) == {x["custom_id"] for x in lines}
        claims = store.claims(b.id)
        assert {i for i, n in claims.items() if n > 1} == orphans and all(claims[i] == 2 for i in orphans)
        assert set(claims) == set(range(len(lines)))
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait(30)


def test_a_batch_item_asking_for_choices_or_beams_is_answered_400_naming_the_parameter(stack: Stack) -> None:
    """A batch item is one prompt and one choice: ``n`` and beam search are refused per item, never
    run as a plain request with the parameter ignored."""
    from pdserve.router import batch_api

    for extra, param in (({"n": 2}, "n"), ({"use_beam_search": True}, "use_beam_search")):
        body = {"model": "tiny", "prompt": "Say", "max_tokens": 2, **extra}
        status, out = stack.call(batch_api.respond(stack.serving, "/v1/completions", body, "cid-1"))
        assert status == 400, (extra, out)
        assert out["error"]["param"] == param, out


def test_a_tenants_cached_prefix_is_its_own(stack: Stack) -> None:
    """With keys, a prompt cached by one tenant is a cache hit for that tenant only (the owner id
    salts the prefix hashes): another tenant sees ``cached_tokens`` 0 for the same prompt, also
    when it sends the first tenant's ``cache_salt``."""
    prompt = "The quarterly report of the northern warehouse lists " * 6   # several full blocks

    def cached(key: str, **extra) -> int:
        out = stack.openai(key).completions.create(model="tiny", prompt=prompt, max_tokens=1, temperature=0,
                                                   extra_body=extra or None)
        return out.usage.prompt_tokens_details.cached_tokens

    cached(KEY_A)
    assert cached(KEY_A) >= 16                       # A's own second request hits A's blocks
    assert cached(KEY_B) == 0                        # B's same prompt does not
    cached(KEY_A, cache_salt="team-1")
    assert cached(KEY_B, cache_salt="team-1") == 0   # nor does B sending A's salt
    assert cached(KEY_A, cache_salt="team-1") >= 16

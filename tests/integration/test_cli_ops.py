"""The operator's commands as an operator runs them, against one head for the whole module:
``pdserve up / status / requests tail / batch / router / down`` and ``pdserve config`` as
subprocesses, with the state directory in a temporary folder.

``up`` starts a head process (its own Ray on 127.0.0.1, embedded Redis with a data directory,
one prefill and one decode worker, an elected control plane with ``router.replicas: 2``: the
head's router and a router actor) and returns once ``/health`` answers; the environment carries a
``RAY_ADDRESS`` that leads nowhere, so a head that tried to join another Ray instead of starting
its own would never come up. The API key is given as ``--set`` and must be readable nowhere.
The tests run in file order on that head; the last kills it with SIGKILL mid-batch, ends what it
left with ``down`` and brings a new head up on the same data directory, which finishes the batch.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from scripts import procs

pytestmark = [pytest.mark.timeout(600)]

UP_TIMEOUT_S = 240
PROMPT = "Every request has two phases, and they are limited by completely different things. " * 2
GEN = 8
KEY = "sk-argv-7d41e09b5c"
SETTINGS = {
    "router.http_port": 0, "router.grpc_port": 0, "ray.include_dashboard": "false", "ray.num_cpus": 4,
    "planner.enabled": "false", "router.disaggregation.local_prefill_max_tokens": 0,
    **{f"{role}.engine.{key}": value for role in ("prefill", "decode")
       for key, value in (("kv_cache_memory_gb", 0.03), ("num_threads", 1))},
}
ELECTED = {**SETTINGS, "control_plane.election": "true", "control_plane.lease_s": 3}
# two sequences at a time: the batch of the last test runs one item at a time, so its kill comes mid-batch.
# float32: requests repeat a prompt whose prefix is cached, and in bf16 a prefill over cached context
# rounds differently from a fresh one (near-tied logits of the random-weight model then pick another token)
HEAD = {**ELECTED, "router.replicas": 2, "decode.engine.max_num_seqs": 2, "model.dtype": "float32"}


def _pdserve_argv() -> list[str]:
    script = Path(sys.executable).parent / "pdserve"  # the installed console script
    return [str(script)] if script.exists() else [sys.executable, "-m", "pdserve.cli"]


def _env(state_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PDSERVE_API_KEYS", "PDSERVE_API_KEY")}
    env.update(PDSERVE_STATE_DIR=str(state_dir), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
               RAY_ADDRESS="127.0.0.1:9", **extra)  # nothing listens there: joining it would fail
    return env


def pdserve(state_dir: Path, *args: str, timeout_s: float = 60.0, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([*_pdserve_argv(), *args], env=_env(state_dir, **env), capture_output=True, text=True,
                          timeout=timeout_s)


def overrides(settings: dict) -> list[str]:
    return [arg for key, value in settings.items() for arg in ("--set", f"{key}={value}")]


def http_json(url: str, body: dict | None = None, timeout_s: float = 60.0, key: str | None = KEY) -> dict:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers), timeout=timeout_s) as resp:
        return json.loads(resp.read())


def status_code(url: str, key: str | None) -> int:
    try:
        http_json(url + "/v1/completions", {"prompt": "hello", "max_tokens": 2}, key=key)
        return 200
    except urllib.error.HTTPError as exc:
        return exc.code


def complete(base_url: str, model: str) -> dict:
    body = {"model": model, "prompt": PROMPT, "max_tokens": GEN, "temperature": 0, "ignore_eos": True}
    return http_json(base_url + "/v1/completions", body)


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        return ""


@dataclass
class Head:
    state_dir: Path
    settings: list[str]     # the --set arguments it was started with
    up_stdout: str
    model_dir: Path

    @property
    def state(self) -> dict:
        return json.loads((self.state_dir / "state.json").read_text())

    def up(self) -> dict:
        out = pdserve(self.state_dir, "up", "--model", str(self.model_dir), *self.settings,
                      "--timeout", str(UP_TIMEOUT_S), timeout_s=UP_TIMEOUT_S + 30)
        log_path = self.state_dir / "head.log"
        log = log_path.read_text(errors="replace") if log_path.exists() else ""
        assert out.returncode == 0, f"{out.stdout}\n{out.stderr}\n--- head.log ---\n{log[-4000:]}"
        self.up_stdout = out.stdout
        return self.state


@pytest.fixture(scope="module")
def head(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path):
    """One head for the module, stopped with ``down`` at its end if a test left it up (the last test
    downs it itself; a selection of the tests need not); ``down`` must leave no process behind."""
    root = tmp_path_factory.mktemp("cli")
    settings = overrides({**HEAD, "redis.data_dir": root / "redis-data", "router.api_keys": f'["{KEY}"]'})
    h = Head(root / "state", settings, "", tiny_model)
    try:
        h.up()
        yield h
    finally:
        st = h.state_dir / "state.json"
        if st.exists():
            tree = procs.descendants(json.loads(st.read_text())["pid"])
            down = pdserve(h.state_dir, "down", "--timeout", "60", timeout_s=90)
            left = procs.wait_gone(tree, 10)
            for p, _ in left:
                os.kill(p, 9)
            assert down.returncode == 0 and not left, down.stdout + down.stderr + procs.describe(left)


def test_an_api_key_given_to_up_is_in_no_argv_and_no_world_readable_file(head: Head) -> None:
    state = head.state
    tree = procs.descendants(state["pid"])
    argvs = {pid: cmdline(pid) for pid in {state["pid"], *(p for p, _ in tree)}}
    assert "_head" in argvs[state["pid"]] and "--set" not in argvs[state["pid"]], argvs[state["pid"]]
    leaked = {pid: argv for pid, argv in argvs.items() if KEY in argv}
    assert not leaked, leaked

    assert stat.S_IMODE(head.state_dir.stat().st_mode) == 0o700
    files = sorted(p for p in head.state_dir.iterdir() if p.is_file())
    assert {p.name for p in files} >= {"state.json", "head.log", "redis-password"}, files
    assert not [p for p in files if p.name.startswith("head-overrides-")], files
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in files), \
        {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in files}
    assert KEY not in (head.state_dir / "state.json").read_text()
    assert KEY not in (head.state_dir / "head.log").read_text(errors="replace")

    assert status_code(state["http"], None) == 401  # the key applied all the same
    assert status_code(state["http"], KEY) == 200


def test_up_status_request_tail(head: Head) -> None:
    state = head.state
    assert "pdserve is up" in head.up_stdout and state["http"] in head.up_stdout
    assert state["http"].startswith("http://127.0.0.1:") and state["grpc"].startswith("127.0.0.1:")
    assert state["ray_address"].startswith("127.0.0.1:") and state["ray_address"] != "127.0.0.1:9"

    # A second `up` refuses while this one runs.
    again = pdserve(head.state_dir, "up", "--model", str(head.model_dir), *overrides(SETTINGS))
    assert again.returncode != 0 and f"already up (pid {state['pid']})" in again.stdout

    status = pdserve(head.state_dir, "status")
    assert status.returncode == 0, status.stderr
    lines = status.stdout.splitlines()
    for role in ("prefill", "decode"):
        assert any(line.split()[:4] == ["pool", role, "replicas", "1"] for line in lines), status.stdout
        workers = [line.split() for line in lines if line.startswith(f"{role}-")]
        assert len(workers) == 1 and workers[0][1:3] == [role, "up"], status.stdout
    as_json = json.loads(pdserve(head.state_dir, "status", "--json").stdout)
    assert {w["role"] for w in as_json["workers"]} == {"prefill", "decode"}
    assert all(w["alive"] and not w["draining"] for w in as_json["workers"])
    # each worker's threads (num_threads 1 here) and cores; two workers never share a core
    assert all(w["num_threads"] == 1 and w["dtype"] in ("float32", "bfloat16") for w in as_json["workers"])
    pinned = [c for w in as_json["workers"] for c in w["cores"]]
    assert len(pinned) == len(set(pinned)), as_json["workers"]
    assert "thr" in status.stdout and "matmuls" in status.stdout, status.stdout

    assert http_json(state["http"] + "/health") is not None
    body = {"model": state["model"], "prompt": PROMPT, "max_tokens": GEN, "temperature": 0, "ignore_eos": True}
    done = http_json(state["http"] + "/v1/completions", body)
    assert done["usage"]["completion_tokens"] == GEN and done["choices"][0]["finish_reason"] == "length"
    request_id = done["pdserve"]["request_id"]

    def record() -> dict | None:  # the log is appended just after the response: poll (bounded)
        out = pdserve(head.state_dir, "requests", "tail", "-n", "5", "--json")
        assert out.returncode == 0, out.stderr
        found = [json.loads(line) for line in out.stdout.splitlines() if request_id in line]
        return found[0] if found else None

    deadline = time.monotonic() + 20
    while (rec := record()) is None and time.monotonic() < deadline:
        time.sleep(0.3)
    assert rec is not None, f"{request_id} not in the request log"
    assert rec["finish_reason"] == "length" and rec["output_tokens"] == GEN
    assert rec["prompt_tokens"] == done["usage"]["prompt_tokens"] > 0
    assert rec["prefill_worker"].startswith("prefill-") and rec["decode_worker"].startswith("decode-")
    assert rec["kv_bytes"] > 0 and 0 < rec["ttft_s"] <= rec["total_s"]
    for field in ("queue_s", "prefill_s", "kv_transfer_s", "decode_s", "cached_prompt_tokens", "attempts"):
        assert field in rec, field
    text = pdserve(head.state_dir, "requests", "tail", "-n", "5").stdout
    assert any(line.startswith(request_id) and f"out {GEN:5d}" in line for line in text.splitlines()), text

    # A client that leaves mid-stream leaves a trace: its record, outcome "cancelled".
    streamed = dict(body, stream=True, max_tokens=200)
    req = urllib.request.Request(state["http"] + "/v1/completions", json.dumps(streamed).encode(),
                                 {"Content-Type": "application/json", "X-Request-Id": "leaves-early",
                                  "Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.readline().startswith(b"data: ")  # one event read, then the connection closes
    deadline = time.monotonic() + 20
    left = None
    while left is None and time.monotonic() < deadline:
        out = pdserve(head.state_dir, "requests", "tail", "-n", "5", "--json").stdout
        left = next((json.loads(line) for line in out.splitlines() if '"leaves-early"' in line), None)
        time.sleep(0.3)
    assert left is not None, "the cancelled request is not in the request log"
    assert left["outcome"] == "cancelled" and left["finish_reason"] == "abort" and left["api"] == "http"
    assert 0 < left["output_tokens"] < 200 and left["decode_worker"].startswith("decode-")

    # The Batch API through the cluster (its state in the cluster's Redis), as an operator runs it.
    src = head.state_dir.parent / "batch.jsonl"
    src.write_text("".join(json.dumps({"custom_id": f"op-{i}", "method": "POST", "url": "/v1/completions",
                                       "body": {"model": state["model"], "prompt": PROMPT, "max_tokens": 3,
                                                "temperature": 0}}) + "\n" for i in range(3)))
    submitted = pdserve(head.state_dir, "batch", "submit", str(src), PDSERVE_API_KEY=KEY)
    assert submitted.returncode == 0, submitted.stderr
    watched = pdserve(head.state_dir, "batch", "status", submitted.stdout.strip(), "--watch", timeout_s=120,
                      PDSERVE_API_KEY=KEY)
    assert watched.returncode == 0 and "3/3 (0 failed) completed" in watched.stdout, watched.stdout + watched.stderr
    got = pdserve(head.state_dir, "batch", "results", submitted.stdout.strip(), PDSERVE_API_KEY=KEY)
    assert sorted(json.loads(x)["custom_id"] for x in got.stdout.splitlines()) == ["op-0", "op-1", "op-2"]
    assert pdserve(head.state_dir, "batch", "results", submitted.stdout.strip()).returncode != 0  # no key: refused


def test_up_with_a_misspelt_key_names_the_field(tmp_path: Path, tiny_model: Path) -> None:
    config = tmp_path / "cluster.yaml"
    config.write_text(f"model:\n  path: {tiny_model}\ndecode:\n  engine:\n    max_num_seqz: 4\n")
    out = pdserve(tmp_path, "up", "-c", str(config))
    assert out.returncode != 0
    assert "decode.engine.max_num_seqz" in out.stderr and "max_num_seqs" in out.stderr, out.stderr
    assert not (tmp_path / "state.json").exists() and not (tmp_path / "head.log").exists()


def test_config_schema_prints_the_json_schema(tmp_path: Path) -> None:
    out = pdserve(tmp_path, "config", "schema")
    assert out.returncode == 0, out.stderr
    schema = json.loads(out.stdout)
    assert {"model", "prefill", "decode", "router", "redis", "ray", "planner"} <= set(schema["properties"])
    assert "max_num_seqs" in schema["$defs"]["EngineSettings"]["properties"]


def test_router_refuses_without_an_elected_control_plane(tmp_path: Path, tiny_model: Path) -> None:
    out = pdserve(tmp_path, "router", "--model", str(tiny_model), *overrides(SETTINGS))
    assert out.returncode != 0
    assert "control_plane.election" in out.stderr, out.stderr


def test_a_second_router_joins_serves_and_leaves(head: Head) -> None:
    """``pdserve router`` joins the head's cluster (its Ray and Redis, found from the state
    directory): three routers serve the same workers; ``status`` lists them and which one leads;
    the joined router leaves on SIGTERM and the others serve on."""
    state = head.state
    assert [r["http"] for r in state["routers"]][0] == state["http"] and len(state["routers"]) == 2
    actor_http = state["routers"][1]["http"]
    assert actor_http.startswith("http://127.0.0.1:") and actor_http in head.up_stdout
    router = subprocess.Popen([*_pdserve_argv(), "router", "--model", str(head.model_dir), *overrides(ELECTED)],
                              env=_env(head.state_dir, PDSERVE_API_KEYS=KEY),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.append(router.stdout.readline()), daemon=True)
        reader.start()
        reader.join(120)
        if not lines or "is up" not in lines[0]:
            router.kill()
            raise AssertionError(f"router did not come up: {lines} rc {router.wait(10)}\n{router.stderr.read()[-4000:]}")
        http = lines[0].split("HTTP ")[1].split()[0]
        assert http.startswith("http://127.0.0.1:") and http != state["http"]
        assert "follows the control plane" in lines[0]

        # the three routers serve the same workers, token for token. The prompt is cached first:
        # in bf16 a prompt prefilled after its cached blocks need not give the same greedy tokens
        # as one prefilled whole (random weights, near-tied logits; seen on an AMX host), so
        # every compared request finds the same cache
        cold = complete(state["http"], state["model"])
        via_router, via_head = complete(http, state["model"]), complete(state["http"], state["model"])
        via_actor = complete(actor_http, state["model"])
        assert via_router["choices"][0]["text"] == via_head["choices"][0]["text"] == via_actor["choices"][0]["text"], \
            f"cold {cold['choices'][0]['text']!r}"
        assert via_router["pdserve"]["phase"]["decode_worker"] == via_head["pdserve"]["phase"]["decode_worker"] \
            == via_actor["pdserve"]["phase"]["decode_worker"]
        assert status_code(http, None) == 401  # the joined router applies the same keys

        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            status = json.loads(pdserve(head.state_dir, "status", "--json").stdout)
            routers = (status.get("control_plane") or {}).get("routers", [])
            if len(routers) == 3:
                break
            time.sleep(0.5)
        assert len(routers) == 3, status.get("control_plane")
        assert sorted(r["leader"] for r in routers) == [False, False, True]
        assert {r["http"] for r in routers} == {http, state["http"], actor_http}
        text = pdserve(head.state_dir, "status").stdout
        assert "control plane: elected" in text and text.count("\nrouter ") == 3, text

        router.send_signal(signal.SIGTERM)
        assert router.wait(60) == 0, router.stderr.read()[-3000:]
        # the head (the leader) and the router actor serve on, with the same workers
        for url in (state["http"], actor_http):
            assert complete(url, state["model"])["choices"][0]["text"] == via_head["choices"][0]["text"]
    finally:
        if router.poll() is None:
            router.kill()


def test_the_heads_embedded_redis_has_a_secret_password_and_is_restarted_when_killed(head: Head) -> None:
    """No Redis configured: a random password (in a 0600 file, in no argv, not in state.json) ->
    SIGKILL the server -> a request right away still succeeds -> the head restarts the server
    (logged) -> ``pdserve status`` works again."""
    state = head.state
    tree = procs.descendants(state["pid"])
    secret = head.state_dir / "redis-password"
    password = secret.read_text()
    assert len(password) >= 24 and stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert password not in (head.state_dir / "state.json").read_text() and "@" not in state["redis_url"]
    servers = [pid for pid, _ in tree if "-server" in cmdline(pid) and ("valkey" in cmdline(pid)
                                                                       or "redis" in cmdline(pid))]
    assert len(servers) == 1, procs.describe(tree)
    assert all(password not in cmdline(pid) for pid, _ in tree | {(state["pid"], 0)})

    before = complete(state["http"], state["model"])["pdserve"]["token_ids"]
    os.kill(servers[0], signal.SIGKILL)
    assert complete(state["http"], state["model"])["pdserve"]["token_ids"] == before  # served while it restarts
    log_path = head.state_dir / "head.log"
    deadline = time.monotonic() + 20
    while "embedded Redis restarted" not in log_path.read_text(errors="replace") and time.monotonic() < deadline:
        time.sleep(0.2)
    log = log_path.read_text(errors="replace")
    assert "embedded Redis restarted" in log and password not in log

    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        out = pdserve(head.state_dir, "status", "--json")
        if out.returncode == 0 and json.loads(out.stdout).get("workers"):
            break
        time.sleep(0.5)
    assert out.returncode == 0 and json.loads(out.stdout).get("workers"), out.stdout + out.stderr
    assert complete(state["http"], state["model"])["pdserve"]["token_ids"] == before


def test_a_head_killed_with_sigkill_leaves_nothing_after_down_and_its_data_dir_serves_again(head: Head) -> None:
    """SIGKILL of the head mid-batch -> `status` says it is dead and names what it left (Valkey,
    Ray's processes), exit code 3 -> `up` refuses to start beside them -> `down` ends them all
    before it returns -> `up` on the same redis.data_dir loads its AOF and finishes the batch,
    every item answered once -> `down` stops that head by itself within its timeout and leaves
    no password file."""
    state = head.state
    pid = state["pid"]
    n = 24
    lines = "".join(json.dumps({"custom_id": f"crash-{i}", "method": "POST", "url": "/v1/completions",
                                "body": {"model": state["model"], "prompt": f"{i} {PROMPT}", "max_tokens": 32,
                                         "temperature": 0, "ignore_eos": True}}) + "\n" for i in range(n))
    # submitted over HTTP (the CLI's submit is tested above): the watch below starts at once
    auth = {"Authorization": f"Bearer {KEY}"}
    uploaded = requests.post(state["http"] + "/v1/files", headers=auth, data={"purpose": "batch"},
                             files={"file": ("crash.jsonl", lines.encode(), "application/jsonl")}, timeout=60)
    assert uploaded.status_code == 200, uploaded.text
    created = requests.post(state["http"] + "/v1/batches", headers=auth, timeout=60, json={
        "input_file_id": uploaded.json()["id"], "endpoint": "/v1/completions", "completion_window": "24h"})
    assert created.status_code == 200, created.text
    batch_id = created.json()["id"]
    deadline = time.monotonic() + 60  # kill it mid-batch: some items answered, not all
    while time.monotonic() < deadline:
        counts = http_json(f"{state['http']}/v1/batches/{batch_id}")["request_counts"]
        if counts["completed"] >= 1:
            break
        time.sleep(0.05)
    print(f"killed with {counts['completed']} of {n} items answered")
    assert 1 <= counts["completed"] < n, counts

    tree = procs.descendants(pid) | procs.in_session(pid)  # the head, Valkey, Ray (GCS, raylet, agents, workers)
    assert len(tree) >= 5, procs.describe(tree)
    os.kill(pid, signal.SIGKILL)
    assert not procs.wait_gone({p for p in tree if p[0] == pid}, 10)

    status = pdserve(head.state_dir, "status")
    print(status.stdout)
    assert status.returncode == 3, status.stdout + status.stderr
    assert f"head (pid {pid}) is dead" in status.stdout and "valkey-server" in status.stdout, status.stdout
    as_json = json.loads(pdserve(head.state_dir, "status", "--json").stdout)
    assert as_json["head"] == "dead" and as_json["leftovers"], as_json
    assert {p["pid"] for p in as_json["leftovers"]} <= {p for p, _ in tree}  # nothing that is not the head's

    refused = pdserve(head.state_dir, "up", "--model", str(head.model_dir), *head.settings)
    assert refused.returncode != 0 and "pdserve down" in refused.stderr, refused.stdout + refused.stderr

    down = pdserve(head.state_dir, "down", timeout_s=120)
    print(down.stdout)
    assert down.returncode == 0 and "pdserve is down" in down.stdout, down.stdout + down.stderr
    assert "is not running" in down.stdout and "valkey-server" in down.stdout, down.stdout
    left = procs.survivors(tree)  # `down` returned: every process of the head has ended
    assert not left, f"processes of the dead head still running: {procs.describe(left)}"
    assert not (head.state_dir / "state.json").exists() and not (head.state_dir / "head.json").exists()
    assert pdserve(head.state_dir, "status").returncode == 1

    state = head.up()  # the same data dir: the stale lock is taken over, the AOF loaded
    assert state["pid"] != pid
    watched = pdserve(head.state_dir, "batch", "status", batch_id, "--watch", timeout_s=240, PDSERVE_API_KEY=KEY)
    assert watched.returncode == 0 and f"{n}/{n} (0 failed) completed" in watched.stdout, \
        watched.stdout + watched.stderr
    got = pdserve(head.state_dir, "batch", "results", batch_id, PDSERVE_API_KEY=KEY).stdout.splitlines()
    assert sorted(json.loads(x)["custom_id"] for x in got) == sorted(f"crash-{i}" for i in range(n))  # each once

    tree = procs.descendants(state["pid"])  # the head, its Ray (GCS, raylet, workers), Redis
    assert len(tree) >= 5, procs.describe(tree)
    down = pdserve(head.state_dir, "down", timeout_s=150)
    assert down.returncode == 0 and "pdserve is down" in down.stdout, down.stdout + down.stderr
    assert "killed" not in down.stderr  # stopped by itself, within the timeout
    assert not (head.state_dir / "state.json").exists() and not (head.state_dir / "redis-password").exists()
    left = procs.wait_gone(tree, 20.0)
    assert not left, f"processes of the head still running: {procs.describe(left)}"
    second = pdserve(head.state_dir, "down")
    assert second.returncode == 0 and "not up" in second.stdout
    assert pdserve(head.state_dir, "status").returncode != 0

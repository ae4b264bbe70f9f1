"""The operator's commands as an operator runs them: ``pdserve up / status / requests tail /
down`` and ``pdserve config`` as subprocesses, with the state directory in a temporary folder.

``up`` starts a head process (its own Ray on 127.0.0.1, embedded Redis, one prefill and one
decode worker, the router) and returns once ``/health`` answers; the environment carries a
``RAY_ADDRESS`` that leads nowhere, so a head that tried to join another Ray instead of starting
its own would never come up. ``down`` must leave no process of that head running.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from scripts import procs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

UP_TIMEOUT_S = 240
PROMPT = "Every request has two phases, and they are limited by completely different things. " * 2
GEN = 8
SETTINGS = {
    "router.http_port": 0, "router.grpc_port": 0, "ray.include_dashboard": "false", "ray.num_cpus": 4,
    "planner.enabled": "false", "router.disaggregation.local_prefill_max_tokens": 0,
    **{f"{role}.engine.{key}": value for role in ("prefill", "decode")
       for key, value in (("kv_cache_memory_gb", 0.03), ("num_threads", 1))},
}


def _pdserve_argv() -> list[str]:
    script = Path(sys.executable).parent / "pdserve"  # the installed console script
    return [str(script)] if script.exists() else [sys.executable, "-m", "pdserve.cli"]


def pdserve(state_dir: Path, *args: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess:
    env = dict(os.environ, PDSERVE_STATE_DIR=str(state_dir), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
               RAY_ADDRESS="127.0.0.1:9")  # nothing listens there: joining it would fail
    return subprocess.run([*_pdserve_argv(), *args], env=env, capture_output=True, text=True, timeout=timeout_s)


def overrides(settings: dict) -> list[str]:
    return [arg for key, value in settings.items() for arg in ("--set", f"{key}={value}")]


def http_json(url: str, body: dict | None = None, timeout_s: float = 60.0) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.loads(resp.read())


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    """The CLI's state directory; a head still up after the test is stopped (and the test fails)."""
    yield tmp_path
    st = tmp_path / "state.json"
    if st.exists():
        pid = json.loads(st.read_text())["pid"]
        tree = procs.descendants(pid)
        pdserve(tmp_path, "down", "--timeout", "60", timeout_s=90)
        for p, _ in procs.wait_gone(tree, 10):
            os.kill(p, 9)
        pytest.fail("the test left pdserve up")


def test_up_status_request_tail_down(state_dir: Path, tiny_model: Path) -> None:
    t0 = time.monotonic()
    up = pdserve(state_dir, "up", "--model", str(tiny_model), *overrides(SETTINGS), "--timeout", str(UP_TIMEOUT_S),
                 timeout_s=UP_TIMEOUT_S + 30)
    log = (state_dir / "head.log").read_text(errors="replace") if (state_dir / "head.log").exists() else ""
    assert up.returncode == 0, f"{up.stdout}\n{up.stderr}\n--- head.log ---\n{log[-4000:]}"
    state = json.loads((state_dir / "state.json").read_text())
    head = state["pid"]
    assert "pdserve is up" in up.stdout and state["http"] in up.stdout
    assert state["http"].startswith("http://127.0.0.1:") and state["grpc"].startswith("127.0.0.1:")
    assert state["ray_address"].startswith("127.0.0.1:") and state["ray_address"] != "127.0.0.1:9"
    print(f"up in {time.monotonic() - t0:.1f} s")

    # A second `up` refuses while this one runs.
    again = pdserve(state_dir, "up", "--model", str(tiny_model), *overrides(SETTINGS))
    assert again.returncode != 0 and f"already up (pid {head})" in again.stdout

    status = pdserve(state_dir, "status")
    assert status.returncode == 0, status.stderr
    lines = status.stdout.splitlines()
    for role in ("prefill", "decode"):
        assert any(line.split()[:4] == ["pool", role, "replicas", "1"] for line in lines), status.stdout
        workers = [line.split() for line in lines if line.startswith(f"{role}-")]
        assert len(workers) == 1 and workers[0][1:3] == [role, "up"], status.stdout
    as_json = json.loads(pdserve(state_dir, "status", "--json").stdout)
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
        out = pdserve(state_dir, "requests", "tail", "-n", "5", "--json")
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
    text = pdserve(state_dir, "requests", "tail", "-n", "5").stdout
    assert any(line.startswith(request_id) and f"out {GEN:5d}" in line for line in text.splitlines()), text

    # A client that leaves mid-stream leaves a trace: its record, outcome "cancelled".
    streamed = dict(body, stream=True, max_tokens=200)
    req = urllib.request.Request(state["http"] + "/v1/completions", json.dumps(streamed).encode(),
                                 {"Content-Type": "application/json", "X-Request-Id": "leaves-early"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.readline().startswith(b"data: ")  # one event read, then the connection closes
    deadline = time.monotonic() + 20
    left = None
    while left is None and time.monotonic() < deadline:
        out = pdserve(state_dir, "requests", "tail", "-n", "5", "--json").stdout
        left = next((json.loads(line) for line in out.splitlines() if '"leaves-early"' in line), None)
        time.sleep(0.3)
    assert left is not None, "the cancelled request is not in the request log"
    assert left["outcome"] == "cancelled" and left["finish_reason"] == "abort" and left["api"] == "http"
    assert 0 < left["output_tokens"] < 200 and left["decode_worker"].startswith("decode-")

    # The Batch API through the cluster (its state in the cluster's Redis), as an operator runs it.
    src = state_dir / "batch.jsonl"
    src.write_text("".join(json.dumps({"custom_id": f"op-{i}", "method": "POST", "url": "/v1/completions",
                                       "body": {"model": state["model"], "prompt": PROMPT, "max_tokens": 3,
                                                "temperature": 0}}) + "\n" for i in range(3)))
    submitted = pdserve(state_dir, "batch", "submit", str(src))
    assert submitted.returncode == 0, submitted.stderr
    watched = pdserve(state_dir, "batch", "status", submitted.stdout.strip(), "--watch", timeout_s=120)
    assert watched.returncode == 0 and "3/3 (0 failed) completed" in watched.stdout, watched.stdout + watched.stderr
    got = pdserve(state_dir, "batch", "results", submitted.stdout.strip()).stdout.splitlines()
    assert sorted(json.loads(x)["custom_id"] for x in got) == ["op-0", "op-1", "op-2"]

    tree = procs.descendants(head)  # the head, its Ray (GCS, raylet, workers), Redis
    assert len(tree) >= 5, procs.describe(tree)
    down = pdserve(state_dir, "down", timeout_s=150)
    assert down.returncode == 0 and "pdserve is down" in down.stdout, down.stdout + down.stderr
    assert "killed" not in down.stderr  # stopped by itself, within the timeout
    assert not (state_dir / "state.json").exists()
    left = procs.wait_gone(tree, 20.0)
    assert not left, f"processes of the head still running: {procs.describe(left)}"

    second = pdserve(state_dir, "down")
    assert second.returncode == 0 and "not up" in second.stdout
    assert pdserve(state_dir, "status").returncode != 0


def test_up_with_a_misspelt_key_names_the_field(state_dir: Path, tiny_model: Path) -> None:
    config = state_dir / "cluster.yaml"
    config.write_text(f"model:\n  path: {tiny_model}\ndecode:\n  engine:\n    max_num_seqz: 4\n")
    out = pdserve(state_dir, "up", "-c", str(config))
    assert out.returncode != 0
    assert "decode.engine.max_num_seqz" in out.stderr and "max_num_seqs" in out.stderr, out.stderr
    assert not (state_dir / "state.json").exists() and not (state_dir / "head.log").exists()


def test_config_schema_prints_the_json_schema(state_dir: Path) -> None:
    out = pdserve(state_dir, "config", "schema")
    assert out.returncode == 0, out.stderr
    schema = json.loads(out.stdout)
    assert {"model", "prefill", "decode", "router", "redis", "ray", "planner"} <= set(schema["properties"])
    assert "max_num_seqs" in schema["$defs"]["EngineSettings"]["properties"]


@pytest.mark.timeout(900)
def test_a_head_killed_with_sigkill_leaves_nothing_after_down_and_its_data_dir_serves_again(
        state_dir: Path, tiny_model: Path) -> None:
    """SIGKILL of the head mid-batch -> `status` says it is dead and names what it left (Valkey,
    Ray's processes), exit code 3 -> `up` refuses to start beside them -> `down` ends them all
    before it returns -> `up` on the same redis.data_dir loads its AOF and finishes the batch,
    every item answered once."""
    import signal

    data_dir = state_dir / "redis-data"
    # two sequences at a time: the batch runs one item at a time, so the kill comes mid-batch
    settings = overrides({**SETTINGS, "redis.data_dir": str(data_dir), "decode.engine.max_num_seqs": 2})

    def up() -> dict:
        out = pdserve(state_dir, "up", "--model", str(tiny_model), *settings, "--timeout", str(UP_TIMEOUT_S),
                      timeout_s=UP_TIMEOUT_S + 30)
        log = (state_dir / "head.log").read_text(errors="replace") if (state_dir / "head.log").exists() else ""
        assert out.returncode == 0, f"{out.stdout}\n{out.stderr}\n--- head.log ---\n{log[-4000:]}"
        return json.loads((state_dir / "state.json").read_text())

    state = up()
    head = state["pid"]
    n = 48
    src = state_dir / "batch.jsonl"
    src.write_text("".join(json.dumps({"custom_id": f"crash-{i}", "method": "POST", "url": "/v1/completions",
                                       "body": {"model": state["model"], "prompt": f"{i} {PROMPT}", "max_tokens": 64,
                                                "temperature": 0, "ignore_eos": True}}) + "\n" for i in range(n)))
    submitted = pdserve(state_dir, "batch", "submit", str(src))
    assert submitted.returncode == 0, submitted.stderr
    batch_id = submitted.stdout.strip()
    deadline = time.monotonic() + 60  # kill it mid-batch: some items answered, not all
    while time.monotonic() < deadline:
        counts = http_json(f"{state['http']}/v1/batches/{batch_id}")["request_counts"]
        if counts["completed"] >= 1:
            break
        time.sleep(0.05)
    print(f"killed with {counts['completed']} of {n} items answered")
    assert 1 <= counts["completed"] < n, counts

    tree = procs.descendants(head) | procs.in_session(head)  # the head, Valkey, Ray (GCS, raylet, agents, workers)
    assert len(tree) >= 5, procs.describe(tree)
    os.kill(head, signal.SIGKILL)
    assert not procs.wait_gone({p for p in tree if p[0] == head}, 10)

    status = pdserve(state_dir, "status")
    print(status.stdout)
    assert status.returncode == 3, status.stdout + status.stderr
    assert f"head (pid {head}) is dead" in status.stdout and "valkey-server" in status.stdout, status.stdout
    as_json = json.loads(pdserve(state_dir, "status", "--json").stdout)
    assert as_json["head"] == "dead" and as_json["leftovers"], as_json
    assert {p["pid"] for p in as_json["leftovers"]} <= {pid for pid, _ in tree}  # nothing that is not the head's

    refused = pdserve(state_dir, "up", "--model", str(tiny_model), *settings)
    assert refused.returncode != 0 and "pdserve down" in refused.stderr, refused.stdout + refused.stderr

    down = pdserve(state_dir, "down", timeout_s=120)
    print(down.stdout)
    assert down.returncode == 0 and "pdserve is down" in down.stdout, down.stdout + down.stderr
    assert "is not running" in down.stdout and "valkey-server" in down.stdout, down.stdout
    left = procs.survivors(tree)  # `down` returned: every process of the head has ended
    assert not left, f"processes of the dead head still running: {procs.describe(left)}"
    assert not (state_dir / "state.json").exists() and not (state_dir / "head.json").exists()
    assert pdserve(state_dir, "status").returncode == 1

    state = up()  # the same data dir: the stale lock is taken over, the AOF loaded
    assert state["pid"] != head
    watched = pdserve(state_dir, "batch", "status", batch_id, "--watch", timeout_s=240)
    assert watched.returncode == 0 and f"{n}/{n} (0 failed) completed" in watched.stdout, \
        watched.stdout + watched.stderr
    got = [json.loads(x)["custom_id"] for x in pdserve(state_dir, "batch", "results", batch_id).stdout.splitlines()]
    assert sorted(got) == sorted(f"crash-{i}" for i in range(n))  # each item answered once

    tree = procs.descendants(state["pid"])
    down = pdserve(state_dir, "down", timeout_s=150)
    assert down.returncode == 0 and "pdserve is down" in down.stdout, down.stdout + down.stderr
    assert not procs.wait_gone(tree, 20.0)

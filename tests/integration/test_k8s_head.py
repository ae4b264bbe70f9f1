"""The Kubernetes head, run the way the manifests run it, against a password-protected Redis.

What ``k8s/`` gives the head container (checked below, so this test follows the manifests):
the command ``pdserve up -c /etc/pdserve/cluster.yaml --address auto --foreground``, a
``cluster.yaml`` whose ``redis`` section is an external ``redis://…/1`` URL with
``password: null``, and the password in ``PDSERVE_REDIS_PASSWORD`` from a Secret; the Redis
StatefulSet runs ``redis-server --requirepass``.

Life cycle:

1. A real Redis-protocol server with ``requirepass``, started by this test on 127.0.0.1.
2. ``pdserve up -c cluster.yaml --foreground`` as a subprocess, the manifests' ``redis``
   section (host and port pointed at that server, DB kept) and ``PDSERVE_REDIS_PASSWORD`` in
   its environment. ``--address auto`` is left out: there is no KubeRay head here, so the head
   starts its own Ray on 127.0.0.1 (which is ``up``'s path without ``--address``).
3. It becomes healthy (it used to exit in 14 s with ``AuthenticationError``), serves a request,
   publishes its status into the configured DB, and ``pdserve status`` works from a shell that
   does not have the password in its environment (it reads the head's 0600 password file).
4. The password is in no argv, not in ``state.json``, not in the head's log.
5. SIGTERM stops the head and every process it started.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import pytest
import yaml

from pdserve.cluster.state.redis_server import EmbeddedRedis, connect
from scripts import procs

pytestmark = pytest.mark.timeout(420)

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "k8s"
UP_TIMEOUT_S = 240
GEN = 8


def manifest_redis_section() -> dict:
    """The head's ``redis`` config as every overlay ships it (they must agree)."""
    sections = [yaml.safe_load(p.read_text())["redis"]
                for p in [K8S / "base" / "cluster.yaml", *sorted(K8S.glob("overlays/*/cluster.yaml"))]]
    assert sections and all(s == sections[0] for s in sections), sections
    return sections[0]


def head_container() -> dict:
    docs = yaml.safe_load_all((K8S / "base" / "raycluster.yaml").read_text())
    cluster = next(d for d in docs if d and d.get("kind") == "RayCluster")
    pod = cluster["spec"]["headGroupSpec"]["template"]["spec"]
    containers = pod.get("initContainers", []) + pod["containers"]
    return next(c for c in containers if any("pdserve up" in a for a in c.get("args", [])))


def _pdserve_argv() -> list[str]:
    script = Path(sys.executable).parent / "pdserve"
    return [str(script)] if script.exists() else [sys.executable, "-m", "pdserve.cli"]


def _env(state_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_REDIS_PASSWORD"}
    return dict(env, PDSERVE_STATE_DIR=str(state_dir), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
                HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", RAY_ADDRESS="127.0.0.1:9", **extra)


def http_json(url: str, body: dict | None = None, timeout_s: float = 60.0) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.loads(resp.read())


def test_head_starts_against_a_password_protected_external_redis_as_k8s_configures_it(
        tiny_model: Path, tmp_path: Path) -> None:
    section = manifest_redis_section()
    assert section["password"] is None and section["url"].startswith("redis://"), section
    head = head_container()
    env_names = {e["name"] for e in head["env"]}
    assert "PDSERVE_REDIS_PASSWORD" in env_names
    assert "--foreground" in head["args"][0] and "-c /etc/pdserve/cluster.yaml" in head["args"][0]

    password = f"k8s-{uuid.uuid4().hex}"
    redis_server = EmbeddedRedis(password=password).start()  # redis-server --requirepass
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    url = urllib.parse.urlsplit(section["url"])._replace(netloc=f"127.0.0.1:{redis_server.port}").geturl()
    config = {
        "model": {"path": str(tiny_model)},
        "router": {"http_port": 0, "grpc_port": 0, "disaggregation": {"local_prefill_max_tokens": 0}},
        "planner": {"enabled": False},
        "ray": {"include_dashboard": False, "num_cpus": 4},
        **{role: {"engine": {"kv_cache_memory_gb": 0.03, "num_threads": 1}} for role in ("prefill", "decode")},
        "redis": {**section, "url": url},
    }
    config_path = tmp_path / "cluster.yaml"
    config_path.write_text(yaml.safe_dump(config))
    log_path = tmp_path / "head.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([*_pdserve_argv(), "up", "-c", str(config_path), "--foreground"],
                                env=_env(state_dir, PDSERVE_REDIS_PASSWORD=password),
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    tree: set = set()
    try:
        state = None
        deadline = time.monotonic() + UP_TIMEOUT_S
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"the head exited ({proc.returncode}):\n{log_path.read_text()[-4000:]}"
            st = state_dir / "state.json"
            if st.exists():
                state = json.loads(st.read_text())
                try:
                    if http_json(state["http"] + "/health", timeout_s=2) is not None:
                        break
                except OSError:
                    pass
            time.sleep(0.5)
        else:
            pytest.fail(f"head not healthy in {UP_TIMEOUT_S} s:\n{log_path.read_text()[-4000:]}")

        body = {"model": state["model"], "prompt": "The head talks to Redis with a password:",
                "max_tokens": GEN, "temperature": 0, "ignore_eos": True}
        done = http_json(state["http"] + "/v1/completions", body)
        assert done["usage"]["completion_tokens"] == GEN

        # The status lands in the configured DB (1), written with the password from the environment.
        db = connect(url, password=password)
        try:
            deadline = time.monotonic() + 15
            while db.get("pdserve:status") is None and time.monotonic() < deadline:
                time.sleep(0.3)
            assert db.get("pdserve:status") is not None
        finally:
            db.close()

        status = subprocess.run([*_pdserve_argv(), "status", "--json"], env=_env(state_dir),
                                capture_output=True, text=True, timeout=60)
        assert status.returncode == 0, status.stdout + status.stderr
        published = json.loads(status.stdout)
        assert {w["role"] for w in published["workers"]} == {"prefill", "decode"}
        assert published["redis"]["up"] is True

        # The secret stays secret: a 0600 file for the CLI, nowhere else.
        secret_file = state_dir / "redis-password"
        assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
        assert secret_file.read_text() == password
        assert password not in (state_dir / "state.json").read_text()
        tree = procs.descendants(proc.pid)
        for pid, _ in tree | {(proc.pid, None)}:
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            assert password not in cmdline, f"password in the argv of pid {pid}"
        assert password not in log_path.read_text(errors="replace")
    finally:
        tree = tree or procs.descendants(proc.pid)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        left = procs.wait_gone(tree, 20.0)
        for pid, _ in left:
            os.kill(pid, signal.SIGKILL)
        redis_server.stop()
    assert proc.returncode == 0, log_path.read_text()[-4000:]
    assert not left, f"processes of the head still running: {procs.describe(left)}"
    assert not (state_dir / "state.json").exists() and not (state_dir / "redis-password").exists()

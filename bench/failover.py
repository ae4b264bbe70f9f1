"""``pdserve bench failover``: how long a cluster with an elected control plane is without its
control plane when the leader dies, and what a router's death costs its clients.

    pdserve bench failover --json failover.json [--lease-s 6] [--clients 8] [--max-tokens 128]

This process plays the infrastructure only: a local Ray on 127.0.0.1 and an embedded Redis (as
a Ray head pod and a Redis service would on Kubernetes). The routers are ``pdserve router``
processes on a config with ``control_plane.election`` on, the planner deciding every second, and
the tiny test model (one prefill and one decode worker, kept at one each):

1. Router A starts first, takes the lease and starts the workers; routers B and C join.
2. **Leader failover.** A is killed (SIGKILL). ``leader_failover_s``: seconds from the kill to
   the first scaling decision of the next leader (the status document the leader writes to
   Redis every second carries each decision's time); ``takeover_s``: to that leader's first
   status. ``workers_restarted``: worker ids that changed (aim: none).
3. **Router failover.** ``--clients`` clients stream greedy completions through C; once each
   has tokens, C is killed. A client whose stream broke resumes it on B: the same request with
   its ``X-Request-Id`` and ``Last-Event-ID`` (the tokens it got), and receives the rest.
   ``router_failover_s``: from the kill to the last resumed stream's end; ``lost_requests``:
   requests with no complete answer after the resume (aim 0); ``retried_mismatch``: streams
   whose tokens before and after the resume differ from a reference run of the same greedy
   request (aim 0).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from pdserve.bench.common import run_and_save

logger = logging.getLogger(__name__)

PROMPT = "A cluster keeps serving when the process that manages it dies, because"


@dataclass(frozen=True, slots=True)
class Settings:
    lease_s: float = 6.0
    clients: int = 8
    max_tokens: int = 128
    start_timeout_s: float = 300.0


def settings_from_args(args: argparse.Namespace) -> Settings:
    st = Settings(args.lease_s, args.clients, args.max_tokens)
    if not 1.0 <= st.lease_s <= 120.0:
        raise ValueError(f"--lease-s must be in [1, 120], got {st.lease_s}")
    if not 1 <= st.clients <= 64 or not 8 <= st.max_tokens <= 2048:
        raise ValueError("--clients must be in [1, 64] and --max-tokens in [8, 2048]")
    return st


class _Router:
    """One ``pdserve router`` process and the line it prints once it serves."""

    def __init__(self, name: str, config: Path, env: dict, log_dir: Path) -> None:
        exe = Path(sys.executable).with_name("pdserve")
        cmd = [str(exe) if exe.exists() else shutil.which("pdserve") or "pdserve", "router", "-c", str(config)]
        self.name = name
        self.log = log_dir / f"router-{name}.log"
        with open(self.log, "wb") as err:
            self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
        self.http = ""
        self.router_id = ""

    def wait_up(self, timeout_s: float) -> None:
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout_s)
        if not line or "is up" not in line[0]:
            self.kill()
            raise RuntimeError(f"router {self.name} did not start; see {self.log}")
        self.router_id = line[0].split()[2]
        self.http = line[0].split("HTTP ")[1].split()[0]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.kill()


def _status(client) -> dict:
    from pdserve.cluster.head.status_report import STATUS_KEY

    raw = client.get(STATUS_KEY)
    return json.loads(raw) if raw else {}


def _stream(base_url: str, model: str, max_tokens: int, request_id: str, got: list[int],
            resume_from: int | None = None) -> list[int]:
    """Stream one greedy completion (SSE), appending token ids to ``got`` as they come; returns
    them all. Raises when the stream breaks before its end. ``resume_from``: resume the stream
    ``request_id`` after that many tokens (``Last-Event-ID``)."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
    if resume_from is not None:
        headers["Last-Event-ID"] = str(resume_from)
    req = urllib.request.Request(base_url + "/v1/completions", json.dumps(body).encode(), headers)
    done = False
    with urllib.request.urlopen(req, timeout=120) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line == "data: [DONE]":
                done = True
                break
            if line.startswith("data: "):
                got.extend((json.loads(line[6:]).get("pdserve") or {}).get("token_ids", []))
    if not done:
        raise ConnectionError("stream ended without [DONE]")
    return got


def run_bench(st: Settings) -> dict:
    from pdserve.bench.hw import cpu_model
    from pdserve.cluster.runtime.ray_env import LOOPBACK_IP, use_loopback
    from pdserve.cluster.state.redis_server import EmbeddedRedis, connect
    from pdserve.engine.testmodel import ensure_model

    use_loopback()
    import ray
    import tempfile

    started = time.monotonic()
    model = ensure_model("tiny")
    ray.init(address="local", _node_ip_address=LOOPBACK_IP, include_dashboard=False, num_cpus=8, log_to_driver=False,
             namespace="pdserve-bench-failover")
    password = f"pw-{os.urandom(8).hex()}"
    routers: list[_Router] = []
    try:
        with EmbeddedRedis(password=password) as redis_server, tempfile.TemporaryDirectory() as tmp:
            client = connect(redis_server.url)
            bare_url = redis_server.address_url
            config = Path(tmp) / "cluster.yaml"
            config.write_text(
                f"model: {{path: {model}, dtype: float32}}\n"
                f"prefill: {{min_replicas: 1, max_replicas: 1, engine: {{kv_cache_memory_gb: 0.05, num_threads: 1}}}}\n"
                f"decode: {{min_replicas: 1, max_replicas: 1, engine: {{kv_cache_memory_gb: 0.05, num_threads: 1}}}}\n"
                f"router: {{http_port: 0, grpc_port: 0, worker_dead_after_s: 10,"
                f" disaggregation: {{local_prefill_max_tokens: 0}}}}\n"
                f"redis: {{url: '{bare_url}'}}\n"
                f"ray: {{address: '{ray.get_runtime_context().gcs_address}', namespace: pdserve-bench-failover}}\n"
                f"planner: {{enabled: true, interval_s: 1}}\n"
                f"control_plane: {{election: true, lease_s: {st.lease_s}}}\n")
            env = dict(os.environ, PDSERVE_REDIS_PASSWORD=password, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
            log_dir = Path(tmp)
            a = _Router("a", config, env, log_dir)
            routers.append(a)
            a.wait_up(st.start_timeout_s)
            b, c = _Router("b", config, env, log_dir), _Router("c", config, env, log_dir)
            routers += [b, c]
            b.wait_up(st.start_timeout_s)
            c.wait_up(st.start_timeout_s)
            status = _status(client)
            model_name = (status.get("state") or {}).get("model") or Path(model).name
            workers_before = sorted(w["worker_id"] for w in status.get("workers", []))
            # warm both remaining routers' paths once; B's run is every client's greedy reference
            reference = _stream(b.http, model_name, st.max_tokens, "reference", [])
            _stream(c.http, model_name, 8, "warm-c", [])

            # -------- leader failover
            assert (status.get("control_plane") or {}).get("router_id") == a.router_id, status.get("control_plane")
            killed_wall = time.time()
            a.kill()
            takeover_s = leader_failover_s = None
            deadline = time.monotonic() + 6 * st.lease_s + 30
            new_leader = None
            while time.monotonic() < deadline and leader_failover_s is None:
                s = _status(client)
                cp = s.get("control_plane") or {}
                if cp.get("router_id") not in (None, a.router_id):
                    new_leader = cp["router_id"]
                    if takeover_s is None:
                        takeover_s = time.time() - killed_wall
                    ats = [d.get("at") for d in s.get("planner", []) if d.get("at")]
                    if ats and max(ats) > killed_wall:
                        leader_failover_s = max(ats) - killed_wall
                        workers_after = sorted(w["worker_id"] for w in s.get("workers", []))
                time.sleep(0.1)
            if leader_failover_s is None:
                raise RuntimeError("no scaling decision after the leader's death; see the routers' logs")
            restarted = sorted(set(workers_before) ^ set(workers_after))

            # -------- router failover: clients on C, C killed, retries on B
            got = [[] for _ in range(st.clients)]
            results: list[dict] = [{} for _ in range(st.clients)]
            kill_at: list[float] = []

            def client_run(i: int) -> None:
                rid = f"failover-{i}-{os.urandom(4).hex()}"
                try:
                    _stream(c.http, model_name, st.max_tokens, rid, got[i])
                    results[i] = {"ok": True, "retried": False}
                    return
                except Exception:
                    before = list(got[i])
                try:   # the same request id, resumed after the tokens it got (the rest, not all again)
                    rest = _stream(b.http, model_name, st.max_tokens, rid, [], resume_from=len(before))
                    results[i] = {"ok": len(before) + len(rest) == st.max_tokens, "retried": True,
                                  "end": time.monotonic(), "mismatch": before + rest != reference}
                except Exception as exc:
                    results[i] = {"ok": False, "retried": True, "end": time.monotonic(), "error": str(exc)}

            threads = [threading.Thread(target=client_run, args=(i,)) for i in range(st.clients)]
            for t in threads:
                t.start()
            wait_end = time.monotonic() + 60
            while time.monotonic() < wait_end and not all(len(g) >= 2 for g in got):
                time.sleep(0.01)
            kill_at.append(time.monotonic())
            c.kill()
            for t in threads:
                t.join(180)
            retried = [r for r in results if r.get("retried")]
            router_failover_s = (max(r["end"] for r in retried) - kill_at[0]) if retried else 0.0
            client.close()
    finally:
        for r in routers:
            r.stop()
        ray.shutdown()
    return {
        "benchmark": "failover",
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "command": "pdserve " + " ".join(sys.argv[1:]),
        "host": {"cpu": cpu_model(), "cpu_count": os.cpu_count(), "hostname": socket.gethostname()},
        "settings": asdict(st),
        "leader_failover_s": round(leader_failover_s, 3),
        "takeover_s": round(takeover_s, 3),
        "new_leader": new_leader,
        "workers_restarted": restarted,
        "router_failover_s": round(router_failover_s, 3),
        "requests": st.clients,
        "retried_requests": len(retried),
        "lost_requests": sum(1 for r in results if not r.get("ok")),
        "retried_mismatch": sum(1 for r in retried if r.get("mismatch")),
        "aims": {"leader_failover_s": "<= 10", "lost_requests": "0"},
        "wall_s": round(time.monotonic() - started, 1),
    }


def format_table(r: dict) -> str:
    return "\n".join([
        f"host: {r['host']['cpu']} ({r['host']['cpu_count']} CPUs)",
        f"leader failover: {r['leader_failover_s']:.2f} s to the next scaling decision "
        f"(takeover seen in {r['takeover_s']:.2f} s; lease {r['settings']['lease_s']} s; "
        f"workers restarted: {len(r['workers_restarted'])})",
        f"router failover: {r['router_failover_s']:.2f} s until the last resumed stream ended; "
        f"{r['retried_requests']}/{r['requests']} resumed, lost {r['lost_requests']}, "
        f"mismatched {r['retried_mismatch']}",
    ])


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", type=Path, required=True, help="write the result here")
    p.add_argument("--lease-s", type=float, default=6.0, help="control_plane.lease_s (default 6)")
    p.add_argument("--clients", type=int, default=8, help="streams on the router that is killed (default 8)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per stream (default 128)")


def run(args: argparse.Namespace) -> int:
    return 0 if run_and_save("failover", args, settings_from_args, run_bench, format_table) is not None else 2

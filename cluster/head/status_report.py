"""What ``pdserve status`` shows: the status the head publishes to Redis every second, read back
with the state directory's URL and password, or, for a head that is dead or still starting, what
its state files and the process table say; and the text it prints.

Redis is imported only when a head is up to ask: ``status`` of nothing loads no client library.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.cluster.head.head_processes import HeadIdentity, Proc, leftovers
from pdserve.cluster.head.state_files import read_head, read_state, redis_password_file
from pdserve.cluster.status import ClusterStatus

if TYPE_CHECKING:
    import redis

STATUS_KEY = "pdserve:status"
RAY_TOKEN_FILE = Path.home() / ".ray" / "auth_token"


def state_redis_client(url: str | None = None) -> redis.Redis | None:
    """A Redis client for CLI commands, from the state file (URL, CA) and the password file."""
    from pdserve.cluster.state.redis_server import connect   # redis: only with a head to ask

    st = read_state() or {}
    url = url or st.get("redis_url")
    if not url:
        return None
    try:
        password = redis_password_file().read_text(encoding="utf-8") or None
    except FileNotFoundError:
        password = None
    return connect(url, retries=2, password=password, ssl_ca_file=st.get("redis_tls_ca_file"))


def fetch_status() -> dict | None:
    """The cluster's published status with ``state``; for a head that is dead or still starting,
    ``head`` ("dead" with ``leftovers``, the processes it left running, or "starting") instead."""
    st = read_head()
    if not st:
        return None
    head = HeadIdentity.from_state(st)
    if not head.alive():
        return {"state": st, "head": "dead", "leftovers": [_proc_record(p) for p in leftovers(head)]}
    if "http" not in st:
        return {"state": st, "head": "starting"}
    import redis

    try:
        raw = state_redis_client().get(STATUS_KEY)
    except (redis.ConnectionError, redis.TimeoutError) as exc:  # the head serves on without Redis
        return {"state": st, "redis_unreachable": str(exc)}
    status = json.loads(raw) if raw else {}
    status["state"] = st
    return status


def _proc_record(proc: Proc) -> dict:
    return {"pid": proc.pid, "name": proc.name}


def dashboard_hint(url: str) -> str:
    """How to open the Ray dashboard with token authentication on (Ray 2.60's default); the token
    itself is never printed (terminals and logs are not the place for it)."""
    return (f"Ray dashboard: {url} (token authentication: paste the token that `ray get-auth-token` "
            f"prints (it is in {RAY_TOKEN_FILE}) when the page asks; for its HTTP API send "
            f"\"Authorization: Bearer $(cat {RAY_TOKEN_FILE})\")")


def format_dead_head(status: dict) -> str:
    """``status`` of a head that died: what it left, and what to do."""
    pid = status.get("state", {}).get("pid")
    left = status.get("leftovers") or []
    if not left:
        return f"pdserve's head (pid {pid}) is dead and left nothing running; `pdserve down` removes its state"
    procs = ", ".join(f"{p['pid']} ({p['name']})" for p in left)
    return (f"pdserve's head (pid {pid}) is dead; {len(left)} process(es) it started still run: {procs}\n"
            f"run `pdserve down` to stop them")


def _cores(cores: list[int] | None) -> str:
    """"0-3" / "0,2" for pinned cores, "unpinned" for none."""
    if cores is None:
        return "?"
    if not cores:
        return "unpinned"
    if cores == list(range(cores[0], cores[-1] + 1)) and len(cores) > 2:
        return f"{cores[0]}-{cores[-1]}"
    return ",".join(map(str, cores))


def format_status(status: dict) -> str:
    st = status.get("state", {})
    cs = ClusterStatus.from_dict(status)
    lines = [f"pdserve  model {st.get('model')}  HTTP {st.get('http')}  gRPC {st.get('grpc')}",
             f"uptime {cs.uptime_s:.0f} s  retries {cs.retries}  migrations {cs.migrations}"]
    if st.get("dashboard"):
        lines.append(dashboard_hint(st["dashboard"]))
    if status.get("redis_unreachable"):
        lines.append(f"Redis unreachable ({status['redis_unreachable']}): no live status; requests are "
                     f"still served (see docs/operations.md, 'During a Redis outage')")
    elif cs.redis:
        r = cs.redis
        dropped = ", ".join(f"{k} {v}" for k, v in sorted(r.dropped.items())) or "none"
        lines.append(f"redis {'up' if r.up else 'DOWN'}  outages {r.outages}  "
                     f"writes dropped: {dropped}")
    if cs.control_plane:
        cp = cs.control_plane
        lines.append(f"control plane: elected (epoch {cp.epoch}, led by {cp.leader_id or '?'})")
        for r in cp.routers:
            lines.append(f"router {r.router_id:22s} {'leader' if r.leader else 'follower':8s} "
                         f"HTTP {r.http}  gRPC {r.grpc}  pid {r.pid} on {r.host}")
    for role, p in cs.pools.items():
        lines.append(f"pool {role:8s} replicas {p.replicas}  pending {p.pending}  draining {len(p.draining)}"
                     + (f"  failed starts {p.start_failures}" if p.start_failures else "")
                     + (f"  peers skipped {p.peers_skipped}" if p.peers_skipped else ""))
    lines.append(f"{'worker':24s} {'role':8s} {'state':9s} {'kv':>6s} {'run':>4s} {'wait':>4s} {'tok/s':>7s} "
                 f"{'hit':>6s} {'thr':>3s} {'cores':9s} {'dtype':8s} node")
    for w in cs.workers:
        state = "dead" if not w.alive else "silent" if not w.responsive else "draining" if w.draining else "up"
        threads = "?" if w.num_threads is None else str(w.num_threads)
        lines.append(f"{w.worker_id:24s} {w.role:8s} {state:9s} {w.kv_usage * 100:5.1f}% {w.running:4d} "
                     f"{w.waiting:4d} {w.tokens_per_s:7.1f} {w.prefix_hit_rate * 100:5.1f}% "
                     f"{threads:>3s} {_cores(w.cores):9s} {w.dtype or '?':8s} {w.node_ip} {w.node_id[:8]}")
        if w.kernels:
            lines.append(f"{'':24s} matmuls {' '.join(f'{op}={b}' for op, b in w.kernels.items())}  "
                         f"attention {w.attention_backend or '?'}")
    for d in cs.planner:
        lines.append(f"planner {d.pool}: {d.action} -> {d.target} ({d.reason})")
    for b in cs.batches:
        lines.append(f"batch {b.id} {b.status}: {b.completed + b.failed}/{b.total} done "
                     f"({b.failed} failed), {b.running} running  {b.endpoint}")
    return "\n".join(lines)

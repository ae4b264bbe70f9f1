"""``pdserve up`` / ``status`` / ``down``: one head process per machine that owns the cluster.

``up`` starts the head (this module's ``run_head``) as a background process and returns once
every pool has its initial replicas serving and ``/health`` answers OK. The head starts (or
joins) Ray with node IP 127.0.0.1, starts the embedded Redis when no URL is configured, and
runs the router service. It writes ``state.json`` (endpoints, pid, Redis URL) in the state
directory and publishes its status to Redis every second, which is what ``status`` reads.
``down`` asks the head to stop (SIGTERM): it stops taking requests, lets in-flight ones finish
(bounded), stops the workers, Redis and Ray it started, and removes the state file.

A head that died without its clean-up (SIGKILL, OOM kill) leaves processes running: ``head.json``
(written before the head starts anything) and ``state.json`` record who the head was
(``cluster/head/head_processes.py``), so ``down`` ends what it left (SIGTERM,
then SIGKILL, bounded) before it removes the state, ``status`` says the head is dead and names
what still runs (exit code 3), and ``up`` refuses to start beside those leftovers.

Secrets stay out of sight: ``up`` hands its ``--set`` overrides (``router.api_keys=...``) to the
head in a 0600 file that the head deletes once read, never in the head's argv; the state
directory is 0700 and every file in it 0600; ``state.json`` has no password (a password in
``redis.url`` is moved into the 0600 ``redis-password`` file).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import signal
import stat
import subprocess
import tempfile
import sys
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.cluster.config import ClusterConfig
from pdserve.cluster.config_io import load_cli_config
from pdserve.cluster.head.router_actor import start_router_actors, stop_router_actors
from pdserve.cluster.head.head_processes import (HEAD_ID_ENV, HeadIdentity, Proc, describe, leftovers, new_head_id,
                                            stop_leftovers)
from pdserve.cluster.pids import boot_id, start_ticks
from pdserve.cluster.runtime.ray_env import LOOPBACK_IP, use_loopback, use_routable, use_token_auth_if_available
from pdserve.cluster.redact import split_password
from pdserve.cluster.state.redis_server import EmbeddedRedis, connect
from pdserve.cluster.state.redis_supervisor import RedisSupervisor
from pdserve.cluster.status import ClusterStatus
from pdserve.engine.gc_freeze import freeze_startup_heap

if TYPE_CHECKING:
    import redis

logger = logging.getLogger(__name__)

STATUS_KEY = "pdserve:status"


def state_dir() -> Path:
    return Path(os.environ.get("PDSERVE_STATE_DIR", Path.home() / ".pdserve"))


def state_file() -> Path:
    return state_dir() / "state.json"


def head_file() -> Path:
    """Who the head is (``HeadIdentity``), written before it starts anything: ``state.json``
    appears only once it serves, and a head that dies on the way leaves processes too."""
    return state_dir() / "head.json"


def ensure_state_dir() -> Path:
    """The state directory, created 0700 (and made 0700 if it is ours and open to others)."""
    path = state_dir()
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_mode & 0o077:
        if st.st_uid == os.getuid() and not st.st_mode & stat.S_ISVTX:  # never chmod a shared /tmp
            os.chmod(path, 0o700)
        else:
            logger.warning("state directory %s is readable by other users; its files are 0600", path)
    return path


def _write_private(path: Path, text: str) -> None:
    """Write ``path`` atomically as a 0600 file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(text)
    tmp.replace(path)


def _give_overrides(overrides: list[str]) -> Path:
    """A 0600 file holding ``up``'s ``--set`` values for the head (see ``take_overrides``)."""
    fd, name = tempfile.mkstemp(prefix="head-overrides-", suffix=".json", dir=ensure_state_dir())
    with os.fdopen(fd, "w", encoding="utf-8") as fh:  # mkstemp creates it 0600
        json.dump(overrides, fh)
    return Path(name)


def take_overrides(path: str | os.PathLike[str]) -> list[str]:
    """The ``--set`` values ``up`` left for this head; the file is deleted once read."""
    file = Path(path)
    try:
        values = json.loads(file.read_text(encoding="utf-8"))
    finally:
        file.unlink(missing_ok=True)
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise ValueError(f"{file}: expected a JSON list of KEY=VALUE strings")
    return values


def read_state() -> dict | None:
    try:
        state = json.loads(state_file().read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return state if isinstance(state, dict) and isinstance(state.get("pid"), int) else None


def read_head() -> dict | None:
    """The last head's record: ``state.json`` once it served, else ``head.json`` (no endpoints:
    it was still starting, or died before it served)."""
    st = read_state()
    if st is not None:
        return st
    try:
        head = json.loads(head_file().read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return head if isinstance(head, dict) and isinstance(head.get("pid"), int) else None


# --------------------------------------------------------------------------- the head process
async def serve(config: ClusterConfig, ready: asyncio.Event | None = None,
                stop: asyncio.Event | None = None, write_state: bool = True, freeze_heap: bool = False) -> dict:
    """Run the head until ``stop`` is set (or SIGTERM/SIGINT); ``ready`` is set once serving.
    ``freeze_heap``: a head process that lives for this call alone keeps its start-up heap out of
    full garbage collections once serving (``engine/gc_freeze.py``); not for a test session."""
    if config.ray.address and config.ray.address not in ("local",) and not config.ray.address.startswith(
            ("127.", "localhost")):
        use_routable()  # joining a cluster of several hosts: keep Ray's own node IP choice
    else:
        use_loopback()
    identity = HeadIdentity.of_this_process()
    if write_state:  # who this head is, before it starts anything: `down` finds what it left by it
        ensure_state_dir()
        _write_private(head_file(), json.dumps(identity.as_state(), indent=2))
    import ray

    from pdserve.cluster.head.router_service import RouterService   # Ray, gRPC, the router: 2 s, not for `status`

    started_ray = False
    if not ray.is_initialized():
        kwargs: dict = {"namespace": config.ray.namespace, "log_to_driver": False}
        if config.ray.address:
            kwargs["address"] = config.ray.address
            if config.ray.address != "auto":
                use_token_auth_if_available()
        else:
            started_ray = True
            # "local": never join another Ray found via RAY_ADDRESS or /tmp/ray/ray_current_cluster.
            kwargs.update(address="local", _node_ip_address=config.ray.node_ip_address, num_cpus=config.ray.num_cpus,
                          include_dashboard=config.ray.include_dashboard, dashboard_host=LOOPBACK_IP,
                          dashboard_port=config.ray.dashboard_port)
        ray.init(**kwargs)
        if started_ray:
            _protect_ray_token()
    _log_into_ray_session()
    redis_server = supervisor = None
    redis_url = config.redis.url
    # The password travels in memory (and in a 0600 file for the CLI), never in a URL or argv.
    password = config.redis.password.get_secret_value() if config.redis.password else None
    if redis_url is not None:
        redis_url, in_url = split_password(redis_url)  # state.json shows the URL: keep it clean
        password = password or in_url
    if redis_url is None:
        password = password or secrets.token_urlsafe(24)  # the embedded server is never open
        redis_server = EmbeddedRedis(password=password, data_dir=config.redis.data_dir,
                                     appendonly=True).start()
        supervisor = RedisSupervisor(redis_server).start()  # restarted (with its AOF) if it dies
        redis_url = redis_server.address_url
    service = RouterService(config, redis_url=redis_url, namespace=config.ray.namespace,
                            redis_password=password)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread
            pass
    state: dict = {}
    router_actors: list = []
    try:
        endpoints = await service.start()
        if config.router.replicas > 1:
            started = await asyncio.to_thread(start_router_actors, config, redis_url, password,
                                              detached=not started_ray)
            router_actors = [actor for actor, _ in started]
            routers = [{"router_id": service.router_id, "http": endpoints.http_url, "grpc": endpoints.grpc_target}] + [
                {"router_id": ep.router_id, "http": ep.http_url, "grpc": ep.grpc_target} for _, ep in started]
        else:
            routers = []
        state = {**identity.as_state(), "http": endpoints.http_url, "grpc": endpoints.grpc_target,
                 "redis_url": redis_url, "ray_address": ray.get_runtime_context().gcs_address,
                 "dashboard": _dashboard_url(), "model": config.model.served_name, "started_at": time.time()}
        if routers:
            state["routers"] = routers
        if config.redis.tls_ca_file is not None:
            state["redis_tls_ca_file"] = str(config.redis.tls_ca_file)
        if write_state:
            ensure_state_dir()
            _write_redis_password(password)
            _write_private(state_file(), json.dumps(state, indent=2))
        serve.state = state  # type: ignore[attr-defined]
        if freeze_heap:  # the head streams every token: a full collection would pause them all
            freeze_startup_heap("head")
        if ready is not None:
            ready.set()
        await service.serve_until(stop, STATUS_KEY, "in-flight requests")
    finally:
        if router_actors:
            await asyncio.to_thread(stop_router_actors, router_actors)
        try:
            if service.redis_client is not None and (service.redis_guard is None or service.redis_guard.up):
                service.redis_client.delete(STATUS_KEY)
        except Exception as exc:  # Redis down at shutdown: the key expires on its own in 10 s
            logger.info("status key not deleted: %s", exc)
        # A head that started Ray takes the cluster down with it; one that joined a Ray cluster
        # whose control plane is elected leaves the workers to the other routers.
        await service.stop(stop_workers=started_ray or not service.elected)
        if supervisor is not None:
            supervisor.stop()
        if redis_server is not None:
            redis_server.stop()
        if started_ray:
            ray.shutdown()
        st = read_head()
        if write_state and st and st.get("pid") == os.getpid():
            _remove_state()
    return state


def redis_password_file() -> Path:
    """The head's Redis password for CLI commands (``status``, ``requests``): mode 0600."""
    return state_dir() / "redis-password"


def _write_redis_password(password: str | None) -> None:
    path = redis_password_file()
    if password is None:
        path.unlink(missing_ok=True)
        return
    tmp = path.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(password)
    tmp.replace(path)


def state_redis_client(url: str | None = None) -> redis.Redis | None:
    """A Redis client for CLI commands, from the state file (URL, CA) and the password file."""
    st = read_state() or {}
    url = url or st.get("redis_url")
    if not url:
        return None
    try:
        password = redis_password_file().read_text(encoding="utf-8") or None
    except FileNotFoundError:
        password = None
    return connect(url, retries=2, password=password, ssl_ca_file=st.get("redis_tls_ca_file"))


RAY_TOKEN_FILE = Path.home() / ".ray" / "auth_token"


def _log_into_ray_session() -> Path | None:
    """pdserve's INFO events of this head (router, planner, pool manager) also into a file of
    this Ray node's log directory, ``pdserve-head-<pid>.log``, where the Ray dashboard lists it
    (Logs, under the node) beside the workers' logs; owner-readable only, like head.log."""
    import ray

    try:
        logs = Path(ray._private.worker._global_node.get_logs_dir_path())
        path = logs / f"pdserve-head-{os.getpid()}.log"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    except (AttributeError, OSError) as exc:   # a driver without a local Ray node's directory
        logger.info("head log not written into the Ray session (%s)", exc)
        return None
    handler = logging.StreamHandler(os.fdopen(fd, "a", buffering=1))
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.setLevel(logging.INFO)
    pkg = logging.getLogger("pdserve")
    pkg.addHandler(handler)
    pkg.setLevel(logging.INFO)   # the planner's decisions and worker events, also on a --foreground head's stderr
    logger.info("this head's log is also %s (the Ray dashboard's Logs view)", path)
    return path


def _protect_ray_token() -> None:
    """Ray 2.60 writes the token of its (default) token authentication to ~/.ray/auth_token
    readable by every user of the host; the token opens the dashboard and the cluster's APIs."""
    with contextlib.suppress(OSError):
        if RAY_TOKEN_FILE.stat().st_mode & 0o077:
            RAY_TOKEN_FILE.chmod(0o600)
            logger.info("made %s readable by its owner only", RAY_TOKEN_FILE)


def dashboard_hint(url: str) -> str:
    """How to open the Ray dashboard with token authentication on (Ray 2.60's default); the token
    itself is never printed (terminals and logs are not the place for it)."""
    return (f"Ray dashboard: {url} (token authentication: paste the token that `ray get-auth-token` "
            f"prints (it is in {RAY_TOKEN_FILE}) when the page asks; for its HTTP API send "
            f"\"Authorization: Bearer $(cat {RAY_TOKEN_FILE})\")")


def _dashboard_url() -> str | None:
    try:
        import ray

        ctx = ray.get_runtime_context()
        url = getattr(ctx, "dashboard_url", None) or ray.worker.get_dashboard_url()
        return f"http://{url}" if url and not url.startswith("http") else url
    except Exception:
        return None


def run_head(config: ClusterConfig) -> int:
    """The head in the foreground (``pdserve up --foreground``, and the background child)."""
    os.environ.setdefault(HEAD_ID_ENV, new_head_id())  # what it starts inherits it (head_processes.py)
    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        runner.run(serve(config, freeze_heap=True))
    return 0


def event_loop_factory():
    """uvloop's event loop where it is installed (a dependency on Linux): the head streams every
    token of every request through its loop, and uvloop's transports cost less CPU per write
    than asyncio's, CPU the engine sharing this host's cores gets back. asyncio's otherwise."""
    try:
        import uvloop
    except ImportError:
        logger.info("event loop: asyncio (uvloop is not installed)")
        return None
    logger.info("event loop: uvloop %s", uvloop.__version__)
    return uvloop.new_event_loop


# ------------------------------------------------------------------------------ the commands
def up(config_path: str | None, model: str | None, overrides: list[str], foreground: bool,
       timeout_s: float = 600.0) -> int:
    st = read_head()
    if st:
        head = HeadIdentity.from_state(st)
        if head.alive():
            print(f"pdserve is already up (pid {head.pid}): HTTP {st['http']}, gRPC {st['grpc']}" if "http" in st
                  else f"pdserve is already up (pid {head.pid}), still starting")
            return 1
        left = leftovers(head)
        if left:
            print(f"pdserve: error: the last head (pid {head.pid}) died and left {len(left)} process(es) "
                  f"running: {describe(left)}; run `pdserve down` to stop them first", file=sys.stderr)
            return 1
        _remove_state()  # a dead head that left nothing running
    if foreground:
        return run_head(load_cli_config(config_path, model, overrides))
    args = [sys.executable, "-m", "pdserve.cli", "_head"]
    if config_path:
        args += ["-c", config_path]
    if model:
        args += ["--model", model]
    handoff = _give_overrides(overrides) if overrides else None
    if handoff is not None:  # never `--set` in argv: `ps` shows argv to every user, and values may be secrets
        args += ["--overrides-file", str(handoff)]
    log_path = ensure_state_dir() / "head.log"
    head_id = new_head_id()
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               **{HEAD_ID_ENV: head_id})
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "ab") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)
    print(f"starting pdserve (pid {proc.pid}, log {log_path}) ...", flush=True)
    identity = HeadIdentity(proc.pid, start_ticks(proc.pid), head_id, proc.pid, boot_id())  # it leads its session
    try:
        return _wait_up(proc, log_path, timeout_s, identity)
    finally:
        if handoff is not None:
            handoff.unlink(missing_ok=True)  # the head deleted it, unless it died first


def _wait_up(proc: subprocess.Popen, log_path: Path, timeout_s: float, identity: HeadIdentity | None = None) -> int:
    """Until the head answers /health (0), exits, or ``timeout_s`` passes (1). A head that exits
    during its start leaves nothing running: what it started is stopped, its state removed."""
    deadline = time.monotonic() + timeout_s
    last_note = 0.0
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            print(f"pdserve: error: the head exited with code {proc.returncode}; see {log_path}", file=sys.stderr)
            tail = log_path.read_text(errors="replace").splitlines()[-15:]
            print("\n".join(tail), file=sys.stderr)
            stop_leftovers(identity or HeadIdentity(proc.pid))
            st = read_head()
            if st and st.get("pid") == proc.pid:
                _remove_state()
            return 1
        st = read_state()
        if st and st.get("pid") == proc.pid and "http" in st and _healthy(st["http"]):
            print(f"pdserve is up: HTTP {st['http']}  gRPC {st['grpc']}  model {st['model']}")
            for r in st.get("routers", [])[1:]:
                print(f"  router {r['router_id']}: HTTP {r['http']}  gRPC {r['grpc']}")
            if st.get("dashboard"):
                print(dashboard_hint(st["dashboard"]))
            return 0
        if time.monotonic() - last_note > 10:
            last_note = time.monotonic()
            print("  waiting for the workers to load the model and report ready ...", flush=True)
        time.sleep(0.5)
    print(f"pdserve: error: not healthy after {timeout_s:.0f} s; see {log_path}", file=sys.stderr)
    return 1


def _healthy(http_url: str) -> bool:
    try:
        with urllib.request.urlopen(http_url + "/health", timeout=2) as resp:
            return resp.status == 200
    except Exception:
        return False


def down(timeout_s: float = 120.0) -> int:
    """Stop the head (SIGTERM, SIGKILL after ``timeout_s``), then whatever it started that still
    runs (a head killed with SIGKILL left its Valkey and Ray's agents): 0 once none runs, 1 if
    some would not stop (the state is kept, so ``down`` can be run again)."""
    st = read_head()
    if not st:
        print("pdserve is not up (no state file)")
        return 0
    head = HeadIdentity.from_state(st)
    if head.alive():
        os.kill(head.pid, signal.SIGTERM)
        print(f"stopping pdserve (pid {head.pid}): draining requests, stopping workers ...", flush=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and head.alive():
            time.sleep(0.3)
        if head.alive():
            _kill_head(head.pid)
            print("pdserve: the head did not stop in time and was killed", file=sys.stderr)
    else:
        print(f"pdserve's head (pid {head.pid}) is not running: it died without stopping what it started")
    stopped, left = stop_leftovers(head)
    if stopped:
        print(f"stopped {len(stopped)} process(es) the head left running: {describe(stopped)}")
    if left:
        print(f"pdserve: error: still running after SIGKILL: {describe(left)}", file=sys.stderr)
        return 1
    _remove_state()
    print("pdserve is down")
    return 0


def _remove_state() -> None:
    state_file().unlink(missing_ok=True)
    head_file().unlink(missing_ok=True)
    redis_password_file().unlink(missing_ok=True)


def _kill_head(pid: int) -> None:
    """SIGKILL a head that did not stop, with the Ray processes and Redis it started.

    A head started by ``up`` leads its own process group, which its GCS, raylet, agents and
    Redis share, so killing the group leaves none of them orphaned (Ray's worker processes have
    groups of their own and exit when their raylet dies). A head run in the foreground shares
    the operator's process group: only the head itself is killed then.
    """
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


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

"""The head: the process ``pdserve up`` starts (``pdserve _head``, or ``up --foreground`` in its own
process) that owns the cluster on this machine.

The head starts (or joins) Ray with node IP 127.0.0.1, starts the embedded Redis when no URL is
configured (watched by ``RedisSupervisor``), and runs the router service. It writes ``head.json``
before it starts anything and ``state.json`` (endpoints, pid, Redis URL) once it serves
(``state_files.py``), and publishes its status to Redis every second while it leads, which is what
``status`` reads (``status_report.py``). On SIGTERM (``down``, ``up_down.py``) it stops taking
requests, lets in-flight ones finish (bounded), stops the workers, Redis and Ray it started, and
removes its state files.

Secrets stay out of sight: the head takes ``up``'s ``--set`` overrides (``router.api_keys=...``)
from a 0600 file it deletes once read, never from argv; ``state.json`` has no password (a password
in ``redis.url`` is moved into the 0600 ``redis-password`` file).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import signal
import time
from pathlib import Path

from pdserve.cluster.config import ClusterConfig
from pdserve.cluster.head.head_processes import HEAD_ID_ENV, HeadIdentity, new_head_id
from pdserve.cluster.head.gpu_preflight import wait_for_gpus
from pdserve.cluster.head.router_actor import start_router_actors, stop_router_actors
from pdserve.cluster.head.state_files import (ensure_state_dir, head_file, read_head, remove_state, state_file,
                                              write_private, write_redis_password)
from pdserve.cluster.head.status_report import RAY_TOKEN_FILE, STATUS_KEY
from pdserve.cluster.redact import split_password
from pdserve.cluster.runtime.ray_env import LOOPBACK_IP, use_loopback, use_routable, use_token_auth_if_available
from pdserve.cluster.state.redis_server import EmbeddedRedis
from pdserve.cluster.state.redis_supervisor import RedisSupervisor
from pdserve.engine.gc_freeze import freeze_startup_heap

logger = logging.getLogger(__name__)


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
        write_private(head_file(), json.dumps(identity.as_state(), indent=2))
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
        await wait_for_gpus(config, stop)   # a GPU config Ray cannot hold: refused in one line, before any worker
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
            write_redis_password(password)
            write_private(state_file(), json.dumps(state, indent=2))
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
            remove_state()
    return state


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

"""``pdserve router``: one more router for a running cluster whose control plane is elected.

It joins the cluster's Ray and Redis (``ray.address`` / ``redis.url``, or those of the
``pdserve up`` head on this machine, from its state file and its 0600 password file), serves
HTTP and gRPC on its own ports, routes to the workers the registry in Redis lists, and stands
for the control-plane lease: when the leading router dies, one of the others takes the planner,
the pool manager and the reaper over (``RouterService``). It runs in the foreground until
SIGTERM/Ctrl-C, then drains its own streams and leaves; the workers keep serving the others.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from pdserve.cluster.config import ClusterConfig
from pdserve.cluster.head.launcher import event_loop_factory
from pdserve.cluster.head.state_files import read_state, redis_password_file
from pdserve.cluster.head.status_report import STATUS_KEY
from pdserve.cluster.redact import split_password
from pdserve.cluster.runtime.ray_env import use_loopback, use_routable, use_token_auth_if_available
from pdserve.engine.gc_freeze import freeze_startup_heap
from pdserve.engine.errors import InvalidRequestError


def join_settings(config: ClusterConfig) -> tuple[str, str, str | None]:
    """(Ray address, Redis URL, Redis password) this router joins: the config's, else the local
    head's. ``InvalidRequestError`` when the control plane is not elected or nothing is there to join."""
    if not config.control_plane.election:
        raise InvalidRequestError("pdserve router joins a cluster whose control plane is elected: set "
                                  "control_plane.election: true (here and in the head's config)")
    state = read_state() or {}
    ray_address = config.ray.address or state.get("ray_address")
    redis_url = config.redis.url or state.get("redis_url")
    if not ray_address or not redis_url:
        raise InvalidRequestError("no cluster to join: set ray.address and redis.url, or start one on this "
                                  "machine with `pdserve up --set control_plane.election=true`")
    redis_url, in_url = split_password(redis_url)
    password = config.redis.password.get_secret_value() if config.redis.password else in_url
    if password is None and not config.redis.url:
        try:
            password = redis_password_file().read_text(encoding="utf-8") or None
        except FileNotFoundError:
            password = None
    return ray_address, redis_url, password


async def serve_router(config: ClusterConfig, stop: asyncio.Event | None = None) -> None:
    from pdserve.cluster.head.router_service import RouterService   # Ray, gRPC, the router: 2 s, not for `status`

    ray_address, redis_url, password = join_settings(config)
    if ray_address.startswith(("127.", "localhost")):
        use_loopback()
    else:
        use_routable()
    use_token_auth_if_available()
    import ray

    ray.init(address=ray_address, namespace=config.ray.namespace, log_to_driver=False)
    service = RouterService(config, redis_url=redis_url, namespace=config.ray.namespace, redis_password=password)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    try:
        endpoints = await service.start()
        freeze_startup_heap(f"router {service.router_id}")  # streams every token: no full-collection pauses
        print(f"pdserve router {service.router_id} is up: HTTP {endpoints.http_url}  gRPC {endpoints.grpc_target}  "
              f"({'leads' if service.is_leader else 'follows'} the control plane)", flush=True)
        await service.serve_until(stop, STATUS_KEY, "this router's streams")
    finally:
        await service.stop(stop_workers=False)
        ray.shutdown()


def run_router(config: ClusterConfig) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        runner.run(serve_router(config))
    return 0

"""One router of an elected control plane, in a process of its own, for the failover tests: it
joins the test session's Ray (``ROUTER_RAY_ADDRESS``) and Redis (``ROUTER_REDIS_URL``, with its
password: environment, never argv), serves the test config of ``MODEL_DIR`` with
``control_plane.election`` on, prints one JSON line (its endpoints, router id, whether it leads)
once it serves, and serves until it is killed.

    python elected_router_proc.py MODEL_DIR REDIS_NAMESPACE LEASE_S LEDGER_LEASE_S
"""

from __future__ import annotations

import asyncio
import json
import os
import sys


async def main(model_dir: str, redis_namespace: str, lease_s: float, ledger_lease_s: float) -> None:
    import ray

    from cluster_helpers import cluster_config
    from pdserve.cluster.runtime.ray_env import use_loopback
    from pdserve.cluster.head.router_service import RouterService

    use_loopback()
    ray.init(address=os.environ["ROUTER_RAY_ADDRESS"], namespace="pdserve-tests", log_to_driver=False)
    config = cluster_config(model_dir, **{"control_plane.election": True, "control_plane.lease_s": lease_s,
                                          "router.worker_dead_after_s": 10.0})
    service = RouterService(config, redis_url=os.environ["ROUTER_REDIS_URL"], redis_namespace=redis_namespace,
                            reap_interval_s=0.5)
    endpoints = await service.start()
    service.backend.lease_s = ledger_lease_s   # the dead router's ledger entries expire within the test
    print(json.dumps({"http": endpoints.http_url, "grpc": endpoints.grpc_target, "router_id": service.router_id,
                      "leader": service.is_leader}), flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])))

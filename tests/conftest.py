"""Shared fixtures: models generated once and cached, one Redis and one Ray per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from ray_settings import METRICS_REPORT_INTERVAL_MS

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Ray's node IP stays 127.0.0.1 only with this set before ray is imported (see cluster/runtime/ray_env.py).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# Ray starts workers at niceness 15 by default: the test process (router, clients) would starve them.
os.environ.setdefault("RAY_worker_niceness", "0")
# Each Ray the tests start (the session's, every head's) would boot two idle workers for its first
# driver, 0.7 s of CPU each, that the engine workers never use: their runtime_env differs (UCX_NET_DEVICES).
os.environ.setdefault("RAY_prestart_worker_first_driver", "0")

REPO_ROOT = Path(__file__).resolve().parent.parent
pytest_plugins = ["time_budget", "shared_clusters"]   # per-module time budgets; clusters shared by modules

# Two cores are shared by the test process and every worker it starts: one torch thread each
# avoids threads spinning against each other (it makes oversubscribed runs 10-30x faster).
os.environ.setdefault("OMP_NUM_THREADS", "1")
try:
    import torch

    torch.set_num_threads(1)
except ModuleNotFoundError:  # pragma: no cover
    pass

try:  # the session Redis server fixture (real server, loopback only)
    from redis_fixture import *  # noqa: F401,F403
except ModuleNotFoundError as exc:  # pragma: no cover - only while the module is being written
    if exc.name != "redis_fixture":
        raise


@pytest.fixture(scope="session")
def native_kernels():
    """The C++ kernel library ``make setup`` builds: skips only where no compiler exists, fails
    where one does but the library does not load."""
    from pdserve.engine.kernels import build, load

    status = load()
    if not status.available and build.compiler() is None:
        pytest.skip(f"no C++ compiler on this host: {status.reason}")
    assert status.available, f"kernel not loadable although a compiler exists (run `make setup`): {status.reason}"
    return status


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    from pdserve.engine.testmodel import ensure_model

    return ensure_model("tiny", "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_model() -> Path:
    from pdserve.engine.testmodel import ensure_model

    return ensure_model("tiny", "qwen2")




@pytest.fixture(scope="session")
def ray_session():
    """One local Ray per test session, on 127.0.0.1, without the dashboard, exporting its
    metrics every ``METRICS_REPORT_INTERVAL_MS``."""
    import ray

    if not ray.is_initialized():
        ray.init(
            address="local",  # never join another Ray that happens to run on this machine
            _node_ip_address="127.0.0.1",
            include_dashboard=False,
            num_cpus=8,
            namespace="pdserve-tests",
            log_to_driver=False,
            runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}},
            _system_config={"metrics_report_interval_ms": METRICS_REPORT_INTERVAL_MS},
        )
    yield ray
    ray.shutdown()

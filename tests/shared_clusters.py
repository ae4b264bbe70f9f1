"""Clusters shared by several test modules: one per configuration per test session.

A ``RouterService`` with its Ray workers takes seconds to start on two cores; the modules that
need the same configuration take the same cluster. Each module wraps it in a ``ModuleView``
holding its own references (``ref``, ``tokenizer``...), so nothing a module adds is seen by
another, and checks at its end that nothing is held, as a module of its own cluster did.
A module that kills a worker, or needs a setting of its own, keeps a cluster of its own.

The modules sharing a cluster run one after another (collection moves them next to the first
of them) and the cluster stops after the last of their tests: while it runs its workers hold
cores, and a later module's workers would run unpinned (``test_worker_threads`` checks pinning).
"""

from __future__ import annotations

from typing import Any

import pytest

# One prefill and two decode workers; a transfer timeout and a grammar budget other than the
# defaults, so test_cluster_router can see that they reach the workers.
ROUTER_GRAMMAR_BUDGET_S = 2.0
ROUTER_CLUSTER: dict[str, Any] = {"decode.min_replicas": 2,
                                  "router.disaggregation.kv_transfer_timeout_s": 45.0,
                                  "structured.compile_timeout_s": ROUTER_GRAMMAR_BUDGET_S}
SHARED = ("router_cluster",)

_live: dict[str, Any] = {}       # fixture name -> its running harness
_last_user: dict[str, str] = {}  # fixture name -> node id of the last test that uses it


class ModuleView:
    """One module's view of a shared cluster: its own attributes, the harness's for the rest."""

    def __init__(self, harness: Any, **attrs: Any) -> None:
        self._harness = harness
        self.__dict__.update(attrs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._harness, name)


def _stop(name: str) -> None:
    h = _live.pop(name, None)
    if h is not None:
        try:
            h.assert_nothing_held()
        finally:
            h.stop()


@pytest.fixture(scope="session")
def router_cluster(tiny_model, ray_session, redis_server):
    """The disaggregated cluster of the router's own tests (1 prefill, 2 decode workers)."""
    from cluster_helpers import ClusterHarness, cluster_config

    h = ClusterHarness(cluster_config(tiny_model, **ROUTER_CLUSTER), redis_server.url)
    _live["router_cluster"] = h
    try:
        h.start()
        yield h
    finally:
        _stop("router_cluster")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for name in SHARED:
        modules = list(dict.fromkeys(i.module for i in items if name in getattr(i, "fixturenames", ())))
        if not modules:
            continue
        first = next(n for n, i in enumerate(items) if i.module in modules)
        group = [i for i in items if i.module in modules]
        rest = [i for i in items if i.module not in modules]
        items[:] = rest[:first] + group + rest[first:]
        _last_user[name] = group[-1].nodeid


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    yield
    for name, nodeid in _last_user.items():
        if item.nodeid == nodeid:
            _stop(name)

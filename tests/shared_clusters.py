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
_last_user: dict[str, pytest.Item] = {}  # fixture name -> the last test that uses it


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


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups marked here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    shared_by: dict[Any, str] = {}   # module -> the shared cluster it uses
    for name in SHARED:
        modules = list(dict.fromkeys(i.module for i in items if name in getattr(i, "fixturenames", ())))
        if not modules:
            continue
        first = next(n for n, i in enumerate(items) if i.module in modules)
        group = [i for i in items if i.module in modules]
        rest = [i for i in items if i.module not in modules]
        items[:] = rest[:first] + group + rest[first:]
        _last_user[name] = group[-1]
        shared_by.update(dict.fromkeys(modules, name))
    if config.getoption("dist", "no") == "loadgroup":
        _group_for_xdist(items, shared_by)


def _group_for_xdist(items: list[pytest.Item], shared_by: dict[Any, str]) -> None:
    """pytest-xdist: a module's tests run in one worker (its module fixtures start once), and so
    do all the modules of one shared cluster. The groups that took longest in the measured runs
    (tests/time_budget.json) go first, so the last one to start is short."""
    from time_budget import module_budgets

    budgets = module_budgets("test")
    groups: dict[str, list[pytest.Item]] = {}
    for item in items:
        module = item.nodeid.split("::")[0]
        name = shared_by.get(item.module, module)
        item.add_marker(pytest.mark.xdist_group(name))
        groups.setdefault(name, []).append(item)
    cost = {name: sum(budgets.get(m, 0.0) for m in {i.nodeid.split("::")[0] for i in members})
            for name, members in groups.items()}
    items[:] = [i for name in sorted(groups, key=lambda g: -cost[g]) for i in groups[name]]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    yield
    for name, last in _last_user.items():
        if item is last:
            _stop(name)

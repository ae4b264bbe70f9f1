"""Clusters shared by several test modules: one per configuration per test session.

A ``RouterService`` with its Ray workers takes seconds to start on two cores; the modules that
need the same configuration take the same cluster. Each module wraps it in a ``ModuleView``
holding its own references (``ref``, ``tokenizer``...), so nothing a module adds is seen by
another, and checks at its end that nothing is held, as a module of its own cluster did.
A module that kills a worker, or needs a setting of its own, keeps a cluster of its own.
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


class ModuleView:
    """One module's view of a shared cluster: its own attributes, the harness's for the rest."""

    def __init__(self, harness: Any, **attrs: Any) -> None:
        self._harness = harness
        self.__dict__.update(attrs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._harness, name)


@pytest.fixture(scope="session")
def router_cluster(tiny_model, ray_session, redis_server):
    """The disaggregated cluster of the router's own tests (1 prefill, 2 decode workers)."""
    from cluster_helpers import ClusterHarness, cluster_config

    h = ClusterHarness(cluster_config(tiny_model, **ROUTER_CLUSTER), redis_server.url)
    try:
        h.start()
        yield h
        h.assert_nothing_held()
    finally:
        h.stop()

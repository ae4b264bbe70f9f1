"""The head's GPU pre-flight (``cluster/head/gpu_preflight.py``): a GPU config on a Ray cluster
that cannot hold its pools is refused in one line naming the setting; a CPU config never asks
Ray; the autoscaler's node groups count as GPUs to come."""

from __future__ import annotations

import asyncio
import sys
from types import SimpleNamespace
from typing import Any

import pytest

from pdserve.cluster.config import ClusterConfig
from pdserve.cluster.head.gpu_preflight import (ReplicaNeed, gpu_needs, gpu_refusal, offers_from_node_groups,
                                                offers_from_ray_nodes, placement_refusal, wait_for_gpus)
from pdserve.engine.errors import InvalidRequestError, PdserveError


def make_config(prefill: dict | None = None, decode: dict | None = None, ray: dict | None = None) -> ClusterConfig:
    return ClusterConfig.model_validate({"model": {"path": "/m"}, "prefill": prefill or {}, "decode": decode or {},
                                         "ray": ray or {}})


def ray_node(name: str, cpus: float = 16, gpus: float = 0, accelerator: str | None = None, alive: bool = True,
             **custom: float) -> dict[str, Any]:
    """One entry of ``ray.nodes()``."""
    resources = {"CPU": cpus, "memory": 64e9, f"node:{name}": 1.0, **custom}
    if gpus:
        resources["GPU"] = gpus
    if accelerator:
        resources[f"accelerator_type:{accelerator}"] = 1.0
    return {"NodeID": f"id-{name}", "NodeManagerAddress": name, "Alive": alive, "Resources": resources}


def refusal(config: ClusterConfig, *nodes: dict[str, Any], groups: list[dict] = ()) -> str | None:
    return gpu_refusal(config, offers_from_ray_nodes(nodes) + offers_from_node_groups(groups))


ONE_GPU = {"num_gpus": 1, "engine": {"device": "cuda"}}


def test_a_cpu_config_passes_and_ray_is_not_asked(monkeypatch) -> None:
    config = make_config({"num_cpus": 2}, {"num_cpus": 2})
    assert gpu_needs(config) == []
    assert refusal(config, ray_node("10.0.0.1", gpus=0)) is None
    monkeypatch.setitem(sys.modules, "ray", None)   # `import ray` would raise: the check never gets there
    asyncio.run(wait_for_gpus(config))


def test_no_gpu_on_the_cluster_is_refused_in_one_line() -> None:
    reason = refusal(make_config(ONE_GPU), ray_node("10.0.0.1", cpus=16), ray_node("10.0.0.2", cpus=8))
    assert reason == ("prefill.num_gpus: a replica needs 1 GPU, but the Ray cluster has no GPU (2 nodes, 24 CPUs) "
                      "and no autoscaler group that adds one; run pdserve on a Ray cluster with GPUs, or set "
                      "prefill.num_gpus: 0 and prefill.engine.device: cpu")
    assert "\n" not in reason


def test_an_accelerator_type_alone_places_the_pool_on_nodes_of_that_type() -> None:
    config = make_config(decode={"accelerator_type": "L4", "resources": {"decode": 1}})
    assert [(n.pool, n.gpus, n.accelerator_type) for n in gpu_needs(config)] == [("decode", 0.0, "L4")]
    assert refusal(config, ray_node("a", gpus=1, accelerator="L4"), ray_node("b", decode=1.0)) == (
        "decode.resources: no node of the Ray cluster with L4 GPUs also has decode 1; start the GPU nodes with those "
        "resources (the k8s overlays' worker groups do)")
    assert refusal(config, ray_node("a", gpus=1, accelerator="L4", decode=1.0)) is None


def test_a_replica_needing_more_gpus_than_any_one_node_has_is_refused() -> None:
    """Two nodes of one GPU are two GPUs, but a replica (one actor) never spans nodes."""
    config = make_config({"num_gpus": 2, "initial_replicas": 1})
    reason = refusal(config, ray_node("a", gpus=1), ray_node("b", gpus=1))
    assert reason == ("prefill.num_gpus: a replica needs 2 GPUs on one node, but the most GPUs any node of the Ray "
                      "cluster has is 1; lower prefill.num_gpus (fractions allowed) or add a bigger node")
    assert refusal(config, ray_node("a", gpus=1), ray_node("b", gpus=2)) is None


def test_a_missing_accelerator_type_is_refused_naming_what_the_cluster_has() -> None:
    config = make_config(decode={"num_gpus": 1, "accelerator_type": "H200"})
    reason = refusal(config, ray_node("a", gpus=8, accelerator="A100"), ray_node("b", gpus=8, accelerator="H100"))
    assert reason.startswith("decode.accelerator_type: no node of the Ray cluster has 'H200' GPUs (it has 'A100', "
                             "'H100'); set the type Ray reports")
    assert refusal(config, ray_node("a", gpus=8, accelerator="A100"), ray_node("c", gpus=1, accelerator="H200")) is None


def test_the_gpu_count_is_checked_on_the_nodes_of_the_requested_type() -> None:
    config = make_config({"num_gpus": 4, "accelerator_type": "H100"})
    reason = refusal(config, ray_node("a", gpus=8, accelerator="A100"), ray_node("b", gpus=2, accelerator="H100"))
    assert reason.startswith("prefill.num_gpus: a replica needs 4 GPUs on one node, but the most H100 GPUs any node "
                             "of the Ray cluster has is 2")


def test_fractional_gpus_share_one_gpu_and_the_initial_replicas_are_counted() -> None:
    """Half a GPU per replica: one prefill and one decode replica fit on one GPU; three halves do not,
    and with nothing to add GPUs the head would otherwise wait for them until its timeout."""
    half = {"num_gpus": 0.5}
    gpu_host = ray_node("gpu-host", cpus=16, gpus=1, accelerator="L4")
    assert refusal(make_config(half, half), gpu_host) is None
    reason = refusal(make_config({**half, "initial_replicas": 2}, half), gpu_host)
    assert reason == ("the initial replicas need 1.5 GPUs (prefill 2 x 0.5 + decode 1 x 0.5), but the Ray cluster "
                      "has 1 and no autoscaler group that adds more; lower initial_replicas or num_gpus (fractions "
                      "allowed), or add GPUs")
    # a pool that never runs a replica asks for nothing
    assert [n.pool for n in gpu_needs(make_config({**half, "min_replicas": 0, "max_replicas": 0}, half))] == ["decode"]


def test_the_gpus_and_the_pools_custom_resources_must_be_on_one_node() -> None:
    """On KubeRay the prefill group's pods offer {prefill: 1}: a GPU on another node does not help."""
    config = make_config({"num_gpus": 1, "resources": {"prefill": 1}})
    reason = refusal(config, ray_node("gpu", gpus=1), ray_node("cpu", prefill=1.0))
    assert reason == ("prefill.resources: no node of the Ray cluster with 1 GPU also has prefill 1; start the GPU "
                      "nodes with those resources (the k8s overlays' worker groups do)")
    assert refusal(config, ray_node("gpu", gpus=1, prefill=1.0)) is None


def test_gpu_nodes_the_autoscaler_may_start_count_and_dead_nodes_do_not() -> None:
    """KubeRay: the head runs before the GPU pods join (or their groups scale from zero); the
    autoscaler's groups say what it can add. A group with max_count 0 adds nothing."""
    config = make_config({"num_gpus": 1, "resources": {"prefill": 1}, "initial_replicas": 2},
                         {"num_gpus": 1, "resources": {"decode": 1}})
    head = ray_node("head", cpus=2)
    groups = [{"name": "prefill", "resources": {"CPU": 8, "GPU": 1, "prefill": 1}, "max_count": 8},
              {"name": "decode", "resources": {"CPU": 8, "GPU": 1, "decode": 1}, "max_count": -1}]
    assert refusal(config, head, groups=groups) is None
    assert refusal(config, head, groups=[{**g, "max_count": 0} for g in groups]).startswith(
        "prefill.num_gpus: a replica needs 1 GPU, but the Ray cluster has no GPU (1 node, 2 CPUs)")
    assert refusal(config, head, ray_node("gone", gpus=8, prefill=1, decode=1, alive=False)).startswith(
        "prefill.num_gpus: a replica needs 1 GPU, but the Ray cluster has no GPU")


def test_the_first_pool_that_cannot_be_placed_is_named() -> None:
    needs = [ReplicaNeed("prefill", 1.0, None), ReplicaNeed("decode", 1.0, "H200")]
    offers = offers_from_ray_nodes([ray_node("a", gpus=1, accelerator="H100")])
    assert placement_refusal(needs, offers).startswith("decode.accelerator_type: no node of the Ray cluster has "
                                                       "'H200' GPUs (it has 'H100')")


class _Group(SimpleNamespace):
    """One ``NodeGroupConfig`` of the autoscaler's ``ClusterConfig`` (protobuf) as Ray returns it."""


def fake_ray(*views: list[dict[str, Any]], groups: list[_Group] | None = None) -> SimpleNamespace:
    """A ``ray`` module whose ``nodes()`` returns each view in turn (the last one from then on)."""
    cluster_config = None if groups is None else SimpleNamespace(node_group_configs=groups)
    state = SimpleNamespace(state=SimpleNamespace(get_cluster_config=lambda: cluster_config))
    calls = iter(range(10**6))
    return SimpleNamespace(nodes=lambda: views[min(next(calls), len(views) - 1)],
                           _private=SimpleNamespace(state=state))


CPU_ONLY = [ray_node("127.0.0.1", cpus=2)]
WITH_GPU = CPU_ONLY + [ray_node("10.0.0.7", cpus=8, gpus=1)]


def test_on_a_local_ray_the_head_is_refused_at_once_in_one_line(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", fake_ray(CPU_ONLY, WITH_GPU))   # a GPU node would join: too late
    with pytest.raises(InvalidRequestError) as info:
        asyncio.run(wait_for_gpus(make_config(ONE_GPU)))
    assert str(info.value) == ("prefill.num_gpus: a replica needs 1 GPU, but the Ray cluster has no GPU (1 node, 2 CPUs) "
                               "and no autoscaler group that adds one; run pdserve on a Ray cluster with GPUs, or set "
                               "prefill.num_gpus: 0 and prefill.engine.device: cpu")


def test_the_autoscalers_groups_are_read_from_ray(monkeypatch) -> None:
    group = _Group(name="gpu", resources={"CPU": 8, "GPU": 1}, max_count=2)
    monkeypatch.setitem(sys.modules, "ray", fake_ray(CPU_ONLY, groups=[group]))
    asyncio.run(wait_for_gpus(make_config(ONE_GPU)))   # the autoscaler can add the GPU node


def test_a_joined_cluster_is_given_time_for_its_gpu_nodes_to_join(monkeypatch) -> None:
    """KubeRay: the head pod's `pdserve up --address auto` runs before the GPU pods have joined."""
    joined = make_config(ONE_GPU, ray={"address": "auto"})
    monkeypatch.setitem(sys.modules, "ray", fake_ray(CPU_ONLY, CPU_ONLY, WITH_GPU))
    asyncio.run(wait_for_gpus(joined, poll_s=0.01))
    monkeypatch.setitem(sys.modules, "ray", fake_ray(CPU_ONLY))
    with pytest.raises(InvalidRequestError, match=r"prefill.num_gpus: .* \(after waiting 0 s for nodes to join\)$"):
        asyncio.run(wait_for_gpus(joined, wait_s=0.05, poll_s=0.01))


def test_a_stop_ends_the_wait(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", fake_ray(CPU_ONLY))
    stop = asyncio.Event()

    async def stopped_meanwhile() -> None:
        asyncio.get_running_loop().call_later(0.05, stop.set)
        await wait_for_gpus(make_config(ONE_GPU, ray={"address": "auto"}), stop, poll_s=10.0)

    with pytest.raises(PdserveError, match="^stopped while waiting for nodes that can hold the GPU pools"):
        asyncio.run(stopped_meanwhile())

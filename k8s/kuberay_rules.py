"""Checks that a RayCluster passes the KubeRay v1.7.0 operator's own admission rules.

The CRD schema only says which fields exist. The operator rejects more than that when it
reconciles (ray-operator/controllers/ray/utils/validation.go); this module re-states, in
our words, the subset of those rules that pdserve's manifests can run into, so a manifest
that the operator would refuse fails offline instead of in a cluster:

* the head and every worker group have at least one container, the Ray one first;
* worker group names are unique, 0 <= minReplicas <= replicas <= maxReplicas;
* a group sets Ray resources either in ``rayStartParams`` (num-cpus, num-gpus, memory,
  resources) or in its ``resources`` field, never both; ``rayStartParams.labels`` is
  refused in favour of the group's ``labels`` field, whose keys and values must be
  Kubernetes label syntax;
* with ``gcsFaultToleranceOptions`` the head sets no ``redis-password`` start parameter, no
  REDIS_PASSWORD / RAY_REDIS_ADDRESS / REDIS_USERNAME env, and no ``ray.io/ft-enabled``
  annotation;
* per-group ``idleTimeoutSeconds`` needs autoscaler v2, and autoscaler v2 needs every Ray
  pod's restartPolicy to be Never or unset;
* the name is a DNS-1035 label of at most 63 characters.
"""

from __future__ import annotations

import re
from typing import Any

_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_LABEL_NAME = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)$")
_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_RAY_START_RESOURCE_KEYS = ("num-cpus", "num-gpus", "memory", "resources")
_FORBIDDEN_HEAD_ENV_WITH_GCS_FT = ("REDIS_PASSWORD", "RAY_REDIS_ADDRESS")


def is_label_key(key: str) -> bool:
    """Kubernetes qualified name: optional DNS-subdomain prefix and '/', then a name."""
    prefix, _, name = key.rpartition("/")
    if prefix and (len(prefix) > 253 or not _DNS1123_SUBDOMAIN.match(prefix)):
        return False
    return 0 < len(name) <= 63 and bool(_LABEL_NAME.match(name))


def is_label_value(value: str) -> bool:
    return len(value) <= 63 and (value == "" or bool(_LABEL_NAME.match(value)))


def autoscaler_v2_enabled(spec: dict[str, Any]) -> bool:
    if not spec.get("enableInTreeAutoscaling", False):
        return False
    if spec.get("autoscalerOptions", {}).get("version") == "v2":
        return True
    containers = _containers(spec.get("headGroupSpec", {}))
    head_env = containers[0].get("env", []) if containers else []
    return any(e.get("name") == "RAY_enable_autoscaler_v2" and e.get("value") in ("1", "true") for e in head_env)


def raycluster_errors(obj: dict[str, Any]) -> list[str]:
    """Every rule above that ``obj`` (a ray.io/v1 RayCluster) breaks; empty when it passes."""
    errors: list[str] = []
    name = obj.get("metadata", {}).get("name", "")
    if len(name) > 63 or not _DNS1035.match(name):
        errors.append(f"name {name!r} is not a DNS-1035 label of at most 63 characters")
    spec = obj.get("spec", {})
    head = spec.get("headGroupSpec", {})
    if not _containers(head):
        return errors + ["headGroupSpec has no container"]
    errors += _group_errors("head", head)

    v2 = autoscaler_v2_enabled(spec)
    names: set[str] = set()
    for group in spec.get("workerGroupSpecs", []):
        group_name = group.get("groupName", "")
        if group_name in names:
            errors.append(f"worker group name {group_name!r} is used twice")
        names.add(group_name)
        if not _containers(group):
            errors.append(f"worker group {group_name} has no container")
            continue
        errors += _group_errors(group_name, group)
        errors += _replica_errors(group_name, group)
        if group.get("idleTimeoutSeconds") is not None and not v2:
            errors.append(f"worker group {group_name}: idleTimeoutSeconds needs autoscaler v2")
        if v2:
            errors += _restart_policy_errors(group_name, group)
    if v2:
        errors += _restart_policy_errors("head", head)
    errors += _gcs_ft_errors(obj)
    return errors


def _containers(group: dict[str, Any]) -> list[dict[str, Any]]:
    return group.get("template", {}).get("spec", {}).get("containers", [])


def _group_errors(group_name: str, group: dict[str, Any]) -> list[str]:
    errors = []
    params = group.get("rayStartParams", {}) or {}
    if group.get("resources") and any(params.get(k) for k in _RAY_START_RESOURCE_KEYS):
        errors.append(f"group {group_name}: Ray resources set both in rayStartParams and resources")
    if "labels" in params:
        errors.append(f"group {group_name}: rayStartParams.labels is refused; use the labels field")
    for key, value in (group.get("labels") or {}).items():
        if not is_label_key(key) or not is_label_value(str(value)):
            errors.append(f"group {group_name}: invalid Ray label {key}={value}")
    return errors


def _replica_errors(group_name: str, group: dict[str, Any]) -> list[str]:
    low, high = group.get("minReplicas"), group.get("maxReplicas")
    replicas = group.get("replicas")
    errors = []
    if (low is not None and low < 0) or (high is not None and high < 0):
        errors.append(f"worker group {group_name}: negative min/maxReplicas")
    if low is not None and high is not None and low > high:
        errors.append(f"worker group {group_name}: minReplicas {low} > maxReplicas {high}")
    if replicas is not None and low is not None and high is not None and not low <= replicas <= high:
        errors.append(f"worker group {group_name}: replicas {replicas} outside [{low}, {high}]")
    return errors


def _restart_policy_errors(group_name: str, group: dict[str, Any]) -> list[str]:
    policy = group.get("template", {}).get("spec", {}).get("restartPolicy")
    if policy not in (None, "", "Never"):
        return [f"group {group_name}: restartPolicy {policy} is refused with autoscaler v2"]
    return []


def _gcs_ft_errors(obj: dict[str, Any]) -> list[str]:
    spec = obj.get("spec", {})
    head = spec["headGroupSpec"]
    env_names = {e.get("name") for e in _containers(head)[0].get("env", [])}
    errors = []
    if env_names & {"REDIS_USERNAME"} or (head.get("rayStartParams") or {}).get("redis-username"):
        errors.append("head: a Redis username belongs in gcsFaultToleranceOptions.redisUsername")
    if "gcsFaultToleranceOptions" not in spec:
        if "RAY_REDIS_ADDRESS" in env_names:
            errors.append("head: RAY_REDIS_ADDRESS set without gcsFaultToleranceOptions")
        return errors
    if obj.get("metadata", {}).get("annotations", {}).get("ray.io/ft-enabled"):
        errors.append("ray.io/ft-enabled annotation together with gcsFaultToleranceOptions")
    if (head.get("rayStartParams") or {}).get("redis-password"):
        errors.append("head: redis-password in rayStartParams together with gcsFaultToleranceOptions")
    for env in _FORBIDDEN_HEAD_ENV_WITH_GCS_FT:
        if env in env_names:
            errors.append(f"head: env {env} together with gcsFaultToleranceOptions")
    return errors

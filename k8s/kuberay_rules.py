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
* the name is a DNS-1035 label of at most 63 characters;
* ``authOptions.mode: token`` needs ``rayVersion`` 2.52.0 or newer; ``enableK8sTokenAuth`` needs
  mode token, Ray 2.55.0 or newer and no ``secretName``; ``secretName`` is a Secret name.

``token_auth_errors`` is pdserve's own rule on top (``validate.py`` applies it to every
RayCluster): Ray token authentication is on, with a Secret the operator creates, and every
process that talks to Ray has the token, from that Secret, never as a literal.
"""

from __future__ import annotations

import re
from typing import Any

_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_LABEL_NAME = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)$")
_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_RAY_START_RESOURCE_KEYS = ("num-cpus", "num-gpus", "memory", "resources")
_FORBIDDEN_HEAD_ENV_WITH_GCS_FT = ("REDIS_PASSWORD", "RAY_REDIS_ADDRESS")
_VERSION = re.compile(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?")
#: Ray's token authentication (KubeRay v1.7.0: RAY_AUTH_MODE / RAY_AUTH_TOKEN, Secret key ``auth_token``).
AUTH_MODE_ENV, AUTH_TOKEN_ENV, AUTH_TOKEN_KEY = "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "auth_token"


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
    errors += _auth_option_errors(spec)
    return errors


def token_auth_errors(obj: dict[str, Any]) -> list[str]:
    """pdserve's rule for a RayCluster (not the operator's): Ray token authentication on, from a
    Secret the operator creates (``authOptions.secretName``), and the token reaching every process
    that talks to Ray. KubeRay sets RAY_AUTH_MODE and RAY_AUTH_TOKEN on each pod's Ray container
    only (and on its own autoscaler and wait-gcs-ready); a native sidecar (an init container with
    ``restartPolicy: Always``, like pdserve's router) must take both itself. Anywhere in a Ray pod,
    RAY_AUTH_TOKEN comes from that Secret's ``auth_token`` (never a literal value) and RAY_AUTH_MODE,
    if set, is ``token`` (KubeRay keeps a value a container sets, so ``disabled`` would win)."""
    options = obj.get("spec", {}).get("authOptions") or {}
    if options.get("mode") != "token":
        return ["authOptions.mode must be 'token': without it the dashboard's Jobs API runs anyone's code"]
    secret = options.get("secretName")
    errors = [] if secret else ["authOptions.secretName must name the Secret the operator creates (key auth_token)"]
    if options.get("enableK8sTokenAuth"):
        errors.append("authOptions.enableK8sTokenAuth: pdserve's sidecars authenticate with the Secret's token")
    for group_name, template in _pod_templates(obj.get("spec", {})):
        pod = template.get("spec", {})
        for container in pod.get("containers", []) + pod.get("initContainers", []):
            where = f"group {group_name} container {container.get('name')}"
            env = {e.get("name"): e for e in container.get("env", []) or []}
            sidecar = container.get("restartPolicy") == "Always"
            mode, token = env.get(AUTH_MODE_ENV), env.get(AUTH_TOKEN_ENV)
            if mode is not None and mode.get("value") != "token":
                errors.append(f"{where}: {AUTH_MODE_ENV} must be 'token' (got {mode.get('value')!r})")
            elif mode is None and sidecar:
                errors.append(f"{where}: a sidecar joining Ray needs {AUTH_MODE_ENV}=token (KubeRay does not set it)")
            if token is None:
                if sidecar:
                    errors.append(f"{where}: a sidecar joining Ray needs {AUTH_TOKEN_ENV} from Secret {secret}")
            elif "value" in token:
                errors.append(f"{where}: {AUTH_TOKEN_ENV} is a literal; take it from Secret {secret} (secretKeyRef)")
            elif ((token.get("valueFrom") or {}).get("secretKeyRef") or {}) != {"name": secret, "key": AUTH_TOKEN_KEY}:
                errors.append(f"{where}: {AUTH_TOKEN_ENV} must come from Secret {secret}, key {AUTH_TOKEN_KEY}")
    return errors


def _pod_templates(spec: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    templates = [("head", spec.get("headGroupSpec", {}).get("template", {}))]
    return templates + [(g.get("groupName", ""), g.get("template", {})) for g in spec.get("workerGroupSpecs", [])]


def _ray_version(text: str) -> tuple[int, int, int] | None:
    match = _VERSION.match(text or "")
    return None if match is None else (int(match[1]), int(match[2]), int(match[3] or 0))


def _auth_option_errors(spec: dict[str, Any]) -> list[str]:
    options = spec.get("authOptions")
    if options is None:
        return []
    errors = []
    secret = options.get("secretName")
    if secret and (len(secret) > 253 or not _DNS1123_SUBDOMAIN.match(secret)):
        errors.append(f"authOptions.secretName {secret!r} is not a valid Secret name")
    k8s_auth = bool(options.get("enableK8sTokenAuth"))
    if options.get("mode") != "token":
        # KubeRay v1.7.0 turns token auth on only for an explicit mode: token (no default applies).
        return errors + (["authOptions.enableK8sTokenAuth needs authOptions.mode token"] if k8s_auth else [])
    version = _ray_version(spec.get("rayVersion", ""))
    if not spec.get("rayVersion"):
        errors.append("authOptions.mode token needs spec.rayVersion (Ray 2.52.0 or newer)")
    elif version is None:
        errors.append(f"authOptions.mode token: rayVersion {spec['rayVersion']!r} is not a version")
    elif version < (2, 52, 0):
        errors.append(f"authOptions.mode token needs Ray 2.52.0 or newer, got {spec['rayVersion']}")
    if k8s_auth:
        if version is not None and version < (2, 55, 0):
            errors.append(f"authOptions.enableK8sTokenAuth needs Ray 2.55.0 or newer, got {spec['rayVersion']}")
        if secret:
            errors.append("authOptions.enableK8sTokenAuth together with authOptions.secretName")
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

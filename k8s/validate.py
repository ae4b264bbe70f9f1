"""Validate pdserve's rendered Kubernetes manifests offline, without a cluster.

* Built-in kinds (Service, StatefulSet, ConfigMap, ...) against the Kubernetes OpenAPI
  schemas shipped by ``kubernetes-validate``, in strict mode (unknown fields fail).
* KubeRay kinds (RayCluster, RayService, RayJob) against the v1.7.0 CRDs' openAPIV3Schema,
  made strict: ``additionalProperties: false`` is added wherever ``properties`` appears,
  unless that node already says ``additionalProperties`` or preserves unknown fields. The
  CRDs hold pod templates only as open objects for metadata, so each RayCluster pod template
  is also validated as a core/v1 PodTemplate, and the KubeRay operator's own admission
  rules are checked (``kuberay_rules``), with pdserve's own: Ray token authentication on, its
  token from a Secret in every process that talks to Ray.
* PodMonitor (no schema available offline): a structural check of the fields used here.

Usage: ``python k8s/validate.py k8s/overlays/gpu [--schemas ../shared/k8s-schemas]``.
"""

from __future__ import annotations

import argparse
import copy
import functools
import logging
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import kuberay_rules  # noqa: E402
import render  # noqa: E402

logger = logging.getLogger(__name__)

#: Oldest Kubernetes the manifests support (native sidecar containers are on by default
#: from 1.29) and a current one; both must accept them.
K8S_VERSIONS = ("1.29.0", "1.33.0")
KUBERAY_CRD_FILES = ("ray.io_rayclusters.yaml", "ray.io_rayservices.yaml", "ray.io_rayjobs.yaml")
DEFAULT_SCHEMA_DIR = Path(__file__).resolve().parents[2] / "shared" / "k8s-schemas"

_POD_MONITOR_SPEC_KEYS = frozenset(
    {"jobLabel", "selector", "podMetricsEndpoints", "namespaceSelector", "podTargetLabels",
     "sampleLimit", "targetLimit", "attachMetadata"}
)
_POD_METRICS_ENDPOINT_KEYS = frozenset(
    {"port", "portNumber", "path", "scheme", "interval", "scrapeTimeout", "params",
     "honorLabels", "honorTimestamps", "relabelings", "metricRelabelings", "enableHttp2",
     "filterRunning", "followRedirects", "basicAuth", "authorization", "tlsConfig", "proxyUrl"}
)
_RELABEL_KEYS = frozenset(
    {"sourceLabels", "separator", "targetLabel", "regex", "modulus", "replacement", "action"}
)


def strict_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of an OpenAPI v3 schema in which unknown object fields are errors."""
    strict = copy.deepcopy(schema)
    _forbid_unknown_fields(strict)
    return strict


def _forbid_unknown_fields(node: Any) -> None:
    if isinstance(node, dict):
        if ("properties" in node and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields", False)):
            node["additionalProperties"] = False
        for value in node.values():
            _forbid_unknown_fields(value)
    elif isinstance(node, list):
        for value in node:
            _forbid_unknown_fields(value)


@functools.lru_cache(maxsize=4)
def load_crd_schemas(schema_dir: Path) -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> strict openAPIV3Schema, from the CRDs in ``schema_dir/kuberay``."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    schemas: dict[tuple[str, str], dict[str, Any]] = {}
    for name in KUBERAY_CRD_FILES:
        with (schema_dir / "kuberay" / name).open(encoding="utf-8") as handle:
            crd = yaml.load(handle, Loader=loader)  # noqa: S506 - a safe loader
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            schema = version["schema"]["openAPIV3Schema"]
            schemas[(f"{group}/{version['name']}", kind)] = strict_schema(schema)
    return schemas


def builtin_errors(obj: dict[str, Any], k8s_version: str) -> list[str]:
    """Errors of a built-in kind against the strict Kubernetes schema of ``k8s_version``."""
    try:
        kubernetes_validate.validate(obj, k8s_version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        path = "/".join(str(p) for p in exc.path)
        return [f"{_describe(obj)} (k8s {k8s_version}) at /{path}: {exc.message}"]
    except kubernetes_validate.SchemaNotFoundError:
        return [f"{_describe(obj)}: no Kubernetes {k8s_version} schema for this kind"]
    return []


def crd_errors(obj: dict[str, Any], schemas: dict[tuple[str, str], dict[str, Any]]) -> list[str]:
    """Errors of a custom resource against its strict CRD schema."""
    schema = schemas.get((obj.get("apiVersion", ""), obj.get("kind", "")))
    if schema is None:
        return [f"{_describe(obj)}: no CRD schema for {obj.get('apiVersion')}"]
    validator = jsonschema.Draft7Validator(schema)
    return [
        f"{_describe(obj)} at /{'/'.join(str(p) for p in error.absolute_path)}: {error.message}"
        for error in sorted(validator.iter_errors(obj), key=lambda e: list(map(str, e.absolute_path)))
    ]


def raycluster_pod_templates(obj: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(group name, pod template) for the head ("head") and each worker group of a RayCluster."""
    spec = obj.get("spec", {})
    templates = [("head", spec.get("headGroupSpec", {}).get("template", {}))]
    templates += [(g.get("groupName", ""), g.get("template", {})) for g in spec.get("workerGroupSpecs", [])]
    return templates


def pod_template_errors(obj: dict[str, Any], k8s_version: str) -> list[str]:
    """Each RayCluster pod template, validated as a strict core/v1 PodTemplate."""
    errors = []
    for group, template in raycluster_pod_templates(obj):
        wrapper = {"apiVersion": "v1", "kind": "PodTemplate",
                   "metadata": {"name": f"{obj['metadata']['name']}-{group}"}, "template": template}
        errors += [f"{_describe(obj)} group {group}: {e}" for e in builtin_errors(wrapper, k8s_version)]
    return errors


def object_meta_errors(obj: dict[str, Any], k8s_version: str) -> list[str]:
    """A custom resource's metadata, validated as strict ObjectMeta (the CRDs leave it open)."""
    wrapper = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": obj.get("metadata", {})}
    return [f"{_describe(obj)} metadata: {e}" for e in builtin_errors(wrapper, k8s_version)]


def pod_monitor_errors(obj: dict[str, Any]) -> list[str]:
    """Structural check of a monitoring.coreos.com/v1 PodMonitor (fields used by pdserve)."""
    errors = []
    if obj.get("apiVersion") != "monitoring.coreos.com/v1":
        errors.append(f"{_describe(obj)}: apiVersion must be monitoring.coreos.com/v1")
    if set(obj) - {"apiVersion", "kind", "metadata", "spec"}:
        errors.append(f"{_describe(obj)}: unknown top-level fields {sorted(set(obj) - {'apiVersion', 'kind', 'metadata', 'spec'})}")
    if not obj.get("metadata", {}).get("name"):
        errors.append(f"{_describe(obj)}: metadata.name missing")
    spec = obj.get("spec", {})
    errors += [f"{_describe(obj)}: unknown spec field {k!r}" for k in sorted(set(spec) - _POD_MONITOR_SPEC_KEYS)]
    match_labels = spec.get("selector", {}).get("matchLabels")
    if not isinstance(match_labels, dict) or not match_labels:
        errors.append(f"{_describe(obj)}: spec.selector.matchLabels must be a non-empty map")
    endpoints = spec.get("podMetricsEndpoints")
    if not isinstance(endpoints, list) or not endpoints:
        return errors + [f"{_describe(obj)}: spec.podMetricsEndpoints must be a non-empty list"]
    for index, endpoint in enumerate(endpoints):
        where = f"{_describe(obj)} podMetricsEndpoints[{index}]"
        errors += [f"{where}: unknown field {k!r}" for k in sorted(set(endpoint) - _POD_METRICS_ENDPOINT_KEYS)]
        if not isinstance(endpoint.get("port"), str) and not isinstance(endpoint.get("portNumber"), int):
            errors.append(f"{where}: needs a named port or a portNumber")
        for rule in endpoint.get("relabelings", []) + endpoint.get("metricRelabelings", []):
            errors += [f"{where}: unknown relabeling field {k!r}" for k in sorted(set(rule) - _RELABEL_KEYS)]
    return errors


def manifest_errors(
    obj: dict[str, Any],
    schemas: dict[tuple[str, str], dict[str, Any]] | None,
    k8s_versions: tuple[str, ...] = K8S_VERSIONS,
) -> list[str]:
    """Every error of one manifest. ``schemas`` None means the KubeRay CRDs are unavailable: a
    KubeRay object is then checked for all but its CRD schema (metadata, the operator's admission
    rules, its pod templates as core/v1 PodTemplates), and the caller says so."""
    group = obj.get("apiVersion", "").rpartition("/")[0]
    if group == "ray.io":
        errors = (crd_errors(obj, schemas) if schemas is not None else []) + object_meta_errors(obj, k8s_versions[-1])
        if obj.get("kind") == "RayCluster":
            errors += kuberay_rules.raycluster_errors(obj) + kuberay_rules.token_auth_errors(obj)
            for version in k8s_versions:
                errors += pod_template_errors(obj, version)
        return errors
    if group == "monitoring.coreos.com":
        return pod_monitor_errors(obj) + object_meta_errors(obj, k8s_versions[-1])
    return [e for version in k8s_versions for e in builtin_errors(obj, version)]


def _describe(obj: dict[str, Any]) -> str:
    return f"{obj.get('kind', '?')}/{obj.get('metadata', {}).get('name', '?')}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kustomization", type=Path, help="directory holding a kustomization.yaml")
    parser.add_argument("--schemas", type=Path, default=DEFAULT_SCHEMA_DIR,
                        help="folder holding kuberay/ray.io_*.yaml (default: %(default)s)")
    args = parser.parse_args(argv)
    crd_dir = args.schemas.resolve() / "kuberay"
    missing = [name for name in KUBERAY_CRD_FILES if not (crd_dir / name).is_file()]
    schemas = None if missing else load_crd_schemas(args.schemas.resolve())
    if missing:
        sys.stdout.write(f"KubeRay CRD schemas not found: looked for {', '.join(missing)} in {crd_dir}. RayCluster "
                         f"objects are checked without them (metadata, KubeRay's admission rules, pod templates "
                         f"against core/v1); pass --schemas DIR (a folder holding kuberay/ray.io_*.yaml, the "
                         f"v1.7.0 CRDs) for the full check\n")
    errors = [e for obj in render.render(args.kustomization) for e in manifest_errors(obj, schemas)]
    for error in errors:
        sys.stderr.write(error + "\n")
    verdict = "OK" if not errors else f"{len(errors)} error(s)"
    sys.stdout.write(f"{args.kustomization}: {verdict}{' (without the KubeRay CRD schemas)' if missing else ''}\n")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())

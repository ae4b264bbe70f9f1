"""Render a kustomization offline, without kubectl, for pdserve's own manifests.

Supports exactly the kustomize features `k8s/` uses, with kustomize's semantics, and
refuses anything else (a silently ignored field would make the tests lie):

* ``resources``: YAML files (one or more documents) and directories holding a
  kustomization, rendered recursively;
* ``configMapGenerator`` with ``files`` (``key=path`` or ``path``) and ``literals``,
  ``behavior`` create / replace / merge; only with
  ``generatorOptions.disableNameSuffixHash: true`` (no name hashing here);
* ``patches``: JSON 6902 operation lists (add, remove, replace, move, copy, test) with a
  ``target``, and the one strategic-merge form used here, a whole-resource
  ``$patch: delete``;
* ``namespace``: set on every namespaced object;
* ``images``: rewrite ``image`` in any ``containers`` / ``initContainers`` list at any
  depth (kustomize does this for custom resources too), by name, with newName, newTag
  or digest.

Usage: ``python k8s/render.py k8s/overlays/cpu-dev`` prints the YAML stream.
"""

from __future__ import annotations

import copy
import logging
import sys
from pathlib import Path
from typing import Any

import yaml

logger = logging.getLogger(__name__)

Manifest = dict[str, Any]

_KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
_SUPPORTED_KEYS = frozenset(
    {"apiVersion", "kind", "resources", "configMapGenerator", "generatorOptions",
     "patches", "namespace", "images"}
)
_CLUSTER_SCOPED_KINDS = frozenset(
    {"Namespace", "CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding",
     "PersistentVolume", "StorageClass", "PriorityClass", "IngressClass",
     "ValidatingWebhookConfiguration", "MutatingWebhookConfiguration"}
)


def load_yaml_documents(path: Path) -> list[Manifest]:
    """Every non-empty document of a YAML file."""
    with path.open(encoding="utf-8") as handle:
        return [doc for doc in yaml.safe_load_all(handle) if doc]


def render(directory: str | Path) -> list[Manifest]:
    """Render the kustomization in ``directory`` into a list of manifests."""
    root = Path(directory)
    kustomization = _load_kustomization(root)
    unsupported = set(kustomization) - _SUPPORTED_KEYS
    if unsupported:
        raise ValueError(f"{root}: unsupported kustomization fields {sorted(unsupported)}")

    objects: list[Manifest] = []
    for entry in kustomization.get("resources", []):
        target = root / entry
        objects.extend(render(target) if target.is_dir() else load_yaml_documents(target))

    options = kustomization.get("generatorOptions", {})
    for generator in kustomization.get("configMapGenerator", []):
        _apply_config_map_generator(root, generator, options, objects)

    for patch in kustomization.get("patches", []):
        objects = _apply_patch(root, patch, objects)

    namespace = kustomization.get("namespace")
    if namespace:
        for obj in objects:
            if obj.get("kind") not in _CLUSTER_SCOPED_KINDS:
                obj.setdefault("metadata", {})["namespace"] = namespace

    for image in kustomization.get("images", []):
        for obj in objects:
            _rewrite_images(obj, image)
    _check_unique(objects, root)
    return objects


def object_key(obj: Manifest) -> tuple[str, str, str]:
    """(kind, namespace, name): how kustomize tells objects apart."""
    meta = obj.get("metadata", {})
    return obj.get("kind", ""), meta.get("namespace", ""), meta.get("name", "")


def _load_kustomization(root: Path) -> Manifest:
    for name in _KUSTOMIZATION_FILES:
        candidate = root / name
        if candidate.is_file():
            docs = load_yaml_documents(candidate)
            if len(docs) != 1:
                raise ValueError(f"{candidate}: expected one YAML document")
            return docs[0]
    raise ValueError(f"{root}: no kustomization file")


def _check_unique(objects: list[Manifest], root: Path) -> None:
    seen: set[tuple[str, str, str]] = set()
    for obj in objects:
        key = object_key(obj)
        if key in seen:
            raise ValueError(f"{root}: duplicate object {key}")
        seen.add(key)


def _apply_config_map_generator(
    root: Path, generator: Manifest, options: Manifest, objects: list[Manifest]
) -> None:
    if not options.get("disableNameSuffixHash", False):
        raise ValueError(f"{root}: configMapGenerator needs generatorOptions.disableNameSuffixHash")
    unsupported = set(generator) - {"name", "files", "literals", "behavior"}
    if unsupported:
        raise ValueError(f"{root}: unsupported configMapGenerator fields {sorted(unsupported)}")
    data: dict[str, str] = {}
    for entry in generator.get("files", []):
        key, _, rel = entry.partition("=") if "=" in entry else (Path(entry).name, "", entry)
        data[key] = (root / rel).read_text(encoding="utf-8")
    for literal in generator.get("literals", []):
        key, _, value = literal.partition("=")
        data[key] = value

    name = generator["name"]
    behavior = generator.get("behavior", "create")
    existing = [o for o in objects if o.get("kind") == "ConfigMap" and o["metadata"]["name"] == name]
    if behavior == "create":
        if existing:
            raise ValueError(f"{root}: ConfigMap {name} already exists; use behavior replace/merge")
        objects.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": data})
    elif behavior in ("replace", "merge"):
        if len(existing) != 1:
            raise ValueError(f"{root}: behavior {behavior} needs exactly one ConfigMap {name}")
        target = existing[0]
        target["data"] = data if behavior == "replace" else {**target.get("data", {}), **data}
    else:
        raise ValueError(f"{root}: unknown configMapGenerator behavior {behavior!r}")


def _apply_patch(root: Path, patch: Manifest, objects: list[Manifest]) -> list[Manifest]:
    unsupported = set(patch) - {"path", "patch", "target"}
    if unsupported:
        raise ValueError(f"{root}: unsupported patch fields {sorted(unsupported)}")
    if "path" in patch:
        body = yaml.safe_load((root / patch["path"]).read_text(encoding="utf-8"))
    else:
        body = yaml.safe_load(patch["patch"])

    if isinstance(body, dict):
        if body.get("$patch") != "delete":
            raise ValueError(f"{root}: only `$patch: delete` strategic-merge patches are supported")
        doomed = (body.get("kind"), body.get("metadata", {}).get("name"))
        kept = [o for o in objects if (o.get("kind"), o["metadata"]["name"]) != doomed]
        if len(kept) == len(objects):
            raise ValueError(f"{root}: delete patch matched nothing: {doomed}")
        return kept

    if not isinstance(body, list) or "target" not in patch:
        raise ValueError(f"{root}: a JSON 6902 patch needs a list of operations and a target")
    matches = [o for o in objects if _matches(o, patch["target"])]
    if not matches:
        raise ValueError(f"{root}: patch target matched nothing: {patch['target']}")
    for obj in matches:
        for operation in body:
            _json_patch_operation(obj, operation)
    return objects


def _matches(obj: Manifest, target: Manifest) -> bool:
    group, _, version = obj.get("apiVersion", "").rpartition("/")
    meta = obj.get("metadata", {})
    wanted = {"group": group, "version": version, "kind": obj.get("kind"),
              "name": meta.get("name"), "namespace": meta.get("namespace")}
    for field, value in target.items():
        if field not in wanted:
            raise ValueError(f"unsupported patch target field {field!r}")
        if wanted[field] != value:
            return False
    return True


def _split_pointer(pointer: str) -> list[str]:
    if not pointer.startswith("/"):
        raise ValueError(f"JSON pointer must start with '/': {pointer!r}")
    return [part.replace("~1", "/").replace("~0", "~") for part in pointer[1:].split("/")]


def _resolve(doc: Any, parts: list[str]) -> Any:
    for part in parts:
        doc = doc[_index(doc, part)] if isinstance(doc, list) else doc[part]
    return doc


def _index(seq: list[Any], part: str, allow_end: bool = False) -> int:
    if part == "-" and allow_end:
        return len(seq)
    index = int(part)
    if not 0 <= index < len(seq) + (1 if allow_end else 0):
        raise ValueError(f"index {index} out of range")
    return index


def _json_patch_operation(doc: Manifest, operation: Manifest) -> None:
    """Apply one RFC 6902 operation in place; raise ValueError when it cannot apply."""
    op = operation.get("op")
    parts = _split_pointer(operation["path"])
    parent_parts, last = parts[:-1], parts[-1]
    try:
        if op == "test":
            if _resolve(doc, parts) != operation["value"]:
                raise ValueError(f"test failed at {operation['path']}")
            return
        if op in ("move", "copy"):
            value = copy.deepcopy(_resolve(doc, _split_pointer(operation["from"])))
            if op == "move":
                _json_patch_operation(doc, {"op": "remove", "path": operation["from"]})
            _json_patch_operation(doc, {"op": "add", "path": operation["path"], "value": value})
            return
        parent = _resolve(doc, parent_parts)
        if op == "add":
            value = copy.deepcopy(operation["value"])
            if isinstance(parent, list):
                parent.insert(_index(parent, last, allow_end=True), value)
            else:
                parent[last] = value
        elif op == "replace":
            if isinstance(parent, list):
                parent[_index(parent, last)] = copy.deepcopy(operation["value"])
            elif last not in parent:
                raise ValueError(f"replace: nothing at {operation['path']}")
            else:
                parent[last] = copy.deepcopy(operation["value"])
        elif op == "remove":
            if isinstance(parent, list):
                del parent[_index(parent, last)]
            else:
                del parent[last]
        else:
            raise ValueError(f"unsupported JSON patch op {op!r}")
    except (KeyError, IndexError, TypeError) as exc:
        raise ValueError(f"JSON patch {operation} cannot apply: {exc!r}") from exc


def _split_image(image: str) -> tuple[str, str]:
    """'repo/name:tag' -> ('repo/name', ':tag'); digests and registry ports handled."""
    if "@" in image:
        name, _, digest = image.partition("@")
        return name, "@" + digest
    slash = image.rfind("/")
    colon = image.rfind(":")
    if colon > slash:
        return image[:colon], image[colon:]
    return image, ""


def _rewrite_images(node: Any, image: Manifest) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("containers", "initContainers") and isinstance(value, list):
                for container in value:
                    if isinstance(container, dict) and "image" in container:
                        container["image"] = _new_image(container["image"], image)
            _rewrite_images(value, image)
    elif isinstance(node, list):
        for item in node:
            _rewrite_images(item, image)


def _new_image(current: str, image: Manifest) -> str:
    name, suffix = _split_image(current)
    if name != image["name"]:
        return current
    name = image.get("newName", name)
    if "digest" in image:
        return f"{name}@{image['digest']}"
    if "newTag" in image:
        return f"{name}:{image['newTag']}"
    return name + suffix


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        sys.stderr.write("usage: python k8s/render.py <kustomization directory>\n")
        return 2
    sys.stdout.write(yaml.safe_dump_all(render(argv[1]), sort_keys=False))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

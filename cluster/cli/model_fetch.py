"""``pdserve prepare-model -c FILE``: make sure ``model.path`` holds a complete checkpoint before a pod
starts serving (the ``model`` init container of every Ray pod in ``k8s/``).

* A complete checkpoint already there (copied onto the model volume by hand): checked, nothing
  fetched.
* Missing, and the config names ``model.hub`` (a Hugging Face repository id and a pinned commit):
  downloaded into ``model.path`` with ``huggingface_hub.snapshot_download`` (the token of a gated
  repository comes from ``HF_TOKEN`` in the environment, never from argv or the config), then checked.
* Missing and no ``model.hub``: an error that says what is missing and the two ways to provide it.

Nothing else in pdserve downloads: ``pdserve up`` and the workers only read ``model.path``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path

from pdserve.cluster.config import ClusterConfig
from pdserve.engine.errors import InvalidRequestError

logger = logging.getLogger(__name__)

# What a snapshot download takes: the checkpoint, its tokenizer and configs; not the other
# formats a repository often carries beside them (GGUF, ONNX, .bin weights, images).
_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.txt", "*.tiktoken", "*.py"]


class ModelUnavailable(InvalidRequestError):
    """``model.path`` holds no complete checkpoint and it could not be fetched; says what to do."""


def missing_files(path: Path) -> list[str]:
    """What a complete checkpoint in ``path`` lacks ([] = complete): config.json, the tokenizer,
    and every safetensors file (each shard its index names)."""
    if not path.is_dir():
        return [f"the directory {path} itself"]
    missing = [] if (path / "config.json").is_file() else ["config.json"]
    if not any((path / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json")):
        missing.append("tokenizer.json (or tokenizer_config.json)")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as exc:
            return [*missing, f"a readable {index.name} ({exc})"]
        missing += [s for s in shards if not (path / s).is_file()]
    elif not (path / "model.safetensors").is_file():
        missing.append("model.safetensors (or model.safetensors.index.json and its shards)")
    return missing


def prepare_model(config: ClusterConfig) -> str:
    """Check, or fetch then check, ``config.model.path``; returns a line saying which."""
    path, hub = config.model.path, config.model.hub
    if not (missing := missing_files(path)):
        return f"model at {path}: complete, nothing to fetch"
    if hub is None:
        raise ModelUnavailable(
            f"model.path {path} holds no complete checkpoint (missing: {', '.join(missing)}) and the config "
            f"names no model.hub to fetch it from: copy the model onto the volume (k8s/README.md, \"3. Put a "
            f"model on the PVC\"), or set model.hub.id and model.hub.revision (a commit) to download it")
    with contextlib.suppress(OSError):
        path.mkdir(parents=True, exist_ok=True)
    if not os.access(path, os.W_OK):
        raise ModelUnavailable(f"model.path {path} lacks {', '.join(missing)} and is not writable, so "
                               f"{hub.id}@{hub.revision} cannot be downloaded into it: mount a writable volume "
                               f"there (an emptyDir per pod) or put the model on the volume by hand")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    logger.info("downloading %s@%s into %s", hub.id, hub.revision, path)
    try:
        snapshot_download(repo_id=hub.id, revision=hub.revision, local_dir=str(path), allow_patterns=_PATTERNS)
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as exc:
        raise ModelUnavailable(f"could not download {hub.id}@{hub.revision} into {path}: {exc}"
                               + (" (HF_HUB_OFFLINE is set)" if os.environ.get("HF_HUB_OFFLINE") else "")) from exc
    if missing := missing_files(path):
        raise ModelUnavailable(f"{hub.id}@{hub.revision} downloaded into {path} but it lacks "
                               f"{', '.join(missing)}: is it a safetensors Hugging Face checkpoint?")
    return f"model at {path}: downloaded {hub.id}@{hub.revision}"

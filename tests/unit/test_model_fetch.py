"""``pdserve prepare-model``: the check (or pinned download) each Kubernetes pod's ``model`` init
container runs before Ray starts. No traffic leaves this machine: the download path is driven with
``HF_HUB_OFFLINE=1``, where huggingface_hub refuses to connect."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pdserve.cli import main
from pdserve.cluster.config_io import load_config
from pdserve.cluster.cli.model_fetch import missing_files
from pdserve.engine.errors import InvalidRequestError

REVISION = "0123456789abcdef0123456789abcdef01234567"


def _config(tmp_path: Path, model_dir: Path, hub: str = "") -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text(f"model:\n  path: {model_dir}\n{hub}")
    return path


def test_a_complete_model_is_checked_and_nothing_fetched(tmp_path, tiny_model, capsys):
    assert missing_files(tiny_model) == []
    assert main(["prepare-model", "-c", str(_config(tmp_path, tiny_model))]) == 0
    assert "complete, nothing to fetch" in capsys.readouterr().out


def test_an_incomplete_model_without_a_hub_names_what_is_missing(tmp_path, tiny_model, capsys):
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    (model / "model.safetensors").unlink()
    (model / "tokenizer.json").unlink()
    (model / "tokenizer_config.json").unlink(missing_ok=True)
    assert main(["prepare-model", "-c", str(_config(tmp_path, model))]) == 2
    err = capsys.readouterr().err
    assert "model.safetensors" in err and "tokenizer.json" in err
    assert "model.hub.id and model.hub.revision" in err and "Put a model on the PVC" in err
    assert main(["prepare-model", "-c", str(_config(tmp_path, tmp_path / "absent"))]) == 2
    assert "the directory" in capsys.readouterr().err


def test_a_sharded_model_needs_every_shard_its_index_names(tmp_path, tiny_model):
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    (model / "model.safetensors").rename(model / "model-00001-of-00002.safetensors")
    (model / "model.safetensors.index.json").write_text(
        '{"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}')
    assert missing_files(model) == ["model-00002-of-00002.safetensors"]


def test_a_hub_model_is_downloaded_only_where_it_can_be(tmp_path, tiny_model, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub = f"  hub: {{id: HuggingFaceTB/SmolLM2-135M-Instruct, revision: {REVISION}}}\n"
    assert main(["prepare-model", "-c", str(_config(tmp_path, tiny_model, hub))]) == 0   # there: no fetch
    assert "nothing to fetch" in capsys.readouterr().out
    target = tmp_path / "fresh" / "model"
    assert main(["prepare-model", "-c", str(_config(tmp_path, target, hub))]) == 2
    err = capsys.readouterr().err
    assert f"could not download HuggingFaceTB/SmolLM2-135M-Instruct@{REVISION} into {target}" in err
    assert "HF_HUB_OFFLINE is set" in err


@pytest.mark.parametrize("hub, why", [
    ("{id: HuggingFaceTB/SmolLM2-135M-Instruct, revision: main}", "model.hub.revision"),
    ("{id: not-a-repo-id, revision: " + REVISION + "}", "model.hub.id"),
    ("{id: a/b, revision: " + REVISION + ", token: x}", "model.hub.token"),
])
def test_a_hub_model_must_be_pinned_and_well_formed(tmp_path, tiny_model, hub, why):
    with pytest.raises(InvalidRequestError, match=why.replace(".", r"\.")):
        load_config(_config(tmp_path, tiny_model, f"  hub: {hub}\n"), check_paths=False)

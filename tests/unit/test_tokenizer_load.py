"""Loading a checkpoint's tokenizer: ``load_tokenizer`` gives the tokenizer ``AutoTokenizer`` gives,
reading it directly where the JSON files name transformers' generic fast tokenizer (no config
class built, ~1.2 s less CPU in every worker's start) and through ``AutoTokenizer`` elsewhere.
SmolLM2's tokenizer is compared in tests/integration/test_real_model.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizer_checks import assert_same_tokenizer

from pdserve.engine.tokenizer import generic_tokenizer_class, load_tokenizer


def _auto(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def _variant(src: Path, dst: Path, *, config: dict | None = None, tokenizer_config: dict | None = None,
             drop: tuple[str, ...] = ()) -> Path:
    """A copy of ``src``'s tokenizer and config files with keys changed (None deletes one) or files removed."""
    dst.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src / name).exists() and name not in drop:
            shutil.copy(src / name, dst / name)
    for name, changes in (("config.json", config), ("tokenizer_config.json", tokenizer_config)):
        if changes and (dst / name).exists():
            data = json.loads((dst / name).read_text())
            for key, value in changes.items():
                if value is None:
                    data.pop(key, None)
                else:
                    data[key] = value
            (dst / name).write_text(json.dumps(data))
    return dst


@pytest.fixture(scope="module")
def mistral_model(tiny_model, tmp_path_factory) -> Path:
    """The tiny llama checkpoint labelled ``mistral`` (as tests/integration/test_model_parity.py does)."""
    return _variant(tiny_model, tmp_path_factory.mktemp("tok") / "mistral",
                    config={"architectures": ["MistralForCausalLM"], "model_type": "mistral"})


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_generic_tokenizer_is_read_directly_and_matches_auto_tokenizer(name, tiny_model, mistral_model) -> None:
    model_dir = tiny_model if name == "llama" else mistral_model
    assert generic_tokenizer_class(model_dir) is not None      # the direct path is taken
    assert_same_tokenizer(load_tokenizer(model_dir), _auto(model_dir))


def test_model_type_with_its_own_tokenizer_goes_through_auto_tokenizer(tiny_qwen2_model) -> None:
    # qwen2's checkpoint declares the generic class, but AutoTokenizer loads Qwen2Tokenizer for it
    assert generic_tokenizer_class(tiny_qwen2_model) is None
    ours, reference = load_tokenizer(tiny_qwen2_model), _auto(tiny_qwen2_model)
    assert type(ours).__name__ == "Qwen2Tokenizer"
    assert_same_tokenizer(ours, reference)


@pytest.mark.parametrize("change", [
    {"drop": ("tokenizer.json",)},
    {"drop": ("config.json",)},
    {"tokenizer_config": {"tokenizer_class": None}},
    {"tokenizer_config": {"tokenizer_class": "LlamaTokenizer"}},
    {"tokenizer_config": {"tokenizer_class": "PreTrainedTokenizer"}},
    {"tokenizer_config": {"auto_map": {"AutoTokenizer": [None, "custom.CustomTokenizer"]}}},
    {"config": {"auto_map": {"AutoConfig": "custom.CustomConfig"}}},
    {"config": {"model_type": None}},
    {"config": {"model_type": "not-a-transformers-model"}},
    {"config": {"model_type": "gpt-sw3"}},     # a config class (GPT2Config) shared with another type
], ids=["no-tokenizer-json", "no-config", "no-declared-class", "slow-class", "slow-generic", "custom-tokenizer",
        "custom-config", "no-model-type", "unknown-model-type", "shared-config-class"])
def test_anything_the_files_cannot_settle_is_left_to_auto_tokenizer(change, tiny_model, tmp_path) -> None:
    assert generic_tokenizer_class(_variant(tiny_model, tmp_path / "m", **change)) is None


def test_direct_path_builds_no_config_class(tiny_model) -> None:
    """The point of the direct path: the model's config class (and the torch.distributed import
    behind it) is never loaded, in a fresh process."""
    code = ("import sys; from pdserve.engine.tokenizer import load_tokenizer; load_tokenizer(sys.argv[1]); "
            "print(sorted(m for m in ('transformers.models.llama.configuration_llama', 'transformers.activations', "
            "'torch.distributed.tensor') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, str(tiny_model)], capture_output=True, text=True, check=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "[]"

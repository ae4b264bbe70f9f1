"""The configuration docs cannot drift from the loader: every YAML example in
``docs/configuration.md`` is a whole cluster config that ``load_config`` accepts and that would
serve (its router beyond loopback has a key from the environment), and the GPU pre-flight's
refusal it quotes is the one pdserve prints."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pdserve.cluster.config import ClusterConfig
from pdserve.cluster.config_io import load_config
from pdserve.cluster.head.gpu_preflight import gpu_refusal, offers_from_ray_nodes

DOCS = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
ENVIRON = {"PDSERVE_API_KEYS": "sk-docs-example"}   # what an operator's environment gives the router


def yaml_examples() -> list[tuple[int, str]]:
    """(line of the opening fence, text) of each ```yaml block of the docs."""
    text = DOCS.read_text()
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in re.finditer(r"^```yaml\n(.*?)^```", text, re.M | re.S)]


def test_the_configuration_docs_have_yaml_examples() -> None:
    assert len(yaml_examples()) >= 1   # else the test below checks nothing


@pytest.mark.parametrize("line, text", [pytest.param(line, text, id=f"line-{line}") for line, text in yaml_examples()])
def test_every_yaml_example_loads_with_the_real_loader(tmp_path: Path, line: int, text: str) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    config = load_config(path, check_paths=False, environ=ENVIRON)
    assert config.exposure_problems() == [], f"docs/configuration.md:{line}"


def test_the_gpu_placement_example_fits_the_cluster_it_describes(tmp_path: Path) -> None:
    """"Placing the pools": prefill on H100 nodes, decode on H200 nodes; the pre-flight lets it
    start there and names the pool that has no node of its type elsewhere."""
    text = next(text for _, text in yaml_examples() if "accelerator_type" in text)
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    config = load_config(path, check_paths=False, environ=ENVIRON)
    assert {config.prefill.engine.device, config.decode.engine.device} == {"cuda"}

    def node(name: str, accelerator: str) -> dict:
        return {"NodeManagerAddress": name, "Resources": {"CPU": 32.0, "GPU": 8.0, f"accelerator_type:{accelerator}": 1.0}}

    assert gpu_refusal(config, offers_from_ray_nodes([node("a", "H100"), node("b", "H200")])) is None
    reason = gpu_refusal(config, offers_from_ray_nodes([node("a", "H100"), node("b", "H100")]))
    assert reason.startswith("decode.accelerator_type: no node of the Ray cluster has 'H200' GPUs (it has 'H100')")


def test_the_quoted_gpu_refusal_is_the_one_pdserve_prints() -> None:
    config = ClusterConfig.model_validate({"model": {"path": "/m"}, "prefill": {"num_gpus": 1}})
    reason = gpu_refusal(config, offers_from_ray_nodes([{"NodeManagerAddress": "h", "Resources": {"CPU": 16.0}}]))
    docs = " ".join(DOCS.read_text().split())
    quoted = re.search(r"`pdserve: error: (prefill\.num_gpus: [^`]*?) \.\.\.`", docs)
    assert quoted and reason.startswith(quoted.group(1)), (quoted and quoted.group(1), reason)

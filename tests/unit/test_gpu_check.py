"""The prepared GPU check where there is no GPU: it says it skipped and exits 0, and what it needs
on the GPU machine (the tree importable without installing it, no Ray/Redis/pydantic) holds here.

The check itself is rehearsed on host memory in tests/integration/test_kv_transfer.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine would run the real check")


def run(*cmd: str, env: dict[str, str] | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def test_the_wrapper_says_it_skipped_and_exits_0(tmp_path: Path) -> None:
    done = run("bash", "scripts/gpu_check.sh", "all", "--out", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        f"gpu-check all skipped: no CUDA device (torch {torch.__version__}, built for CUDA None)"]
    assert not (tmp_path / "out").exists()  # nothing measured, nothing written
    assert run("bash", "scripts/gpu_check.sh", "everything").returncode == 2


def test_the_nixl_check_says_it_skipped_and_exits_0(tmp_path: Path) -> None:
    done = run(sys.executable, "scripts/gpu_check_nixl.py", "--out", str(tmp_path / "nixl.json"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("skipped: no CUDA device") and len(done.stdout.splitlines()) == 1
    assert not (tmp_path / "nixl.json").exists()


def test_the_tree_imports_uninstalled_and_without_any_third_party_package(tmp_path: Path) -> None:
    """What the nixl check imports from pdserve loads from a symlinked copy of the tree with no
    site-packages at all (``python -S``): no Ray, Redis or pydantic can hide in it."""
    tree = run(sys.executable, "scripts/tree_pythonpath.py", str(tmp_path / "tree"))
    assert tree.returncode == 0, tree.stderr
    code = ("import sys, pdserve.kv_transfer, pdserve.kv_transfer.engine_layout; "
            "print(pdserve.kv_transfer.__file__); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'nixl')))")
    # (run elsewhere than the tree's root, whose own pdserve/ folder would come first on sys.path)
    done = run(sys.executable, "-S", "-c", code, env={"PYTHONPATH": tree.stdout.strip()}, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    file, heavy = done.stdout.splitlines()
    assert file == str(tmp_path / "tree" / "pdserve" / "kv_transfer" / "__init__.py")
    assert heavy == "[]"  # torch, numpy and NIXL load when an agent is made, not on import


def test_the_nixl_check_pushes_the_medium_presets_kv() -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gpu_check_nixl as check
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    from pdserve.engine.testmodel import PRESETS

    medium = PRESETS[check.PRESET]
    assert (check.NUM_LAYERS, check.NUM_KV_HEADS, check.HEAD_DIM) == (
        medium.num_layers, medium.num_kv_heads, medium.head_dim)
    layout = check.make_layout(256)
    assert layout.block_bytes * 128 == 2048 * 26 * 2 * 8 * 64 * 2  # a 2,048-token prompt in bf16

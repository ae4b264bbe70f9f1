#!/usr/bin/env python3
"""The engine half of the prepared GPU check (issue 59): parity with transformers, decode against
``generate`` and the decode roofline on one CUDA GPU, written to one JSON (``bench/gpu_engine.py``
says what is measured and how).

    python scripts/gpu_check_engine.py --out FILE.json              # on a machine with CUDA
    python scripts/gpu_check_engine.py --out FILE.json --device cpu --quick   # tiny sizes, anywhere

Without CUDA and without ``--device`` it prints one line, ``skipped: no CUDA``, writes nothing and
exits 0. Otherwise it writes the JSON after each part (``complete``: false until the last, so a
run stopped by a time limit keeps what it measured), prints a one-line summary and exits 0 (a
parity that fails is a result in the JSON, not an error); an exception ends it with exit 1.

It needs torch and transformers only (with the safetensors, tokenizers and numpy they bring), and
runs from a source tree that is not installed: the ``pdserve.*`` packages are found through
``pyproject.toml``'s package map.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import importlib.util
import json
import logging
import os
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class _SourceTree(importlib.abc.MetaPathFinder):
    """Finds ``pdserve`` and its packages in this tree by ``[tool.setuptools] package-dir``."""

    def __init__(self, root: Path) -> None:
        package_dir = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
        self.dirs = {name: root / rel for name, rel in package_dir.items()}

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        d = self.dirs.get(fullname)
        if d is None:
            return None
        return importlib.util.spec_from_file_location(fullname, d / "__init__.py", submodule_search_locations=[str(d)])


def use_source_tree(root: Path = ROOT) -> None:
    """Make ``pdserve.*`` importable from ``root`` when pdserve is not installed."""
    try:
        if importlib.util.find_spec("pdserve.engine") is not None:
            return
    except ImportError:   # no pdserve at all
        pass
    sys.meta_path.append(_SourceTree(root))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("gpu_check_engine.json"), help="where the JSON goes")
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when there is one, "
                                                  "else skip)")
    p.add_argument("--quick", action="store_true", help="tiny sizes (the CPU test of this script)")
    p.add_argument("--cache-dir", type=Path, default=None, help="generated models (default: the model cache)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch

    if args.device is None and not torch.cuda.is_available():
        print("skipped: no CUDA")
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    use_source_tree()
    from pdserve.bench.gpu_engine import CheckSettings, run_check

    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save(result: dict) -> None:   # after each part: a run cut short by its time limit keeps the rest
        tmp = args.out.with_name(args.out.name + ".tmp")
        tmp.write_text(json.dumps(result, indent=2) + "\n")
        tmp.replace(args.out)

    result = run_check(CheckSettings.for_device(args.device or "cuda", args.quick, args.cache_dir), save)
    print(f"engine check on {result['device']}: parity_fp32={result['parity_fp32']} "
          f"parity_bf16={result['parity_bf16']} vs_hf_decode_b32={result['vs_hf_decode_b32']} "
          f"decode_roofline_ratio={result['decode_roofline_ratio']:.3f} ({result['wall_s']:.0f} s) -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

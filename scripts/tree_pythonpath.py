"""Make this source tree importable as the ``pdserve`` package without installing it.

    python scripts/tree_pythonpath.py DIR    # prints DIR; then PYTHONPATH=DIR python ...

pyproject.toml maps ``pdserve.engine`` to ``engine/``, ``pdserve.kv_transfer`` to
``kv_transfer/`` and so on (``[tool.setuptools] package-dir``); ``pip install -e .`` turns that map
into an import hook. A machine that only received a copy of the tree (the GPU check's machine:
no venv, no build tools, no network) has no hook, so this builds the same map out of symlinks:
``DIR/pdserve/`` holds links to the files of ``pdserve/`` and one link per mapped package.
Nothing in the tree is written.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def build(dest: Path, root: Path = ROOT) -> Path:
    """Create ``dest/pdserve`` (``dest`` must not hold one yet); returns ``dest``."""
    setuptools = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_dir: dict[str, str] = setuptools["package-dir"]
    package = dest / "pdserve"
    package.mkdir(parents=True)
    for entry in (root / package_dir["pdserve"]).iterdir():
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    for name, path in package_dir.items():
        sub = name.removeprefix("pdserve.")
        if name != "pdserve" and "." not in sub:  # nested packages live inside their parent's folder
            (package / sub).symlink_to(root / path)
    return dest


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python scripts/tree_pythonpath.py DIR")
    print(build(Path(sys.argv[1]).resolve()))

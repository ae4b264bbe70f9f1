"""Every third-party module the product imports is a declared dependency in pyproject.toml, so
nothing arrives only because Ray or transformers happens to pull it in today."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "kv_transfer", "worker", "prefill_worker", "decode_worker", "router", "proto", "cluster",
            "capacity", "bench", "pdserve")
# Imported but deliberately not in `dependencies`, each with why.
NOT_DECLARED = {
    "xgrammar": "installed by `make setup` with --no-deps (its triton dependency is GPU-only); pyproject says so",
    "grpc_tools": "proto/generate.py, a developer tool: in the `test` extra, pinned",
    "llguidance": "bench/structured.py compares grammar libraries when they are installed",
    "outlines_core": "bench/structured.py compares grammar libraries when they are installed",
    "starlette": "bench/serve_ingress.py compares Ray Serve's ingress when ray[serve] is installed",
}


def _imports() -> dict[str, str]:
    """Top-level third-party module -> one file that imports it (function-local imports included)."""
    found: dict[str, str] = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top != "pdserve":
                        found.setdefault(top, str(path.relative_to(ROOT)))
    return found


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_every_imported_library_is_declared() -> None:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    declared = {_normal(re.split(r"[\[<>=!~; ]", d, maxsplit=1)[0]) for d in deps}
    dists = packages_distributions()
    missing = [f"{module} (imported by {where}; distribution {dists.get(module, [module])})"
               for module, where in sorted(_imports().items())
               if module not in NOT_DECLARED
               and not any(_normal(d) in declared for d in dists.get(module, [module]))]
    assert not missing, "imported but not in pyproject.toml's dependencies: " + "; ".join(missing)


def test_the_exceptions_are_still_imported() -> None:
    assert set(NOT_DECLARED) <= set(_imports()), "drop from NOT_DECLARED what nothing imports any more"

"""Dependencies point one way (``docs/design.md``, "Layers"): every import of one pdserve package
by another, at module level or inside a function, is parsed from the source and checked against
the allowed order; Ray and Redis are imported only where the design says."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# package -> the pdserve packages it may import
ALLOWED = {
    "engine": set(),
    "proto": set(),
    "kv_transfer": {"engine"},
    "worker": {"engine", "kv_transfer"},
    "prefill_worker": {"engine", "kv_transfer", "worker"},
    "decode_worker": {"engine", "kv_transfer", "worker"},
    "router": {"engine", "kv_transfer", "proto"},
    "capacity": {"engine"},
    "cluster": {"engine", "kv_transfer", "worker", "prefill_worker", "decode_worker", "router", "proto", "capacity"},
    "bench": {"engine", "kv_transfer", "worker", "prefill_worker", "decode_worker", "router", "proto", "cluster",
              "capacity"},
    "pdserve": {"engine", "cluster", "bench", "capacity"},
}
RAY_ALLOWED = ("cluster/", "bench/", "router/worker_pool.py")   # the router's one seam to Ray actors
REDIS_ALLOWED = ("cluster/", "bench/")


def imports(path: Path) -> list[tuple[str, int]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, node.lineno))
    return out


def test_packages_import_only_inward() -> None:
    wrong = []
    for pkg, allowed in ALLOWED.items():
        for path in sorted((REPO / pkg).rglob("*.py")):
            for module, line in imports(path):
                parts = module.split(".")
                if parts[0] == "pdserve" and len(parts) > 1 and parts[1] in ALLOWED:
                    if parts[1] != pkg and parts[1] not in allowed:
                        wrong.append(f"{path.relative_to(REPO)}:{line} imports {module}")
    assert wrong == []


def test_ray_and_redis_are_imported_only_where_the_design_says() -> None:
    wrong = []
    for pkg in ALLOWED:
        for path in sorted((REPO / pkg).rglob("*.py")):
            rel = str(path.relative_to(REPO))
            for module, line in imports(path):
                top = module.split(".")[0]
                if top == "ray" and not rel.startswith(RAY_ALLOWED):
                    wrong.append(f"{rel}:{line} imports {module}")
                if top == "redis" and not rel.startswith(REDIS_ALLOWED):
                    wrong.append(f"{rel}:{line} imports {module}")
    assert wrong == []


def test_the_check_sees_a_violation(tmp_path: Path) -> None:
    bad = tmp_path / "x.py"
    bad.write_text("def f():\n    from pdserve.cluster.config import ClusterConfig\n")
    assert imports(bad) == [("pdserve.cluster.config", 2)]

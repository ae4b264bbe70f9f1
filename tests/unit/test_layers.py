"""Dependencies point one way (``docs/design.md``, "Layers"): every import of one pdserve package
by another, at module level or inside a function, is parsed from the source and checked against
the allowed order; inside a package the modules' imports form no cycle; ``cluster``'s rooms
import one way too; function-local imports of pdserve modules are counted (each one loads
something heavy only when used, never dodges a cycle); Ray and Redis are imported only where the
design says."""

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
    # the pure capacity model: profile format and fits, plan, simulator, the planner's decisions
    # and its traffic window; no Ray, Redis or cluster (the profiler that starts engines and
    # served clusters is bench/profiler.py, above it)
    "capacity": {"engine"},
    "cluster": {"engine", "kv_transfer", "worker", "prefill_worker", "decode_worker", "router", "proto", "capacity"},
    "bench": {"engine", "kv_transfer", "worker", "prefill_worker", "decode_worker", "router", "proto", "cluster",
              "capacity"},
    # the command line's top floor: its own modules (cli.py, *_cmd.py) compose the rest
    "pdserve": {"engine", "cluster", "bench", "capacity"},
}
# cluster's rooms (its subpackages; "base" is its top-level modules: config, config_io, redact,
# pids, status) -> the rooms each may import
ROOMS = {
    "base": set(),
    "state": {"base"},                                          # Redis
    "runtime": {"base"},                                        # Ray, the worker actors, metrics
    "control": {"base", "state", "runtime"},                    # the leader's control loops
    "head": {"base", "state", "runtime", "control"},            # the processes that serve
    "cli": {"base", "state", "runtime", "control", "head"},     # the operator's commands
}
# Function-local imports of pdserve modules, at most, per package. Each loads something heavy only
# when its command or code path runs (torch, Ray, gRPC); none may dodge a cycle (the cycle test
# below sees function-local imports too). Lower a figure when one goes; raise it only with a reason.
LOCAL_IMPORTS_MAX = {
    "engine": 10,    # the compiled kernels (engine.kernels builds them on first use), linear from kernel_select;
                     # the GGUF converter (torch) in known_models, only when a file is converted, so that
                     # `pdserve config`/`up --model DIR` load no torch
    "router": 5,     # the tokenizer (transformers) and the grammar engine, where a request needs them
    "capacity": 0,
    "cluster": 9,    # RouterService (Ray, gRPC, the router: ~2 s) in the 3 processes that serve, not in
                     # `pdserve status`; the worker actor classes (torch) in runtime/workers.py; demo's model
                     # loading (3); the head itself only for `up --foreground`, not before `up` spawns it;
                     # the Redis client only when `status` has a head to ask
    "bench": 121,    # `pdserve bench` registers every benchmark at start: each loads its tools when run
    "pdserve": 21,   # a command's handler loads its engine or capacity modules when it runs (the command
                     # table in pdserve/cli.py loads only the chosen command's modules)
}
RAY_ALLOWED = ("cluster/runtime/", "cluster/control/", "cluster/head/", "bench/",
               "router/worker_pool.py")   # the router's one seam to Ray actors
REDIS_ALLOWED = ("cluster/state/", "cluster/control/", "cluster/head/", "bench/")


def imports(path: Path) -> list[tuple[str, int]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module == "pdserve" and node.level == 0:
            out += [(f"pdserve.{a.name}", node.lineno) for a in node.names]   # from pdserve import generate_cmd
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, node.lineno))
    return out


def local_imports(path: Path) -> list[tuple[str, int]]:
    """The pdserve modules imported inside a function of ``path``."""
    out = []
    for fn in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("pdserve"):
                    out.append((node.module, node.lineno))
                elif isinstance(node, ast.Import):
                    out += [(a.name, node.lineno) for a in node.names if a.name.startswith("pdserve")]
    return sorted(set(out), key=lambda x: x[1])   # a nested function's import is counted once


def modules(root: Path) -> dict[str, Path]:
    """A package's modules by dotted name within it (``head.launcher``; ``head`` its __init__)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def module_edges(pkg: str, path: Path, names: set[str]) -> set[str]:
    """The modules of ``pkg`` (in ``names``) that ``path`` imports, at module level or in a function;
    ``from pdserve.pkg.room import module`` counts as an import of ``room.module``."""
    prefix = f"pdserve.{pkg}"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == prefix or node.module.startswith(prefix + "."):
                base = node.module[len(prefix) + 1:]
                for a in node.names:
                    sub = f"{base}.{a.name}" if base else a.name
                    out.add(sub if sub in names else base)
        elif isinstance(node, ast.Import):
            out |= {a.name[len(prefix) + 1:] for a in node.names if a.name.startswith(prefix + ".")}
    return {m for m in out if m in names}


def cycles(pkg: str, root: Path) -> list[list[str]]:
    """The import cycles among a package's modules (strongly connected sets of two or more; an
    __init__ that imports nothing is no part of one)."""
    mods = modules(root)
    graph = {m: module_edges(pkg, p, set(mods)) - {m} for m, p in mods.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:   # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def room_of(module: str) -> str:
    room = module.split(".")[0]
    return room if room in ROOMS and "." in module else "base"


def room_violations(root: Path) -> list[str]:
    mods = modules(root)
    wrong = []
    for m, path in mods.items():
        for dep in module_edges("cluster", path, set(mods)):
            if room_of(dep) != room_of(m) and room_of(dep) not in ROOMS[room_of(m)]:
                wrong.append(f"{path.relative_to(root.parent)}: {room_of(m)} imports {room_of(dep)} ({dep})")
    return wrong


def package_of(module: str) -> str | None:
    """The pdserve package of an imported module: ``pdserve.generate_cmd`` is the top package's;
    ``pdserve.__version__`` (``pdserve/__init__.py``) is everyone's."""
    parts = module.split(".")
    if parts[0] != "pdserve" or parts[1:] in ([], ["__version__"]):
        return None
    if len(parts) > 1 and parts[1] in ALLOWED:
        return parts[1]
    return "pdserve"


def test_packages_import_only_inward() -> None:
    wrong = []
    for pkg, allowed in ALLOWED.items():
        for path in sorted((REPO / pkg).rglob("*.py")):
            for module, line in imports(path):
                dep = package_of(module)
                if dep is not None and dep != pkg and dep not in allowed:
                    wrong.append(f"{path.relative_to(REPO)}:{line} imports {module}")
    assert wrong == []


def test_no_package_has_an_import_cycle_among_its_modules() -> None:
    found = {pkg: c for pkg in ALLOWED if (c := cycles(pkg, REPO / pkg))}
    assert found == {}


def test_cluster_rooms_import_one_way() -> None:
    rooms = {p.name for p in (REPO / "cluster").iterdir() if (p / "__init__.py").is_file()}
    assert rooms == set(ROOMS) - {"base"}   # every room in the table, and only those
    assert room_violations(REPO / "cluster") == []


def test_function_local_imports_of_pdserve_modules_are_counted() -> None:
    counts = {pkg: sum(len(local_imports(p)) for p in (REPO / pkg).rglob("*.py")) for pkg in ALLOWED}
    over = {pkg: (n, LOCAL_IMPORTS_MAX.get(pkg, 0)) for pkg, n in counts.items() if n > LOCAL_IMPORTS_MAX.get(pkg, 0)}
    assert over == {}


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
    assert local_imports(bad) == [("pdserve.cluster.config", 2)]
    assert package_of("pdserve.generate_cmd") == "pdserve"
    (tmp_path / "y.py").write_text("from pdserve import generate_cmd\n")
    assert imports(tmp_path / "y.py") == [("pdserve.generate_cmd", 1)]


def test_the_checks_see_a_cycle_and_a_room_imported_upward(tmp_path: Path) -> None:
    root = tmp_path / "cluster"
    for room in ("state", "head"):
        (root / room).mkdir(parents=True)
        (root / room / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "config.py").write_text("X = 1\n")
    (root / "state" / "store.py").write_text("from pdserve.cluster.head import service\n")   # a room upward
    (root / "head" / "service.py").write_text("from pdserve.cluster.config import X\n\n\n"
                                              "def serve():\n    from pdserve.cluster.head.launcher import run\n")
    (root / "head" / "launcher.py").write_text("from pdserve.cluster.head.service import serve\n")
    assert cycles("cluster", root) == [["head.launcher", "head.service"]]   # one side function-local
    assert room_violations(root) == ["cluster/state/store.py: state imports head (head.service)"]
    (root / "head" / "service.py").write_text("from pdserve.cluster.config import X\n")
    assert cycles("cluster", root) == []

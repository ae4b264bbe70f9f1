"""Ahead-of-time build of the engine's C++ kernels (``make setup`` runs ``python -m pdserve.engine.kernels.build``).

1. The sources under ``csrc/`` are compiled with the host compiler (``$CXX`` or ``g++``) against
   torch's headers and libraries into one shared library that registers ``torch.ops.pdserve.*``.
2. The library lands in ``<sys.prefix>/lib/pdserve-kernels/<key>/`` (inside the venv, never in the
   repository; ``PDSERVE_KERNEL_DIR`` overrides the root). ``key`` hashes the sources, the compiler
   flags, torch's version and ABI, and the CPU (model and flags): it is built with
   ``-march=native``, so another host rebuilds.
3. The file is written under a temporary name and renamed, so a concurrent loader never sees half
   a library; libraries of other keys are removed. A build that fails (or a host without a
   compiler) logs one line and exits 0: the engine falls back to its torch attention path
   (``kernels.load`` says why).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

LIB_NAME = "pdserve_kernels.so"
SOURCES = ("paged_attention.cpp", "prefill_attention.cpp", "gemv.cpp", "blas_packed.cpp", "rms_norm.cpp",
           "rope.cpp")
HEADERS = ("vec_host.h",)
_CSRC = Path(__file__).parent / "csrc"
_FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-std=c++17", "-fopenmp", "-fno-math-errno")


class KernelBuildError(RuntimeError):
    """The kernels could not be compiled on this host (no compiler, or the compiler failed)."""


def compiler() -> str | None:
    """The C++ compiler to use, or None when the host has none."""
    return shutil.which(os.environ.get("CXX", "g++"))


def _cpu_id() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [ln for ln in lines if ln.startswith(("model name", "flags", "vendor_id"))]
    return "\n".join(dict.fromkeys(keep))  # every core repeats the same lines


def cache_key() -> str:
    import torch

    h = hashlib.sha256()
    for name in SOURCES + HEADERS:
        h.update((_CSRC / name).read_bytes())
    h.update(" ".join(_FLAGS).encode())
    h.update(f"{torch.__version__}|{torch._C._GLIBCXX_USE_CXX11_ABI}|{sys.version_info[:2]}".encode())
    h.update(_cpu_id().encode())
    h.update(str(compiler()).encode())
    return h.hexdigest()[:16]


def library_path() -> Path:
    """Where the library for this host, torch and these sources lives (it may not exist yet)."""
    root = Path(os.environ.get("PDSERVE_KERNEL_DIR", Path(sys.prefix) / "lib" / "pdserve-kernels"))
    return root / cache_key() / LIB_NAME


def build(force: bool = False) -> Path:
    """Compile the kernels unless an up-to-date library exists; returns its path."""
    import torch
    from torch.utils import cpp_extension

    out = library_path()
    if out.exists() and not force:
        return out
    cxx = compiler()
    if cxx is None:
        raise KernelBuildError(f"no C++ compiler ({os.environ.get('CXX', 'g++')}) on PATH")
    torch_lib = Path(torch.__file__).parent / "lib"
    cmd = [cxx, *_FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    cmd += [f"-I{p}" for p in cpp_extension.include_paths()]
    cmd += [str(_CSRC / name) for name in SOURCES]
    # torch ships its own libgomp.so.1: linking that one keeps a single OpenMP runtime per process
    cmd += [f"-L{torch_lib}", "-lc10", "-ltorch_cpu", "-ltorch", "-ldl", f"-Wl,-rpath,{torch_lib}"]
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        res = subprocess.run([*cmd, "-o", tmp], capture_output=True, text=True, check=False)
        if res.returncode:
            raise KernelBuildError(f"{cxx} failed ({res.returncode}): {res.stderr.strip()[-2000:]}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    logger.info("built %s (%s)", out, sysconfig.get_platform())
    _prune(out.parent)
    return out


def _prune(keep: Path) -> None:
    """Remove libraries of other keys (older sources, another torch); a process that loaded one
    keeps its mapping."""
    for d in keep.parent.iterdir():
        if d != keep and len(d.name) == 16 and (d / LIB_NAME).exists():
            shutil.rmtree(d, ignore_errors=True)


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        path = build(force="--force" in sys.argv[1:])
    except KernelBuildError as exc:
        logger.warning("pdserve kernels not built, the engine will use torch attention: %s", exc)
        return 0
    logger.info("pdserve kernels: %s", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Matmul kernels chosen on the machine that runs them.

At engine start, for each hot call of a decoder layer (``qkv``, ``o_add``, ``mlp_add``) and the
output projection (``lm_head``):
1. build every candidate backend ("dense": torch mm/addmm on transposed weights; "packed":
   oneDNN-packed weights with fused epilogues; "gemv": ``torch.ops.pdserve.gemv`` on dense's
   transposed weights for M <= 8, dense's mm/addmm on the same tensors above; "mkl_packed":
   float32 weights packed once by MKL, ``cblas_sgemm_compute`` at every M; both offered only when
   the kernel library is built) from the model's own first-layer weights;
2. check that each agrees with the reference (dense matmuls in float32 on the same weights) at
   every timed M; a candidate that disagrees or fails is dropped;
3. time each on the real shapes, decode ``M`` in ``DECODE_M`` and prefill ``M`` in ``PREFILL_M``, best of
   ``repeats`` (min: a shared machine only ever adds time);
4. score = mean over the ``M``s of time relative to the default backend (the LM head is timed at
   the decode ``M``s only, since it runs on one row per sequence); switch away from the
   default only when the winner is clearly faster (``SWITCH_MARGIN``), since timing is noisy;
5. cache the choice in ``kernels.json`` under the cache directory, keyed by CPU model, CPU flags,
   torch version, dtype, threads and shapes, so a second start costs nothing. The file is locked
   while a choice is measured: workers starting together on one host agree on one choice. A
   choice measured on a busy machine stays until the file is deleted (then measured again).

No CPU-vendor test anywhere: the measurement decides.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from filelock import FileLock

if TYPE_CHECKING:
    import torch

    from pdserve.engine.loader import LayerWeights

logger = logging.getLogger(__name__)

OPS = ("qkv", "o_add", "mlp_add", "lm_head")
DECODE_M = (1, 8, 32)
PREFILL_M = (256, 1024)   # a chunk of a few prompts, and a long one (packed weights differ there)
SWITCH_MARGIN = 0.05
REPEATS = 5
CACHE_FILE = "kernels.json"
_FORMAT = 3   # 3: the LM head scored at decode M only, prefill M 1024 added (2: "gemv" joined); older
              # entries are measured again


@dataclass(frozen=True, slots=True)
class KernelChoice:
    """The backend of each call, how it was reached, and what was measured (µs, best of repeats)."""

    backends: dict[str, str]
    source: str                                   # "forced" | "measured" | "cache"
    timings_us: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)  # op -> backend -> M -> µs
    rejected: dict[str, str] = field(default_factory=dict)                            # "op/backend" -> why

    def __post_init__(self) -> None:
        if set(self.backends) != set(OPS) or not set(self.backends.values()) <= {"dense", "packed", "gemv", "mkl_packed"}:
            raise ValueError(f"a kernel choice names dense/packed/gemv/mkl_packed for each of {OPS}, "
                             f"got {self.backends}")

    @property
    def summary(self) -> str:
        """"dense", "packed", "gemv", "mkl_packed", or "mixed" when the calls differ."""
        kinds = set(self.backends.values())
        return kinds.pop() if len(kinds) == 1 else "mixed"

    def describe(self) -> str:
        return " ".join(f"{op}={self.backends[op]}" for op in OPS) + f" ({self.source})"

    def to_dict(self) -> dict[str, object]:
        return {"backends": dict(self.backends), "source": self.source, "timings_us": self.timings_us,
                "rejected": dict(self.rejected)}


def forced(backend: str) -> KernelChoice:
    return KernelChoice({op: backend for op in OPS}, "forced")


# ----------------------------------------------------------------------------- cache
def default_cache_dir() -> Path:
    """``$PDSERVE_CACHE_DIR``, else ``$XDG_CACHE_HOME/pdserve``, else ``~/.cache/pdserve``."""
    if env := os.environ.get("PDSERVE_CACHE_DIR"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pdserve"


def machine_key() -> dict[str, str]:
    """What makes timings of this machine differ from another's: CPU model and flags, torch."""
    import torch

    model, flags = "", ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() == "model name" and not model:
                model = value.strip()
            elif name.strip() in ("flags", "Features") and not flags:
                flags = value.strip()
    return {"cpu": model or os.uname().machine, "flags": hashlib.sha256(flags.encode()).hexdigest()[:16],
            "torch": torch.__version__, "capability": torch.backends.cpu.get_cpu_capability()}


class KernelCache:
    """One JSON file of choices, read and written under an exclusive lock."""

    def __init__(self, directory: Path | None = None) -> None:
        self.path = (directory or default_cache_dir()) / CACHE_FILE

    @contextlib.contextmanager
    def locked(self) -> Iterator[dict[str, dict]]:
        """The cached entries, under the file's lock; changes to the dict are written back."""
        lock = FileLock(self.path.with_suffix(".lock"), mode=0o644)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            lock.acquire()
        except OSError as exc:
            logger.warning("kernel cache %s not writable (%s): measuring without a cache", self.path, exc)
            yield {}
            return
        try:
            entries = self._read()
            before = json.dumps(entries, sort_keys=True)
            yield entries
            if json.dumps(entries, sort_keys=True) != before:
                tmp = self.path.with_suffix(f".tmp{os.getpid()}")
                tmp.write_text(json.dumps(entries, indent=1, sort_keys=True))
                os.replace(tmp, self.path)
        finally:
            lock.release()

    def _read(self) -> dict[str, dict]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            logger.warning("kernel cache %s unreadable (%s): starting it afresh", self.path, exc)
            return {}
        return data if isinstance(data, dict) and data.get("format") == _FORMAT else {"format": _FORMAT}


def cache_key(dtype: str, threads: int, shapes: dict[str, int],
              candidates: list[str] | None = None) -> tuple[str, dict[str, object]]:
    """The entry's key (a hash) and the fields it hashes; ``candidates`` are the backends offered
    here, so a host that gains or loses the gemv library measures again."""
    fields = {**machine_key(), "dtype": dtype, "threads": threads, "shapes": shapes, "m": [*DECODE_M, *PREFILL_M],
              "format": _FORMAT, "candidates": sorted(candidates or ["dense"])}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:24], fields


# ----------------------------------------------------------------------------- selection
def select_kernels(layer: LayerWeights, lm_head: torch.Tensor, dtype: torch.dtype,
                   cache: KernelCache | None = None, repeats: int = REPEATS) -> KernelChoice:
    """The fastest agreeing backend of each call on these weights' shapes (CPU), cached."""
    import torch

    name = str(dtype).removeprefix("torch.")
    shapes = {"hidden": layer.qkv.shape[1], "qkv": layer.qkv.shape[0], "attn": layer.o.shape[1],
              "inter": layer.down.shape[1], "vocab": lm_head.shape[0]}
    candidates = available_backends(dtype)
    key, fields = cache_key(name, torch.get_num_threads(), shapes, candidates)
    with (cache.locked() if cache else contextlib.nullcontext({})) as entries:
        if (hit := entries.get(key)) is not None:
            backends = {op: hit["backends"][op] for op in OPS if op in hit["backends"]}
            choice = KernelChoice(backends, "cache", hit.get("timings_us", {}), hit.get("rejected", {}))
            logger.info("kernels for %s: %s", name, choice.describe())
            return choice
        t0 = time.perf_counter()
        choice = measure(layer, lm_head, dtype, candidates, default_backend(dtype, candidates), repeats)
        entries.setdefault("format", _FORMAT)
        entries[key] = {**choice.to_dict(), "key": fields}
    logger.info("kernels for %s: %s, measured in %.1f s; timings (µs) %s", name, choice.describe(),
                time.perf_counter() - t0, choice.timings_us)
    return choice


def available_backends(dtype: torch.dtype) -> list[str]:
    """The backends that run on this CPU for ``dtype``: dense always, packed when oneDNN's packed
    linear works, gemv (float32, bfloat16) when the kernel library is built, mkl_packed (float32)
    when it is built and torch has MKL (an absence is logged once)."""
    import torch

    from pdserve.engine.linear import gemv_available, mkl_packed_available, packed_available

    return (["dense"] + (["packed"] if packed_available(dtype, torch.device("cpu")) else [])
            + (["gemv"] if dtype in (torch.float32, torch.bfloat16) and gemv_available() else [])
            + (["mkl_packed"] if dtype == torch.float32 and mkl_packed_available() else []))


def default_backend(dtype: torch.dtype, candidates: list[str]) -> str:
    """The backend kept unless another is clearly faster: packed for bf16 (measured faster on the
    machines we know), dense for float32 (oneDNN's per-call cost outweighs what it saves)."""
    import torch

    return "packed" if dtype == torch.bfloat16 and "packed" in candidates else "dense"


def measure(layer: LayerWeights, lm_head: torch.Tensor, dtype: torch.dtype, candidates: list[str],
            default: str, repeats: int = REPEATS) -> KernelChoice:
    """Steps 2-4 of the module docstring, without the cache."""
    calls = _calls(layer, lm_head, dtype, candidates)
    tol = 0.03 if dtype != _float32() else 1e-3
    timings: dict[str, dict[str, dict[str, float]]] = {}
    rejected: dict[str, str] = {}
    backends: dict[str, str] = {}
    for op in OPS:
        ok: dict[str, dict[str, float]] = {}
        for backend in candidates:
            why = _disagreement(calls, op, backend, tol)
            if why:
                rejected[f"{op}/{backend}"] = why
                logger.warning("kernel %s/%s rejected: %s", op, backend, why)
                continue
            ok[backend] = {str(m): round(_best_us(calls[op][backend], m, repeats), 1) for m in timed_m(op)}
        timings[op] = ok
        backends[op] = pick(ok, default)
    return KernelChoice(backends, "measured", timings, rejected)


def timed_m(op: str) -> tuple[int, ...]:
    """The row counts ``op`` is timed at: decode and prefill sizes, except for the LM head, which
    runs on one row per sequence (a prompt's last token, each decode row): decode sizes only."""
    return DECODE_M if op == "lm_head" else (*DECODE_M, *PREFILL_M)


def pick(timings: dict[str, dict[str, float]], default: str, margin: float = SWITCH_MARGIN) -> str:
    """The backend with the lowest mean time relative to ``default`` over the shapes; ``default``
    unless another beats it by more than ``margin`` (or ``default`` was rejected)."""
    if not timings:
        raise RuntimeError("no matmul backend agreed with the float32 reference")
    if default not in timings:
        return min(timings, key=lambda b: sum(timings[b].values()))
    base = timings[default]
    score = {b: sum(t[m] / base[m] for m in base) / len(base) for b, t in timings.items()}
    best = min(score, key=score.__getitem__)
    return best if score[best] < 1.0 - margin else default


# ------------------------------------------------------------------------- internals
def _float32() -> torch.dtype:
    import torch

    return torch.float32


_Call = Callable[[int], "torch.Tensor"]


def _calls(layer: LayerWeights, lm_head: torch.Tensor, dtype: torch.dtype,
           candidates: list[str]) -> dict[str, dict[str, _Call]]:
    """op -> backend -> f(M), plus op -> "reference" (float32 dense on the same weights)."""
    import dataclasses

    import torch

    from pdserve.engine.linear import DenseLinear, GemvLinear, LmHead, MklPackedLinear, PackedLinear

    gen = torch.Generator().manual_seed(0)
    m_max = max(PREFILL_M)
    hidden, attn = layer.qkv.shape[1], layer.o.shape[1]
    h = torch.randn(m_max, hidden, generator=gen).to(dtype)
    a = torch.randn(m_max, attn, generator=gen).to(dtype)
    x = torch.randn(m_max, hidden, generator=gen).to(dtype)
    f32 = dataclasses.replace(layer, **{f.name: getattr(layer, f.name).float() for f in dataclasses.fields(layer)
                                        if getattr(layer, f.name) is not None})
    impls = {"reference": (DenseLinear(f32), LmHead(lm_head.float(), "dense"), torch.float32)}
    layer_impls = {"dense": DenseLinear, "packed": PackedLinear, "gemv": GemvLinear, "mkl_packed": MklPackedLinear}
    for backend in candidates:
        impls[backend] = (layer_impls[backend](layer), LmHead(lm_head, backend), dtype)
    out: dict[str, dict[str, _Call]] = {op: {} for op in OPS}
    for backend, (mm, head, dt) in impls.items():
        hh, aa, xx = h.to(dt), a.to(dt), x.to(dt)
        out["qkv"][backend] = lambda m, mm=mm, hh=hh: mm.qkv(hh[:m])
        out["o_add"][backend] = lambda m, mm=mm, aa=aa, xx=xx: mm.o_add(aa[:m], xx[:m])
        out["mlp_add"][backend] = lambda m, mm=mm, hh=hh, xx=xx: mm.mlp_add(hh[:m], xx[:m])
        out["lm_head"][backend] = lambda m, head=head, hh=hh: head(hh[:m])
    return out


def _disagreement(calls: dict[str, dict[str, _Call]], op: str, backend: str, tol: float) -> str:
    """"" when ``backend`` matches the reference on ``op`` at every timed M, else why not."""
    import torch

    with torch.inference_mode():
        for m in timed_m(op):
            ref = calls[op]["reference"](m).float()
            try:
                got = calls[op][backend](m).float()
            except (RuntimeError, AttributeError) as exc:
                return f"failed at M={m}: {exc}"
            err = float((got - ref).abs().max()) / max(float(ref.abs().max()), 1e-12)
            if not err <= tol:
                return f"max error {err:.2e} of the float32 reference's range at M={m} (tolerance {tol})"
    return ""


def _best_us(call: _Call, m: int, repeats: int) -> float:
    import torch

    with torch.inference_mode():
        call(m)  # warm-up: plans and caches for this shape
        best = float("inf")
        for _ in range(max(1, repeats)):
            t0 = time.perf_counter()
            call(m)
            best = min(best, time.perf_counter() - t0)
    return best * 1e6

"""Matmul backends for one decoder layer's projections.

``DenseLinear`` uses plain ``torch`` ops (any device, any dtype) and folds residual adds into
``addmm``. ``PackedLinear`` (CPU) pre-packs each weight into oneDNN's blocked layout once at load
time and fuses the epilogues (bias, SiLU, the SwiGLU product, the residual add) into the matmuls;
in bf16 this avoids ``F.linear``'s per-call re-planning, which dominates at decode batch sizes.

Both expose the same three calls, so the layer never branches on the backend:
    qkv(h)           -> h @ W_qkv^T (+ bias)                    [T, (heads + 2 kv_heads) * head_dim]
    o_add(a, x)      -> x + a @ W_o^T (+ bias)                  the residual after attention
    mlp_add(h, x)    -> x + (silu(h @ W_gate^T) * (h @ W_up^T)) @ W_down^T

``GemvLinear`` keeps DenseLinear's ``[in, out]`` tensors and, for calls of at most
``GEMV_MAX_ROWS`` rows (batch-1 decode), runs ``torch.ops.pdserve.gemv`` on them (the C++ kernel
streams the weight once, fp32 accumulation, bias/residual fused); more rows take DenseLinear's
``mm``/``addmm`` on the same tensors, so it holds one copy of each weight.

``MklPackedLinear`` (CPU, float32) packs each weight once with MKL's ``cblas_sgemm_pack`` and runs
``cblas_sgemm_compute`` (``torch.ops.pdserve.blas_packed_mm``): torch's ``mm`` repacks the weight on
every call, which at decode row counts costs about as much as the products. Bias and residual adds
ride in the GEMM (beta = 1).

``MixedLinear`` takes each call from the backend ``engine/kernel_select.py`` measured fastest for
it on this machine; ``make_layer_linear`` builds whichever a choice needs. Each
backend builds only the weights of the calls it serves (``ops``), so no weight is held twice.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from pdserve.engine.loader import LayerWeights

logger = logging.getLogger(__name__)

LAYER_OPS = frozenset({"qkv", "o_add", "mlp_add"})
BACKENDS = ("dense", "packed", "gemv", "mkl_packed")
GEMV_MAX_ROWS = 8   # torch.ops.pdserve.gemv takes 1..8 rows


class DenseLinear:
    """Weights stored transposed and contiguous (``[in, out]``): ``mm``/``addmm`` on that layout
    measured faster than ``F.linear`` at decode batch sizes > 1 (MKL's small-M path)."""

    __slots__ = ("qkv_t", "qkv_b", "o_t", "o_b", "gate_up_t", "down_t", "inter")

    def __init__(self, w: LayerWeights, ops: frozenset[str] = LAYER_OPS) -> None:
        t = lambda m: m.t().contiguous()  # noqa: E731
        self.qkv_t, self.qkv_b = (t(w.qkv), w.qkv_bias) if "qkv" in ops else (None, None)
        self.o_t, self.o_b = (t(w.o), w.o_bias) if "o_add" in ops else (None, None)
        self.gate_up_t = t(w.gate_up) if "mlp_add" in ops else None
        self.down_t = t(w.down) if "mlp_add" in ops else None
        self.inter = w.down.shape[1]

    def qkv(self, h: torch.Tensor) -> torch.Tensor:
        if self.qkv_b is None:
            return torch.mm(h, self.qkv_t)
        return torch.addmm(self.qkv_b, h, self.qkv_t)

    def o_add(self, a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.o_b is not None:
            x = x + self.o_b
        return torch.addmm(x, a, self.o_t)

    def mlp_add(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        gu = torch.mm(h, self.gate_up_t)
        return torch.addmm(x, F.silu(gu[:, : self.inter]) * gu[:, self.inter :], self.down_t)


class PackedLinear:
    """oneDNN-packed weights with fused epilogues (CPU only); holds no unpacked copy."""

    __slots__ = ("qkv_w", "qkv_b", "o_w", "o_b", "gate_w", "up_w", "down_w", "op")

    def __init__(self, w: LayerWeights, ops: frozenset[str] = LAYER_OPS) -> None:
        pack = torch.ops.mkldnn._reorder_linear_weight
        inter = w.down.shape[1]
        self.qkv_w, self.qkv_b = (pack(w.qkv, None), w.qkv_bias) if "qkv" in ops else (None, None)
        self.o_w, self.o_b = (pack(w.o, None), w.o_bias) if "o_add" in ops else (None, None)
        mlp = "mlp_add" in ops
        self.gate_w = pack(w.gate_up[:inter].contiguous(), None) if mlp else None
        self.up_w = pack(w.gate_up[inter:].contiguous(), None) if mlp else None
        self.down_w = pack(w.down, None) if mlp else None
        self.op = torch.ops.mkldnn._linear_pointwise

    def qkv(self, h: torch.Tensor) -> torch.Tensor:
        return self.op(h, self.qkv_w, self.qkv_b, "none", [], "")

    def o_add(self, a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.op.binary(a, x, self.o_w, self.o_b, "add")

    def mlp_add(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        g = self.op(h, self.gate_w, None, "swish", [], "")
        return self.op.binary(self.op.binary(h, g, self.up_w, None, "mul"), x, self.down_w, None, "add")


class GemvLinear(DenseLinear):
    """DenseLinear's weights; calls of 1..``GEMV_MAX_ROWS`` rows run ``torch.ops.pdserve.gemv`` (CPU,
    fp32/bf16; needs the kernel library, see ``gemv_available``), larger ones DenseLinear's matmuls."""

    __slots__ = ("_gemv",)

    def __init__(self, w: LayerWeights, ops: frozenset[str] = LAYER_OPS) -> None:
        super().__init__(w, ops)
        self._gemv = torch.ops.pdserve.gemv

    def qkv(self, h: torch.Tensor) -> torch.Tensor:
        if not 0 < h.shape[0] <= GEMV_MAX_ROWS:
            return super().qkv(h)
        return self._gemv(h, self.qkv_t, self.qkv_b)

    def o_add(self, a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if not 0 < a.shape[0] <= GEMV_MAX_ROWS:
            return super().o_add(a, x)
        return self._gemv(a, self.o_t, x if self.o_b is None else x + self.o_b)

    def mlp_add(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if not 0 < h.shape[0] <= GEMV_MAX_ROWS:
            return super().mlp_add(h, x)
        gu = self._gemv(h, self.gate_up_t, None)
        return self._gemv(F.silu(gu[:, : self.inter]) * gu[:, self.inter :], self.down_t, x)


class MklPackedLinear:
    """Weights packed by MKL for ``torch.ops.pdserve.blas_packed_mm`` (float32, CPU); no plain copy."""

    __slots__ = ("qkv_p", "qkv_b", "n_qkv", "o_p", "o_b", "n_o", "gu_p", "down_p", "inter", "hidden", "mm")

    def __init__(self, w: LayerWeights, ops: frozenset[str] = LAYER_OPS) -> None:
        pack = torch.ops.pdserve.blas_pack
        self.mm = torch.ops.pdserve.blas_packed_mm
        self.n_qkv, self.n_o = w.qkv.shape[0], w.o.shape[0]
        self.inter, self.hidden = w.down.shape[1], w.down.shape[0]
        self.qkv_p, self.qkv_b = (pack(w.qkv), w.qkv_bias) if "qkv" in ops else (None, None)
        self.o_p, self.o_b = (pack(w.o), w.o_bias) if "o_add" in ops else (None, None)
        mlp = "mlp_add" in ops
        self.gu_p = pack(w.gate_up) if mlp else None
        self.down_p = pack(w.down) if mlp else None

    def qkv(self, h: torch.Tensor) -> torch.Tensor:
        return self.mm(h, self.qkv_p, self.n_qkv, self.qkv_b)

    def o_add(self, a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.mm(a, self.o_p, self.n_o, x if self.o_b is None else x + self.o_b)

    def mlp_add(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        gu = self.mm(h, self.gu_p, 2 * self.inter, None)
        return self.mm(F.silu(gu[:, : self.inter]) * gu[:, self.inter :], self.down_p, self.hidden, x)


class MixedLinear:
    """Each of the three calls from its own backend (``choice`` maps a call to one of ``BACKENDS``)."""

    __slots__ = ("qkv", "o_add", "mlp_add", "backends")

    def __init__(self, w: LayerWeights, choice: dict[str, str]) -> None:
        self.backends = {op: choice[op] for op in sorted(LAYER_OPS)}
        ops_of = lambda name: frozenset(op for op, b in self.backends.items() if b == name)  # noqa: E731
        impls = {"dense": DenseLinear, "packed": PackedLinear, "gemv": GemvLinear, "mkl_packed": MklPackedLinear}
        built = {name: impls[name](w, ops_of(name)) for name in BACKENDS if ops_of(name)}
        pick = lambda op: getattr(built[self.backends[op]], op)  # noqa: E731
        self.qkv, self.o_add, self.mlp_add = pick("qkv"), pick("o_add"), pick("mlp_add")


def make_layer_linear(w: LayerWeights,
                      choice: dict[str, str]
                      ) -> DenseLinear | PackedLinear | GemvLinear | MklPackedLinear | MixedLinear:
    """The layer's matmuls as ``choice`` (call -> one of ``BACKENDS``) says; unknown names raise."""
    bad = {op: b for op, b in choice.items() if b not in BACKENDS}
    if bad or not LAYER_OPS <= choice.keys():
        raise ValueError(f"a linear choice needs one of {'/'.join(BACKENDS)} for each of {sorted(LAYER_OPS)}, "
                         f"got {choice}")
    backends = {choice[op] for op in LAYER_OPS}
    if backends == {"dense"}:
        return DenseLinear(w)
    if backends == {"packed"}:
        return PackedLinear(w)
    if backends == {"gemv"}:
        return GemvLinear(w)
    if backends == {"mkl_packed"}:
        return MklPackedLinear(w)
    return MixedLinear(w, choice)


@functools.cache
def gemv_available() -> bool:
    """True when ``torch.ops.pdserve.gemv`` is loaded (the kernel library built by ``make setup``);
    otherwise logs once why gemv is not a matmul candidate."""
    from pdserve.engine.kernels import load

    status = load()
    if status.available and hasattr(torch.ops.pdserve, "gemv"):
        return True
    logger.info("gemv matmul backend unavailable (%s); batch-1 calls use dense/packed matmuls",
                status.reason if not status.available else "library has no gemv op")
    return False


@functools.cache
def mkl_packed_available() -> bool:
    """True when ``torch.ops.pdserve.blas_packed_mm`` is loaded and this torch build has MKL's
    packed GEMM (looked up at run time: a torch without MKL still loads the library)."""
    from pdserve.engine.kernels import load

    status = load()
    if status.available and hasattr(torch.ops.pdserve, "blas_packed_mm"):
        if torch.ops.pdserve.blas_packed_available():
            return True
        logger.info("mkl_packed matmul backend unavailable: this torch build has no MKL packed GEMM")
        return False
    logger.info("mkl_packed matmul backend unavailable (%s)",
                status.reason if not status.available else "library has no blas_packed_mm op")
    return False


def packed_available(dtype: torch.dtype, device: torch.device) -> bool:
    """True when oneDNN's packed linear runs here and agrees with the dense path on a probe."""
    if device.type != "cpu":
        return False
    gen = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=gen).to(dtype)  # noqa: E731
    probe = LayerWeights(input_norm=r(32), qkv=r(48, 32), qkv_bias=r(48), o=r(32, 16), o_bias=None,
                         post_norm=r(32), gate_up=r(64, 32), down=r(32, 32))
    h, a, x = r(3, 32), r(3, 16), r(3, 32)
    try:
        packed, dense = PackedLinear(probe), DenseLinear(probe)
        pairs = [(packed.qkv(h), dense.qkv(h)), (packed.o_add(a, x), dense.o_add(a, x)),
                 (packed.mlp_add(h, x), dense.mlp_add(h, x))]
    except (RuntimeError, AttributeError) as exc:
        logger.info("oneDNN packed linear unavailable (%s); using dense matmuls", exc)
        return False
    ok = all(float((p.float() - d.float()).abs().max()) <= 0.02 * float(d.float().abs().max()) for p, d in pairs)
    if not ok:
        logger.warning("oneDNN packed linear disagrees with F.linear on a probe; using dense matmuls")
    return ok


class LmHead:
    """``x @ W^T`` for the output projection: "dense" (``F.linear`` on W itself, which may be the
    tied embedding), "packed" (oneDNN), "gemv" (W transposed ``[hidden, vocab]``: the gemv kernel
    for 1..``GEMV_MAX_ROWS`` rows, ``mm`` on the same tensor above), or "mkl_packed" (W packed by
    MKL once)."""

    __slots__ = ("w", "backend", "n")

    def __init__(self, w: torch.Tensor, backend: str) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"lm_head backend must be one of {BACKENDS}, got {backend!r}")
        self.backend, self.n = backend, w.shape[0]
        if backend == "mkl_packed":
            self.w = torch.ops.pdserve.blas_pack(w)
        elif backend == "packed":
            self.w = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), None)
        elif backend == "gemv":
            self.w = w.t().contiguous()
        else:
            self.w = w

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend == "mkl_packed":
            return torch.ops.pdserve.blas_packed_mm(x, self.w, self.n, None)
        if self.backend == "packed":
            return torch.ops.mkldnn._linear_pointwise(x, self.w, None, "none", [], "")
        if self.backend == "gemv":
            if 0 < x.shape[0] <= GEMV_MAX_ROWS:
                return torch.ops.pdserve.gemv(x, self.w, None)
            return torch.mm(x, self.w)
        return F.linear(x, self.w)

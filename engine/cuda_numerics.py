"""How CUDA computes for the engine: float32 means IEEE float32, and (for parity checks) one
deterministic attention kernel.

* ``disable_tf32()``: float32 matmuls on CUDA may run as TF32 (10-bit mantissa) when torch is told
  so; a ``dtype: float32`` engine must not. ``ModelRunner`` calls it when its device is CUDA
  (process-wide: a worker process holds one engine).
* ``deterministic_attention(True)``: ``scaled_dot_product_attention`` restricted to its math
  backend (no flash, memory-efficient or cuDNN kernels, whose choice depends on shapes and whose
  reductions differ from transformers' eager path). For parity checks (``scripts/gpu_check_engine.py``
  calls it); ``False`` gives torch back its choice. It does not constrain the "flex" and "varlen"
  attention backends; the float32 parity check runs on "sdpa".

Both change torch's process-wide settings and return what they set, for the check's record.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def disable_tf32() -> dict[str, bool]:
    """IEEE float32 for CUDA matmuls and cuDNN (TF32 off); returns the flags as read back.

    Set through ``allow_tf32``, the API every torch since 1.12 has: torch >= 2.9 maps it onto its
    ``fp32_precision`` settings, while setting those directly makes any later read of
    ``cudnn.allow_tf32`` (by torch's compiler, by a library) raise on the mix of the two APIs."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    applied = {"cuda.matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
               "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32}
    logger.info("CUDA float32: TF32 off (%s)", applied)
    return applied


def deterministic_attention(enabled: bool) -> dict[str, bool]:
    """SDPA on its math backend only (``enabled``) or on torch's choice; returns the backends' state."""
    import torch

    cuda = torch.backends.cuda
    cuda.enable_math_sdp(True)
    cuda.enable_flash_sdp(not enabled)
    cuda.enable_mem_efficient_sdp(not enabled)
    if hasattr(cuda, "enable_cudnn_sdp"):
        cuda.enable_cudnn_sdp(not enabled)
    state = {"math": cuda.math_sdp_enabled(), "flash": cuda.flash_sdp_enabled(),
             "mem_efficient": cuda.mem_efficient_sdp_enabled(),
             "cudnn": cuda.cudnn_sdp_enabled() if hasattr(cuda, "cudnn_sdp_enabled") else False}
    logger.info("SDPA backends: %s", state)
    return state

"""The switches the GPU parity check relies on (engine/cuda_numerics.py): they set torch's
process-wide flags, which exist on a CPU build too, and say what they set."""

from __future__ import annotations

import torch

from pdserve.engine.cuda_numerics import deterministic_attention, disable_tf32


def test_deterministic_attention_leaves_sdpa_only_its_math_backend():
    try:
        state = deterministic_attention(True)
        assert state == {"math": True, "flash": False, "mem_efficient": False, "cudnn": False}
        assert not torch.backends.cuda.flash_sdp_enabled()
    finally:
        state = deterministic_attention(False)
    assert state["math"] and state["flash"] and state["mem_efficient"]


def test_disable_tf32_says_what_it_set():
    matmul = torch.backends.cuda.matmul
    new_api = hasattr(matmul, "fp32_precision")
    before = (matmul.fp32_precision, torch.backends.cudnn.fp32_precision) if new_api else matmul.allow_tf32
    try:
        applied = disable_tf32()
        if new_api:
            assert matmul.fp32_precision == "ieee"
            assert applied["cuda.matmul.fp32_precision"] == "ieee"
        else:
            assert matmul.allow_tf32 is False
            assert applied["cuda.matmul.allow_tf32"] == "False"
    finally:
        if new_api:
            matmul.fp32_precision, torch.backends.cudnn.fp32_precision = before
        else:
            matmul.allow_tf32 = before

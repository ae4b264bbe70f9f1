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
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    before = (matmul.allow_tf32, cudnn.allow_tf32)
    try:
        matmul.allow_tf32 = cudnn.allow_tf32 = True
        assert disable_tf32() == {"cuda.matmul.allow_tf32": False, "cudnn.allow_tf32": False}
        assert (matmul.allow_tf32, cudnn.allow_tf32) == (False, False)
        assert torch.get_float32_matmul_precision() == "highest"
    finally:
        matmul.allow_tf32, cudnn.allow_tf32 = before

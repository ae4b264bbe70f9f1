"""``scripts/gpu_check_engine.py --device cpu --quick`` end to end, as the GPU machine would run it
(torch and transformers only, pdserve not installed: ``tests/gpu_machine_env.py``): it writes the
JSON the GPU check's runner reads, float32 parity holds, and every figure is there."""

from __future__ import annotations

import json

import pytest
from gpu_machine_env import run_python

RUN = """
import gpu_check_engine
sys.exit(gpu_check_engine.main(sys.argv[1:]))
"""


@pytest.mark.timeout(600)
def test_quick_run_on_cpu_writes_the_json(tmp_path, tiny_model, tiny_qwen2_model):
    out = tmp_path / "engine.json"
    cache = tiny_model.parent   # the models the session generated: none is built again
    done = run_python(RUN, tmp_path, "--device", "cpu", "--quick", "--out", str(out), "--cache-dir", str(cache))
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.startswith("engine check on cpu: parity_fp32=True"), done.stdout
    r = json.loads(out.read_text())
    assert r["device"] == "cpu" and r["quick"] is True
    assert r["parity_fp32"] is True
    for arch in ("llama", "qwen2"):
        detail = r["parity_fp32_detail"][arch]
        assert detail["mismatches"] == [] and detail["prefix_hit_tokens"] >= 32
    assert r["parity_bf16"] is True
    assert set(r["bf16_tolerance"]) == {"llama", "qwen2"}
    assert r["vs_hf_decode_b32"] is None                        # quick: batches 1 and 8 only
    assert [row["batch"] for row in r["decode"]] == [1, 8]
    assert all(row["tok_s"] > 0 and row["hf_tok_s"] > 0 and row["vs_hf"] > 0 for row in r["decode"])
    assert r["decode_roofline_ratio"] > 0 and r["copy_gbs"] > 0
    cands = r["attention_candidates"]   # flash varlen: CUDA only
    assert cands["sdpa"]["decode"]["tok_s"] > 0 and cands["flex"]["decode"]["tok_s"] > 0
    assert cands["sdpa"]["bf16"]["ok"] and cands["flex"]["bf16"]["ok"]
    assert "CUDA" in cands["varlen"]["decode"]["error"] and "CUDA" in cands["varlen"]["bf16"]["error"]
    assert r["complete"] is True

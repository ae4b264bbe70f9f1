"""The model runner's logits match transformers (eager, fp32) on the same checkpoint.

Each scenario runs mixed engine steps through ``ModelRunner.execute``: whole prefills, prefills
split into chunks whose boundaries are not block-aligned (later chunks read earlier ones from the
cache), decodes of sequences of different lengths batched in one call together with prefill
chunks, items listed prefill-first (the runner reorders internally but must answer in item order),
and shuffled, non-contiguous block tables. After every step each returned row is compared with
transformers' full forward over the whole sequence so far (no KV cache on the reference side).
"""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from pdserve.engine.model_runner import ForwardItem, ModelRunner
from pdserve.engine.testmodel import ensure_model

BLOCK = 8
LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
# (prompt length, chunk sizes); chunk boundaries 13, 21, 42 fall inside blocks of 8
PROMPTS = [(7, [7]), (19, [19]), (37, [13, 24]), (50, [21, 21, 8])]


def _hf(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()


def _reference(hf, seq: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([seq])).logits[0, -1].float()


def run_scenario(runner: ModelRunner, hf, decode_steps: int = 5, seed: int = 0):
    """Yield (our logits row, reference row, sequence) for every sampled row of every step."""
    rng = random.Random(seed)
    vocab = runner.spec.vocab_size
    free = list(range(runner.num_blocks))
    rng.shuffle(free)
    seqs, tables, chunks = [], [], []
    for n, sizes in PROMPTS:
        seqs.append([rng.randrange(vocab) for _ in range(n)])
        tables.append([free.pop() for _ in range(-(-(n + decode_steps + 1) // BLOCK))])
        chunks.append(list(sizes))
    done = [0] * len(seqs)  # tokens whose KV is in the cache
    while True:
        items, owners = [], []
        for i in range(len(seqs)):  # prefill chunks first, decodes after: the runner must reorder
            if chunks[i]:
                n = chunks[i].pop(0)
                items.append(ForwardItem(seqs[i][done[i] : done[i] + n], done[i], tables[i], not chunks[i]))
                owners.append(i)
        for i in range(len(seqs)):
            if not chunks[i] and done[i] == len(seqs[i]) - 1 and len(seqs[i]) <= PROMPTS[i][0] + decode_steps:
                items.append(ForwardItem([seqs[i][-1]], done[i], tables[i], True))
                owners.append(i)
        if not items:
            return
        logits = runner.execute(items)
        assert logits.shape == (sum(it.sample for it in items), vocab)
        assert logits.dtype == torch.float32
        row = 0
        for it, i in zip(items, owners):
            done[i] += len(it.token_ids)
            if it.sample:
                yield logits[row], _reference(hf, seqs[i]), list(seqs[i])
                seqs[i].append(int(logits[row].argmax()))
                row += 1


def assert_scenario_exact(runner: ModelRunner, hf, label: str) -> None:
    """Every row of the scenario within 1e-4 of transformers' logits (relative to their scale)."""
    rows = 0
    for ours, ref, _ in run_scenario(runner, hf):
        scale, diff = float(ref.abs().max()), float((ours - ref).abs().max())
        assert diff <= 1e-4 * scale, f"{label}: max |diff| {diff:.3g} at logit scale {scale:.3g}"
        rows += 1
    assert rows == len(PROMPTS) * 6  # one prefill row + 5 decode rows per sequence


def _as_mistral(src, dst):
    """The tiny llama checkpoint relabelled as MistralForCausalLM (same tensors and shapes)."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=None)
    for key in ("attention_bias", "mlp_bias", "pretraining_tp"):
        cfg.pop(key, None)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module", params=["llama", "qwen2", "llama3-rope", "mistral"])
def model_pair(request, tmp_path_factory):
    torch.manual_seed(0)
    if request.param == "llama3-rope":
        model_dir = ensure_model("tiny", arch="llama", rope_scaling=LLAMA3)
    elif request.param == "mistral":
        model_dir = _as_mistral(ensure_model("tiny"), tmp_path_factory.mktemp("mistral") / "model")
    else:
        model_dir = ensure_model("tiny", arch=request.param)
    hf = _hf(model_dir)
    return request.param, model_dir, hf


@pytest.mark.parametrize("backend", ["dense", "packed"])
def test_fp32_logits_match_transformers(model_pair, backend):
    name, model_dir, hf = model_pair
    if name == "llama3-rope":
        assert hf.config.rope_parameters["rope_type"] == "llama3"  # the reference really is scaled
    if name == "mistral":
        assert type(hf).__name__ == "MistralForCausalLM"
    runner = ModelRunner(model_dir, dtype="float32", block_size=BLOCK, num_blocks=64, num_threads=1,
                         linear_backend=backend)
    assert runner.linear_backend == backend
    worst, rows = 0.0, 0
    for ours, ref, _ in run_scenario(runner, hf):
        scale = float(ref.abs().max())
        diff = float((ours - ref).abs().max())
        worst = max(worst, diff / scale)
        rows += 1
        assert diff <= 1e-4 * scale, f"{name}: max |diff| {diff:.3g} at logit scale {scale:.3g}"
    assert rows == len(PROMPTS) * 6  # one prefill row + 5 decode rows per sequence
    print(f"{name} {backend}: worst max|diff|/max|logit| = {worst:.2e} over {rows} rows")


@pytest.mark.parametrize("linear,attention", [("gemv", "auto"), ("mkl_packed", "auto"), ("dense", "sdpa"),
                                              ("dense", "flex")])
def test_fp32_llama_other_kernels_match_transformers(linear, attention):
    """One Llama case per alternative path, so each stays covered: the gemv matmuls (every decode
    step here has at most 8 rows), MKL's packed matmuls, the gather + SDPA attention (the portable
    path) and FlexAttention over packed contexts (a GPU candidate, eager on CPU)."""
    model_dir = ensure_model("tiny")
    hf = _hf(model_dir)
    runner = ModelRunner(model_dir, dtype="float32", block_size=BLOCK, num_blocks=64, num_threads=1,
                         linear_backend=linear, attention_backend=attention)
    assert runner.linear_backend == linear
    if attention != "auto":
        assert runner.attention_backend == attention
    assert_scenario_exact(runner, hf, f"{linear}/{attention}")


def test_fp32_logits_with_bucketed_rows_match_transformers(monkeypatch):
    """Steps whose matmuls run at a padded row count (engine/row_buckets.py: on for bf16 and for
    oneDNN's packed float32, forced here on dense float32) stay exact: the padding rows go through
    the matmuls and norms only, never RoPE, attention or the sampled rows."""
    import pdserve.engine.model_runner as model_runner

    model_dir = ensure_model("tiny")
    hf = _hf(model_dir)
    runner = ModelRunner(model_dir, dtype="float32", block_size=BLOCK, num_blocks=64, num_threads=1,
                         linear_backend="dense")
    assert not runner.bucket_rows        # float32 through MKL builds nothing per shape
    runner.bucket_rows = True
    seen: list[tuple[int, int]] = []
    bucket = model_runner.row_bucket
    monkeypatch.setattr(model_runner, "row_bucket", lambda n: seen.append((n, bucket(n))) or bucket(n))
    assert_scenario_exact(runner, hf, "dense, bucketed rows")
    assert any(b > n for n, b in seen), f"no step was padded: {seen}"


@pytest.mark.parametrize("fresh", ["native", "sdpa"])
def test_fp32_fresh_prefill_chunks_either_way_match_transformers(fresh):
    """Fresh prefill chunks (nothing cached before them) take whichever of the C++ kernel and SDPA
    measured faster at start; both paths stay exact, including SDPA for fresh chunks beside kernel
    calls, one chunk at a time, for chunks that continue a prompt in the same step."""
    model_dir = ensure_model("tiny")
    hf = _hf(model_dir)
    runner = ModelRunner(model_dir, dtype="float32", block_size=BLOCK, num_blocks=64, num_threads=1)
    assert runner.describe()["fresh_prefill_attention"] in ("native", "sdpa")
    assert runner.describe()["fresh_prefill_timings_ms"].keys() == {"native", "sdpa"}
    assert float(runner.kv_cache.abs().max()) == 0.0        # the start-up probe left no trace
    runner._cache.fresh_prefill = fresh
    assert_scenario_exact(runner, hf, f"fresh={fresh}")
    # one step holding a chunk that continues a prompt and a fresh prompt: SDPA for the fresh one
    # and the kernel for the other, in their rows' order
    a, c = list(range(3, 40)), list(range(50, 71))
    runner.execute([ForwardItem(a[:13], 0, [10, 11, 12, 13, 14], False)])
    got = runner.execute([ForwardItem(a[13:], 13, [10, 11, 12, 13, 14], True), ForwardItem(c, 0, [20, 21, 22], True)])
    for row, seq in zip(got, (a, c)):
        ref = _reference(hf, seq)
        assert float((row - ref).abs().max()) <= 1e-4 * float(ref.abs().max())


def test_llama3_scaling_changes_logits():
    """Guards the llama3 parity test: with scaling ignored, logits would differ."""
    plain = ModelRunner(ensure_model("tiny"), block_size=BLOCK, num_blocks=16)
    scaled = ModelRunner(ensure_model("tiny", rope_scaling=LLAMA3), block_size=BLOCK, num_blocks=16)
    item = ForwardItem(list(range(1, 40)), 0, list(range(5)), True)
    a, b = plain.execute([item]), scaled.execute([item])
    assert float((a - b).abs().max()) > 1e-2


@pytest.mark.parametrize("arch,backend", [("llama", "auto"), ("qwen2", "auto"), ("llama", "dense")])
def test_bf16_close_to_fp32(arch, backend):
    model_dir = ensure_model("tiny", arch=arch)
    hf = _hf(model_dir)
    runner = ModelRunner(model_dir, dtype="bfloat16", block_size=BLOCK, num_blocks=64, num_threads=1,
                         linear_backend=backend)
    assert runner.kv_cache.dtype == torch.bfloat16
    agree, rows, worst = 0, 0, 0.0
    for ours, ref, _ in run_scenario(runner, hf):
        scale = float(ref.abs().max())
        worst = max(worst, float((ours - ref).abs().max()) / scale)
        agree += int(ours.argmax() == ref.argmax())
        rows += 1
    print(f"bf16 {arch} {runner.linear_backend}: worst relative diff {worst:.3f}, top-1 agreement {agree}/{rows}")
    assert worst < 0.15
    assert agree >= 0.8 * rows


def test_non_sampling_items_return_no_rows_and_cache_is_reused():
    model_dir = ensure_model("tiny")
    runner = ModelRunner(model_dir, dtype="float32", block_size=BLOCK, num_blocks=8)  # 1e-4 below
    prompt = list(range(3, 30))
    table = [6, 2, 5, 0]
    assert runner.execute([ForwardItem(prompt[:11], 0, table, False)]).shape == (0, runner.spec.vocab_size)
    chunked = runner.execute([ForwardItem(prompt[11:], 11, table, True)])
    whole = runner.execute([ForwardItem(prompt, 0, [1, 3, 4, 7], True)])
    torch.testing.assert_close(chunked, whole, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="block table"):
        runner.execute([ForwardItem(prompt, 0, [1, 3], True)])
    with pytest.raises(ValueError, match="outside"):
        runner.execute([ForwardItem([1], 0, [99], True)])

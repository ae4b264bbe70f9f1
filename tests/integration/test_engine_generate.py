"""The whole engine (scheduler + block manager + runner + sampler) against transformers' generate."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams


PROMPT_LENS = (1, 7, 16, 33, 70)
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def hf_model(tiny_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), torch_dtype=torch.float32)
    model.eval()
    return model


@pytest.fixture(scope="module")
def prompts(tiny_model) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    from pdserve.engine.loader import load_model_spec

    vocab = load_model_spec(tiny_model).vocab_size
    return [torch.randint(5, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def reference(hf_model, prompts) -> list[list[int]]:
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = hf_model.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                                    do_sample=False, pad_token_id=0)
            out.append(ids[0, len(p):].tolist())
    return out


def make_engine(model_dir, **kw) -> LLMEngine:
    cfg = dict(model_dir=str(model_dir), kv_cache_memory_gb=0.02, num_threads=1, dtype="float32")  # vs HF fp32
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg))


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("case", [
    dict(),                                                     # defaults: chunked prefill, prefix caching
    dict(enable_prefix_caching=False),
    dict(enable_chunked_prefill=False, max_num_batched_tokens=4096),
    dict(max_num_batched_tokens=8),                             # chunks much smaller than the prompts
    dict(max_num_seqs=1),                                       # batch 1
])
def test_greedy_matches_transformers(tiny_model, prompts, reference, case) -> None:
    engine = make_engine(tiny_model, **case)
    assert engine.generate(prompts, GREEDY) == reference
    assert engine.block_manager.all_free()


def test_the_between_layers_hook_runs_between_every_two_layers_and_changes_no_token(tiny_model, prompts,
                                                                                   reference) -> None:
    """A prefill worker moves its KV pushes on from this hook; it runs in interactive steps too
    (which it never interrupts) and the tokens stay the same."""
    engine = make_engine(tiny_model)
    calls, steps = [], []
    engine.between_layers = lambda: calls.append(len(steps))
    step = engine.step

    def counted_step():
        out = step()
        steps.append(1)
        return out

    engine.step = counted_step
    assert engine.generate(prompts, GREEDY) == reference
    layers = engine.spec.num_layers
    ran = [n for n in range(len(steps)) if n in set(calls)]
    assert ran and all(calls.count(n) == layers for n in ran)   # once before each layer of a step
    assert len(ran) >= MAX_TOKENS and engine.interrupted_steps == 0
    assert engine.block_manager.all_free()


def test_prefix_cache_hit_gives_same_tokens(tiny_model, prompts, reference) -> None:
    engine = make_engine(tiny_model)
    first = engine.generate([prompts[-1]], GREEDY)
    again = engine.generate([prompts[-1]], GREEDY)
    assert first == again == [reference[-1]]
    assert engine.block_manager.prefix_hit_tokens >= 64
    assert engine.block_manager.all_free()


def test_forced_preemption_keeps_tokens_identical(tiny_model, prompts, reference) -> None:
    # 14 blocks of 16 tokens cannot hold five sequences of up to 94 tokens: some are preempted
    # (recomputed) and must still produce exactly the same tokens.
    engine = make_engine(tiny_model, num_blocks=14)
    assert engine.generate(prompts, GREEDY) == reference
    assert engine.scheduler.num_preemptions_total > 0
    assert engine.block_manager.all_free()


def test_static_batching_baseline_matches(tiny_model, prompts, reference) -> None:
    from pdserve.engine.config import SchedulingPolicy

    engine = make_engine(tiny_model, policy=SchedulingPolicy.STATIC)
    assert engine.generate(prompts, GREEDY) == reference
    assert engine.block_manager.all_free()


def test_seeded_sampling_is_reproducible_and_differs_by_seed(tiny_model, prompts) -> None:
    engine = make_engine(tiny_model)
    p = lambda seed: SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, top_k=50, seed=seed,  # noqa: E731
                                    ignore_eos=True)
    a = engine.generate([prompts[2]], p(1))
    b = engine.generate([prompts[2]], p(1))
    c = engine.generate([prompts[2]], p(2))
    assert a == b
    assert a != c


def test_stop_conditions(tiny_model, prompts, reference) -> None:
    engine = make_engine(tiny_model)
    ref = reference[1]
    stop_tok = ref[5]
    out = engine.generate([prompts[1]], SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True,
                                                       stop_token_ids=(stop_tok,)))[0]
    assert out == ref[: ref.index(stop_tok) + 1]
    rid = "stop-string"
    tok = engine.stopper.tokenizer
    text = tok.decode(ref[:8], skip_special_tokens=True)
    stop = text[len(text) // 2: len(text) // 2 + 2] or text[:1]
    engine.add_request(rid, prompts[1], SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True,
                                                      stop=(stop,)))
    final = None
    emitted = ""
    while engine.has_unfinished():
        for o in engine.step():
            emitted += o.text_delta
            if o.finished:
                final = o
    assert final is not None and final.finish_reason == "stop"
    assert stop not in emitted
    assert engine.block_manager.all_free()


def test_phase_record_is_consistent(tiny_model, prompts) -> None:
    engine = make_engine(tiny_model)
    engine.add_request("r", prompts[3], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    final = None
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                final = o
    ph = final.phase
    assert (ph.prompt_tokens, ph.output_tokens, ph.finish_reason) == (len(prompts[3]), 10, "length")
    assert 0 <= ph.queue_s <= ph.ttft_s <= ph.total_s
    assert ph.decode_tokens_per_s and ph.decode_tokens_per_s > 0


@pytest.mark.parametrize("prompt,params,match", [
    ([], SamplingParams(max_tokens=4), "empty"),
    (list(range(5, 5000)), SamplingParams(max_tokens=4), "context length"),
    ([10**7], SamplingParams(max_tokens=4), "vocabulary"),
])
def test_bad_requests_raise_typed_errors(tiny_model, prompt, params, match) -> None:
    engine = make_engine(tiny_model)
    with pytest.raises(InvalidRequestError, match=match):
        engine.add_request("bad", prompt, params)
    assert engine.block_manager.all_free()


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(temperature=-1.0), "temperature"),
])
def test_bad_sampling_params_raise(kwargs, match) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(**kwargs)


def test_generate_cli_json(tiny_model) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "generate", "--model", str(tiny_model), "--max-tokens", "8",
         "--temperature", "0", "--ignore-eos", "--threads", "1", "--json", "The kitchen at seven"],
        capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert len(out["token_ids"]) == 8 and out["finish_reason"] == "length"
    assert out["phase"]["output_tokens"] == 8 and out["phase"]["prompt_tokens"] > 0
    assert isinstance(out["text"], str)


def test_generate_cli_streams_then_prints_phase_record(tiny_model) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "generate", "--model", str(tiny_model), "--max-tokens", "8",
         "--temperature", "0", "--threads", "1", "Hello"], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert "prefill:" in proc.stdout and "decode:" in proc.stdout and "tokens/s" in proc.stdout


def test_generate_cli_rejects_bad_input(tiny_model, tmp_path) -> None:
    empty = subprocess.run([sys.executable, "-m", "pdserve.cli", "generate", "--model", str(tiny_model), ""],
                           capture_output=True, text=True, timeout=180)
    assert empty.returncode == 2 and "prompt is empty" in empty.stderr
    missing = subprocess.run([sys.executable, "-m", "pdserve.cli", "generate", "--model", str(tmp_path), "hi"],
                             capture_output=True, text=True, timeout=180)
    assert missing.returncode == 2 and "config.json" in missing.stderr


@pytest.mark.parametrize("num_blocks", [512, 6])
def test_warm_up_leaves_no_trace(tiny_model, prompts, num_blocks) -> None:
    """The start-up warm-up (one full prefill step, one full decode step on scratch blocks) leaves
    every block free and zeroed, and the engine's outputs token-identical to a cold engine's; with
    fewer blocks than the warm-up's sequences need, the scratch tables wrap and still nothing leaks."""
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    small = [p[:20] for p in prompts]
    outs = []
    for warm in (False, True):
        engine = LLMEngine(EngineConfig(model_dir=str(tiny_model), dtype="float32", num_blocks=num_blocks,
                                        max_num_seqs=8, max_num_batched_tokens=300, warm_up=warm))
        assert engine.block_manager.all_free() and engine.stats().steps == 0
        assert not engine.runner.kv_cache.any(), "warm-up left values in the KV cache"
        outs.append(engine.generate(small[:1] if num_blocks == 6 else small, greedy))
        assert engine.block_manager.all_free()
    assert outs[0] == outs[1]


def test_cluster_workers_warm_up_by_default(tiny_model) -> None:
    from pdserve.cluster.config_io import apply_overrides, config_from_model

    config = config_from_model(tiny_model)
    assert config.worker_engine_config("decode").warm_up and config.worker_engine_config("prefill").warm_up
    off = apply_overrides(config, {"decode.engine.warm_up": False})
    assert not off.worker_engine_config("decode").warm_up


def test_stats_tell_batch_work_apart(tiny_model, prompts) -> None:
    """What the planner reads to let batch work wait: batch sequences and the KV they hold."""
    from pdserve.engine.sequence import Priority

    engine = make_engine(tiny_model)
    engine.add_request("inter", prompts[0], SamplingParams(max_tokens=4, temperature=0))
    engine.add_request("batch", prompts[1], SamplingParams(max_tokens=4, temperature=0), priority=Priority.BATCH)
    assert engine.stats().num_batch_seqs == 1 and engine.stats().batch_kv_usage == 0.0   # waiting: no blocks
    while engine.has_unfinished() and engine.stats().batch_kv_usage == 0.0:
        engine.step()
    s = engine.stats()
    assert s.num_batch_seqs == 1 and 0.0 < s.batch_kv_usage < s.kv_usage
    while engine.has_unfinished():
        engine.step()
    assert engine.stats().num_batch_seqs == 0 and engine.stats().batch_kv_usage == 0.0


def test_an_interrupted_batch_step_is_run_again_token_identical(tiny_model, prompts, reference) -> None:
    """An interactive arrival (``interrupt``) cuts a batch-only step short between layers; the step
    runs again and the batch's tokens equal transformers'. A step with interactive work is never cut."""
    from pdserve.engine.sequence import Priority

    engine = make_engine(tiny_model, max_num_batched_tokens=16)
    outs: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"b{i}", p, GREEDY, priority=Priority.BATCH)
    n = 0
    while engine.has_unfinished():
        n += 1
        if n % 3 == 0:            # mid-prefill and mid-decode steps alike
            engine.interrupt.set()
            assert [o for o in engine.step() if o.new_token_ids] == []
            engine.interrupt.clear()
            continue
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert engine.interrupted_steps == n // 3
    assert [outs[f"b{i}"] for i in range(len(prompts))] == reference
    assert engine.block_manager.all_free()
    # With an interactive request running, the steps with its work run whole however often they
    # are interrupted; the batch turns between them (batch work alone) are the steps cut short.
    engine.add_request("inter", prompts[2], GREEDY)
    engine.add_request("batch", prompts[3], GREEDY, priority=Priority.BATCH)
    cut, turns = engine.interrupted_steps, engine.scheduler.num_batch_turns
    engine.interrupt.set()
    got: dict[str, list[int]] = {"inter": [], "batch": []}
    while len(got["inter"]) < MAX_TOKENS:
        for o in engine.step():
            got[o.request_id] += o.new_token_ids
    assert got["inter"] == reference[2]
    assert engine.scheduler.num_batch_turns > turns
    assert engine.interrupted_steps - cut == engine.scheduler.num_batch_turns - turns
    engine.interrupt.clear()
    while engine.has_unfinished():
        for o in engine.step():
            got[o.request_id] += o.new_token_ids
    batch = got["batch"]
    assert batch == reference[3] and engine.block_manager.all_free()


def test_repetition_penalty_matches_transformers_logits_processor(tiny_model, hf_model, prompts) -> None:
    """repetition_penalty changes the greedy text exactly as transformers' RepetitionPenaltyLogitsProcessor
    does on the same logits (prompt and output tokens both penalised)."""
    engine = make_engine(tiny_model)
    plain = engine.generate(prompts[1:4], GREEDY)
    for penalty in (1.8, 0.3):   # above 1 discourages seen tokens, below 1 encourages them
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, repetition_penalty=penalty)
        ours = engine.generate(prompts[1:4], params)
        with torch.no_grad():
            for p, got in zip(prompts[1:4], ours):
                ids = hf_model.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                                        do_sample=False, repetition_penalty=penalty, pad_token_id=0)
                assert got == ids[0, len(p):].tolist(), penalty
    assert ours != plain   # the penalty did change the text (0.3 makes the model repeat what it has seen)

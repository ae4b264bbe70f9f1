"""Every tensor the engine makes names its device: the portable path (``attention_backend: sdpa``,
``linear_backend: dense``) runs with the engine's device set to "cpu" while torch's default
device is "meta", so a tensor made without a device lands on "meta" and the step fails, as it
would put a tensor on the CPU beside a CUDA cache on a GPU. Its tokens must equal a normal run's.

The runner is built and the engine stepped on this thread: torch's default device is per thread
(``LLMEngine`` builds its runner on a thread of its own, so the test builds it here and hands it in).
"""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.sampling_params import SamplingParams

BLOCK, BLOCKS, STEP_TOKENS, SEQS = 8, 48, 32, 4


def _engine(model_dir, attention: str = "sdpa") -> LLMEngine:
    """The portable path (``attention``: "sdpa"; the packed backends' plans are checked the same
    way in test_attention_packed.py)."""
    runner = ModelRunner(model_dir, dtype="float32", device="cpu", block_size=BLOCK, num_blocks=BLOCKS,
                         linear_backend="dense", attention_backend=attention)
    runner.warm_up(STEP_TOKENS, SEQS, 256)
    config = EngineConfig(str(model_dir), dtype="float32", device="cpu", block_size=BLOCK, num_blocks=BLOCKS,
                          max_num_seqs=SEQS, max_num_batched_tokens=STEP_TOKENS, linear_backend="dense",
                          attention_backend=attention)
    return LLMEngine(config, runner=runner)


def _serve(engine: LLMEngine) -> tuple[dict[str, list[tuple]], int]:
    """Four prompts at once (chunked prefill: later chunks read earlier ones from the cache, then a
    decode batch), then one sharing the first's leading blocks (a prefix hit; it asks for no prompt
    logprobs, which are computed, never read from the prefix cache). Every sampling feature that
    makes tensors: prompt logprobs, logprobs, penalties, a seeded draw with top-k/top-p, allowed
    tokens, and on "e" a logit bias, bad words and min_tokens set so that each decides its tokens
    (a tensor on "meta" used as an index can be ignored silently: these would then differ).
    Returns each request's outputs and the prefix-hit tokens."""
    eos = engine.spec.eos_token_ids[0]
    base = [(7 * i + 3) % 4000 + 5 for i in range(30)]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2, prompt_logprobs=1)
    sampled = SamplingParams(max_tokens=6, temperature=0.8, top_k=50, top_p=0.9, seed=11,
                             repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.2)
    allowed = SamplingParams(max_tokens=4, temperature=0.0, allowed_token_ids=tuple(range(100, 400)))
    steered = SamplingParams(max_tokens=6, temperature=0.0, logit_bias={17: 30.0, 23: 20.0, eos: 40.0},
                             bad_words=((17,),), min_tokens=3)
    got: dict[str, list[tuple]] = {}

    def run() -> None:
        while engine.has_unfinished():
            for out in engine.step():
                got.setdefault(out.request_id, []).append(
                    (out.new_token_ids, out.new_logprobs, out.prompt_logprobs, out.finish_reason))

    engine.add_request("a", base, greedy)
    engine.add_request("b", [11, 12, 13] + base[:17], sampled)
    engine.add_request("d", [42], allowed)
    engine.add_request("e", [43, 44], steered)
    run()
    engine.add_request("c", base[:24] + [99, 98], SamplingParams(max_tokens=6, temperature=0.0, logprobs=1))
    run()
    assert [t for toks, *_ in got["e"] for t in toks] == [23, 23, 23, eos]   # bias, ban, min_tokens
    return got, engine.stats().prefix_hit_tokens


@pytest.fixture
def meta_default():
    """torch's default device is "meta" for this thread while the test runs."""
    before = torch.get_default_device()
    torch.set_default_device("meta")
    try:
        yield
    finally:
        torch.set_default_device(before)


def test_meta_default_catches_a_tensor_without_a_device(meta_default):
    stray = torch.arange(4)   # what a device-less tensor in the engine would be
    assert stray.device.type == "meta"
    with pytest.raises((RuntimeError, NotImplementedError)):
        torch.zeros(4, device="cpu") + stray


def test_portable_path_names_its_device(tiny_model, request):
    normal, normal_hits = _serve(_engine(tiny_model))
    request.getfixturevalue("meta_default")
    assert torch.empty(1).device.type == "meta"
    hygienic, hits = _serve(_engine(tiny_model))
    assert normal_hits == hits >= 2 * BLOCK          # the third request reused the first's blocks
    assert set(hygienic) == {"a", "b", "c", "d", "e"}
    assert hygienic == normal

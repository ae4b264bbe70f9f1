"""Structured outputs: which grammar library, and what a grammar costs its batch.

1. **Libraries** (``--part libs``), side by side on one tokenizer (SmolLM2's 49,152 tokens by
   default): xgrammar (pdserve's choice) and, when installed beside it (``pip install --target
   DIR llguidance outlines-core``, then ``PYTHONPATH=DIR``), llguidance and outlines-core.
   Tokenizer setup (once per engine), schema compile cold and warm (a second request with the
   same schema), and per token: fill the next-token mask, then advance by the token a model
   would have chosen, walking a valid document token by token.
2. **Engine** (``--part engine``): one engine decoding a batch of 32 (``small`` model, 128-token
   prompts, greedy), stepped in three configurations taken in turn, round after round: all rows
   free; one row under a grammar (a JSON array of strings) and 31 free; all 32 under it. Reported: the mean
   decode step of each, and the ratios to all-free measured in the same round (their median).

``pdserve bench structured [--part libs|engine|both] [--json FILE]``. Prints the host first.
Nothing else should run beside it: two busy threads on a shared core read slow."""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

logger = logging.getLogger(__name__)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["new", "vip", "late", "refund"]}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "rating": {"type": "number"},
    },
    "required": ["name", "age", "email", "tags", "address", "rating"],
    "additionalProperties": False,
}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["vip", "late"],
            "address": {"city": "London", "zip": "W1"}, "rating": 4.5}


@dataclass(slots=True)
class LibFigures:
    library: str
    version: str
    tokenizer_setup_ms: float
    compile_cold_ms: float
    compile_warm_ms: float
    per_token_us_mean: float
    per_token_us_p99: float
    tokens: int


def _walk(fill: Callable[[], None], advance: Callable[[int], None], ids: list[int]) -> list[float]:
    times = []
    for tok in ids:
        t0 = time.perf_counter()
        fill()
        advance(tok)
        times.append(time.perf_counter() - t0)
    return times


def _llguidance(hf_tok, schema: str, ids: list[int], rounds: int) -> LibFigures:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(hf_tok)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    matcher = llguidance.LLMatcher(lltok, grammar)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    llguidance.LLMatcher(lltok, grammar)
    warm = time.perf_counter() - t0
    mask = llguidance.torch.allocate_token_bitmask(1, lltok.vocab_size)
    times: list[float] = []
    for _ in range(rounds):
        matcher = llguidance.LLMatcher(lltok, grammar)
        times += _walk(lambda: llguidance.torch.fill_next_token_bitmask(matcher, mask, 0),
                       lambda t: _ok(matcher.consume_token(t), matcher), ids)
    from importlib.metadata import version

    return _figures("llguidance", version("llguidance"), setup, cold, warm, times, len(ids))


def _ok(accepted: bool, matcher) -> None:
    if not accepted:
        raise RuntimeError(f"the grammar refused a token of a valid document: {matcher.get_error()}")


def _xgrammar(hf_tok, schema: str, ids: list[int], rounds: int) -> LibFigures:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf_tok, vocab_size=len(hf_tok))
    compiler = xgr.GrammarCompiler(info)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(schema)
    xgr.GrammarMatcher(compiled)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    xgr.GrammarMatcher(compiler.compile_json_schema(schema))
    warm = time.perf_counter() - t0
    mask = xgr.allocate_token_bitmask(1, info.vocab_size)
    times: list[float] = []
    for _ in range(rounds):
        matcher = xgr.GrammarMatcher(compiled)
        times += _walk(lambda: matcher.fill_next_token_bitmask(mask, 0),
                       lambda t: _ok(matcher.accept_token(t), matcher), ids)
    from importlib.metadata import version

    return _figures("xgrammar", version("xgrammar"), setup, cold, warm, times, len(ids))


def _outlines(hf_tok, schema: str, ids: list[int], rounds: int) -> LibFigures:
    import torch
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    eos = hf_tok.eos_token_id
    t0 = time.perf_counter()
    vocab: dict[str, list[int]] = {}
    special = set(hf_tok.all_special_ids)
    for token, i in hf_tok.get_vocab().items():
        text = hf_tok.convert_tokens_to_string([token])  # byte-level "Ġx" -> " x", as outlines does
        if i != eos and i not in special and "\ufffd" not in text:  # partial UTF-8 bytes left out
            vocab.setdefault(text, []).append(i)
    vocabulary = Vocabulary(eos, vocab)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    index = Index(build_regex_from_schema(schema), vocabulary)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    Guide(index)
    warm = time.perf_counter() - t0
    mask = torch.zeros((len(hf_tok) + 31) // 32, dtype=torch.int32)
    times: list[float] = []
    for _ in range(rounds):
        guide = Guide(index)
        times += _walk(lambda: guide.write_mask_into(mask.data_ptr(), mask.numel(), 4),
                       lambda t: guide.advance(t), ids)
    from importlib.metadata import version

    return _figures("outlines-core", version("outlines_core"), setup, cold, warm, times, len(ids))


def _figures(name: str, version: str, setup: float, cold: float, warm: float, times: list[float],
             n: int) -> LibFigures:
    times_us = sorted(t * 1e6 for t in times)
    return LibFigures(name, version, setup * 1e3, cold * 1e3, warm * 1e3, statistics.fmean(times_us),
                      times_us[min(len(times_us) - 1, int(0.99 * len(times_us)))], n)


LIBRARIES = {"xgrammar": _xgrammar, "llguidance": _llguidance, "outlines-core": _outlines}


def bench_libraries(tokenizer: str, rounds: int) -> list[LibFigures]:
    from pdserve.engine.known_models import resolve_model
    from pdserve.engine.tokenizer import load_tokenizer

    model_dir, _ = resolve_model(tokenizer)
    hf_tok = load_tokenizer(model_dir)
    ids = hf_tok(json.dumps(DOCUMENT), add_special_tokens=False)["input_ids"]
    schema = json.dumps(SCHEMA)
    print(f"libraries: tokenizer {tokenizer} ({len(hf_tok)} tokens); document {len(ids)} tokens x {rounds} walks")
    results = []
    for name, run_lib in LIBRARIES.items():
        try:
            fig = run_lib(hf_tok, schema, ids, rounds)
        except ImportError as exc:
            print(f"  {name:14s} not installed ({exc})")
            continue
        results.append(fig)
        print(f"  {name:14s} {fig.version:8s} tokenizer {fig.tokenizer_setup_ms:6.0f} ms  compile cold "
              f"{fig.compile_cold_ms:8.1f} ms  warm {fig.compile_warm_ms:7.2f} ms  per token mean "
              f"{fig.per_token_us_mean:7.1f} us  p99 {fig.per_token_us_p99:7.1f} us")
    base = next((r for r in results if r.library == "xgrammar"), None)
    for r in results:
        if base is not None and r is not base:
            print(f"  {r.library} / xgrammar: per token {r.per_token_us_mean / base.per_token_us_mean:.2f}x, "
                  f"compile cold {r.compile_cold_ms / base.compile_cold_ms:.2f}x")
    return results


# A JSON array of strings that never closes (EBNF, as guided_grammar): a schema's output could
# end, and a row that ends would leave the timed batch. Its states are a JSON string's, the
# commonest state of a real schema's output.
ENGINE_GRAMMAR = r'''root ::= "[" item
item ::= "\"" [^"\\\x00-\x1f]* "\", " item'''
CONFIGS = ("all free", "1 of 32 constrained", "32 of 32 constrained")


def bench_engine(model: str, dtype: str, batch: int, prompt_len: int, steps: int, rounds: int) -> dict:
    import random

    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.engine.structured import StructuredOutput
    from pdserve.engine.testmodel import ensure_model

    model_dir = ensure_model(model, "llama")
    engine = LLMEngine(EngineConfig(str(model_dir), dtype=dtype, num_blocks=batch * (prompt_len + rounds * steps * 3
                                                                                      + 64) // 16 + 64,
                                    max_num_seqs=batch, max_num_batched_tokens=2048))
    rng = random.Random(0)
    vocab = engine.spec.vocab_size
    prompts = [[rng.randrange(4, vocab) for _ in range(prompt_len)] for _ in range(batch)]
    free = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
    tight = SamplingParams(max_tokens=steps + 8, temperature=0,
                           structured=StructuredOutput("grammar", ENGINE_GRAMMAR))
    print(f"engine: model {model} ({engine.config.dtype}), batch {batch}, prompts {prompt_len} tokens, "
          f"{steps} decode steps per configuration, {rounds} rounds")

    def run(n_constrained: int, tag: str) -> float:
        ids = [f"{tag}-{i}" for i in range(batch)]
        for i, (rid, p) in enumerate(zip(ids, prompts)):
            engine.add_request(rid, p, tight if i < n_constrained else free)
        started: set[str] = set()
        while len(started) < batch:
            started.update(o.request_id for o in engine.step() if o.new_token_ids)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            outs = engine.step()
            times.append(time.perf_counter() - t0)
            if sum(len(o.new_token_ids) for o in outs) != batch:
                raise RuntimeError("a row finished during the timed steps; raise max_tokens")
        for rid in ids:
            engine.abort(rid)
        while engine.has_unfinished():
            engine.step()
        return statistics.fmean(times)

    sampler_us = _sampler_cost(engine, batch, tight, free, steps * rounds)
    means: dict[str, list[float]] = {c: [] for c in CONFIGS}
    for r in range(rounds):
        for c, n in zip(CONFIGS, (0, 1, batch)):
            means[c].append(run(n, f"r{r}-{n}"))
    ratios = {c: statistics.median(m / f for m, f in zip(means[c], means[CONFIGS[0]])) for c in CONFIGS[1:]}
    for c in CONFIGS:
        print(f"  {c:22s} decode step {statistics.fmean(means[c]) * 1e3:7.2f} ms"
              + (f"  x{ratios[c]:.3f} of all free (median of rounds)" if c in ratios else ""))
    return {"model": model, "dtype": engine.config.dtype, "batch": batch, "steps": steps, "rounds": rounds,
            "step_ms": {c: [m * 1e3 for m in means[c]] for c in CONFIGS}, "ratio_to_all_free": ratios,
            "sampler_us": sampler_us}


def _sampler_cost(engine, batch: int, tight, free, iterations: int) -> dict[str, float]:
    """The sampler alone (masks, choice, the grammars' advance) on one batch of logits, for 0, 1
    and all rows constrained: the part of a step a grammar adds, without the forward's noise."""
    import torch

    from pdserve.engine.sequence import Sequence

    vocab = engine.spec.vocab_size
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(0))
    out: dict[str, float] = {}
    for c, n in zip(CONFIGS, (0, 1, batch)):
        seqs = []
        for i in range(batch):
            params = tight if i < n else free
            seq = Sequence(f"s{i}", [5, 6, 7], params, eos_token_ids=frozenset(engine.spec.eos_token_ids))
            if params.structured is not None:
                seq.grammar = engine.grammars.grammar(params.structured)
            seqs.append(seq)
        times = []
        for _ in range(iterations):
            t0 = time.perf_counter()
            res = engine.sampler.sample(logits, seqs)
            for seq, tok in zip(seqs, res.tokens):
                if seq.grammar is not None:
                    seq.grammar.accept(tok)
            times.append(time.perf_counter() - t0)
        out[c] = statistics.median(times) * 1e6
    print("  sampler per step (median): " + ", ".join(f"{c} {us:.0f} us" for c, us in out.items()))
    return out


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--part", choices=("libs", "engine", "both"), default="both")
    p.add_argument("--tokenizer", default="smollm2-135m-instruct", help="libraries: model directory or known name")
    p.add_argument("--walks", type=int, default=20, help="libraries: walks of the document per library")
    p.add_argument("--model", default="small", help="engine: generated model preset")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=32, help="engine: timed decode steps per configuration")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", help="write the figures here")


def run(args: argparse.Namespace) -> int:
    from pdserve.bench.hw import cpu_model

    print(f"host: {cpu_model()}")
    out: dict = {"host": cpu_model()}
    if args.part in ("libs", "both"):
        out["libraries"] = [asdict(r) for r in bench_libraries(args.tokenizer, args.walks)]
    if args.part in ("engine", "both"):
        out["engine"] = bench_engine(args.model, args.dtype, args.batch, 128, args.steps, args.rounds)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.structured", description=__doc__.split("\n")[0])
    add_args(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())

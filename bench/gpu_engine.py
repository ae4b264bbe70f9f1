"""The engine half of the prepared GPU check (issue 59), run by ``scripts/gpu_check_engine.py``.

One run, sized for ~3 minutes on an H100 with nothing but torch and transformers installed, the
headline figures first (the JSON is rewritten after each part, ``complete`` false until the end):

1. Numerics: TF32 off (``engine/cuda_numerics.py``); the device's copy rate, (read + write)
   bytes / s of a large device-to-device copy (``copy_gbs``).
2. float32 parity, ``tiny`` Llama and Qwen2 (generated, no network): SDPA on its deterministic math
   backend, the engine's portable path (``attention_backend: sdpa``, dense matmuls) against
   transformers' eager attention on the same device, greedy, prompts of several lengths in one
   batch (chunked prefill: ``max_num_batched_tokens`` below the longest prompt) and then one
   sharing a prompt's leading blocks (a prefix hit). ``parity_fp32``: every token identical.
3. Decode throughput, ``medium`` preset in bfloat16 (``tiny`` with ``--quick``): batch 1/8/32/64,
   prompts of ``prompt_len`` random tokens, the engine's median decode step (``bench/engine.py``'s
   ``EngineDecode``: timed only while every sequence decodes) against transformers' ``generate``
   (greedy; its decode time is ``generate(N + 1 new) - generate(1 new)``, each the best of a few):
   ``vs_hf`` is the engine's tokens/s at its median step over ``generate``'s (``vs_hf_mean``: at
   its mean step).
   ``decode_roofline_ratio`` (batch 1): bytes a decode step must read (the weights it streams,
   ``bench/report.py``, plus the batch's K/V) per step time, over ``copy_gbs``.
4. bfloat16 tolerance (below), both tiny models, the portable path: ``parity_bf16``.
5. The attention candidates: "sdpa" (gather + SDPA), "varlen" (flash varlen) and "flex"
   (FlexAttention, compiled on CUDA, its compile paid in the warm-up steps), each timed at batch 32
   on the decode model (``ModelRunner.use_attention``, same weights) and held to the bf16
   tolerance on the tiny Llama. "flex" is skipped when less than ``FLEX_RESERVE_S`` of
   ``budget_s`` is left.

bfloat16 tolerance: for every token the engine chose (greedy, bf16), its log-probability under
the engine against the float32 transformers model on the same context (teacher-forced), largest
absolute gap ``err``; transformers' own bf16 model, teacher-forced on the same tokens, has gap
``err_hf``. The engine passes when ``err <= BF16_FACTOR * err_hf + BF16_FLOOR_NATS``: no more than
twice the rounding error bf16 itself brings, plus a floor for runs where that is near zero.
Greedy tokens may differ from transformers' in bf16 (a near-tie flips); logprobs on one context
may not drift further than bf16 explains.

Nothing here needs Ray, NIXL, Redis, pydantic, gguf or xgrammar.
"""

from __future__ import annotations

import datetime as _dt
import gc
import logging
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pdserve.bench.engine import EngineDecode
from pdserve.bench.report import model_cost
from pdserve.engine.attention_packed import PACKED_BACKENDS
from pdserve.engine.config import EngineConfig
from pdserve.engine.cuda_numerics import deterministic_attention, disable_tf32
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.testmodel import ensure_model

logger = logging.getLogger(__name__)

BF16_FACTOR = 2.0
BF16_FLOOR_NATS = 0.02
PROMPT_LENS = (7, 19, 37, 50)   # one batch: ragged, several blocks, chunked past 32 tokens
CANDIDATE_BATCH = 32
FLEX_RESERVE_S = 80.0


@dataclass(frozen=True, slots=True)
class CheckSettings:
    device: str
    quick: bool = False
    new_tokens: int = 16          # parity: greedy tokens per prompt
    batches: tuple[int, ...] = (1, 8, 32, 64)
    prompt_len: int = 128
    decode_steps: int = 32
    warmup_steps: int = 3
    copy_bytes: int = 1 << 30
    bench_preset: str = "medium"
    # seconds this run may take (scripts/gpu_check.sh gives the script 200, imports included); the
    # flex candidate (a torch.compile) starts only with FLEX_RESERVE_S of them left
    budget_s: float = 170.0
    cache_dir: Path | None = None

    @classmethod
    def for_device(cls, device: str, quick: bool, cache_dir: Path | None = None) -> CheckSettings:
        if quick:
            return cls(device, True, new_tokens=6, batches=(1, 8), prompt_len=16, decode_steps=4,
                       warmup_steps=1, copy_bytes=64 << 20, bench_preset="tiny", cache_dir=cache_dir)
        return cls(device, cache_dir=cache_dir)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def copy_rate_gbs(device: str, nbytes: int, repeats: int = 8) -> float:
    """(read + write) GB/s of the best of ``repeats`` copies of ``nbytes`` on ``device``."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best / 1e9


def load_hf(model_dir: Path, dtype: torch.dtype, device: str, attn: str | None = None) -> Any:
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    kw: dict[str, Any] = {"dtype" if (major, minor) >= (4, 56) else "torch_dtype": dtype}
    if attn is not None:
        kw["attn_implementation"] = attn
    return transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), **kw).to(device).eval()


def make_engine(model_dir: Path, device: str, dtype: str, *, attention: str = "sdpa", kv_gb: float = 0.25,
                step_tokens: int = 2048, seqs: int = 64) -> LLMEngine:
    """The portable path: dense matmuls, ``attention`` (sdpa unless a candidate is measured)."""
    return LLMEngine(EngineConfig(str(model_dir), dtype=dtype, device=device, kv_cache_memory_gb=kv_gb,
                                  max_num_seqs=seqs, max_num_batched_tokens=step_tokens,
                                  linear_backend="dense", attention_backend=attention, detokenize=False))


def parity_prompts(vocab: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """The batch's prompts, and one sharing the last one's first 33 tokens (two blocks of 16 hit)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENS]
    return prompts, prompts[-1][:33] + [rng.randrange(3, vocab) for _ in range(5)]


def engine_greedy(engine: LLMEngine, prompts: list[list[int]], n: int) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens (EOS ignored) and each token's logprob, per prompt, all prompts in one batch."""
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=0)
    ids = [f"check-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, params)
    got: dict[str, tuple[list[int], list[float]]] = {rid: ([], []) for rid in ids}
    while engine.has_unfinished():
        for out in engine.step():
            toks, lps = got[out.request_id]
            for tok, lp in zip(out.new_token_ids, out.new_logprobs or [{}] * len(out.new_token_ids)):
                toks.append(tok)
                lps.append(lp.get(tok, float("nan")))
            if out.error:
                raise RuntimeError(f"request {out.request_id} failed: {out.error}")
    return [got[rid] for rid in ids]


@torch.inference_mode()
def hf_greedy(model: Any, prompt: list[int], n: int, device: str) -> list[int]:
    """Greedy tokens from full forwards over the whole sequence (no KV cache on the reference side)."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(model(torch.tensor([seq], device=device)).logits[0, -1].argmax()))
    return seq[len(prompt):]


@torch.inference_mode()
def hf_token_logprobs(model: Any, prompt: list[int], tokens: list[int], device: str) -> list[float]:
    """Teacher-forced logprob of each of ``tokens`` after ``prompt`` under ``model``."""
    seq = prompt + tokens
    lp = model(torch.tensor([seq], device=device)).logits[0].float().log_softmax(-1)
    rows = torch.arange(len(prompt) - 1, len(seq) - 1, device=device)
    return lp[rows, torch.tensor(tokens, device=device)].tolist()


def fp32_parity(model_dir: Path, st: CheckSettings) -> dict[str, Any]:
    """Token-identical greedy decoding against transformers (eager), float32, deterministic SDPA."""
    engine = make_engine(model_dir, st.device, "float32", step_tokens=32, seqs=8)
    prompts, shared = parity_prompts(engine.spec.vocab_size)
    ours = [t for t, _ in engine_greedy(engine, prompts, st.new_tokens)]
    ours += [t for t, _ in engine_greedy(engine, [shared], st.new_tokens)]
    hits = engine.stats().prefix_hit_tokens
    del engine
    hf = load_hf(model_dir, torch.float32, st.device, attn="eager")
    ref = [hf_greedy(hf, p, st.new_tokens, st.device) for p in prompts + [shared]]
    del hf
    mismatches = [{"prompt": i, "at": next(j for j, (a, b) in enumerate(zip(o, r)) if a != b), "ours": o, "hf": r}
                  for i, (o, r) in enumerate(zip(ours, ref)) if o != r]
    return {"identical": not mismatches and hits > 0, "prefix_hit_tokens": hits, "mismatches": mismatches}


def bf16_tolerance(st: CheckSettings, engine: LLMEngine, refs: tuple[Any, Any]) -> dict[str, Any]:
    """The bf16 criterion of the module docstring for ``engine`` (its current attention backend)."""
    hf32, hf16 = refs
    prompts, _ = parity_prompts(engine.spec.vocab_size)
    err = err_hf = 0.0
    for p, (toks, lps) in zip(prompts, engine_greedy(engine, prompts, st.new_tokens)):
        ref = hf_token_logprobs(hf32, p, toks, st.device)
        theirs = hf_token_logprobs(hf16, p, toks, st.device)
        err = max(err, max(abs(a - b) for a, b in zip(lps, ref)))
        err_hf = max(err_hf, max(abs(a - b) for a, b in zip(theirs, ref)))
    bound = BF16_FACTOR * err_hf + BF16_FLOOR_NATS
    return {"ok": err <= bound, "err_nats": err, "err_hf_bf16_nats": err_hf, "bound_nats": bound}


def decode_row(engine: LLMEngine, hf: Any, prompts: list[list[int]], st: CheckSettings, cost: Any,
               copy_gbs: float) -> dict[str, Any]:
    b = len(prompts)
    run = EngineDecode(engine, prompts, st.warmup_steps + st.decode_steps)
    try:
        times = [run.step()[0] for _ in range(st.warmup_steps + st.decode_steps)][st.warmup_steps:]
    finally:
        run.close()
    step = statistics.median(times)
    ctx = st.prompt_len + st.warmup_steps + st.decode_steps / 2
    step_bytes = cost.weight_bytes_per_token("bfloat16") + b * ctx * cost.kv_bytes_per_token("bfloat16")
    row: dict[str, Any] = {"batch": b, "tok_s": b / step, "tok_s_mean": b * len(times) / sum(times),
                           "step_ms": 1e3 * step, "bytes_per_step": step_bytes,
                           "roofline_ratio": step_bytes / step / 1e9 / copy_gbs}
    if hf is not None:   # vs_hf: the engine's median step against generate's best whole run
        hf_tok_s = b * st.decode_steps / hf_generate_decode_s(hf, prompts, st.decode_steps, st.device)
        row.update(hf_tok_s=hf_tok_s, vs_hf=row["tok_s"] / hf_tok_s, vs_hf_mean=row["tok_s_mean"] / hf_tok_s)
    return row


@torch.inference_mode()
def hf_generate_decode_s(model: Any, prompts: list[list[int]], n: int, device: str, repeats: int = 2) -> float:
    """Seconds ``generate`` spends on ``n`` decode steps: generate(n + 1 new) - generate(1 new)."""
    ids = torch.tensor(prompts, device=device)
    mask = torch.ones_like(ids)

    def timed(new: int) -> float:
        _sync(device)
        t0 = time.perf_counter()
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                       do_sample=False, pad_token_id=0)
        _sync(device)
        return time.perf_counter() - t0

    timed(2)   # warm-up
    first = min(timed(1) for _ in range(repeats))
    whole = min(timed(n + 1) for _ in range(repeats))
    return max(whole - first, 1e-9)


def run_check(st: CheckSettings, save: Callable[[dict[str, Any]], None] = lambda r: None) -> dict[str, Any]:
    """Every part of the module docstring, headline figures first; ``save`` gets the result so
    far after each part (``complete`` is False until the last), so a run stopped by its time
    limit still leaves what it measured."""
    import transformers

    t_start = time.perf_counter()
    cuda = st.device.startswith("cuda")
    r: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(torch.device(st.device)) if cuda else "cpu",
        "torch_version": torch.__version__, "transformers_version": transformers.__version__,
        "cuda_version": torch.version.cuda, "quick": st.quick, "complete": False, "cuda_graphs": False,
        "numerics": disable_tf32() if cuda else {}, "copy_gbs": copy_rate_gbs(st.device, st.copy_bytes),
        "notes": "decode: bfloat16, portable path (dense matmuls, eager torch, no CUDA graphs); roofline bytes = "
                 "streamed weights (all but the embedding table) + the batch's K/V at mid-run context; "
                 "copy_gbs = (read + write) bytes/s of a device-to-device copy",
    }

    def done(part: str) -> None:
        r["wall_s"] = time.perf_counter() - t_start
        logger.info("%s done at %.0f s", part, r["wall_s"])
        save(r)

    tiny = {arch: ensure_model("tiny", arch, st.cache_dir) for arch in ("llama", "qwen2")}
    r["sdpa_for_parity"] = deterministic_attention(True) if cuda else {}
    parity = {arch: fp32_parity(d, st) for arch, d in tiny.items()}
    if cuda:
        deterministic_attention(False)
    r.update(parity_fp32=all(p["identical"] for p in parity.values()), parity_fp32_detail=parity)
    done("float32 parity")
    bench = Bench.start(st, r["copy_gbs"])
    r.update(bench_preset=st.bench_preset, decode=bench.sweep())
    by_batch = {row["batch"]: row for row in r["decode"]}
    r.update(vs_hf_decode_b32=by_batch.get(32, {}).get("vs_hf"),
             decode_roofline_ratio=by_batch[min(by_batch)]["roofline_ratio"])
    done("decode sweep")
    r["bf16_tolerance"] = {arch: _tolerance(st, d, "sdpa") for arch, d in tiny.items()}
    r["parity_bf16"] = all(t.get("ok") is True for t in r["bf16_tolerance"].values())
    done("bfloat16 tolerance")
    cands: dict[str, Any] = {"batch": bench.candidate_batch, "bf16_on": "tiny llama"}
    r["attention_candidates"] = cands
    for backend in ("sdpa", *PACKED_BACKENDS):
        used = time.perf_counter() - t_start
        if backend == "flex" and st.budget_s - used < FLEX_RESERVE_S:   # its compile may take a minute
            cands[backend] = {"skipped": f"time: {used:.0f} s of {st.budget_s:.0f} used, "
                                         f"{FLEX_RESERVE_S:.0f} s needed"}
            continue
        cands[backend] = {"decode": _try(lambda b=backend: bench.candidate(b)),
                          "bf16": _try(lambda b=backend: _tolerance(st, tiny["llama"], b))}
        done(f"attention {backend}")
    r["complete"] = True
    done("check")
    return r


def _tolerance(st: CheckSettings, model_dir: Path, attention: str) -> dict[str, Any]:
    engine = make_engine(model_dir, st.device, "bfloat16", attention=attention, step_tokens=32, seqs=8)
    refs = (load_hf(model_dir, torch.float32, st.device, attn="eager"), load_hf(model_dir, torch.bfloat16, st.device))
    return bf16_tolerance(st, engine, refs)


@dataclass(slots=True)
class Bench:
    """The decode model (``bench_preset``, bf16) loaded once in the engine and in transformers."""

    st: CheckSettings
    copy_gbs: float
    engine: LLMEngine
    hf: Any
    cost: Any
    rng: random.Random

    @classmethod
    def start(cls, st: CheckSettings, copy_gbs: float) -> Bench:
        model_dir = ensure_model(st.bench_preset, "llama", st.cache_dir)
        cost = model_cost(model_dir, st.bench_preset)
        tokens = max(st.batches) * (st.prompt_len + st.warmup_steps + st.decode_steps + 64)
        kv_gb = max(0.05, 1.2 * tokens * cost.kv_bytes_per_token("bfloat16") / (1 << 30))
        engine = make_engine(model_dir, st.device, "bfloat16", kv_gb=kv_gb, seqs=max(st.batches))
        return cls(st, copy_gbs, engine, load_hf(model_dir, torch.bfloat16, st.device), cost, random.Random(1))

    @property
    def candidate_batch(self) -> int:
        return 2 if self.st.quick else CANDIDATE_BATCH

    def prompts(self, batch: int) -> list[list[int]]:
        vocab = self.engine.spec.vocab_size
        return [[self.rng.randrange(3, vocab) for _ in range(self.st.prompt_len)] for _ in range(batch)]

    def sweep(self) -> list[dict[str, Any]]:
        rows = []
        for b in self.st.batches:
            rows.append(decode_row(self.engine, self.hf, self.prompts(b), self.st, self.cost, self.copy_gbs))
            logger.info("decode batch %d: %s", b, rows[-1])
        self.hf = None   # transformers' copy is not needed past the sweep
        gc.collect()
        return rows

    def candidate(self, backend: str) -> dict[str, Any]:
        """Decode at ``candidate_batch`` with ``backend`` (the engine goes back to sdpa after)."""
        try:
            self.engine.runner.use_attention(backend)
            return decode_row(self.engine, None, self.prompts(self.candidate_batch), self.st, self.cost,
                              self.copy_gbs)
        finally:
            self.engine.runner.use_attention("sdpa")


def _try(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``fn()``, or what stopped it (a candidate this device or torch cannot run is a result, too)."""
    try:
        return fn()
    except Exception as exc:   # recorded in the JSON: the check goes on with the other candidates
        logger.warning("candidate failed: %s", exc)
        return {"error": f"{type(exc).__name__}: {exc}"[:500]}

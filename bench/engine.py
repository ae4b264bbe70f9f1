"""``pdserve bench engine``: the engine against its rooflines and against transformers, in one run.

    pdserve bench engine --json engine.json [--quick] [--threads 2] [--dtype float32|bfloat16|both]
                         [--attention auto|native|sdpa|both]

1. Hardware: copy bandwidth and matmul GFLOP/s (``bench/hw.py``).
2. ``medium`` model, batch-1 decode through ``LLMEngine``: tokens/s over the roofline
   ``copy bandwidth / weight bytes per token`` (``decode_roofline_ratio``; see ``bench/report.py``
   for what the bytes count). ``decode_roofline_ratio_interleaved`` uses instead the time to read
   a weight-sized buffer, measured between the decode steps (same machine load).
3. ``small`` model: decode tokens/s at batch 1, 8, 32, 64 (prompts of 128 random tokens, greedy,
   ``ignore_eos``); prefill tokens/s of one 128, 512, 2048-token prompt and its FLOP rate over the
   matmul peak (``prefill_matmul_ratio``, at the longest prompt).
4. ``transformers`` (``AutoModelForCausalLM``, its own KV cache, a greedy loop) on the same
   checkpoint, prompts, batch sizes and dtype, measured interleaved with ours.

Decode is timed only once every sequence of the batch has its first token (prefill done) and
while all of them are still running; each figure is ``batch / median step time``, which resists
the noise of a shared machine. ``runner_tok_s`` times ``ModelRunner.execute`` inside the same
steps, so ``engine_overhead_frac`` is the share of a step spent in scheduling, sampling and
bookkeeping.

``--attention both``: the small model's decode runs on the C++ paged attention ("native") and, in
a second engine stepped in turn with it on the same prompts, on gather + SDPA; each decode row
then carries ``sdpa_tok_s`` and ``native_over_sdpa`` (the headline has one per batch).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import inspect
import json
import logging
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pdserve.bench.common import run_and_save
from pdserve.bench.report import ModelCost, format_table, model_cost

logger = logging.getLogger(__name__)

_DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True, slots=True)
class Settings:
    dtypes: tuple[str, ...]
    threads: int
    batches: tuple[int, ...] = (1, 8, 32, 64)
    prompt_len: int = 128
    decode_tokens: int = 32
    warmup_steps: int = 3
    prefill_lens: tuple[int, ...] = (128, 512, 2048)
    prefill_repeats: int = 3
    buffer_bytes: int = 1 << 30
    hw_repeats: int = 5
    hf: bool = True
    quick: bool = False
    attention: str = "auto"   # engine.attention_backend, or "both": native and sdpa side by side
    linear: str = "auto"      # engine.linear_backend

    def __post_init__(self) -> None:
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.decode_tokens < 2 or self.prefill_repeats < 1:
            raise ValueError("decode_tokens must be >= 2 and prefill_repeats >= 1")
        bad = [d for d in self.dtypes if d not in _DTYPES]
        if bad or not self.dtypes:
            raise ValueError(f"dtypes must be float32 and/or bfloat16, got {self.dtypes}")
        if self.attention not in ("auto", "native", "sdpa", "both"):
            raise ValueError(f"attention must be auto, native, sdpa or both, got {self.attention!r}")


def settings_from_args(args: argparse.Namespace) -> Settings:
    dtypes = ("float32", "bfloat16") if args.dtype == "both" else (args.dtype,)
    if args.quick:
        return Settings(dtypes, args.threads, prompt_len=32, decode_tokens=8, warmup_steps=1, prefill_repeats=1,
                        buffer_bytes=512 << 20, hw_repeats=3, hf=not args.no_hf, quick=True,
                        attention=args.attention, linear=args.linear)
    return Settings(dtypes, args.threads, hf=not args.no_hf, attention=args.attention, linear=args.linear)


# ------------------------------------------------------------------------------- pdserve engine
def _make_engine(model_dir: Path, dtype: str, threads: int, cost: ModelCost, max_tokens: int,
                 attention: str = "auto", linear: str = "auto"):
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine

    kv_gb = max(0.05, 1.1 * max_tokens * cost.kv_bytes_per_token(dtype) / (1 << 30))
    return LLMEngine(EngineConfig(str(model_dir), dtype=dtype, kv_cache_memory_gb=kv_gb, max_num_seqs=64,
                                  max_num_batched_tokens=2048, num_threads=threads,
                                  attention_backend="native" if attention == "both" else attention,
                                  linear_backend=linear))


class EngineDecode:
    """A batch decoding in an ``LLMEngine``; ``step()`` times one engine step and the
    ``ModelRunner.execute`` call inside it. Construction runs the (untimed) prefill."""

    def __init__(self, engine, prompts: list[list[int]], max_steps: int) -> None:
        from pdserve.engine.sampling_params import SamplingParams

        self.engine, self.batch = engine, len(prompts)
        # Sequences admitted first decode while later ones prefill: leave room so none finishes early.
        slack = 4 + -(-self.batch * len(prompts[0]) // 2048)
        params = SamplingParams(max_tokens=max_steps + slack, temperature=0.0, ignore_eos=True)
        tag = time.monotonic_ns()
        self.ids = [f"bench-{tag}-{i}" for i in range(self.batch)]
        for rid, p in zip(self.ids, prompts):
            engine.add_request(rid, p, params)
        started: set[str] = set()
        while len(started) < self.batch:
            started.update(o.request_id for o in engine.step() if o.new_token_ids)
        # the engine's step calls ModelRunner.execute_scored (execute is its thin wrapper)
        self._inner, self._exec_s = engine.runner.execute_scored, 0.0
        engine.runner.execute_scored = self._timed_execute   # instance attribute shadows the method

    def _timed_execute(self, items, stop=None):
        t0 = time.perf_counter()
        out = self._inner(items, stop)
        self._exec_s = time.perf_counter() - t0
        return out

    def step(self) -> tuple[float, float]:
        """(step seconds, of which ModelRunner.execute_scored seconds)."""
        self._exec_s = 0.0
        t0 = time.perf_counter()
        outs = self.engine.step()
        elapsed = time.perf_counter() - t0
        if self._exec_s <= 0.0:
            raise RuntimeError("the model runner's timing hook saw no call: the engine's step no longer goes "
                               "through ModelRunner.execute_scored")
        made = sum(len(o.new_token_ids) for o in outs)
        if made != self.batch or any(o.finished for o in outs):
            raise RuntimeError(f"a timed decode step made {made} tokens for a batch of {self.batch}")
        return elapsed, self._exec_s

    def close(self) -> None:
        del self.engine.runner.execute_scored
        for rid in self.ids:
            self.engine.abort(rid)
        while self.engine.has_unfinished():
            self.engine.step()


class HFDecode:
    """The same batch in transformers: one batched forward per step with its own KV cache,
    greedy; construction runs the (untimed) prefill."""

    def __init__(self, model, prompts: list[list[int]]) -> None:
        import torch

        self.model, self.torch = model, torch
        # transformers >= 5.2x renamed ``past_key_values`` to ``cache``; accept both.
        self.key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        with torch.inference_mode():
            out = model(torch.tensor(prompts), use_cache=True, logits_to_keep=1)
        self.past, self.next = getattr(out, self.key), out.logits[:, -1].argmax(-1, keepdim=True)

    def step(self) -> float:
        t0 = time.perf_counter()
        with self.torch.inference_mode():
            out = self.model(self.next, use_cache=True, **{self.key: self.past})
            self.past, self.next = getattr(out, self.key), out.logits[:, -1].argmax(-1, keepdim=True)
            self.next.tolist()   # the engine hands its tokens to Python too
        return time.perf_counter() - t0


def decode_side_by_side(engine, model, prompts: list[list[int]], steps: int, warmup: int,
                        probe=None) -> dict:
    """Alternate one pdserve step, one transformers step and ``probe()`` (if given; e.g. a read of
    a weight-sized buffer), so all of them see the same machine load."""
    b = len(prompts)
    ours = EngineDecode(engine, prompts, warmup + steps)
    times: list[tuple[float, float]] = []
    ref_times: list[float] = []
    probe_times: list[float] = []
    try:
        ref = HFDecode(model, prompts) if model is not None else None
        for i in range(warmup + steps):
            t = ours.step()
            r = ref.step() if ref else None
            if probe is not None:
                t0 = time.perf_counter()
                probe()
                probe_times.append(time.perf_counter() - t0)
            if i >= warmup:
                times.append(t)
                if r is not None:
                    ref_times.append(r)
    finally:
        ours.close()
    step, run = statistics.median(t for t, _ in times), statistics.median(e for _, e in times)
    row = {"batch": b, "tok_s": b / step, "tok_s_mean": b * len(times) / sum(t for t, _ in times),
           "runner_tok_s": b / run, "step_ms": 1e3 * step, "runner_ms": 1e3 * run,
           "engine_overhead_frac": max(0.0, (step - run) / step)}
    if ref_times:
        hstep = statistics.median(ref_times)
        row.update(hf_tok_s=b / hstep, hf_tok_s_mean=b * len(ref_times) / sum(ref_times),
                   hf_step_ms=1e3 * hstep, vs_hf=hstep / step)
    if probe_times:
        row["probe_ms"] = 1e3 * statistics.median(probe_times[warmup:])
    return row


def engine_prefill(engine, prompt: list[int]) -> float:
    """Wall time of serving one prompt with ``max_tokens=1`` (add to first token)."""
    from pdserve.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    engine.add_request(f"bench-prefill-{time.monotonic_ns()}", prompt, params)
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - t0


def hf_prefill(model, prompt: list[int]) -> float:
    """Wall time of one forward over the prompt (building its cache; logits of the last token)."""
    import torch

    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model(torch.tensor([prompt]), use_cache=True, logits_to_keep=1)
        out.logits[:, -1].argmax(-1).tolist()
        return time.perf_counter() - t0


def load_hf(model_dir: Path, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).eval()


# -------------------------------------------------------------------------------------- driver
def _prompts(gen, vocab: int, n: int, length: int) -> list[list[int]]:
    import torch

    return torch.randint(3, vocab, (n, length), generator=gen).tolist()


def bench_medium(model_dir: Path, cost: ModelCost, dtype: str, st: Settings, bw_gbs: float) -> dict:
    import torch

    prompts = _prompts(torch.Generator().manual_seed(1), _vocab(model_dir), 1, st.prompt_len)
    engine = _make_engine(model_dir, dtype, st.threads, cost, st.prompt_len + st.decode_tokens + 64, st.attention,
                          st.linear)
    model = load_hf(model_dir, dtype) if st.hf else None
    wbytes = cost.weight_bytes_per_token(dtype)
    weights_like = torch.ones(wbytes // 4)   # read once per step: the roofline, under the same load
    row = decode_side_by_side(engine, model, prompts, st.decode_tokens, st.warmup_steps,
                              probe=weights_like.sum)
    runner = engine.runner.describe()   # dtype, threads, the matmul kernels chosen on this machine
    del engine, model, weights_like
    gc.collect()
    return {"runner": runner, "decode_tok_s": row["tok_s"], "hf_decode_tok_s": row.get("hf_tok_s"), "decode": row,
            "weight_bytes_per_token": wbytes, "kv_bytes_per_token": cost.kv_bytes_per_token(dtype),
            "roofline_tok_s": bw_gbs * 1e9 / wbytes,
            "roofline_interleaved_tok_s": 1e3 / row["probe_ms"]}


def bench_small(model_dir: Path, cost: ModelCost, dtype: str, st: Settings, peak_gflops: float) -> dict:
    import torch

    gen = torch.Generator().manual_seed(2)
    vocab = _vocab(model_dir)
    max_tokens = max(st.batches) * (st.prompt_len + st.decode_tokens + st.warmup_steps + 64) + max(st.prefill_lens)
    engine = _make_engine(model_dir, dtype, st.threads, cost, max_tokens, st.attention, st.linear)
    sdpa = (_make_engine(model_dir, dtype, st.threads, cost, max_tokens, "sdpa", st.linear)
            if st.attention == "both" else None)
    model = load_hf(model_dir, dtype) if st.hf else None
    decode = []
    for b in st.batches:
        prompts = _prompts(gen, vocab, b, st.prompt_len)
        # the sdpa engine steps as decode_side_by_side's probe: interleaved, under the same load
        alt = EngineDecode(sdpa, prompts, st.warmup_steps + st.decode_tokens) if sdpa else None
        try:
            row = decode_side_by_side(engine, model, prompts, st.decode_tokens, st.warmup_steps,
                                      probe=alt.step if alt else None)
        finally:
            if alt:
                alt.close()
        if alt:
            row["sdpa_step_ms"] = row.pop("probe_ms")
            row["sdpa_tok_s"] = b * 1e3 / row["sdpa_step_ms"]
            row["native_over_sdpa"] = row["tok_s"] / row["sdpa_tok_s"]
        logger.info("decode batch %d: %s", b, row)
        decode.append(row)
    prefill = []
    for n in st.prefill_lens:
        ours, ref = [], []
        for p in _prompts(gen, vocab, st.prefill_repeats + (n == st.prefill_lens[0]), n):
            ours.append(engine_prefill(engine, p))   # distinct random prompts: no prefix-cache hits
            if model is not None:
                ref.append(hf_prefill(model, p))
        if n == st.prefill_lens[0]:                  # the first prompt warms both up
            ours, ref = ours[1:], ref[1:]
        t, flops = min(ours), cost.prefill_flops(n)
        row = {"tokens": n, "seconds": t, "tok_s": n / t, "gflops": flops / t / 1e9,
               "matmul_ratio": flops / t / 1e9 / peak_gflops}
        if ref:
            row.update(hf_seconds=min(ref), hf_tok_s=n / min(ref), vs_hf=min(ref) / t)
        logger.info("prefill %d: %s", n, row)
        prefill.append(row)
    backend, runner = engine.runner.attention_backend, engine.runner.describe()
    del engine, sdpa, model
    gc.collect()
    return {"attention_backend": backend, "runner": runner, "prompt_len": st.prompt_len, "decode_tokens": st.decode_tokens,
            "prefill_repeats": st.prefill_repeats, "decode": decode, "prefill": prefill}


def _vocab(model_dir: Path) -> int:
    return json.loads((model_dir / "config.json").read_text())["vocab_size"]


def _headline(medium: dict, small: dict) -> dict:
    by_batch = {r["batch"]: r for r in small["decode"]}
    out = {
        "decode_roofline_ratio": medium["decode_tok_s"] / medium["roofline_tok_s"],
        "decode_roofline_ratio_interleaved": medium["decode_tok_s"] / medium["roofline_interleaved_tok_s"],
        "vs_hf_decode_medium_batch1": medium["decode"].get("vs_hf"),
        "decode_batch32_over_batch1": (by_batch[32]["tok_s"] / by_batch[1]["tok_s"]
                                       if 32 in by_batch and 1 in by_batch else None),
        "prefill_matmul_ratio": small["prefill"][-1]["matmul_ratio"],
    }
    for b, r in by_batch.items():
        out[f"vs_hf_decode_batch{b}"] = r.get("vs_hf")
        if "native_over_sdpa" in r:
            out[f"native_over_sdpa_decode_batch{b}"] = r["native_over_sdpa"]
    for r in small["prefill"]:
        out[f"vs_hf_prefill_{r['tokens']}"] = r.get("vs_hf")
    return out


def run_bench(st: Settings) -> dict:
    """Run every measurement; returns the JSON-ready result."""
    import torch
    import transformers
    from pdserve.bench import hw
    from pdserve.engine.testmodel import ensure_model

    torch.set_num_threads(st.threads)
    t_start, load_start = time.perf_counter(), os.getloadavg()[0]
    if load_start > (os.cpu_count() or 1):
        logger.warning("load average %.1f exceeds %d CPUs: figures will be noisy (more so with "
                       "--threads > 1, where OpenMP threads wait on each other)", load_start, os.cpu_count())
    dirs = {name: ensure_model(name) for name in ("medium", "small")}
    costs = {name: model_cost(d, name) for name, d in dirs.items()}
    logger.info("measuring hardware")
    figs = hw.measure(list(st.dtypes), buffer_bytes=st.buffer_bytes, repeats=st.hw_repeats)
    by_dtype = {}
    for dtype in st.dtypes:
        logger.info("benchmarking %s", dtype)
        medium = bench_medium(dirs["medium"], costs["medium"], dtype, st, figs.copy_gbs)
        small = bench_small(dirs["small"], costs["small"], dtype, st, figs.matmul_gflops[dtype])
        by_dtype[dtype] = {"dtype": dtype, **_headline(medium, small), "medium": medium, "small": small}
    primary = by_dtype[st.dtypes[0]]
    return {
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "command": "pdserve " + " ".join(sys.argv[1:]),
        "torch_version": torch.__version__, "transformers_version": transformers.__version__,
        "cpu_model": hw.cpu_model(), "threads": st.threads, "quick": st.quick,
        "dtype": st.dtypes[0], "dtypes": list(st.dtypes), "dtype_auto": probe_cpu_bf16_verdict(),
        "attention": st.attention, "attention_backend": primary["small"]["attention_backend"],
        **{k: v for k, v in primary.items() if not isinstance(v, dict) and k != "dtype"},
        "hw": figs.to_dict(), "models": {k: c.to_dict() for k, c in costs.items()},
        "roofline_note": "weight bytes = all parameters except the embedding table (gathered, not "
                         "streamed), lm_head included once; bandwidth = copy (read + write) GB/s",
        "cpu_count": os.cpu_count(), "load_avg_start": load_start, "load_avg_end": os.getloadavg()[0],
        "by_dtype": by_dtype, "wall_s": time.perf_counter() - t_start,
    }


def probe_cpu_bf16_verdict() -> str:
    """What ``model.dtype: auto`` resolves to here, and the measurement behind it."""
    from pdserve.engine.dtype_probe import probe_cpu_bf16

    native, why = probe_cpu_bf16()
    return f"{'bfloat16' if native else 'float32'} ({why})"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", type=Path, required=True, metavar="FILE", help="write the full result here")
    p.add_argument("--quick", action="store_true", help="few tokens: checks the command works (~2-3 min)")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default: 2)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "both"), default="float32",
                   help="model dtype (default: float32)")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers side")
    p.add_argument("--attention", choices=("auto", "native", "sdpa", "both"), default="auto",
                   help="decode attention backend; both: native and sdpa side by side (default: auto)")
    p.add_argument("--linear", choices=("auto", "dense", "packed", "gemv", "mkl_packed"), default="auto",
                   help="matmul kernels (engine.linear_backend; default: auto, timed per machine)")


def run(args: argparse.Namespace) -> int:
    result = run_and_save("engine", args, settings_from_args, run_bench, format_table)
    if result is None:
        return 2
    print(f"\ndtype auto on this machine: {result['dtype_auto']}")
    for dtype, r in result["by_dtype"].items():
        for name in ("medium", "small"):
            k = r[name]["runner"]
            timings = k.get("fresh_prefill_timings_ms") or {}
            fresh = k.get("fresh_prefill_attention", "?") + (
                f" (one layer, 1024 tokens: native {timings['native']:.1f} ms, sdpa {timings['sdpa']:.1f} ms)"
                if timings else "")
            print(f"{dtype} {name}: {k['num_threads']} threads, matmuls "
                  f"{' '.join(f'{op}={b}' for op, b in k['kernels'].items())} ({k['kernels_source']}); "
                  f"fresh prefill attention {fresh}")
    print(f"\nwrote {args.json} in {result['wall_s']:.0f}s")
    return 0

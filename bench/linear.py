"""``pdserve bench linear``: the engine's matmul backends side by side, on the real model.

    pdserve bench linear --json linear.json [--backends dense,mkl_packed,auto] [--threads 2]
                         [--batches 1,8,32] [--prompts 128,512,2048] [--model small] [--steps 30]

One ``LLMEngine`` per backend (``engine.linear_backend``; ``auto`` is the kernel selector's own
choice, cached per machine), all in this process on the same float32 weights and prompts:

1. decode: for each batch size, every engine prefills the same random prompts (128 tokens), then
   the engines take turns one decode step at a time; each figure is the median step time, so a
   noisy moment of the shared host hits every backend alike;
2. prefill: for each prompt length, a fresh prompt (never cached) per round, prefilled by each
   engine in turn; the median over the rounds.

Unlike the selector's timings (one call on weights that stay in cache), every layer's weights here
stream from memory as they do when serving. Ratios are against the first backend listed.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import logging
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pdserve.bench.common import run_and_save

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class Settings:
    backends: tuple[str, ...]
    threads: int
    batches: tuple[int, ...]
    prompts: tuple[int, ...]
    model: str
    steps: int
    rounds: int


def _ints(text: str, name: str, lo: int, hi: int) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"--{name} takes comma-separated integers, got {text!r}") from None
    if not values or any(not lo <= v <= hi for v in values):
        raise ValueError(f"--{name} values must lie in {lo}..{hi}, got {text!r}")
    return values


def settings_from_args(args: argparse.Namespace) -> Settings:
    from pdserve.engine.linear import BACKENDS

    names = (*BACKENDS, "auto")
    backends = tuple(b.strip() for b in args.backends.split(","))
    if len(backends) < 2 or len(set(backends)) != len(backends) or not set(backends) <= set(names):
        raise ValueError(f"--backends takes two or more distinct names of {', '.join(names)}, got {args.backends!r}")
    if not 1 <= args.threads <= (os.cpu_count() or 1):
        raise ValueError(f"--threads must lie in 1..{os.cpu_count()}, got {args.threads}")
    if not 5 <= args.steps <= 500:
        raise ValueError(f"--steps must lie in 5..500, got {args.steps}")
    if not 1 <= args.rounds <= 20:
        raise ValueError(f"--rounds must lie in 1..20, got {args.rounds}")
    from pdserve.engine.testmodel import PRESETS

    if args.model not in PRESETS:
        raise ValueError(f"--model must be one of {', '.join(sorted(PRESETS))}, got {args.model!r}")
    return Settings(backends, args.threads, _ints(args.batches, "batches", 1, 64),
                    _ints(args.prompts, "prompts", 1, 4096), args.model, args.steps, args.rounds)


def run_bench(st: Settings) -> dict:
    import torch

    from pdserve.bench.engine import EngineDecode, _make_engine, engine_prefill
    from pdserve.bench.hw import cpu_model
    from pdserve.bench.report import model_cost
    from pdserve.engine.testmodel import ensure_model

    torch.set_num_threads(st.threads)
    t0 = time.perf_counter()
    model_dir = ensure_model(st.model)
    cost = model_cost(model_dir, st.model)
    max_tokens = max(max(st.batches) * (128 + st.steps + 40), max(st.prompts) + 64)
    engines = {b: _make_engine(model_dir, "float32", st.threads, cost, max_tokens, linear=b) for b in st.backends}
    kernels = {b: e.runner.kernels.describe() for b, e in engines.items()}
    for b, k in kernels.items():
        logger.info("%s: %s", b, k)
    gen = random.Random(0)
    vocab = int(engines[st.backends[0]].runner.spec.vocab_size)
    decode: dict[str, dict[str, float]] = {}
    for batch in st.batches:
        prompts = [[gen.randrange(3, vocab) for _ in range(128)] for _ in range(batch)]
        runs = {b: EngineDecode(e, prompts, st.steps + 8) for b, e in engines.items()}
        try:
            for d in runs.values():
                for _ in range(3):
                    d.step()
            steps: dict[str, list[float]] = {b: [] for b in runs}
            for _ in range(st.steps):
                for b, d in runs.items():
                    steps[b].append(d.step()[0])
        finally:
            for d in runs.values():
                d.close()
        decode[str(batch)] = {b: statistics.median(s) * 1e3 for b, s in steps.items()}
    prefill: dict[str, dict[str, float]] = {}
    for length in st.prompts:
        times: dict[str, list[float]] = {b: [] for b in engines}
        for _ in range(st.rounds):
            prompt = [gen.randrange(3, vocab) for _ in range(length)]
            for b, e in engines.items():
                times[b].append(engine_prefill(e, prompt))
        prefill[str(length)] = {b: statistics.median(t) * 1e3 for b, t in times.items()}
    base = st.backends[0]
    ratio = lambda table: {k: {b: row[base] / row[b] for b in row if b != base} for k, row in table.items()}  # noqa: E731
    return {
        "benchmark": "linear", "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "command": "pdserve " + " ".join(sys.argv[1:]), "host": cpu_model(), "cpu_count": os.cpu_count(),
        "torch_version": torch.__version__, "model": st.model, "dtype": "float32", "threads": st.threads,
        "backends": list(st.backends), "kernels": kernels,
        "decode_step_ms": decode, "prefill_ms": prefill,
        "decode_speedup": ratio(decode), "prefill_speedup": ratio(prefill),
        "wall_s": time.perf_counter() - t0,
    }


def format_table(r: dict) -> str:
    base = r["backends"][0]
    others = r["backends"][1:]
    lines = [f"pdserve bench linear  {r['date']}  host {r['host']} x{r['cpu_count']}  {r['model']} float32  "
             f"{r['threads']} threads"]
    lines += [f"  {b}: {k}" for b, k in r["kernels"].items()]
    head = f"{'':<14}" + "".join(f"{b:>14}" for b in r["backends"]) + "".join(f"{b + '/' + base:>22}" for b in others)
    lines.append(head)
    for title, table, speed in (("decode batch", r["decode_step_ms"], r["decode_speedup"]),
                                ("prefill", r["prefill_ms"], r["prefill_speedup"])):
        for k, row in table.items():
            label = f"{title} {k}"
            lines.append(f"{label:<14}" + "".join(f"{row[b]:>11.1f} ms" for b in r["backends"])
                         + "".join(f"{speed[k][b]:>21.2f}x" for b in others))
    lines.append("(speed-up = the first backend's time / this one's; decode is per step, prefill per prompt)")
    return "\n".join(lines)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", type=Path, required=True, metavar="FILE", help="write the full result here")
    p.add_argument("--backends", default="dense,mkl_packed,auto",
                   help="comma-separated, two or more engine.linear_backend values (auto included); "
                        "ratios against the first")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default: 2)")
    p.add_argument("--batches", default="1,8,32", help="decode batch sizes (default: 1,8,32)")
    p.add_argument("--prompts", default="128,512,2048", help="prefill prompt lengths (default: 128,512,2048)")
    p.add_argument("--model", default="small", help="make-model preset (default: small)")
    p.add_argument("--steps", type=int, default=30, help="timed decode steps per batch size (default: 30)")
    p.add_argument("--rounds", type=int, default=5, help="prefill rounds per prompt length (default: 5)")


def run(args: argparse.Namespace) -> int:
    result = run_and_save("linear", args, settings_from_args, run_bench, format_table)
    if result is None:
        return 2
    print(f"\nwrote {args.json} in {result['wall_s']:.0f}s")
    return 0

"""``pdserve bench shapes``: engine steps whose row counts vary as a load's do, with the matmuls at
their exact row counts and at row buckets (``engine/row_buckets.py``), side by side.

    pdserve bench shapes [--model DIR | --preset small] [--dtype auto] [--steps 300] [--pairs 2] [--json F]

A seeded sequence of ``--steps`` steps, as a served load makes them: a decode batch that drifts
between 1 and ``--max-seqs`` sequences (arrivals and finishes), and in some steps one to three
prompts of 64-512 tokens beside it. Each arm runs in a fresh process (oneDNN's kernel cache is
per process), in turn, ``--pairs`` times: the model runner at start (the bucketed arm also builds
its buckets' kernels, as a worker's warm-up does, timed apart), then the sequence twice. The first
pass meets each row count for the first time, as a server's early traffic, or any traffic with
more distinct counts than the kernel cache holds; the second meets only counts it has seen (the
padding's own cost). Printed: both arms' mean step times and their ratio per pair, and the host.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model directory (default: the generated --preset)")
    p.add_argument("--preset", default="small", help="testmodel preset when --model is not given")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    p.add_argument("--threads", type=int, default=None, help="engine threads (default: torch's)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--max-seqs", type=int, default=64)
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--arm", default=None, choices=("exact", "bucketed"), help=argparse.SUPPRESS)


def step_shapes(steps: int, max_seqs: int, seed: int) -> list[tuple[int, list[int]]]:
    """(decode batch, prompt lengths) per step: the batch a random walk, prompts in a quarter of
    the steps (one to three, 64-512 tokens)."""
    rng = random.Random(seed)
    b, out = max_seqs // 2, []
    for _ in range(steps):
        b = min(max_seqs, max(1, b + rng.choice((-3, -2, -1, 0, 1, 2, 3))))
        prompts = [rng.randint(64, 512) for _ in range(rng.choice((1, 1, 2, 3)))] if rng.random() < 0.25 else []
        out.append((b, prompts))
    return out


def _arm(args: argparse.Namespace, model_dir: str) -> dict:
    """One arm in this process: the runner, then the sequence twice; mean step seconds per pass."""
    from pdserve.engine.model_runner import ForwardItem, ModelRunner

    shapes = step_shapes(args.steps, args.max_seqs, args.seed)
    longest = max(sum(p) + b for b, p in shapes)
    runner = ModelRunner(model_dir, dtype=args.dtype, num_threads=args.threads, num_blocks=2048)
    bucketed = args.arm == "bucketed"
    runner.bucket_rows = bucketed and runner.bucket_rows
    build_s = 0.0
    if runner.bucket_rows:
        t0 = time.perf_counter()
        runner._build_row_buckets(longest, args.max_seqs)
        build_s = time.perf_counter() - t0
    # scratch block tables (they wrap and share blocks: the values are garbage, the work is real);
    # prompts and the decodes' context clamped to the model's
    ctx = runner.rope.max_positions
    pos, cap = min(200, ctx - 2), min(512, ctx - 1)
    per_seq = -(-(max(pos, cap) + 2) // runner.block_size)
    table = lambda i: [(i * per_seq + k) % runner.num_blocks for k in range(per_seq)]  # noqa: E731
    passes = []
    for _ in range(2):
        times = []
        for b, prompts in shapes:
            items = [ForwardItem([1], pos, table(i), True) for i in range(b)]
            items += [ForwardItem([1] * min(n, cap), 0, table(b + j), True) for j, n in enumerate(prompts)]
            t0 = time.perf_counter()
            runner.execute(items)
            times.append(time.perf_counter() - t0)
        passes.append(statistics.fmean(times))
    return {"arm": args.arm, "bucket_rows": runner.bucket_rows, "dtype": runner.dtype_name,
            "kernels": runner.kernels.summary, "threads": runner.num_threads, "build_s": build_s,
            "first_pass_step_s": passes[0], "second_pass_step_s": passes[1]}


def run(args: argparse.Namespace) -> int:
    from pdserve.bench.hw import cpu_model
    from pdserve.engine.testmodel import ensure_model

    if args.steps < 1 or args.pairs < 1 or args.max_seqs < 1:
        print("bench shapes: error: --steps, --pairs and --max-seqs must be >= 1", flush=True)
        return 2
    model_dir = args.model or str(ensure_model(args.preset))
    if args.arm:
        print(json.dumps(_arm(args, model_dir)), flush=True)
        return 0
    base = [sys.executable, "-m", "pdserve.cli", "bench", "shapes", "--model", model_dir, "--dtype", args.dtype,
            "--steps", str(args.steps), "--max-seqs", str(args.max_seqs), "--seed", str(args.seed)]
    if args.threads is not None:
        base += ["--threads", str(args.threads)]
    print(f"host {cpu_model()}  model {model_dir}  {args.steps} steps, decode batch 1-{args.max_seqs}, "
          f"prompts of 64-512 tokens in a quarter of them", flush=True)
    pairs = []
    for i in range(args.pairs):
        pair = {}
        for arm in ("exact", "bucketed"):
            done = subprocess.run(base + ["--arm", arm], capture_output=True, text=True, timeout=1200)
            if done.returncode != 0:
                print(f"bench shapes: the {arm} arm failed:\n{done.stderr[-2000:]}", flush=True)
                return 1
            pair[arm] = json.loads(done.stdout.strip().splitlines()[-1])
        e, b = pair["exact"], pair["bucketed"]
        pair["first_pass_x"] = b["first_pass_step_s"] / e["first_pass_step_s"]
        pair["second_pass_x"] = b["second_pass_step_s"] / e["second_pass_step_s"]
        pairs.append(pair)
        print(f"pair {i + 1}: {b['dtype']}, kernels {b['kernels']}, {b['threads']} threads; mean step ms, "
              f"exact / bucketed: first pass {e['first_pass_step_s'] * 1e3:.1f} / {b['first_pass_step_s'] * 1e3:.1f} "
              f"(x{pair['first_pass_x']:.2f}), second pass {e['second_pass_step_s'] * 1e3:.1f} / "
              f"{b['second_pass_step_s'] * 1e3:.1f} (x{pair['second_pass_x']:.2f}); the buckets' kernels built "
              f"in {b['build_s']:.2f} s" + ("" if b["bucket_rows"] else " (this dtype and these kernels "
                                             "are not bucketed: both arms alike)"), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "shapes", "host": cpu_model(), "model_dir": model_dir, "steps": args.steps,
                       "max_seqs": args.max_seqs, "seed": args.seed, "pairs": pairs}, f, indent=1)
    return 0

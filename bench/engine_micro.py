"""Microbenchmark of the model runner's decode step against transformers' forward with its KV cache.

    python -m pdserve.bench.engine_micro --preset small --batch 1 8 32 --ctx 128 --dtype float32 bfloat16

For each (dtype, batch): both engines prefill ``batch`` random prompts of ``--ctx`` tokens, then
decode greedily, one step of each engine in turn (so both see the same machine load); prints decode
tokens/s from the median step time, and the ratio. transformers gets one token per sequence per
step with ``past_key_values``; pdserve gets one ``ForwardItem`` per sequence over its block table.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch


def runner_stepper(model_dir, dtype: str, batch: int, ctx: int, steps: int, block_size: int = 16,
                   backend: str = "auto") -> Callable[[], None]:
    from pdserve.engine.model_runner import ForwardItem, ModelRunner

    blocks_per_seq = -(-(ctx + steps + 8) // block_size)
    runner = ModelRunner(model_dir, dtype=dtype, block_size=block_size, num_blocks=batch * blocks_per_seq + 1,
                         linear_backend=backend)
    gen = torch.Generator().manual_seed(0)
    tables = [list(range(1 + b * blocks_per_seq, 1 + (b + 1) * blocks_per_seq)) for b in range(batch)]
    last = []
    for b in range(batch):
        prompt = torch.randint(0, runner.spec.vocab_size, (ctx,), generator=gen).tolist()
        last.append(int(runner.execute([ForwardItem(prompt, 0, tables[b], True)])[0].argmax()))
    state = {"pos": ctx, "last": last}

    def step() -> None:
        items = [ForwardItem([state["last"][b]], state["pos"], tables[b], True) for b in range(batch)]
        state["last"] = runner.execute(items).argmax(-1).tolist()
        state["pos"] += 1

    return step


def hf_stepper(model_dir, dtype: str, batch: int, ctx: int) -> Callable[[], None]:
    from transformers import AutoModelForCausalLM

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).eval()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (batch, ctx), generator=gen)
    with torch.inference_mode():
        out = model(ids, use_cache=True)
    state = {"past": out.past_key_values, "next": out.logits[:, -1].argmax(-1, keepdim=True)}

    def step() -> None:
        with torch.inference_mode():
            out = model(state["next"], past_key_values=state["past"], use_cache=True)
        state["past"], state["next"] = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)

    return step


def measure(steppers: dict[str, Callable[[], None]], steps: int, warmup: int = 3) -> dict[str, float]:
    """Median seconds per step of each stepper, run round-robin."""
    times: dict[str, list[float]] = {k: [] for k in steppers}
    for i in range(warmup + steps):
        for name, step in steppers.items():
            t0 = time.perf_counter()
            step()
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--arch", default="llama")
    ap.add_argument("--model-dir", default=None, help="use this checkpoint instead of a preset")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--backends", nargs="+", default=["auto"], help="pdserve linear backends to compare")
    ap.add_argument("--no-hf", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.model_dir:
        model_dir = args.model_dir
    else:
        from pdserve.engine.testmodel import ensure_model

        model_dir = ensure_model(args.preset, arch=args.arch)
    print(f"model {model_dir}, ctx {args.ctx}, threads {args.threads}, {args.steps} steps (median)")
    for dtype in args.dtype:
        for batch in args.batch:
            steppers = {f"pdserve-{b}": runner_stepper(model_dir, dtype, batch, args.ctx, args.steps, backend=b)
                        for b in args.backends}
            if not args.no_hf:
                steppers["transformers"] = hf_stepper(model_dir, dtype, batch, args.ctx)
            med = measure(steppers, args.steps)
            cells = [f"{k} {batch / v:7.1f} tok/s" for k, v in med.items()]
            if not args.no_hf:
                ref = med["transformers"]
                cells += [f"{k}/hf {ref / v:4.2f}x" for k, v in med.items() if k != "transformers"]
            print(f"{dtype:9s} batch {batch:3d}: " + "   ".join(cells), flush=True)


if __name__ == "__main__":
    main()

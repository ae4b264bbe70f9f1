"""The Batch API's cost to interactive traffic, and its throughput on idle capacity.

One engine (the ``small`` model by default) behind the router's request path (``Serving``), the
Batch API's runner and store (an embedded Redis on 127.0.0.1). Rounds alternate, interactive
load alone and the same load while a batch runs:

* interactive load: ``--requests`` completions (128 random prompt tokens, 32 out), one every
  ``--interval`` seconds; TTFT is measured from the request's admission to its first token;
* batch: ``--batch-items`` completions (64 in, 64 out) submitted as one batch before the load
  starts and cancelled after it; their items run at batch priority on what the interactive load
  leaves.

Then one batch alone on the idle engine: its output tokens per second. Prints the host, TTFT
p50/p99 with and without the batch (all rounds pooled) and ``interactive_ttft_p99_ratio`` (aim
<= 1.1), and the batch throughput. ``pdserve bench batch [--json FILE]``."""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import random
import statistics
import sys
import time

logger = logging.getLogger(__name__)


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


class _NeverSet:
    """An ``LLMEngine.interrupt`` that never fires (``--no-step-interrupt``)."""

    def set(self) -> None:
        pass

    def clear(self) -> None:
        pass

    def is_set(self) -> bool:
        return False


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        from pdserve.cluster.state.batch_store import RedisBatchStore
        from pdserve.cluster.state.redis_server import EmbeddedRedis, connect
        from pdserve.engine.config import EngineConfig
        from pdserve.engine.gc_freeze import freeze_startup_heap
        from pdserve.engine.llm_engine import LLMEngine
        from pdserve.engine.testmodel import ensure_model
        from pdserve.engine.tokenizer import load_tokenizer
        from pdserve.router.admission import Admission, AdmissionConfig
        from pdserve.router.local_backend import LocalEngineBackend
        from pdserve.router.serving import Serving

        self.args = args
        self.redis = EmbeddedRedis().start()
        self.client = connect(self.redis.url)
        self.store = RedisBatchStore(self.client, namespace="bench")
        model = ensure_model(args.model, "llama")
        self.engine = LLMEngine(EngineConfig(str(model), dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                                             kv_cache_memory_gb=1.0))
        if args.no_step_interrupt:  # the ablation: arrivals wait for a batch step to end
            self.engine.interrupt = _NeverSet()
        if args.mixed_batch_prefill:  # the ablation: batch prompt chunks ride in interactive steps
            self.engine.scheduler.batch_prefill_apart = False
        self.backend = LocalEngineBackend(self.engine, model_name=args.model)
        self.serving = Serving(self.backend, tokenizer=load_tokenizer(model),
                               admission=Admission(AdmissionConfig(max_in_flight=args.max_num_seqs, max_queued=256)))
        self.rng = random.Random(0)
        self.vocab = self.engine.spec.vocab_size
        self.engine_ttfts: list[float | None] = []
        self.router_shares: list[float] = []   # router TTFT - engine TTFT, request by request
        if not args.no_gc_freeze:  # as a worker does once started (engine/gc_freeze.py)
            freeze_startup_heap("bench batch")

    def close(self) -> None:
        self.backend.close()
        self.client.close()
        self.redis.stop()

    def _prompt(self, n: int) -> list[int]:
        return [self.rng.randrange(10, self.vocab) for _ in range(n)]

    async def _interactive(self) -> list[float]:
        from pdserve.router.backend import Finished
        from pdserve.router.validation import parse_completion_body

        async def one(i: int) -> tuple[float, float]:
            await asyncio.sleep(i * self.args.interval)
            body = {"prompt": self._prompt(128), "max_tokens": 32, "temperature": 0, "ignore_eos": True}
            t0 = time.monotonic()
            prepared = await self.serving.prepare(parse_completion_body(body), f"i{i}", default_max_tokens=16)
            ttft, engine_ttft = None, None
            async with self.serving.stream(prepared, api="bench") as events:
                async for ev in events:
                    if isinstance(ev, Finished):
                        engine_ttft = ev.phase.ttft_s
                    elif ttft is None:
                        ttft = time.monotonic() - t0
            self.engine_ttfts.append(engine_ttft)
            if engine_ttft is not None:
                self.router_shares.append(ttft - engine_ttft)
            return ttft

        return list(await asyncio.gather(*(one(i) for i in range(self.args.requests))))

    def _engine_side(self, start: int) -> list[float]:
        """The engine's own TTFTs (its arrival to its first token) since ``start``."""
        return [t for t in self.engine_ttfts[start:] if t is not None]

    def _submit(self, n: int) -> str:
        from pdserve.router.batch_api import new_batch

        lines = [json.dumps({"custom_id": f"b{i}", "method": "POST", "url": "/v1/completions",
                             "body": {"prompt": self._prompt(64), "max_tokens": 64, "temperature": 0,
                                      "ignore_eos": True}}) for i in range(n)]
        batch = new_batch("file-bench", "/v1/completions", "24h", None, n)
        self.store.put_batch(batch, lines)
        return batch["id"]

    async def _wait(self, batch_id: str, statuses: tuple[str, ...]) -> dict:
        while True:
            b = await asyncio.to_thread(self.store.batch, batch_id)
            if b["status"] in statuses:
                return b
            await asyncio.sleep(0.1)

    async def run(self) -> dict:
        from pdserve.router.batch_runner import BatchRunner

        runner = BatchRunner(self.serving, self.store, poll_s=0.05)
        task = asyncio.get_running_loop().create_task(runner.run())
        alone: list[float] = []
        beside: list[float] = []
        beside_done, beside_s = 0, 0.0    # batch items completed while the interactive load ran
        try:
            await self._interactive()   # warm-up, not counted
            engine_alone: list[float] = []
            engine_beside: list[float] = []
            share_alone: list[float] = []
            share_beside: list[float] = []
            for r in range(self.args.rounds):
                mark, smark = len(self.engine_ttfts), len(self.router_shares)
                round_alone = await self._interactive()
                alone += round_alone
                engine_alone += self._engine_side(mark)
                share_alone += self.router_shares[smark:]
                bid = self._submit(self.args.batch_items)
                while runner.running < runner.max_concurrent:
                    await asyncio.sleep(0.05)
                t_load = time.monotonic()
                mark, smark = len(self.engine_ttfts), len(self.router_shares)
                round_beside = await self._interactive()
                beside += round_beside
                engine_beside += self._engine_side(mark)
                share_beside += self.router_shares[smark:]
                beside_s += time.monotonic() - t_load
                await asyncio.to_thread(self.store.update_batch, bid, {"status": "cancelling"})
                ended = await self._wait(bid, ("cancelled", "completed"))
                if ended["status"] == "completed":   # then part of the round ran with no batch beside it
                    raise SystemExit(f"the batch of round {r + 1} finished before its interactive load did; "
                                     "raise --batch-items")
                beside_done += ended["request_counts"]["completed"]
                print(f"  round {r + 1}: ttft p99 alone {_pct(round_alone, 0.99):.3f} s, beside a batch "
                      f"{_pct(round_beside, 0.99):.3f} s", flush=True)
            bid = self._submit(self.args.idle_items)
            t0 = time.monotonic()
            done = await self._wait(bid, ("completed",))
            idle_s = time.monotonic() - t0
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await runner.close()
        out = {"ttft_alone_p50_s": statistics.median(alone), "ttft_alone_p99_s": _pct(alone, 0.99),
               "ttft_beside_batch_p50_s": statistics.median(beside), "ttft_beside_batch_p99_s": _pct(beside, 0.99),
               "interactive_ttft_p99_ratio": _pct(beside, 0.99) / _pct(alone, 0.99),
               "samples_per_side": min(len(alone), len(beside)),
               "interactive_ttft_p50_ratio": statistics.median(beside) / statistics.median(alone),
               # with ~90 samples a side p99 is the slowest request or two; p90 moves less
               "interactive_ttft_p90_ratio": _pct(beside, 0.9) / _pct(alone, 0.9),
               # the engine's share: from the backend's submit (the wait for the running step
               # included) to the first token; no tokenizing, no router
               "engine_ttft_alone_p50_s": statistics.median(engine_alone),
               "engine_ttft_alone_p99_s": _pct(engine_alone, 0.99),
               "engine_ttft_beside_batch_p50_s": statistics.median(engine_beside),
               "engine_ttft_beside_batch_p99_s": _pct(engine_beside, 0.99),
               "engine_ttft_p99_ratio": _pct(engine_beside, 0.99) / _pct(engine_alone, 0.99),
               # the rest of each TTFT: preparing the request in the router and the first token's
               # way back to it
               "router_share_alone_p50_s": statistics.median(share_alone),
               "router_share_alone_p99_s": _pct(share_alone, 0.99),
               "router_share_beside_batch_p50_s": statistics.median(share_beside),
               "router_share_beside_batch_p99_s": _pct(share_beside, 0.99),
               "batch_items_done_beside_load": beside_done,
               "batch_output_tok_s_beside_load": beside_done * 64 / beside_s if beside_s else 0.0,
               "batch_idle_output_tok_s": done["request_counts"]["completed"] * 64 / idle_s,
               "batch_idle_items": self.args.idle_items, "batch_idle_s": idle_s}
        return out


class GcPauses:
    """Python's garbage-collector pauses in this process (every thread waits for them): count, total
    and longest per generation, so that a slow interactive request can be told from a collection."""

    def __init__(self) -> None:
        self._t0 = 0.0
        self.pauses: dict[int, list[float]] = {0: [], 1: [], 2: []}

    def __enter__(self) -> "GcPauses":
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.pauses[info["generation"]].append(time.perf_counter() - self._t0)

    def summary(self) -> dict:
        return {f"gc_gen{g}": {"count": len(v), "total_s": sum(v), "max_s": max(v, default=0.0)}
                for g, v in self.pauses.items()}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="small", help="generated model preset")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--requests", type=int, default=40, help="interactive requests per round")
    p.add_argument("--interval", type=float, default=0.5, help="seconds between interactive arrivals")
    p.add_argument("--batch-items", type=int, default=600,
                   help="items of each round's batch: enough to outlast the round's interactive load")
    p.add_argument("--idle-items", type=int, default=64, help="the batch run alone at the end")
    p.add_argument("--rounds", type=int, default=5,
                   help="rounds (the default 5 x 40 gives 200 requests a side: the p99 is the 2nd slowest, "
                        "not the slowest, so one stall does not decide it)")
    p.add_argument("--no-step-interrupt", action="store_true",
                   help="ablation: an interactive arrival does not cut a batch-only engine step short")
    p.add_argument("--mixed-batch-prefill", action="store_true",
                   help="the ablation: batch prompt chunks share interactive steps instead of batch turns")
    p.add_argument("--no-gc-freeze", action="store_true",
                   help="the ablation: leave the start-up heap in Python's full collections")
    p.add_argument("--switch-interval-ms", type=float,
                   help="the ablation: this GIL switch interval instead of the engine loop's (0.5 ms); "
                        "5 is Python's default")
    p.add_argument("--json", help="write the figures here")


def run(args: argparse.Namespace) -> int:
    from pdserve.bench.hw import cpu_model

    print(f"host: {cpu_model()}")
    bench = Bench(args)
    if args.switch_interval_ms is not None:   # after the engine loop set its own
        if not args.switch_interval_ms > 0:
            print("bench batch: error: --switch-interval-ms must be > 0", flush=True)
            bench.close()
            return 2
        sys.setswitchinterval(args.switch_interval_ms / 1000)
    print(f"engine: {args.model} ({bench.engine.config.dtype}), max_num_seqs {args.max_num_seqs}; "
          f"{args.requests} interactive requests per round, every {args.interval} s; batch {args.batch_items} items; "
          f"step interrupt {'off' if args.no_step_interrupt else 'on'}; batch prompts "
          f"{'mixed into interactive steps' if args.mixed_batch_prefill else 'in batch turns'}; "
          f"GIL switch interval {sys.getswitchinterval() * 1000:g} ms")
    try:
        with GcPauses() as gc_pauses:
            out = asyncio.run(bench.run())
    finally:
        bench.close()
    out.update(gc_pauses.summary())
    out["host"] = cpu_model()
    out["step_interrupt"] = not args.no_step_interrupt
    out["interrupted_steps"] = bench.engine.interrupted_steps
    out["batch_prefill_apart"] = not args.mixed_batch_prefill
    out["batch_turns"] = bench.engine.scheduler.num_batch_turns
    out["gc_freeze"] = not args.no_gc_freeze
    out["switch_interval_s"] = sys.getswitchinterval()
    print(f"interactive TTFT p50/p99: alone {out['ttft_alone_p50_s']:.3f}/{out['ttft_alone_p99_s']:.3f} s, "
          f"beside a batch {out['ttft_beside_batch_p50_s']:.3f}/{out['ttft_beside_batch_p99_s']:.3f} s; "
          f"interactive_ttft_p99_ratio {out['interactive_ttft_p99_ratio']:.2f} (aim <= 1.1), "
          f"p90 ratio {out['interactive_ttft_p90_ratio']:.2f}, p50 ratio {out['interactive_ttft_p50_ratio']:.2f} "
          f"({out['samples_per_side']} requests a side: the p99 is the slowest but "
          f"{out['samples_per_side'] - 1 - int(0.99 * out['samples_per_side'])})")
    print(f"  the engine's own TTFT p50/p99: alone {out['engine_ttft_alone_p50_s']:.3f}/"
          f"{out['engine_ttft_alone_p99_s']:.3f} s, beside a batch {out['engine_ttft_beside_batch_p50_s']:.3f}/"
          f"{out['engine_ttft_beside_batch_p99_s']:.3f} s; p99 ratio {out['engine_ttft_p99_ratio']:.2f}")
    print(f"  the rest (the router) p50/p99: alone {out['router_share_alone_p50_s']:.3f}/"
          f"{out['router_share_alone_p99_s']:.3f} s, beside a batch {out['router_share_beside_batch_p50_s']:.3f}/"
          f"{out['router_share_beside_batch_p99_s']:.3f} s")
    print(f"batch turns beside interactive decodes: {out['batch_turns']}; "
          f"batch-only steps cut short by an interactive arrival: {out['interrupted_steps']}")
    print(f"batch beside the interactive load: {out['batch_items_done_beside_load']} items completed, "
          f"{out['batch_output_tok_s_beside_load']:.0f} output tok/s")
    print(f"batch on idle capacity: {out['batch_idle_output_tok_s']:.0f} output tok/s "
          f"({out['batch_idle_items']} items in {out['batch_idle_s']:.1f} s)")
    print("garbage-collector pauses (all threads wait): " + "; ".join(
        f"gen {g} {out[f'gc_gen{g}']['count']} x, longest {out[f'gc_gen{g}']['max_s'] * 1000:.1f} ms, "
        f"total {out[f'gc_gen{g}']['total_s']:.2f} s" for g in (0, 1, 2)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0

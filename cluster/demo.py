"""``pdserve demo``: the embedded default on this machine, end to end.

Local Ray (node IP 127.0.0.1), the embedded Redis, one prefill and one decode worker and the
router, on the generated ``small`` model; a few streamed requests printed with their phase
records (one prompt repeated, to show the cached prefix); then everything is stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

DEMO_PROMPTS = [
    "Every request has two phases, and they are limited by completely different things.",
    "The kitchen at seven in the morning: twelve cooks read the whole ticket at once.",
    "Every request has two phases, and they are limited by completely different things.",
    "Batching shares one weight read across many sequences, so it helps decode enormously.",
]


def _say(msg: str) -> None:
    print(msg, flush=True)


async def _stream_one(base_url: str, model: str, prompt: str, max_tokens: int) -> dict:
    import aiohttp

    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    phase: dict = {}
    usage: dict = {}
    async with aiohttp.ClientSession() as session:
        async with session.post(base_url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices", []):
                    sys.stdout.write(choice.get("text", ""))
                    sys.stdout.flush()
                ext = chunk.get("pdserve") or {}
                phase = ext.get("phase") or phase
                usage = chunk.get("usage") or usage
    return {"phase": phase, "usage": usage}


async def _demo(model_dir: str, max_tokens: int) -> None:
    from pdserve.cluster.config_io import apply_overrides, config_from_model
    from pdserve.cluster.launcher import serve
    from pdserve.generate_cmd import format_phase_record

    config = apply_overrides(config_from_model(model_dir), {
        "router.http_port": 0, "router.grpc_port": 0, "planner.enabled": False,
        "prefill.engine.num_threads": 1, "decode.engine.num_threads": 1,
        "prefill.engine.kv_cache_memory_gb": 0.5, "decode.engine.kv_cache_memory_gb": 0.5,
        "router.disaggregation.local_prefill_max_tokens": 0, "ray.include_dashboard": False,
    }, source="demo")
    ready, stop = asyncio.Event(), asyncio.Event()
    _say("starting Ray (127.0.0.1), the embedded Redis, 1 prefill + 1 decode worker and the router ...")
    t0 = time.monotonic()
    head = asyncio.create_task(serve(config, ready, stop, write_state=False))
    waiter = asyncio.create_task(ready.wait())
    await asyncio.wait({head, waiter}, return_when=asyncio.FIRST_COMPLETED)
    if head.done():
        waiter.cancel()
        head.result()  # raises the start-up error
        return
    state = serve.state  # type: ignore[attr-defined]
    _say(f"up in {time.monotonic() - t0:.1f} s: HTTP {state['http']}  gRPC {state['grpc']}\n")
    try:
        for i, prompt in enumerate(DEMO_PROMPTS, 1):
            _say(f"--- request {i}: {prompt!r}")
            result = await _stream_one(state["http"], config.model.served_name, prompt, max_tokens)
            _say("\n")
            _say(format_phase_record(result["phase"]))
            _say(f"workers: prefill {result['phase'].get('prefill_worker')}  "
                 f"decode {result['phase'].get('decode_worker')}\n")
    finally:
        _say("stopping ...")
        stop.set()
        await head
    _say("done.")


def run_demo(args: argparse.Namespace) -> int:
    model = args.model
    if model is None:
        from pdserve.engine.testmodel import ensure_model

        _say(f"using the generated '{args.preset}' test model (random weights: the text is gibberish, "
             "the timings are real); it is made once and cached")
        model = str(ensure_model(args.preset))
    asyncio.run(_demo(model, args.max_tokens))
    return 0

"""``pdserve demo``: the embedded default on this machine, end to end, on a real model.

Local Ray (node IP 127.0.0.1), the embedded Redis, one prefill and one decode worker and the
router, on SmolLM2-135M-Instruct (the wheel `make setup` installs, converted once into the model
cache). Every prompt goes through the prefill worker and its KV blocks over NIXL to the decode
worker (``disaggregation.mode: always``). A short chat, streamed through ``/v1/chat/completions``,
each reply followed by its phase record:

1. a question with a known answer;
2. a follow-up that sends the conversation so far: its prefix is already in the prefill worker's
   cache, and the record shows those tokens as cached;
3. and 4. two questions under one long system prompt: the second reuses the first's KV for it.

``--model DIR|FILE.gguf|NAME`` serves another model; ``--preset small`` the generated random-weight
test model (gibberish text, real timings) with the same requests as plain completions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

from pdserve.cluster.cli.records import format_phase_record
from pdserve.cluster.config_io import apply_overrides, config_from_model
from pdserve.cluster.head.launcher import serve
from pdserve.engine.known_models import DEFAULT_REAL_MODEL, resolve_model

SYSTEM = (
    "You are a helpful assistant for a bicycle shop. The shop is open from 9 am to 6 pm, Monday to "
    "Saturday, and closed on Sunday. It sells city bikes, mountain bikes and electric bikes, and repairs "
    "any bicycle. A basic tune-up costs 40 dollars and takes one day. Flat tyres are fixed while you wait "
    "for 10 dollars. Rentals cost 25 dollars a day, helmet included. Answer customers in one or two short "
    "sentences."
)
CHAT_TURNS = [
    ("a question with a known answer", None, "What is the capital of France? Answer in one sentence."),
    ("a follow-up: the conversation so far is a cached prefix", "follow-up", "And what is the capital of Germany?"),
    ("a long system prompt ...", "system", "How much does it cost to rent a bike for a day?"),
    ("... shared by a second request: its KV is reused", "system", "What kinds of bikes do you sell?"),
]
PLAIN_PROMPTS = [
    "Every request has two phases, and they are limited by completely different things.",
    "The kitchen at seven in the morning: twelve cooks read the whole ticket at once.",
    "Every request has two phases, and they are limited by completely different things.",
    "Batching shares one weight read across many sequences, so it helps decode enormously.",
]


def _say(msg: str) -> None:
    print(msg, flush=True)


async def _stream(base_url: str, path: str, body: dict) -> dict:
    """POST a streaming request, print its text as it arrives; return its text, phase and usage."""
    import aiohttp

    body = {**body, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    text, phase, usage = [], {}, {}
    async with aiohttp.ClientSession() as session:
        async with session.post(base_url + path, json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices", []):
                    piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                    text.append(piece)
                    sys.stdout.write(piece)
                    sys.stdout.flush()
                phase = (chunk.get("pdserve") or {}).get("phase") or phase
                usage = chunk.get("usage") or usage
    return {"text": "".join(text), "phase": phase, "usage": usage}


def _show_record(result: dict) -> None:
    _say("\n")
    _say(format_phase_record(result["phase"]))
    _say(f"workers: prefill {result['phase'].get('prefill_worker')}  decode {result['phase'].get('decode_worker')}\n")


async def _chat_session(base_url: str, model: str, max_tokens: int) -> None:
    history: list[dict] = []
    for title, kind, question in CHAT_TURNS:
        if kind is None:
            messages = [{"role": "user", "content": question}]
        elif kind == "follow-up":
            messages = [*history, {"role": "user", "content": question}]
        else:
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        if kind == "system":
            _say(f"--- {title}\nsystem: {SYSTEM[:72]}... ({len(SYSTEM)} characters)")
        else:
            _say(f"--- {title}")
        sys.stdout.write(f"user: {question}\nassistant: ")
        result = await _stream(base_url, "/v1/chat/completions",
                               {"model": model, "messages": messages, "max_tokens": max_tokens})
        if kind is None:
            history = [*messages, {"role": "assistant", "content": result["text"]}]
        _show_record(result)


async def _plain_session(base_url: str, model: str, max_tokens: int) -> None:
    for i, prompt in enumerate(PLAIN_PROMPTS, 1):
        _say(f"--- request {i}: {prompt!r}")
        _show_record(await _stream(base_url, "/v1/completions",
                                   {"model": model, "prompt": prompt, "max_tokens": max_tokens}))


async def _demo(model_dir: str, served_name: str | None, max_tokens: int, chat: bool) -> None:
    overrides = {
        "router.http_port": 0, "router.grpc_port": 0, "planner.enabled": False,
        "prefill.engine.num_threads": 1, "decode.engine.num_threads": 1,
        "prefill.engine.kv_cache_memory_gb": 0.5, "decode.engine.kv_cache_memory_gb": 0.5,
        "router.disaggregation.mode": "always", "ray.include_dashboard": False,
    }
    if served_name:
        overrides["model.served_name"] = served_name
    config = apply_overrides(config_from_model(model_dir), overrides, source="demo")
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
    _say(f"up in {time.monotonic() - t0:.1f} s: HTTP {state['http']}  gRPC {state['grpc']}  "
         f"model '{config.model.served_name}'\n")
    try:
        if chat:
            await _chat_session(state["http"], config.model.served_name, max_tokens)
        else:
            await _plain_session(state["http"], config.model.served_name, max_tokens)
    finally:
        _say("stopping ...")
        stop.set()
        await head
    _say("done.")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="a model directory, .gguf file or known name (default: smollm2-135m-instruct)")
    p.add_argument("--preset", help="serve a generated random-weight test model instead (tiny, small, ...)")
    p.add_argument("--max-tokens", type=int, default=64)


def run_demo(args: argparse.Namespace) -> int:
    from pdserve.engine.loader import load_model_spec
    from pdserve.engine.tokenizer import load_tokenizer

    if args.preset is not None and args.model is not None:
        raise SystemExit("pdserve demo: give --model or --preset, not both")
    if args.preset is not None:
        from pdserve.engine.testmodel import ensure_model

        _say(f"using the generated '{args.preset}' test model (random weights: the text is gibberish, "
             "the timings are real); it is made once and cached")
        model_dir, served_name = ensure_model(args.preset), None
    else:
        name = args.model or DEFAULT_REAL_MODEL
        _say(f"model {name} (converted once from its GGUF into the model cache; later runs reuse it) ...")
        model_dir, served_name = resolve_model(name)
        load_model_spec(model_dir)  # a clear error for a directory that is not a model
    chat = args.preset is None and bool(getattr(load_tokenizer(model_dir), "chat_template", None))
    asyncio.run(_demo(str(model_dir), served_name, args.max_tokens, chat))
    return 0

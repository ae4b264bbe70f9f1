"""``pdserve generate``: one prompt through a local engine, streamed, then its phase record."""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid

from pdserve.cluster.cli.records import format_phase_record


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--model", required=True, help="a Hugging Face model directory, a .gguf file, or a known "
                   "model name (`pdserve get-model --list`)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0, help="0 means greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")


def run(args: argparse.Namespace) -> int:
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.errors import InvalidRequestError
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.sampling_params import SamplingParams

    if not args.prompt:
        raise InvalidRequestError("the prompt is empty: give some text to continue")
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
    )
    from pdserve.engine.known_models import resolve_model

    t0 = time.monotonic()
    model_dir, _name = resolve_model(args.model)
    engine = LLMEngine(EngineConfig(model_dir=str(model_dir), dtype=args.dtype, num_threads=args.threads,
                                    kv_cache_memory_gb=0.25))
    load_s = time.monotonic() - t0
    tok = engine.stopper.tokenizer
    if args.chat:
        prompt_ids = tok.apply_chat_template([{"role": "user", "content": args.prompt}],
                                             add_generation_prompt=True, tokenize=True)
        if hasattr(prompt_ids, "keys"):  # transformers 5 returns a BatchEncoding
            prompt_ids = prompt_ids["input_ids"]
    else:
        prompt_ids = tok.encode(args.prompt)
    rid = uuid.uuid4().hex
    engine.add_request(rid, list(prompt_ids), params)
    token_ids: list[int] = []
    text_parts: list[str] = []
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            token_ids.extend(out.new_token_ids)
            if out.text_delta:
                text_parts.append(out.text_delta)
                if not args.json:
                    sys.stdout.write(out.text_delta)
                    sys.stdout.flush()
            if out.finished:
                final = out
    phase = final.phase.to_dict() if final and final.phase else {}
    if args.json:
        print(json.dumps({
            "text": "".join(text_parts),
            "token_ids": token_ids,
            "finish_reason": final.finish_reason if final else None,
            "load_s": round(load_s, 4),
            "phase": phase,
        }))
        return 0
    sys.stdout.write("\n\n")
    print(format_phase_record(phase, load_s=load_s))
    return 0

"""``pdserve get-model``: a real model from an installed package (or any GGUF file) as a Hugging Face
directory pdserve serves. Nothing is downloaded: ``make setup`` installed the package."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def add_args(p: argparse.ArgumentParser) -> None:
    from pdserve.engine.known_models import DEFAULT_REAL_MODEL, KNOWN_MODELS

    p.add_argument("name", nargs="?", choices=sorted(KNOWN_MODELS),
                   help=f"a model shipped in a package `make setup` installs (default: {DEFAULT_REAL_MODEL})")
    p.add_argument("--gguf", type=Path, help="convert this GGUF file (Llama or Qwen2) instead of a known model")
    p.add_argument("--out", type=Path, help="write the directory here (must be new or empty); default: the "
                   "model cache (.cache/models), converted once and reused")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="dtype of the written weights (default: float32, exact for the dequantized values)")
    p.add_argument("--list", action="store_true", help="list the known models and exit")


def run(args: argparse.Namespace) -> int:
    from pdserve.engine.errors import InvalidRequestError
    from pdserve.engine.gguf_convert import convert_gguf, ensure_gguf_model
    from pdserve.engine.known_models import DEFAULT_REAL_MODEL, KNOWN_MODELS, known_model_file

    if args.list:
        for m in KNOWN_MODELS.values():
            print(f"{m.name}  ({m.distribution}) {m.description}")
        return 0
    if args.gguf is not None and args.name is not None:
        raise InvalidRequestError("give a known model name or --gguf FILE, not both")
    source = args.gguf if args.gguf is not None else known_model_file(args.name or DEFAULT_REAL_MODEL)
    t0 = time.monotonic()
    out = convert_gguf(source, args.out, args.dtype) if args.out else ensure_gguf_model(source, args.dtype)
    cfg = json.loads((Path(out) / "config.json").read_text())
    print(f"{cfg['architectures'][0]}: {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, "
          f"vocab {cfg['vocab_size']}, {args.dtype}, from {source} in {time.monotonic() - t0:.1f} s")
    print(out)
    return 0

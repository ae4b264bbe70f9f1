"""``pdserve bench transfer``: a prompt's KV moved prefill -> decode over NIXL, against a plain copy.

    pdserve bench transfer --json transfer.json [--quick] [--threads 1] [--chunk 512]
    pdserve bench transfer --link 1gbit,10gbit --json link.json     # across emulated hosts (root)

On the ``small`` model (30 layers, 3 KV heads, head dim 64, block 16, fp32: 0.74 MB per block),
in one run:

1. ``memcpy``: ``torch.index_select(kv, 0, src_blocks, out=dst)`` of the prompt's blocks inside
   one process, best of N: the host's copy speed for exactly these bytes (counted once).
2. Raw NIXL (``bench/transfer_pair.py``): one agent pair in two processes, the same bytes as one
   coalesced descriptor and as one descriptor per block; optionally once per ``--raw-env``.
3. The real path: a decode worker and two prefill workers as Ray actors (one OS process each,
   NIXL UCX between them). ``overlap`` pushes each chunk's full blocks as soon as the chunk is
   computed (chunk budget ``--chunk`` tokens); ``no_overlap`` pushes every block after the prompt
   is done, in one burst. Each request uses fresh random token ids (no prefix-cache hit); the
   cases are interleaved, one warm-up each, and medians are reported.

Per request: ``ttft_s`` as the caller sees it (reserve on the decode worker + the prefill call),
``prefill_s`` (forward-pass compute only), ``kv_transfer_s`` (first write posted -> DONE sent),
``kv_exposed_s`` (DONE sent - first token ready: transfer not hidden behind compute) and
``non_compute_s = ttft_s - prefill_s`` (everything that is not compute: RPCs, scheduling and
any copy that runs on the engine thread between steps). Headline ratios:
``transfer_vs_memcpy_ratio`` = ``transfer_gbps`` (no_overlap: bytes / transfer time) over
``memcpy_gbps``, and ``transfer_share_of_ttft`` = median ``kv_exposed_s`` / median TTFT per case.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import logging
import os
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from pdserve.bench.transfer_cluster import run_cluster
from pdserve.bench.transfer_report import format_table, summarize

logger = logging.getLogger(__name__)

AIMS = {"transfer_vs_memcpy_ratio": 0.5, "transfer_share_of_ttft_overlap": 0.05}


@dataclass(frozen=True, slots=True)
class Settings:
    prompt_len: int = 2048
    chunk_tokens: int = 512
    threads: int = 1
    repeats: int = 3
    memcpy_repeats: int = 10
    raw: bool = True
    raw_repeats: int = 5
    raw_envs: tuple[str, ...] = ()          # extra UCX env variants for raw NIXL, "K=V,K=V"
    raw_progress_thread: bool = False
    worker_env: str = ""                    # "K=V,K=V" for the workers' UCX (e.g. UCX_TLS=tcp)
    kv_cache_memory_gb: float = 0.3
    quick: bool = False

    def __post_init__(self) -> None:
        if self.prompt_len < 16 or self.chunk_tokens < 16:
            raise ValueError("prompt_len and chunk_tokens must be >= 16")
        if self.threads < 1 or self.repeats < 1 or self.memcpy_repeats < 1 or self.raw_repeats < 1:
            raise ValueError("threads and repeat counts must be >= 1")
        for spec in (*self.raw_envs, self.worker_env):
            parse_env(spec)


def parse_env(spec: str) -> dict[str, str]:
    """``"UCX_TLS=cma,tcp;UCX_CMA_SEG_SIZE=4m"`` -> dict (``;`` separates variables, since
    UCX values themselves contain commas)."""
    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        key, sep, value = part.partition("=")
        if not sep or not key:
            raise ValueError(f"bad environment setting {part!r}: want NAME=VALUE")
        out[key] = value
    return out


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", type=Path, help="write every figure to this file")
    p.add_argument("--quick", action="store_true", help="short prompt, one repeat: a ~1 minute sanity run")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker and for memcpy (default 1)")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 2048; quick 512)")
    p.add_argument("--chunk", type=int, default=None, help="prefill chunk budget in tokens (default 512; quick 128)")
    p.add_argument("--repeats", type=int, default=None, help="measured requests per case (default 3)")
    p.add_argument("--no-raw", action="store_true", help="skip the raw NIXL agent-pair measurement")
    p.add_argument("--raw-env", action="append", default=[], metavar="K=V;K=V",
                   help="also run raw NIXL with these UCX variables (repeatable)")
    p.add_argument("--raw-progress-thread", action="store_true", help="raw NIXL with NIXL's progress thread")
    p.add_argument("--worker-env", default="", metavar="K=V;K=V", help="UCX variables for the workers")
    p.add_argument("--link", default=None, metavar="RATE[,RATE...]",
                   help="run the worker path across emulated hosts on links of these tc rates (e.g. 1gbit,10gbit: "
                        "network namespaces, veth, tbf; needs root) instead of on one host (bench/transfer_link.py)")
    p.add_argument("--lengths", default="512,1024", metavar="N[,N...]",
                   help="with --link: other prompt lengths for share_by_length / hidden_up_to_tokens")


def settings_from_args(args: argparse.Namespace) -> Settings:
    quick = dict(prompt_len=512, chunk_tokens=128, repeats=1, memcpy_repeats=3, raw_repeats=2) if args.quick else {}
    given = {k: v for k, v in (("prompt_len", args.prompt_len), ("chunk_tokens", args.chunk),
                                ("repeats", args.repeats)) if v is not None}
    return Settings(**{**quick, **given}, threads=args.threads, raw=not args.no_raw,
                    raw_envs=tuple(args.raw_env), raw_progress_thread=args.raw_progress_thread,
                    worker_env=args.worker_env, quick=args.quick)


def measure_memcpy(block_shape: tuple[int, ...], num_blocks: int, repeats: int) -> dict:
    """Best-of-N in-process copies of ``num_blocks`` blocks: gathered by index (as a block
    table is) and as one contiguous slice."""
    import torch

    kv = torch.randn(2 * num_blocks, *block_shape)
    idx = torch.arange(0, 2 * num_blocks, 2)       # every other block: a real gather
    dst = torch.empty(num_blocks, *block_shape)
    nbytes = dst.numel() * dst.element_size()

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    gather_s = best(lambda: torch.index_select(kv, 0, idx, out=dst))
    contiguous_s = best(lambda: dst.copy_(kv[:num_blocks]))
    return {"nbytes": nbytes, "repeats": repeats, "gather_s": gather_s, "contiguous_s": contiguous_s,
            "gather_gbps": nbytes / gather_s / 1e9, "contiguous_gbps": nbytes / contiguous_s / 1e9}


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    settings = settings_from_args(args)
    if args.link:
        return run_link_benchmark(args, settings)
    result = run_benchmark(settings)
    argv = sys.argv[sys.argv.index("transfer") + 1:] if "transfer" in sys.argv else sys.argv[1:]
    result["command"] = " ".join(["pdserve bench transfer", *argv])
    sys.stdout.write(format_table(result) + "\n")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        sys.stdout.write(f"wrote {args.json}\n")
    return 0 if result["cluster"]["errors"] == 0 and result["cluster"]["leaked_blocks"] == 0 else 1


def _interrupt(signum: int, frame: object) -> None:
    """A SIGTERM unwinds like Ctrl-C, so the emulated hosts and their processes are torn down."""
    raise KeyboardInterrupt(f"signal {signum}")


def run_link_benchmark(args: argparse.Namespace, s: Settings) -> int:
    """``--link``: the worker path across emulated hosts, one link rate after another."""
    import signal

    from pdserve.bench.hw import cpu_model
    from pdserve.bench.netns import HostsUnavailable, rate_bits
    from pdserve.bench.transfer_link import run_links
    from pdserve.bench.transfer_report import format_links
    from pdserve.engine.testmodel import ensure_model

    try:
        rates = [r.strip() for r in args.link.split(",") if r.strip()]
        for r in rates:
            rate_bits(r)
        bad = [n for n in args.lengths.split(",") if n.strip() and not n.strip().isdigit()]
        if bad:
            raise ValueError(f"--lengths {bad[0].strip()!r} is not a whole number of tokens (e.g. --lengths 512,1024)")
        lengths = [int(n) for n in args.lengths.split(",") if n.strip()]
    except ValueError as exc:
        sys.stderr.write(f"pdserve bench transfer: {exc}\n")
        return 2
    if not rates or any(n < 16 for n in lengths):
        sys.stderr.write("pdserve bench transfer: --link needs at least one rate, --lengths values >= 16\n")
        return 2
    signal.signal(signal.SIGTERM, _interrupt)
    model_dir = ensure_model("small")
    cfg = json.loads((model_dir / "config.json").read_text())
    spec = {"model_dir": str(model_dir), "prompt_len": s.prompt_len, "chunk_tokens": s.chunk_tokens,
            "threads": s.threads, "repeats": s.repeats, "vocab_size": cfg["vocab_size"],
            "kv_cache_memory_gb": s.kv_cache_memory_gb, "env": parse_env(s.worker_env),
            "more_lengths": [n for n in lengths if n != s.prompt_len]}
    started = time.time()
    try:
        result = run_links(rates, spec)
    except HostsUnavailable as exc:
        sys.stderr.write(f"pdserve bench transfer --link: {exc}\n")
        return 2
    argv = sys.argv[sys.argv.index("transfer") + 1:] if "transfer" in sys.argv else sys.argv[1:]
    result.update({
        "benchmark": "transfer-link",
        "command": " ".join(["pdserve bench transfer", *argv]),
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": {"cpu_model": cpu_model(), "cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0]},
        "settings": {**asdict(s), "lengths": lengths}, "prompt_tokens": s.prompt_len,
        "elapsed_s": time.time() - started,
    })
    sys.stdout.write(format_links(result) + "\n")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        sys.stdout.write(f"wrote {args.json}\n")
    bad = any(v["errors"] or v["leaked_blocks"] for v in result["links"].values())
    return 1 if bad else 0


def run_benchmark(s: Settings) -> dict:
    import torch

    from pdserve.bench.hw import cpu_model
    from pdserve.bench.transfer_pair import measure_raw
    from pdserve.engine.testmodel import ensure_model

    model_dir = ensure_model("small")
    cfg = json.loads((model_dir / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", heads)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    block_size = 16
    block_shape = (cfg["num_hidden_layers"], 2, block_size, kv_heads, head_dim)
    block_bytes = 4 * math.prod(block_shape)
    num_blocks = -(-s.prompt_len // block_size)
    nbytes = num_blocks * block_bytes

    torch.set_num_threads(s.threads)
    started = time.time()
    memcpy = measure_memcpy(block_shape, num_blocks, s.memcpy_repeats)
    raw = []
    if s.raw:
        envs = [{}] + [parse_env(e) for e in s.raw_envs]
        raw = [measure_raw(nbytes, [1, num_blocks], repeats=s.raw_repeats, env=e,
                           progress_thread=s.raw_progress_thread).to_dict() for e in envs]
    cluster = run_cluster(str(model_dir), prompt_len=s.prompt_len, chunk_tokens=s.chunk_tokens,
                          threads=s.threads, repeats=s.repeats, vocab_size=cfg["vocab_size"],
                          kv_cache_memory_gb=s.kv_cache_memory_gb, env=parse_env(s.worker_env))
    result = {
        "benchmark": "transfer",
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": {"cpu_model": cpu_model(), "cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0]},
        "torch_version": torch.__version__,
        "settings": asdict(s),
        "model": {"name": "small", "dir": str(model_dir), "num_layers": cfg["num_hidden_layers"],
                  "num_kv_heads": kv_heads, "head_dim": head_dim, "block_size": block_size,
                  "dtype": "float32", "block_bytes": block_bytes},
        "prompt_tokens": s.prompt_len,
        "memcpy": memcpy,
        "raw_nixl": raw,
        "cluster": cluster,
        "aims": AIMS,
        "elapsed_s": time.time() - started,
    }
    result.update(summarize(result, nbytes))
    return result


def main() -> int:
    parser = argparse.ArgumentParser(prog="pdserve bench transfer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())

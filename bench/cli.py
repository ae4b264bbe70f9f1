"""``pdserve bench``: one sub-subcommand per benchmark module.

A benchmark module ``pdserve.bench.<name>`` offers ``add_args(parser)`` and ``run(args) -> int``
and is listed in ``_BENCHMARKS``; a module that does not import (not written yet, or a missing
optional dependency of its own) is simply not offered.
"""

from __future__ import annotations

import argparse
import importlib
import logging

logger = logging.getLogger(__name__)

# name -> (module, one-line help)
_BENCHMARKS: dict[str, tuple[str, str]] = {
    "engine": ("pdserve.bench.engine", "engine decode/prefill against rooflines and transformers"),
    "linear": ("pdserve.bench.linear", "the engine's matmul backends side by side on the real model"),
    "shapes": ("pdserve.bench.shapes", "engine steps of a load's varied row counts: exact against row buckets"),
    "transfer": ("pdserve.bench.transfer", "KV block transfer bandwidth and latency"),
    "router": ("pdserve.bench.router", "router latency and serving load"),
    "serve": ("pdserve.bench.serve", "a served workload from the client, against pdserve and vLLM side by side"),
    "batch": ("pdserve.bench.batch", "interactive TTFT with and without a concurrent batch; batch throughput"),
    "structured": ("pdserve.bench.structured", "grammar libraries compared, and a grammar's cost to its batch"),
    "simulate": ("pdserve.bench.sim_accuracy", "the capacity simulator against real runs here, and its speed"),
    "failover": ("pdserve.bench.failover", "control-plane leader and router deaths: time to recover, requests lost"),
    "hostile": ("pdserve.bench.hostile", "hostile requests: each one's stall of a neighbour's token stream"),
}


def add_args(bench: argparse.ArgumentParser) -> None:
    """One sub-subcommand per benchmark whose module imports (only when ``pdserve bench`` runs)."""
    sub = bench.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    for name, (module, help_text) in _BENCHMARKS.items():
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:
            logger.debug("benchmark %s not available: %s", name, exc)
            continue
        if not (callable(getattr(mod, "add_args", None)) and callable(getattr(mod, "run", None))):
            logger.warning("benchmark module %s lacks add_args(parser) or run(args); skipped", module)
            continue
        p = sub.add_parser(name, help=help_text, description=(mod.__doc__ or "").strip() or None,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_args(p)


def run(args: argparse.Namespace) -> int:
    """The chosen benchmark's ``run(args)``."""
    return importlib.import_module(_BENCHMARKS[args.bench][0]).run(args)

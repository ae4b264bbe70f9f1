"""``pdserve up``: check the config and start the head in the background (``cluster/head/up_down.py``),
or run it in this process with ``--foreground`` (containers). Until the head starts, nothing heavier
than the config is loaded: the head itself (Ray, gRPC, the router) only with ``--foreground``."""

from __future__ import annotations

import argparse

from pdserve.cluster.cli.config_cmd import add_config_source
from pdserve.cluster.config_io import load_cli_config
from pdserve.cluster.head.up_down import clear_for_a_new_head, start_head


def add_args(p: argparse.ArgumentParser) -> None:
    add_config_source(p)
    p.add_argument("--address", help="join this Ray cluster ('auto' on a Ray node) instead of starting one")
    p.add_argument("--foreground", action="store_true",
                   help="run the head in this process until SIGTERM/Ctrl-C (containers, e.g. KubeRay)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the pools to be ready")


def up(args: argparse.Namespace) -> int:
    overrides = list(args.set) + ([f"ray.address={args.address}"] if args.address else [])
    config = load_cli_config(args.config, args.model, overrides)  # fail fast on a bad config, before forking
    if (refused := clear_for_a_new_head()) is not None:
        return refused
    if args.foreground:
        from pdserve.cluster.head.launcher import run_head   # the head itself: Ray, gRPC, the router

        return run_head(config)
    return start_head(args.config, args.model, overrides, args.timeout)

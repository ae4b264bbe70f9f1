"""The serving processes' commands: ``pdserve _head`` (the head ``up`` starts in the background) and
``pdserve router`` (one more router of a cluster whose control plane is elected)."""

from __future__ import annotations

import argparse
import logging

from pdserve.cluster.cli.config_cmd import add_config_source
from pdserve.cluster.config_io import load_cli_config
from pdserve.cluster.head.launcher import run_head
from pdserve.cluster.head.router_process import join_settings, run_router
from pdserve.cluster.head.state_files import take_overrides


def add_head_args(p: argparse.ArgumentParser) -> None:
    add_config_source(p)
    p.add_argument("--overrides-file", help=argparse.SUPPRESS)


def head(args: argparse.Namespace) -> int:
    logging.getLogger().setLevel(logging.INFO)
    overrides = list(args.set)
    if args.overrides_file:  # from `up`: --set values may hold secrets, so they never travel in argv
        overrides += take_overrides(args.overrides_file)
    return run_head(load_cli_config(args.config, args.model, overrides))


def add_router_args(p: argparse.ArgumentParser) -> None:
    add_config_source(p)


def router(args: argparse.Namespace) -> int:
    config = load_cli_config(args.config, args.model, list(args.set))
    join_settings(config)  # refuse at once: no elected control plane, or nothing to join
    return run_router(config)

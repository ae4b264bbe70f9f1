"""``pdserve config schema|show|check`` and ``pdserve prepare-model``: the cluster config read, checked
and printed without starting anything (no Ray, Redis or engine)."""

from __future__ import annotations

import argparse
import json
import sys

from pdserve.cluster.cli.model_fetch import prepare_model as fetch_model
from pdserve.cluster.config import ClusterConfig
from pdserve.cluster.config_io import config_to_yaml, json_schema, load_cli_config


def add_config_source(p: argparse.ArgumentParser) -> None:
    """``-c FILE`` or ``--model``, and ``--set``: where every command that reads a config takes it from."""
    p.add_argument("-c", "--config", help="cluster config YAML (see `pdserve config schema`)")
    p.add_argument("--model", help="a Hugging Face model directory, a .gguf file or a known model name "
                   "(`pdserve get-model --list`); no config file needed")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set router.http_port=8001 (repeatable)")


def add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["schema", "show", "check"])
    add_config_source(p)
    p.add_argument("--offline", action="store_true",
                   help="a config for another machine: check its schema and cross-field rules, not its paths")


def exposure_note(config: ClusterConfig) -> str | None:
    """For ``config check --offline``: what the machine that runs ``config`` must give it, where
    this one lacks it (a router beyond loopback, no key here and no TLS); None when nothing."""
    if not config.exposure_problems():
        return None
    return (f"warning: not checked offline: router.host {config.router.host} is reachable from other machines "
            f"and no API key is at hand here; where this config runs, PDSERVE_API_KEYS must hold the keys (the "
            f"Kubernetes overlays take it from Secret pdserve-api-keys), or TLS be set, or the router refuses "
            f"to start")


def config(args: argparse.Namespace) -> int:
    if args.action == "schema":
        print(json.dumps(json_schema(), indent=2))
    else:
        config = load_cli_config(args.config, args.model, args.set, offline=args.offline)
        if args.action == "check" and args.offline and (note := exposure_note(config)):
            print(note, file=sys.stderr)
        print(config_to_yaml(config) if args.action == "show" else
              "config OK (offline: the model directory and TLS files were not looked for)" if args.offline
              else "config OK")
    return 0


def add_prepare_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--config", required=True, help="cluster config YAML")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")


def prepare_model(args: argparse.Namespace) -> int:
    # the model directory may not exist yet: that is what this command is for
    print(fetch_model(load_cli_config(args.config, None, args.set, offline=True)), flush=True)
    return 0

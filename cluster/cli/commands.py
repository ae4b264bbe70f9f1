"""The operator subcommands: up, router, status, down, demo, config, requests."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from pdserve.cluster.cli.demo import run_demo
from pdserve.cluster.cli.model_fetch import prepare_model
from pdserve.cluster.config import ClusterConfig
from pdserve.cluster.config_io import config_to_yaml, json_schema, load_cli_config
from pdserve.cluster.head import launcher
from pdserve.cluster.head.router_process import join_settings, run_router
from pdserve.cluster.state.request_log import RequestLog
from pdserve.engine.contract import RequestPhase, RequestRecord


def exposure_note(config: ClusterConfig) -> str | None:
    """For ``config check --offline``: what the machine that runs ``config`` must give it, where
    this one lacks it (a router beyond loopback, no key here and no TLS); None when nothing."""
    if not config.exposure_problems():
        return None
    return (f"warning: not checked offline: router.host {config.router.host} is reachable from other machines "
            f"and no API key is at hand here; where this config runs, PDSERVE_API_KEYS must hold the keys (the "
            f"Kubernetes overlays take it from Secret pdserve-api-keys), or TLS be set, or the router refuses "
            f"to start")


def _add_config_source(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--config", help="cluster config YAML (see `pdserve config schema`)")
    p.add_argument("--model", help="a Hugging Face model directory, a .gguf file or a known model name "
                   "(`pdserve get-model --list`); no config file needed")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set router.http_port=8001 (repeatable)")


def _up(args: argparse.Namespace) -> int:
    overrides = list(args.set) + ([f"ray.address={args.address}"] if args.address else [])
    load_cli_config(args.config, args.model, overrides)  # fail fast on a bad config, before forking
    return launcher.up(args.config, args.model, overrides, args.foreground, args.timeout)


def _head(args: argparse.Namespace) -> int:
    logging.getLogger().setLevel(logging.INFO)
    overrides = list(args.set)
    if args.overrides_file:  # from `up`: --set values may hold secrets, so they never travel in argv
        overrides += launcher.take_overrides(args.overrides_file)
    return launcher.run_head(load_cli_config(args.config, args.model, overrides))


def _router(args: argparse.Namespace) -> int:
    config = load_cli_config(args.config, args.model, list(args.set))
    join_settings(config)  # refuse at once: no elected control plane, or nothing to join
    return run_router(config)


def _down(args: argparse.Namespace) -> int:
    return launcher.down(args.timeout)


def _status(args: argparse.Namespace) -> int:
    status = launcher.fetch_status()
    if status is None:
        print("pdserve is not up")
        return 1
    head = status.get("head")
    if args.json:
        print(json.dumps(status, indent=2))
    elif head == "dead":
        print(launcher.format_dead_head(status))
    elif head == "starting":
        print(f"pdserve is starting (head pid {status['state'].get('pid')})")
    else:
        print(launcher.format_status(status))
    return STATUS_EXIT.get(head, 0)


# `pdserve status` exit codes: 0 up, 1 not up (or still starting), 3 the head died (its leftovers
# may still run: `pdserve down` stops them).
STATUS_EXIT = {"starting": 1, "dead": 3}


def _config(args: argparse.Namespace) -> int:
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


def _prepare_model(args: argparse.Namespace) -> int:
    # the model directory may not exist yet: that is what this command is for
    print(prepare_model(load_cli_config(args.config, None, args.set, offline=True)), flush=True)
    return 0


def _requests(args: argparse.Namespace) -> int:
    client = launcher.state_redis_client(args.redis_url)  # the password from the 0600 state file
    if client is None:
        print("pdserve is not up; pass --redis-url", file=sys.stderr)
        return 1
    log = RequestLog(client)
    records = log.follow(from_start=False) if args.follow else log.tail(args.count)
    for rec in records:
        print(json.dumps(rec) if args.json else _format_request(rec), flush=True)
    return 0


def _format_request(entry: dict) -> str:
    rec = RequestRecord.from_dict(entry)
    ph = rec.phase or RequestPhase()
    ttft = ph.ttft_s
    # The id the client knows (its own, or the one its response carried) leads the line; the
    # server's internal id is in the --json record.
    shown = rec.client_request_id or rec.request_id or "?"
    return (f"{shown:40s} {rec.outcome or '?':9s} "
            f"prompt {ph.prompt_tokens:5d} (cached {ph.cached_prompt_tokens:5d}) "
            f"out {ph.output_tokens:5d}  ttft {'-' if ttft is None else f'{ttft:.3f}s'}  "
            f"total {ph.total_s:.3f}s  kv {ph.kv_bytes / 1e6:.2f}MB/{ph.kv_transfer_s:.4f}s  "
            f"P={ph.prefill_worker} D={ph.decode_worker} attempts {ph.attempts}"
            + (f"  owner {rec.owner}" if rec.owner else "") + (f"  error: {rec.error}" if rec.error else ""))


def _demo(args: argparse.Namespace) -> int:
    return run_demo(args)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="start Ray (or join one), Redis, the router and both worker pools")
    _add_config_source(p)
    p.add_argument("--address", help="join this Ray cluster ('auto' on a Ray node) instead of starting one")
    p.add_argument("--foreground", action="store_true",
                   help="run the head in this process until SIGTERM/Ctrl-C (containers, e.g. KubeRay)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the pools to be ready")
    p.set_defaults(func=_up)

    p = sub.add_parser("_head", help=argparse.SUPPRESS)
    _add_config_source(p)
    p.add_argument("--overrides-file", help=argparse.SUPPRESS)
    p.set_defaults(func=_head)

    p = sub.add_parser("router", help="serve one more router of a running cluster whose control plane is "
                       "elected (control_plane.election), in the foreground until SIGTERM/Ctrl-C")
    _add_config_source(p)
    p.set_defaults(func=_router)

    p = sub.add_parser("down", help="drain and stop everything `pdserve up` started")
    p.add_argument("--timeout", type=float, default=120.0)
    p.set_defaults(func=_down)

    p = sub.add_parser("status", help="pools, workers, KV usage, queues, tokens/s, prefix hit rate; exit code 1 "
                       "when not up, 3 when the head died (naming what it left running)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_status)

    p = sub.add_parser("config", help="print the config schema, or check/show a config")
    p.add_argument("action", choices=["schema", "show", "check"])
    _add_config_source(p)
    p.add_argument("--offline", action="store_true",
                   help="a config for another machine: check its schema and cross-field rules, not its paths")
    p.set_defaults(func=_config)

    p = sub.add_parser("prepare-model", help="check model.path holds a complete checkpoint, or download "
                       "model.hub's pinned revision into it (Kubernetes init containers)")
    p.add_argument("-c", "--config", required=True, help="cluster config YAML")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    p.set_defaults(func=_prepare_model)

    p = sub.add_parser("requests", help="the request log: each finished request's phase record")
    p.add_argument("action", choices=["tail"])
    p.add_argument("-n", "--count", type=int, default=20)
    p.add_argument("-f", "--follow", action="store_true")
    p.add_argument("--json", action="store_true")
    p.add_argument("--redis-url", help="default: the running cluster's")
    p.set_defaults(func=_requests)

    p = sub.add_parser("demo", help="up on a real model, a short streamed chat with phase records, down")
    p.add_argument("--model", help="a model directory, .gguf file or known name (default: smollm2-135m-instruct)")
    p.add_argument("--preset", help="serve a generated random-weight test model instead (tiny, small, ...)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.set_defaults(func=_demo)

"""The ``pdserve`` command line: a table of subcommands, each loaded only when it runs.

``COMMANDS`` holds what ``pdserve --help`` shows (each command's name and one-line help) and where
the rest lives, as ``"module:function"``: the function that adds the command's arguments and its
handler. Building the parser imports none of them; only the chosen command's modules are
imported, and each imports what its command needs, so ``pdserve status``, ``down``, ``batch``,
``requests`` and ``config`` never load torch, transformers, Ray or the engine
(``tests/unit/test_cli_imports.py``).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from pdserve.cluster.runtime.ray_env import use_loopback
from pdserve.engine.errors import PdserveError

Handler = Callable[[argparse.Namespace], int]


@dataclass(frozen=True, slots=True)
class Command:
    name: str
    help: str
    args: str   # "module:function(parser)" adding its arguments
    run: str    # "module:function(args) -> exit code"


_CLUSTER = "pdserve.cluster.cli"
COMMANDS: tuple[Command, ...] = (
    Command("make-model", "write a deterministic random-weight test checkpoint (HF format)",
            "pdserve.engine.testmodel:add_make_model_args", "pdserve.engine.testmodel:run_make_model"),
    Command("generate", "generate from a prompt with a local engine and print its phase record",
            "pdserve.generate_cmd:add_args", "pdserve.generate_cmd:run"),
    Command("get-model", "a real model from an installed package, or a GGUF file, as an HF directory",
            "pdserve.get_model_cmd:add_args", "pdserve.get_model_cmd:run"),
    Command("bench", "benchmarks whose figures go into docs/benchmarks.md",
            "pdserve.bench.cli:add_args", "pdserve.bench.cli:run"),
    Command("up", "start Ray (or join one), Redis, the router and both worker pools",
            f"{_CLUSTER}.up_cmd:add_args", f"{_CLUSTER}.up_cmd:up"),
    Command("_head", argparse.SUPPRESS, f"{_CLUSTER}.serve_cmd:add_head_args", f"{_CLUSTER}.serve_cmd:head"),
    Command("router", "serve one more router of a running cluster whose control plane is elected "
            "(control_plane.election), in the foreground until SIGTERM/Ctrl-C",
            f"{_CLUSTER}.serve_cmd:add_router_args", f"{_CLUSTER}.serve_cmd:router"),
    Command("down", "drain and stop everything `pdserve up` started",
            f"{_CLUSTER}.status_cmd:add_down_args", f"{_CLUSTER}.status_cmd:down"),
    Command("status", "pools, workers, KV usage, queues, tokens/s, prefix hit rate; exit code 1 when not up, "
            "3 when the head died (naming what it left running)",
            f"{_CLUSTER}.status_cmd:add_status_args", f"{_CLUSTER}.status_cmd:status"),
    Command("config", "print the config schema, or check/show a config",
            f"{_CLUSTER}.config_cmd:add_config_args", f"{_CLUSTER}.config_cmd:config"),
    Command("prepare-model", "check model.path holds a complete checkpoint, or download model.hub's pinned "
            "revision into it (Kubernetes init containers)",
            f"{_CLUSTER}.config_cmd:add_prepare_model_args", f"{_CLUSTER}.config_cmd:prepare_model"),
    Command("requests", "the request log: each finished request's phase record",
            f"{_CLUSTER}.requests_cmd:add_args", f"{_CLUSTER}.requests_cmd:run"),
    Command("demo", "up on a real model, a short streamed chat with phase records, down",
            f"{_CLUSTER}.demo:add_args", f"{_CLUSTER}.demo:run_demo"),
    Command("batch", "the Batch API: submit a JSONL of requests, watch, fetch results, cancel",
            f"{_CLUSTER}.batch:add_args", f"{_CLUSTER}.batch:run"),
    Command("profile", "measure a model on this host into a capacity profile (JSON)",
            "pdserve.capacity_cmd:add_profile_args", "pdserve.capacity_cmd:run_profile"),
    Command("plan", "prefill and decode replicas for a traffic description, with the arithmetic",
            "pdserve.capacity_cmd:add_plan_args", "pdserve.capacity_cmd:run_plan"),
    Command("simulate", "simulate a cluster shape under a traffic description",
            "pdserve.capacity_cmd:add_simulate_args", "pdserve.capacity_cmd:run_simulate"),
)


def load(target: str) -> Callable:
    """The function a ``"module:function"`` names, its module imported now."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def chosen_command(argv: Sequence[str]) -> str | None:
    """The command a command line runs: its first word that is not an option (``pdserve``'s own
    options, ``-h`` and ``-v``, take no value)."""
    return next((a for a in argv if not a.startswith("-")), None)


def build_parser(commands: Iterable[str] = ()) -> argparse.ArgumentParser:
    """Every command with its one-line help; the arguments of those named in ``commands`` only
    (the one that runs; all of them for a test that builds the whole tree)."""
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    full = set(commands)
    for command in COMMANDS:
        p = sub.add_parser(command.name, help=command.help)
        if command.name in full:
            load(command.args)(p)
            p.set_defaults(handler=command.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    use_loopback()  # before anything imports ray
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser([chosen_command(argv) or ""]).parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    handler: Handler = load(args.handler)
    try:
        return int(handler(args) or 0)
    except PdserveError as exc:
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

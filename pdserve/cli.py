"""The ``pdserve`` command line. Each subcommand imports its heavy modules lazily."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable

Handler = Callable[[argparse.Namespace], int]


def _add_make_model(sub: argparse._SubParsersAction) -> None:
    from pdserve.engine import testmodel

    p = sub.add_parser("make-model", help="write a deterministic random-weight test checkpoint (HF format)")
    testmodel.add_make_model_args(p)
    p.set_defaults(func=testmodel.run_make_model)


def _add_generate(sub: argparse._SubParsersAction) -> None:
    from pdserve import generate_cmd

    p = sub.add_parser("generate", help="generate from a prompt with a local engine and print its phase record")
    generate_cmd.add_args(p)
    p.set_defaults(func=generate_cmd.run)


def _add_get_model(sub: argparse._SubParsersAction) -> None:
    from pdserve import get_model_cmd

    p = sub.add_parser("get-model", help="a real model from an installed package, or a GGUF file, as an HF directory")
    get_model_cmd.add_args(p)
    p.set_defaults(func=get_model_cmd.run)


def _add_registered(sub: argparse._SubParsersAction, module: str) -> None:
    """Subcommands whose modules register themselves with ``register(subparsers)``. They are part
    of the package: an error importing one is raised, never turned into a missing command."""
    import importlib

    importlib.import_module(module).register(sub)


_REGISTERED = (
    "pdserve.bench.cli",
    "pdserve.cluster.cli.commands",
    "pdserve.cluster.cli.batch",
    "pdserve.capacity_cmd",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_make_model(sub)
    _add_generate(sub)
    _add_get_model(sub)
    for module in _REGISTERED:
        _add_registered(sub, module)
    return parser


def main(argv: list[str] | None = None) -> int:
    from pdserve.cluster.runtime.ray_env import use_loopback

    use_loopback()  # before anything imports ray
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from pdserve.engine.errors import PdserveError

    try:
        return int(args.func(args) or 0)
    except PdserveError as exc:
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

"""What every ``pdserve bench`` command does around its measurement: settings, JSON, table."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any


def run_and_save(name: str, args: argparse.Namespace, settings_from_args: Callable[[argparse.Namespace], Any],
                 run_bench: Callable[[Any], dict], format_table: Callable[[dict], str]) -> dict | None:
    """Build the settings (None after printing the error when they are invalid), run the
    benchmark, write ``args.json`` and print the table; returns the result."""
    try:
        settings = settings_from_args(args)
    except ValueError as exc:
        print(f"bench {name}: error: {exc}", file=sys.stderr)
        return None
    result = run_bench(settings)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(format_table(result))
    return result

"""``pdserve status`` and ``pdserve down``: a running head asked, or stopped, from its state files.
Neither reads a config nor loads Ray or the engine (``tests/unit/test_cli_imports.py``)."""

from __future__ import annotations

import argparse
import json

from pdserve.cluster.head import up_down
from pdserve.cluster.head.status_report import fetch_status, format_dead_head, format_status

# `pdserve status` exit codes: 0 up, 1 not up (or still starting), 3 the head died (its leftovers
# may still run: `pdserve down` stops them).
STATUS_EXIT = {"starting": 1, "dead": 3}


def add_status_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true")


def status(args: argparse.Namespace) -> int:
    status = fetch_status()
    if status is None:
        print("pdserve is not up")
        return 1
    head = status.get("head")
    if args.json:
        print(json.dumps(status, indent=2))
    elif head == "dead":
        print(format_dead_head(status))
    elif head == "starting":
        print(f"pdserve is starting (head pid {status['state'].get('pid')})")
    else:
        print(format_status(status))
    return STATUS_EXIT.get(head, 0)


def add_down_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--timeout", type=float, default=120.0)


def down(args: argparse.Namespace) -> int:
    return up_down.down(args.timeout)

"""``pdserve requests tail``: the request log (each finished request's phase record) from the running
cluster's Redis, or ``--redis-url``'s."""

from __future__ import annotations

import argparse
import json
import sys

from pdserve.cluster.head.status_report import state_redis_client
from pdserve.cluster.state.request_log import RequestLog
from pdserve.engine.contract import RequestPhase, RequestRecord


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["tail"])
    p.add_argument("-n", "--count", type=int, default=20)
    p.add_argument("-f", "--follow", action="store_true")
    p.add_argument("--json", action="store_true")
    p.add_argument("--redis-url", help="default: the running cluster's")


def run(args: argparse.Namespace) -> int:
    client = state_redis_client(args.redis_url)  # the password from the 0600 state file
    if client is None:
        print("pdserve is not up; pass --redis-url", file=sys.stderr)
        return 1
    log = RequestLog(client)
    records = log.follow(from_start=False) if args.follow else log.tail(args.count)
    for rec in records:
        print(json.dumps(rec) if args.json else format_request(rec), flush=True)
    return 0


def format_request(entry: dict) -> str:
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

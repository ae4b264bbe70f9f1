"""``pdserve batch``: the Batch API for operators, against the running cluster's HTTP API.

``submit FILE`` uploads a JSONL of requests and starts a batch (its endpoint from the lines'
``url``); ``status ID [--watch]`` shows its counts (``--watch``: a progress bar until it ends);
``results ID [--errors] [-o FILE]`` writes its output (or error) file; ``cancel ID``; ``list``.
The server's address comes from ``pdserve up``'s state (or ``--url``); an API key, when the
router wants one, from ``PDSERVE_API_KEY`` (never from the command line).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

from pdserve.cluster.head.state_files import read_state

FINAL = ("completed", "failed", "cancelled", "expired")


class BatchCliError(Exception):
    pass


def _base(args: argparse.Namespace) -> str:
    if args.url:
        return args.url.rstrip("/")

    st = read_state()
    if not st or not st.get("http"):
        raise BatchCliError("pdserve is not up; start it (pdserve up) or pass --url")
    return st["http"].rstrip("/")


def _call(args: argparse.Namespace, method: str, path: str, body: bytes | None = None,
          content_type: str = "application/json") -> bytes:
    headers = {"Content-Type": content_type} if body is not None else {}
    key = os.environ.get("PDSERVE_API_KEY")
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(_base(args) + path, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.read()
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read())["error"]["message"]
        except Exception:
            message = exc.reason
        raise BatchCliError(f"{method} {path}: {exc.code} {message}") from None
    except urllib.error.URLError as exc:
        raise BatchCliError(f"cannot reach {_base(args)}: {exc.reason}") from None


def _json(args, method: str, path: str, body: dict | None = None) -> dict:
    return json.loads(_call(args, method, path, None if body is None else json.dumps(body).encode()))


def multipart_body(boundary: str, filename: str, content: bytes) -> bytes:
    """The upload's two fields, ``purpose=batch`` and the file. The file name is quoted as browsers
    quote it (HTML's form encoding: ``"`` as ``%22``, CR and LF as ``%0D``/``%0A``), so no name can
    end its header early or add a header line."""
    quoted = filename.replace('"', "%22").replace("\r", "%0D").replace("\n", "%0A")
    return (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{quoted}\"\r\n"
            f"Content-Type: application/jsonl\r\n\r\n").encode() + content + f"\r\n--{boundary}--\r\n".encode()


def _upload(args, path: Path) -> dict:
    # Two fixed fields built by hand: this CLI is synchronous on urllib (one short process, no
    # event loop), and aiohttp's FormData/MultipartWriter serialise only asynchronously.
    boundary = uuid.uuid4().hex
    body = multipart_body(boundary, path.name, path.read_bytes())
    return json.loads(_call(args, "POST", "/v1/files", body, f"multipart/form-data; boundary={boundary}"))


def _endpoint_of(path: Path) -> str:
    with path.open() as f:
        for line in f:
            if line.strip():
                try:
                    return json.loads(line).get("url") or "/v1/chat/completions"
                except (ValueError, AttributeError):
                    raise BatchCliError(f"{path}: the first line is not a JSON request") from None
    raise BatchCliError(f"{path} has no requests")


def _line(b: dict) -> str:
    c = b["request_counts"]
    return (f"{b['id']}  {b['status']:11s} {c['completed'] + c['failed']}/{c['total']} done "
            f"({c['completed']} ok, {c['failed']} failed)  {b['endpoint']}")


def _bar(b: dict, width: int = 30) -> str:
    c = b["request_counts"]
    done, total = c["completed"] + c["failed"], max(1, c["total"])
    filled = int(width * done / total)
    return f"[{'#' * filled}{'.' * (width - filled)}] {done}/{c['total']} ({c['failed']} failed) {b['status']}"


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except BatchCliError as exc:
        print(f"pdserve batch: {exc}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    if args.action == "submit":
        path = Path(args.target)
        if not path.is_file():
            raise BatchCliError(f"{path}: no such file")
        endpoint = args.endpoint or _endpoint_of(path)
        f = _upload(args, path)
        b = _json(args, "POST", "/v1/batches", {"input_file_id": f["id"], "endpoint": endpoint,
                                                "completion_window": "24h"})
        if b["status"] == "failed":
            for e in (b.get("errors") or {}).get("data", [])[:20]:
                print(f"line {e.get('line')}: {e['code']}: {e['message']}", file=sys.stderr)
            raise BatchCliError(f"batch {b['id']} failed validation")
        print(b["id"])
        return 0
    if args.action == "list":
        for b in _json(args, "GET", "/v1/batches?limit=100")["data"]:
            print(_line(b))
        return 0
    if not args.target:
        raise BatchCliError(f"'{args.action}' needs a batch id")
    if args.action == "status":
        b = _json(args, "GET", f"/v1/batches/{args.target}")
        if not args.watch:
            print(json.dumps(b, indent=1) if args.json else _line(b))
            return 0
        while True:
            print("\r" + _bar(b), end="", flush=True)
            if b["status"] in FINAL:
                print()
                return 0 if b["status"] == "completed" else 1
            time.sleep(1.0)
            b = _json(args, "GET", f"/v1/batches/{args.target}")
    if args.action == "cancel":
        print(_line(_json(args, "POST", f"/v1/batches/{args.target}/cancel")))
        return 0
    b = _json(args, "GET", f"/v1/batches/{args.target}")  # results
    file_id = b["error_file_id"] if args.errors else b["output_file_id"]
    if file_id is None:
        if b["status"] not in FINAL:
            raise BatchCliError(f"batch {b['id']} is {b['status']}; its files are written when it ends")
        return 0  # no lines of that kind
    content = _call(args, "GET", f"/v1/files/{file_id}/content")
    if args.output:
        Path(args.output).write_bytes(content)
    else:
        sys.stdout.write(content.decode())
    return 0


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["submit", "status", "results", "cancel", "list"])
    p.add_argument("target", nargs="?", help="submit: the JSONL file; status/results/cancel: the batch id")
    p.add_argument("--endpoint", choices=["/v1/completions", "/v1/chat/completions"],
                   help="submit: default, the first line's url")
    p.add_argument("--watch", action="store_true", help="status: a progress bar until the batch ends")
    p.add_argument("--json", action="store_true", help="status: the whole batch object")
    p.add_argument("--errors", action="store_true", help="results: the error file instead of the output")
    p.add_argument("-o", "--output", help="results: write to this file instead of stdout")
    p.add_argument("--url", help="the router's HTTP address (default: the running cluster's)")

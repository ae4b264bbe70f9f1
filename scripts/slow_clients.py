"""Two hostile clients of the HTTP API over loopback, with the figures docs/reliability.md quotes.

Starts the real HTTP server on 127.0.0.1 (default settings) over a real engine (the generated
tiny model behind ``LocalEngineBackend``; its context is raised to 32k tokens so that the
largest bodies are accepted), then:

1. ``/tokenize`` bodies from 25,000 tiny messages (refused) to 1 MiB of text (300k-560k tokens),
   each sent by a child process while a ticker on the server's event loop records its largest
   gap (the same host's CPUs: run it on a quiet machine);
2. ``--loris`` connections that send a header byte a second and never finish: when each is
   closed (``router.header_timeout_s``, 10 s by default).

Exits 1 when a gap reaches 100 ms or a slow connection outlives the header timeout by 5 s.

    .venv/bin/python scripts/slow_clients.py --loris 200
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import time

import tempfile
import urllib.error
import urllib.request
from pathlib import Path

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.testmodel import ensure_model
from pdserve.engine.tokenizer import load_tokenizer
from pdserve.router.http_server import DEFAULT_HEADER_TIMEOUT_S, start_http_server
from pdserve.router.local_backend import LocalEngineBackend
from pdserve.router.serving import Serving

MAX_GAP_S = 0.1
BODIES = [  # (label, messages, content of each)
    ("25,000 messages", 25_000, "x"),
    ("2,048 messages", 2_048, "hello "),
    ("2,048 messages of 400 characters", 2_048, "hello world " * 33),
    ("1 message of 900k characters", 1, "hello world " * 75_000),
    ("1 message of 900k digits", 1, "1234567 " * 112_000),
]


async def tokenize_gaps(base_url: str) -> bool:
    gaps: list[float] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(0.002)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for label, count, content in BODIES:
            path = Path(tmp) / "body.json"
            path.write_text(json.dumps({"messages": [{"role": "user", "content": content}] * count}))
            child = await asyncio.create_subprocess_exec(sys.executable, __file__, "--send", str(path),
                                                         base_url + "/tokenize", stdout=asyncio.subprocess.PIPE)
            await child.stdout.readline()   # the child is up and about to send
            stop.clear()
            gaps.clear()
            tick = asyncio.create_task(ticker())
            out, _ = await child.communicate()
            stop.set()
            await tick
            print(f"/tokenize {label} ({path.stat().st_size:,} bytes): {out.decode().strip()}; "
                  f"largest event-loop gap {max(gaps) * 1000:.1f} ms")
            ok &= max(gaps) < MAX_GAP_S
    return ok


def send(path: str, url: str) -> None:
    """The child: post the body, print the status, the time and what came back."""
    data = Path(path).read_bytes()
    print("ready", flush=True)
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            status, body = resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        status, body = exc.code, json.loads(exc.read())
    took = time.perf_counter() - t0
    what = f"{body['count']} tokens" if status == 200 else body["error"]["message"][:60]
    print(f"{status} in {took * 1000:.0f} ms ({what})")


async def slow_headers(port: int, connections: int, timeout_s: float) -> bool:
    head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 4000
    t0 = time.monotonic()
    closed: list[float] = []

    async def loris() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            for i in range(len(head)):
                writer.write(head[i:i + 1])
                try:
                    if await asyncio.wait_for(reader.read(1), 1.0) == b"":
                        break
                except asyncio.TimeoutError:
                    continue
                except ConnectionError:
                    break
            closed.append(time.monotonic() - t0)
        finally:
            writer.close()

    await asyncio.wait_for(asyncio.gather(*(loris() for _ in range(connections))), timeout_s + 60)
    print(f"{connections} connections sending a header byte a second: closed from {min(closed):.1f} s "
          f"to {max(closed):.1f} s (header timeout {timeout_s:g} s)")
    return max(closed) < timeout_s + 5


async def main(args: argparse.Namespace) -> int:
    model = ensure_model("tiny", "llama")
    engine = LLMEngine(EngineConfig(model_dir=str(model), num_blocks=64, max_model_len=128, max_num_seqs=8))
    backend = LocalEngineBackend(engine, model_name="tiny")
    serving = Serving(backend, tokenizer=load_tokenizer(model))
    serving.info = dataclasses.replace(serving.info, max_model_len=32_768)  # the character bound of a long context
    http = await start_http_server(serving, max_body_bytes=1 << 20)  # router.max_request_bytes's default
    try:
        ok = await tokenize_gaps(http.base_url)
        if args.loris:
            ok &= await slow_headers(http.port, args.loris, DEFAULT_HEADER_TIMEOUT_S)
    finally:
        await http.stop()
        backend.close()
    return 0 if ok else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loris", type=int, default=200, help="slow-header connections (0: none)")
    parser.add_argument("--send", nargs=2, metavar=("BODY", "URL"), help=argparse.SUPPRESS)  # the child's part
    args = parser.parse_args()
    if args.send:
        send(*args.send)
        sys.exit(0)
    sys.exit(asyncio.run(main(args)))

"""A bounded fuzz of the HTTP API over loopback: every answer must be a status, never a 5xx.

Starts the real HTTP server on 127.0.0.1 over a real engine (the generated tiny model, behind
``LocalEngineBackend``), sends ``--requests`` requests (default 3000) on raw sockets, each a
random mutation of a valid one (a byte flipped, cut or repeated, a field given a value of a wrong
type, huge numbers, deep nesting, surrogate escapes, odd content types and encodings, wrong
methods and paths, gzip of any of these) and counts the statuses. Exits 1 on any 5xx, dropped
connection or traceback in the log. Valid requests generate at most 2 tokens.

    .venv/bin/python scripts/fuzz_http.py --requests 3000 --seed 1
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gzip
import json
import logging
import random
import socket
import sys
import threading
import time

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.testmodel import ensure_model
from pdserve.engine.tokenizer import load_tokenizer
from pdserve.router.http_server import start_http_server
from pdserve.router.local_backend import LocalEngineBackend
from pdserve.router.serving import Serving

logger = logging.getLogger("fuzz_http")

FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "seed", "n", "best_of", "echo", "stop", "stop_token_ids", "stream", "stream_options", "logprobs",
          "top_logprobs", "ignore_eos", "priority", "presence_penalty", "logit_bias", "user"]


class Tracebacks(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info or "Traceback" in record.getMessage():
            self.count += 1
            if self.count <= 3:
                sys.stderr.write(f"traceback logged: {record.getMessage()[:300]}\n")


def odd_value(rng: random.Random) -> object:
    depth = rng.choice([2, 50, 2000])
    return rng.choice([
        True, False, None, 0, -1, 1, 2, 2**63, -(2**63) - 1, 10**300, 1e308, -0.0, 0.5, 3.7, "", "x", "1",
        "\ud800", "a" * rng.choice([10, 70_000]), [], [1, 2], [-5], [10**20], ["a"], [[1]], {}, {"a": 1},
        [{"role": "user", "content": "hi"}], [{"role": "robot", "content": 1}], [{"role": "user"}],
        json.loads("[" * depth + "]" * depth) if depth < 900 else [],
    ])


def base_body(rng: random.Random, chat: bool) -> dict:
    body: dict = {"max_tokens": rng.choice([1, 2]), "temperature": rng.choice([0, 0.7])}
    if chat:
        body["messages"] = [{"role": "user", "content": rng.choice(["hi", "name a colour", "é ü 🙂"])}]
    else:
        body["prompt"] = rng.choice(["hi", "The quick brown fox", [1, 2, 3], "🙂 emoji"])
    return body


def mutate_bytes(rng: random.Random, raw: bytes) -> bytes:
    kind = rng.choice(["flip", "cut", "repeat", "insert", "bigint", "deep", "surrogate"])
    if kind == "flip" and raw:
        i = rng.randrange(len(raw))
        return raw[:i] + bytes([raw[i] ^ (1 << rng.randrange(8))]) + raw[i + 1:]
    if kind == "cut":
        return raw[: rng.randrange(len(raw) + 1)]
    if kind == "repeat":
        i = rng.randrange(len(raw) + 1)
        return raw[:i] + raw[i:i + 8] * rng.randrange(1, 50) + raw[i:]
    if kind == "insert":
        i = rng.randrange(len(raw) + 1)
        return raw[:i] + rng.choice([b"\x00", b"\xff", b'"', b"{", b"]", b",", b"NaN", b"\\u"]) + raw[i:]
    if kind == "bigint":
        return raw.replace(b'"max_tokens": ', b'"max_tokens": ' + b"9" * rng.choice([4000, 5000]) + b", \"x\": ", 1)
    if kind == "deep":
        n = rng.choice([500, 1500, 50_000])
        return raw[:-1] + b', "z": ' + b"[" * n + b"]" * n + b"}"
    return raw.replace(b'"hi"', b'"h\\ud83di"').replace(b'"content": "', b'"content": "\\udc00', 1)


def make_request(rng: random.Random) -> tuple[str, str, dict[str, str], bytes]:
    chat = rng.random() < 0.4
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = base_body(rng, chat)
    for _ in range(rng.choice([0, 1, 1, 2, 3])):
        body[rng.choice(FIELDS)] = odd_value(rng)
    raw = json.dumps(body).encode()
    if rng.random() < 0.4:
        raw = mutate_bytes(rng, raw)
    headers = {"Content-Type": rng.choice(["application/json"] * 20 + [
        "application/json; charset=utf-8", "text/plain", "application/x-www-form-urlencoded",
        "application/json; charset=latin-1", "", "multipart/form-data; boundary=x", "*/*"])}
    if rng.random() < 0.15:
        coding = rng.choice(["gzip", "deflate", "br", "x-foo", "gzip, gzip", "identity"])
        headers["Content-Encoding"] = coding
        if coding == "gzip" and rng.random() < 0.7:
            raw = gzip.compress(raw)
            if rng.random() < 0.3:
                raw = mutate_bytes(rng, raw)
    method = "POST"
    r = rng.random()
    if r < 0.04:
        method = rng.choice(["GET", "PUT", "DELETE", "PATCH", "OPTIONS"])
    elif r < 0.07:
        path = rng.choice(["/v1/models", "/health", "/metrics", "/nope", "/v1/completions/x", "/" + "a" * 3000])
        method = rng.choice(["GET", "POST"])
    return method, path, headers, raw


def send(port: int, method: str, path: str, headers: dict[str, str], body: bytes) -> int:
    head = {"Host": "127.0.0.1", "Connection": "close", "Content-Length": str(len(body)), **headers}
    head = {k: v for k, v in head.items() if v != ""}
    raw = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in head.items()) + "\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(raw.encode("latin-1") + body)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    if not data.startswith(b"HTTP/1."):
        return -1  # no answer at all
    return int(data.split(b" ", 2)[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    if not 1 <= args.requests <= 100_000:
        parser.error("--requests must be between 1 and 100000")
    tracebacks = Tracebacks()
    logging.getLogger().addHandler(tracebacks)
    logging.getLogger().setLevel(logging.WARNING)
    model = ensure_model("tiny", "llama")
    engine = LLMEngine(EngineConfig(model_dir=str(model), num_blocks=256, max_model_len=256, max_num_seqs=16))
    backend = LocalEngineBackend(engine, model_name="tiny")
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    serving = Serving(backend, tokenizer=load_tokenizer(model))
    server = asyncio.run_coroutine_threadsafe(
        start_http_server(serving, max_body_bytes=256 * 1024, body_timeout_s=5.0), loop).result(30)
    rng = random.Random(args.seed)
    counts: collections.Counter[int] = collections.Counter()
    t0 = time.monotonic()
    try:
        for _ in range(args.requests):
            try:
                counts[send(server.port, *make_request(rng))] += 1
            except OSError:
                counts[-1] += 1
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        backend.close()
    took = time.monotonic() - t0
    bad = sum(n for status, n in counts.items() if status >= 500 or status < 0)
    print(f"{args.requests} requests in {took:.1f} s (seed {args.seed}); statuses: "
          + ", ".join(f"{s if s >= 0 else 'no answer'}: {n}" for s, n in sorted(counts.items())))
    print(f"5xx or no answer: {bad}; tracebacks logged: {tracebacks.count}; "
          f"engine idle and every block free: {not engine.has_unfinished() and engine.block_manager.all_free()}")
    return 1 if bad or tracebacks.count else 0


if __name__ == "__main__":
    sys.exit(main())

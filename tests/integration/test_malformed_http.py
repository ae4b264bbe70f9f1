"""Every malformed HTTP request gets a 4xx that says what to fix, and one log line, no traceback.

A real HTTP server on 127.0.0.1 over a real engine (tiny model, ``LocalEngineBackend``); the
requests are written byte by byte on raw sockets, so nothing between the test and the server
fixes them up. Each case: send it → the status (and ``Allow`` for 405) → an OpenAI-shaped
error naming the fix → the server still serves a good request. The module ends by checking the
log holds no traceback and the engine holds no request and no block.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import socket
import threading
import time
import zlib
from dataclasses import dataclass

import pytest
from log_records import LogRecords

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.tokenizer import load_tokenizer
from pdserve.router.http_server import HttpServer, start_http_server
from pdserve.router.local_backend import LocalEngineBackend
from pdserve.router.serving import Serving

pytestmark = pytest.mark.timeout(180)

MAX_BODY = 1024 * 1024
BODY_TIMEOUT_S = 1.0
HEADER_TIMEOUT_S = 1.5
GOOD = json.dumps({"prompt": "hi", "max_tokens": 2, "temperature": 0}).encode()


@dataclass
class Server:
    port: int
    engine: LLMEngine
    backend: LocalEngineBackend
    http: HttpServer


@pytest.fixture(scope="module")
def log_records():
    handler = LogRecords()
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    yield handler
    root.removeHandler(handler)
    root.setLevel(old_level)


@pytest.fixture(scope="module")
def server(tiny_model, log_records):
    engine = LLMEngine(EngineConfig(model_dir=str(tiny_model), num_blocks=64, max_model_len=128, max_num_seqs=8))
    backend = LocalEngineBackend(engine, model_name="tiny")
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="test-http", daemon=True)
    thread.start()

    def call(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(30)

    async def start():
        serving = Serving(backend, tokenizer=load_tokenizer(tiny_model))
        return await start_http_server(serving, max_body_bytes=MAX_BODY, body_timeout_s=BODY_TIMEOUT_S,
                                       header_timeout_s=HEADER_TIMEOUT_S)

    http = call(start())
    yield Server(http.port, engine, backend, http)
    call(http.stop())
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()
    backend.close()
    assert backend.num_active == 0 and not engine.has_unfinished()
    assert engine.block_manager.all_free()
    tracebacks = log_records.tracebacks()
    assert not tracebacks, tracebacks


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: dict

    @property
    def message(self) -> str:
        return self.body["error"]["message"]


def send(port: int, body: bytes, *, method: str = "POST", path: str = "/v1/completions",
         headers: dict[str, str] | None = None, content_type: str | None = "application/json") -> Reply:
    """One request on a fresh connection, exactly these bytes; the whole reply."""
    head = {"Host": "127.0.0.1", "Connection": "close", "Content-Length": str(len(body))}
    if content_type is not None:
        head["Content-Type"] = content_type
    head.update(headers or {})
    raw = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in head.items()) + "\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(raw.encode() + body)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return parse_reply(data)


def parse_reply(data: bytes) -> Reply:
    head, _, payload = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return Reply(int(lines[0].split()[1]), headers, json.loads(payload) if payload else {})


def assert_refused(reply: Reply, status: int, words: str) -> None:
    assert reply.status == status, (reply.status, reply.body)
    assert set(reply.body["error"]) == {"message", "type", "param", "code"}, reply.body
    assert words in reply.message, reply.message


def body_with(**fields) -> bytes:
    return json.dumps({"prompt": "hi", "max_tokens": 2, **fields}).encode()


# ------------------------------------------------------------------ the log (first: before the burst is spent)
def test_refused_requests_are_logged_as_one_line_each_without_traceback(server: Server,
                                                                        log_records: LogRecords) -> None:
    before = len(log_records.records)
    assert send(server.port, b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}").status == 400
    time.sleep(0.2)
    new = [r for r in log_records.records[before:] if r.name.startswith("pdserve")]
    assert len(new) == 1, [r.getMessage()[:200] for r in new]
    line = new[0].getMessage()
    assert new[0].levelno == logging.INFO and new[0].exc_info is None
    assert "\n" not in line and "400" in line and len(line) < 300, line
    assert send(server.port, GOOD).status == 200  # and the server serves on


def test_a_flood_of_refusals_is_logged_at_a_bounded_rate(server: Server, log_records: LogRecords) -> None:
    before = len(log_records.records)
    for _ in range(60):
        assert send(server.port, GOOD, content_type="text/plain").status == 415
    time.sleep(0.2)
    refused = [r for r in log_records.records[before:] if r.getMessage().startswith("refused ")]
    assert 1 <= len(refused) <= 20, len(refused)  # RejectionLog's burst per 10 s window


# ------------------------------------------------------------------ JSON the parser chokes on
def test_an_integer_past_the_digit_limit_is_400(server: Server) -> None:
    body = b'{"prompt": "hi", "max_tokens": ' + b"7" * 5000 + b"}"
    assert_refused(send(server.port, body), 400, "number this server cannot read")


@pytest.mark.parametrize("depth", [1_200, 100_000])
def test_json_nested_past_the_recursion_limit_is_400(server: Server, depth: int) -> None:
    body = b'{"prompt": "hi", "x": ' + b"[" * depth + b"]" * depth + b"}"
    assert_refused(send(server.port, body), 400, "nested too deeply")


def test_an_escaped_lone_surrogate_is_400_naming_the_field(server: Server) -> None:
    reply = send(server.port, b'{"prompt": "a\\ud800b", "max_tokens": 2}')
    assert_refused(reply, 400, "unpaired surrogate")
    assert reply.body["error"]["param"] == "prompt"
    chat = b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}'
    reply = send(server.port, chat, path="/v1/chat/completions")
    assert_refused(reply, 400, "messages[0].content")
    pair = b'{"prompt": "smile \\ud83d\\ude00", "max_tokens": 2}'  # a proper pair is fine
    assert send(server.port, pair).status == 200


# ------------------------------------------------------------------ content type and encoding
@pytest.mark.parametrize("content_type, words", [
    ("application/x-www-form-urlencoded", "add -H 'content-type: application/json'"),  # curl -d
    ("text/plain", "must be application/json"),  # a browser's cross-origin "simple" POST
    ("multipart/form-data; boundary=x", "must be application/json"),
    ("application/json; charset=latin-1", "must be UTF-8 JSON"),
    (None, "has no Content-Type"),
])
def test_a_body_that_is_not_declared_json_is_415(server: Server, content_type: str | None, words: str) -> None:
    assert_refused(send(server.port, GOOD, content_type=content_type), 415, words)


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8",
                                          "Application/JSON;charset=UTF-8"])
def test_json_content_types_are_served(server: Server, content_type: str) -> None:
    assert send(server.port, GOOD, content_type=content_type).status == 200


def test_gzip_and_deflate_bodies_are_read_and_corrupt_ones_are_400(server: Server) -> None:
    gz = gzip.compress(GOOD)
    assert send(server.port, gz, headers={"Content-Encoding": "gzip"}).status == 200
    assert send(server.port, zlib.compress(GOOD), headers={"Content-Encoding": "deflate"}).status == 200
    flipped = gz[:12] + bytes(b ^ 0xFF for b in gz[12:20]) + gz[20:]
    assert_refused(send(server.port, flipped, headers={"Content-Encoding": "gzip"}), 400, "gzip body is corrupt")
    assert_refused(send(server.port, gz[:-6], headers={"Content-Encoding": "gzip"}), 400, "truncated")
    assert_refused(send(server.port, b"not gzip", headers={"Content-Encoding": "gzip"}), 400, "corrupt")


def test_a_body_that_inflates_past_the_limit_is_413(server: Server) -> None:
    bomb = gzip.compress(b'{"prompt": "' + b"a" * (MAX_BODY + 10) + b'"}')
    assert len(bomb) < MAX_BODY // 100
    assert_refused(send(server.port, bomb, headers={"Content-Encoding": "gzip"}), 413, "once decompressed")


@pytest.mark.parametrize("coding", ["br", "zstd", "compress", "x-made-up", "gzip, gzip"])
def test_an_unknown_content_encoding_is_415(server: Server, coding: str) -> None:
    assert_refused(send(server.port, GOOD, headers={"Content-Encoding": coding}), 415, "is not supported")


# ------------------------------------------------------------------ methods and fields
def test_a_wrong_method_on_a_known_path_is_405_with_allow(server: Server) -> None:
    reply = send(server.port, b"", method="GET")
    assert_refused(reply, 405, "use POST")
    assert reply.headers["allow"] == "POST"
    reply = send(server.port, b"", method="DELETE", path="/v1/models")
    assert reply.status == 405 and set(reply.headers["allow"].split(", ")) == {"GET", "HEAD"}
    assert_refused(send(server.port, b"", method="GET", path="/v1/nowhere"), 404, "not an endpoint")


@pytest.mark.parametrize("field, value, words", [
    ("n", True, "'n' must be an integer"),
    ("best_of", True, "'best_of' must be an integer"),
    ("echo", 0, "'echo' must be true or false"),
    ("max_tokens", True, "must be an integer"),
    ("seed", False, "must be an integer"),
])
def test_booleans_are_not_integers_and_integers_are_not_booleans(server: Server, field: str, value: object,
                                                                  words: str) -> None:
    reply = send(server.port, body_with(**{field: value}))
    assert_refused(reply, 400, words)
    assert reply.body["error"]["param"] == field


@pytest.mark.parametrize("field", ["temperature", "top_p"])
def test_an_integer_too_large_for_a_float_is_400(server: Server, field: str) -> None:
    body = b'{"prompt": "hi", "max_tokens": 2, "' + field.encode() + b'": ' + b"9" * 400 + b"}"  # found by fuzzing
    reply = send(server.port, body)
    assert reply.status == 400 and reply.body["error"]["param"] == field, reply.body


def test_a_long_model_name_is_not_echoed_back_whole(server: Server) -> None:
    reply = send(server.port, body_with(model="m" * 500_000))
    assert_refused(reply, 404, "(500000 characters)")
    assert len(reply.message) < 300


# ------------------------------------------------------------------ a body that never ends
def test_a_body_that_never_arrives_gets_408_and_the_connection_closed(server: Server) -> None:
    head = ("POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            "Content-Length: 1000\r\n\r\n")
    with socket.create_connection(("127.0.0.1", server.port), timeout=20) as sock:
        t0 = time.monotonic()
        sock.sendall(head.encode() + b'{"prompt": ')
        data = b""
        while chunk := sock.recv(65536):  # ends when the server closes the connection
            data += chunk
        took = time.monotonic() - t0
    reply = parse_reply(data)
    assert_refused(reply, 408, f"within {BODY_TIMEOUT_S:g} s")
    assert BODY_TIMEOUT_S <= took < BODY_TIMEOUT_S + 5, took


@pytest.mark.parametrize(("headers", "fields", "words"), [
    ({"Last-Event-ID": "abc", "X-Request-Id": "s1"}, {}, "non-negative integer"),
    ({"Last-Event-ID": "-3", "X-Request-Id": "s1"}, {}, "non-negative integer"),
    ({"Last-Event-ID": "9" * 12, "X-Request-Id": "s1"}, {}, "non-negative integer"),
    ({"Last-Event-ID": "3"}, {}, "X-Request-Id"),
    ({"Last-Event-ID": "3", "X-Request-Id": "s1"}, {"n": 2}, "cannot be used with"),
    # a single engine in-process: no other router to resume on
    ({"Last-Event-ID": "3", "X-Request-Id": "s1"}, {}, "needs a pdserve cluster"),
])
def test_a_bad_stream_resume_is_400(server: Server, headers: dict, fields: dict, words: str) -> None:
    assert_refused(send(server.port, body_with(stream=True, **fields), headers=headers), 400, words)


# ------------------------------------------------------------------ headers that never end (slow-loris)
def _closed_after(sock: socket.socket, trickle: bytes, every_s: float, limit_s: float) -> float | None:
    """Send ``trickle`` a byte every ``every_s``, then nothing; the seconds until the server closed
    the connection (None: still open after ``limit_s``)."""
    t0 = time.monotonic()
    sock.settimeout(every_s)
    sent = 0
    while time.monotonic() - t0 < limit_s:
        if sent < len(trickle):
            try:
                sock.sendall(trickle[sent:sent + 1])
            except (BrokenPipeError, ConnectionResetError):
                return time.monotonic() - t0
            sent += 1
        try:
            if sock.recv(65536) == b"":
                return time.monotonic() - t0
        except TimeoutError:
            continue
        except ConnectionResetError:
            return time.monotonic() - t0
    return None


def test_headers_sent_slowly_get_the_connection_closed_after_the_header_timeout(server: Server) -> None:
    head = ("POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            "X-Slow: " + "a" * 200 + "\r\n").encode()   # never ends: a byte every 0.2 s
    before = server.http.header_deadlines.closed_total
    conns = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(20)]
    try:
        for sock in conns[1:]:
            sock.sendall(head[:10])
        took = _closed_after(conns[0], head, 0.2, HEADER_TIMEOUT_S + 5)
        assert took is not None and HEADER_TIMEOUT_S - 0.1 <= took < HEADER_TIMEOUT_S + 2, took
        for sock in conns[1:]:  # every other slow connection is closed too
            assert _closed_after(sock, b"", 0.2, 5) is not None
    finally:
        for sock in conns:
            sock.close()
    assert server.http.header_deadlines.closed_total - before == len(conns)
    assert send(server.port, GOOD).status == 200  # and the server serves on


def test_a_connection_that_sends_nothing_is_closed_after_the_header_timeout(server: Server) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        took = _closed_after(sock, b"", 0.2, HEADER_TIMEOUT_S + 5)
    assert took is not None and took < HEADER_TIMEOUT_S + 2, took


def test_a_kept_alive_connection_gets_the_header_timeout_afresh_for_each_request(server: Server) -> None:
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n" % len(GOOD)) + GOOD
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        time.sleep(HEADER_TIMEOUT_S / 2)           # part of the first head's time, idle
        sock.sendall(request)
        reply = sock.recv(65536)
        assert reply.startswith(b"HTTP/1.1 200"), reply[:100]
        time.sleep(HEADER_TIMEOUT_S * 0.8)         # idle between requests: the keep-alive timer's business
        t0 = time.monotonic()
        sock.sendall(request[:20])                 # the next head starts, and stalls
        took = _closed_after(sock, b"", 0.2, HEADER_TIMEOUT_S + 5)
    assert took is not None and HEADER_TIMEOUT_S - 0.3 <= time.monotonic() - t0 < HEADER_TIMEOUT_S + 2, took


def test_a_request_that_outlives_the_header_timeout_is_not_cut(server: Server) -> None:
    # the head just in time, the body just within its own timeout: the connection lives past the
    # header timeout, and the request is answered
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(GOOD))
    with socket.create_connection(("127.0.0.1", server.port), timeout=20) as sock:
        t0 = time.monotonic()
        time.sleep(HEADER_TIMEOUT_S - 0.5)
        sock.sendall(head)
        time.sleep(BODY_TIMEOUT_S * 0.7)
        sock.sendall(GOOD)
        assert time.monotonic() - t0 > HEADER_TIMEOUT_S
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    assert parse_reply(data).status == 200


# ------------------------------------------------------------------ /tokenize bounds its messages
def test_tokenize_with_too_many_messages_is_400_at_once(server: Server) -> None:
    from pdserve.router.validation import MAX_CHAT_MESSAGES

    many = json.dumps({"messages": [{"role": "user", "content": "x"}] * 25_000}).encode()
    t0 = time.monotonic()
    reply = send(server.port, many, path="/tokenize")
    assert_refused(reply, 400, f"at most {MAX_CHAT_MESSAGES}")
    assert reply.body["error"]["param"] == "messages" and time.monotonic() - t0 < 2.0
    chat = json.dumps({"messages": [{"role": "user", "content": "x"}] * (MAX_CHAT_MESSAGES + 1)}).encode()
    assert_refused(send(server.port, chat, path="/v1/chat/completions"), 400, f"at most {MAX_CHAT_MESSAGES}")
    few = json.dumps({"messages": [{"role": "user", "content": "x"}] * 3}).encode()
    assert send(server.port, few, path="/tokenize").body["count"] > 3

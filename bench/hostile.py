"""Hostile requests against a served cluster: what each one costs a neighbour's stream.

For each case, round after round, a *neighbour* streams a long greedy completion; once it has
received ``--warm-tokens`` tokens, one hostile request is sent and awaited; the neighbour goes on
for ``--margin-s`` more and is then closed. Reported per case (medians over the rounds, and the
worst round):

* ``status``: what the server answered the hostile request (a 4xx is the expected answer for the
  refused ones), and its latency;
* ``gap_ratio``: the neighbour's largest token gap inside the hostile request's window (its
  start to its end plus the margin) over the neighbour's own p99 gap before the window (the
  same stream, the same run); 1.0 means no stall at all. ``max_gap_ms`` and ``p99_gap_ms``
  are the two figures behind it.

The cases (``--cases``, comma-separated; default all):

1. ``json-deep``: a ``guided_json`` schema sent as text, an array's ``items`` nested 900 deep;
2. ``json-props``: a schema with 1,200 optional properties;
3. ``regex-rep``: ``guided_regex`` ``[^x]{0,65535}``;

   (the property names and the excluded character change from round to round, so that every
   round compiles its grammar instead of meeting the first round's verdict in a cache)
4. ``json-2500``: ``guided_json`` text nested 2,500 deep;
5. ``wide-n``: a request with ``n`` as wide as the server accepts (``--wide-n``), and a 4-token
   request sent 0.5 s later: its latency next to the same request alone (``small_latency_ratio``);
6. ``tokenize-25k``: ``/tokenize`` with 25,000 chat messages;
7. ``batch-64mib``: ``/v1/batches`` from a 64 MiB input file (uploaded before the window) whose
   last line is invalid, so the batch is validated whole and fails with nothing run;
8. ``slow-headers``: 100 connections sending their request headers one byte a second for
   ``--slowloris-s``; reported as well: how many the server closed before the end.

Starts ``pdserve up`` itself (the default disaggregated cluster: one prefill and one decode
worker, on the generated ``small`` model unless ``--model-dir``) or measures ``--url``.
``pdserve bench hostile --json FILE``. Prints the host first; run it alone on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

CASES = ("json-deep", "json-props", "regex-rep", "json-2500", "wide-n", "tokenize-25k", "batch-64mib",
         "slow-headers")
BATCH_FILE_BYTES = 64 * 1024 * 1024 - 4096


@dataclass(slots=True)
class Round:
    status: int
    latency_s: float
    max_gap_ms: float
    p99_gap_ms: float
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def gap_ratio(self) -> float:
        return self.max_gap_ms / self.p99_gap_ms if self.p99_gap_ms > 0 else float("nan")


def _p99(values: list[float]) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(0.99 * len(s)))] if s else 0.0


def _nested_array_schema(depth: int) -> str:
    return '{"type":"array","items":' * depth + '{"type":"string"}' + "}" * depth


def _many_props_schema(n: int, tag: int = 0) -> str:
    return json.dumps({"type": "object", "properties": {f"r{tag}p{i}": {"type": "integer"} for i in range(n)}})


class Neighbour:
    """Streaming completions, one after another until cancelled, each stream's chunk arrival
    times recorded apart (the wait for the next stream's first token is no token gap)."""

    def __init__(self, session: Any, url: str, model: str, max_tokens: int) -> None:
        self.session, self.url, self.model, self.max_tokens = session, url, model, max_tokens
        self.streams: list[list[float]] = []
        self.warm = asyncio.Event()

    async def run(self, warm_tokens: int) -> None:
        body = {"model": self.model, "prompt": "Once upon a time", "max_tokens": self.max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True}
        while True:
            arrivals: list[float] = []
            self.streams.append(arrivals)
            async with self.session.post(self.url + "/v1/completions", json=body) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"neighbour stream refused: {resp.status} {await resp.text()}")
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data:") or line.endswith(b"[DONE]"):
                        continue
                    arrivals.append(time.monotonic())
                    if len(arrivals) >= warm_tokens:
                        self.warm.set()

    def gaps(self, start: float, end: float) -> tuple[float, float]:
        """(largest gap overlapping [start, end], p99 of the gaps before start), in ms."""
        before, inside = [], []
        for arrivals in self.streams:
            for a, b in zip(arrivals, arrivals[1:]):
                if b <= start:
                    before.append(b - a)
                elif a <= end:
                    inside.append(b - a)
        return max(inside, default=0.0) * 1e3, _p99(before) * 1e3


class Hostile:
    """The hostile requests, each returning (HTTP status, extra figures)."""

    def __init__(self, session: Any, url: str, model: str, args: argparse.Namespace) -> None:
        self.session, self.url, self.model, self.args = session, url, model, args
        self.batch_file_id: str | None = None
        self.round = 0   # grammars differ from round to round: each is compiled, none answered from a cache

    async def _post(self, path: str, body: dict) -> int:
        async with self.session.post(self.url + path, json=body) as resp:
            await resp.read()
            return resp.status

    async def _guided(self, field_name: str, value: str) -> int:
        return await self._post("/v1/completions", {"model": self.model, "prompt": "Answer:", "max_tokens": 8,
                                                    "temperature": 0, field_name: value})

    async def json_deep(self) -> tuple[int, dict]:
        return await self._guided("guided_json", _nested_array_schema(900)), {}

    async def json_props(self) -> tuple[int, dict]:
        return await self._guided("guided_json", _many_props_schema(1200, self.round)), {}

    async def regex_rep(self) -> tuple[int, dict]:
        return await self._guided("guided_regex", "[^%s]{0,65535}" % "xyzwvu"[self.round % 6]), {}

    async def json_2500(self) -> tuple[int, dict]:
        return await self._guided("guided_json", _nested_array_schema(2500)), {}

    async def _small_latency(self) -> tuple[int, float]:
        t0 = time.monotonic()
        status = await self._post("/v1/completions", {"model": self.model, "prompt": "Hi", "max_tokens": 4,
                                                      "temperature": 0})
        return status, time.monotonic() - t0

    async def wide_n(self) -> tuple[int, dict]:
        _, alone = await self._small_latency()
        wide = asyncio.create_task(self._post("/v1/completions", {
            "model": self.model, "prompt": "List the colours:", "max_tokens": self.args.wide_tokens,
            "temperature": 1.0, "n": self.args.wide_n, "ignore_eos": True}))
        await asyncio.sleep(0.5)
        small_status, beside = await self._small_latency()
        status = await wide
        return status, {"small_status": small_status, "small_alone_s": alone, "small_beside_s": beside,
                        "small_latency_ratio": beside / alone if alone > 0 else float("nan")}

    async def tokenize_25k(self) -> tuple[int, dict]:
        msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": "hi"} for i in range(25_000)]
        return await self._post("/tokenize", {"model": self.model, "messages": msgs}), {}

    async def prepare_batch_file(self) -> None:
        """Upload (outside any window) a 64 MiB JSONL file whose last line is invalid."""
        import aiohttp

        line = json.dumps({"custom_id": "c{i}", "method": "POST", "url": "/v1/completions",
                           "body": {"model": self.model, "prompt": "x" * 1300, "max_tokens": 4}})
        lines = []
        size = 0
        i = 0
        while size + len(line) + 16 < BATCH_FILE_BYTES and i < 49_000:
            text = line.replace("c{i}", f"c{i}")
            lines.append(text)
            size += len(text) + 1
            i += 1
        lines.append('{"custom_id": "last", "method": "POST", "url": "/v1/completions"}')  # no body: invalid
        content = ("\n".join(lines) + "\n").encode()
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", content, filename="hostile.jsonl", content_type="application/jsonl")
        async with self.session.post(self.url + "/v1/files", data=form) as resp:
            body = await resp.json()
            if resp.status != 200:
                raise RuntimeError(f"upload of the {len(content)}-byte batch file refused: {resp.status} {body}")
            self.batch_file_id = body["id"]

    async def batch_64mib(self) -> tuple[int, dict]:
        if self.batch_file_id is None:
            await self.prepare_batch_file()
        async with self.session.post(self.url + "/v1/batches", json={
                "input_file_id": self.batch_file_id, "endpoint": "/v1/completions",
                "completion_window": "24h"}) as resp:
            body = await resp.json()
            status = resp.status
        if status == 200 and body.get("status") not in ("failed", "cancelled"):
            await self._post(f"/v1/batches/{body['id']}/cancel", {})
        return status, {"batch_status": 1.0 if body.get("status") == "failed" else 0.0}

    async def slow_headers(self) -> tuple[int, dict]:
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        end = time.monotonic() + self.args.slowloris_s

        async def one() -> bool:
            """True when the server closed the connection before the end."""
            try:
                reader, writer = await asyncio.open_connection(host, int(port))
            except OSError:
                return True
            try:
                writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
                await writer.drain()
                while time.monotonic() < end:
                    writer.write(b"X")
                    await writer.drain()
                    try:
                        if await asyncio.wait_for(reader.read(1024), timeout=1.0) == b"":
                            return True
                    except asyncio.TimeoutError:
                        pass
                return False
            except (ConnectionError, OSError):
                return True
            finally:
                writer.close()

        closed = await asyncio.gather(*(one() for _ in range(100)))
        return 0, {"connections": float(len(closed)), "closed_by_server": float(sum(closed))}


async def _one_round(session: Any, url: str, model: str, case: str, hostile: Hostile,
                     args: argparse.Namespace) -> Round:
    neighbour = Neighbour(session, url, model, args.neighbour_tokens)
    task = asyncio.create_task(neighbour.run(args.warm_tokens))
    warm = asyncio.create_task(neighbour.warm.wait())
    await asyncio.wait({task, warm}, return_when=asyncio.FIRST_COMPLETED)
    if task.done():  # the neighbour failed before it was warm
        warm.cancel()
        task.result()
    start = time.monotonic()
    try:
        status, extra = await asyncio.wait_for(getattr(hostile, case.replace("-", "_"))(),
                                               timeout=args.hostile_timeout_s)
    except asyncio.TimeoutError:
        status, extra = 0, {"timed_out": 1.0}
    end = time.monotonic()
    await asyncio.sleep(args.margin_s)
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception) as exc:  # noqa: BLE001 - a neighbour cut short is expected
        if not isinstance(exc, asyncio.CancelledError):
            logger.warning("neighbour stream: %s", exc)
    max_gap, p99_gap = neighbour.gaps(start, end + args.margin_s)
    return Round(status, end - start, max_gap, p99_gap, extra)


def _summary(rounds: list[Round]) -> dict:
    ratios = [r.gap_ratio for r in rounds]
    extras: dict[str, float] = {}
    for key in rounds[0].extra:
        extras[key] = statistics.median(r.extra[key] for r in rounds if key in r.extra)
    return {"status": sorted({r.status for r in rounds}), "latency_s": statistics.median(r.latency_s for r in rounds),
            "gap_ratio": statistics.median(ratios), "gap_ratio_worst": max(ratios),
            "max_gap_ms": statistics.median(r.max_gap_ms for r in rounds),
            "p99_gap_ms": statistics.median(r.p99_gap_ms for r in rounds),
            **extras, "rounds": [{**asdict(r), "gap_ratio": r.gap_ratio} for r in rounds]}


async def measure(url: str, args: argparse.Namespace) -> dict:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=None, sock_read=args.hostile_timeout_s + 30)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.get(url + "/v1/models") as resp:
            model = (await resp.json())["data"][0]["id"]
        hostile = Hostile(session, url, model, args)
        if "batch-64mib" in args.cases:
            await hostile.prepare_batch_file()
        out: dict[str, dict] = {}
        for case in args.cases:
            rounds = []
            for i in range(args.rounds):
                hostile.round = i
                rounds.append(await _one_round(session, url, model, case, hostile, args))
                logger.info("%s: %s", case, rounds[-1])
            out[case] = _summary(rounds)
        return out


def format_table(result: dict) -> str:
    lines = [f"host: {result['host']}",
             f"{'case':<14} {'status':<10} {'latency s':>9} {'max gap ms':>10} {'p99 ms':>7} {'ratio':>6} {'worst':>6}"]
    for case, r in result["cases"].items():
        lines.append(f"{case:<14} {','.join(map(str, r['status'])):<10} {r['latency_s']:>9.2f} {r['max_gap_ms']:>10.0f} "
                     f"{r['p99_gap_ms']:>7.0f} {r['gap_ratio']:>6.2f} {r['gap_ratio_worst']:>6.2f}")
        for key in ("small_latency_ratio", "closed_by_server"):
            if key in r:
                lines.append(f"{'':<14} {key} = {r[key]:.2f}")
    return "\n".join(lines)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", type=Path, required=True, help="write the full result here")
    p.add_argument("--url", help="a pdserve already running on 127.0.0.1 (default: start `pdserve up` here)")
    p.add_argument("--model-dir", help="model directory the started cluster serves (default: the generated small model)")
    p.add_argument("--port", type=int, default=8000, help="port the started cluster listens on (127.0.0.1)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override for the started cluster")
    p.add_argument("--cases", type=lambda s: [c.strip() for c in s.split(",") if c.strip()], default=list(CASES),
                   help=f"comma-separated, from: {', '.join(CASES)}")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--neighbour-tokens", type=int, default=1500, help="the neighbour stream's max_tokens")
    p.add_argument("--warm-tokens", type=int, default=60, help="neighbour tokens before the hostile request")
    p.add_argument("--margin-s", type=float, default=1.0, help="neighbour time watched after the hostile answer")
    p.add_argument("--hostile-timeout-s", type=float, default=90.0, help="give up on a hostile request after this")
    p.add_argument("--wide-n", type=int, default=16, help="n of the wide-n case (the server's per-request cap)")
    p.add_argument("--wide-tokens", type=int, default=64)
    p.add_argument("--slowloris-s", type=float, default=20.0)


def run(args: argparse.Namespace) -> int:
    from pdserve.bench.hw import cpu_model

    unknown = sorted(set(args.cases) - set(CASES))
    if unknown or args.rounds < 1:
        print(f"bench hostile: error: unknown cases {unknown}" if unknown else "bench hostile: error: --rounds >= 1")
        return 2
    host = cpu_model()
    if args.url:
        cases = asyncio.run(measure(args.url.rstrip("/"), args))
        served = args.url
    else:
        from pdserve.bench.servers import Server
        from pdserve.engine.testmodel import ensure_model

        model_dir = args.model_dir or str(ensure_model("small", "llama"))
        with Server("pdserve", model_dir, port=args.port, extra_set=list(args.set)) as server:
            cases = asyncio.run(measure(server.url, args))
        served = f"pdserve up --model {model_dir}"
    result = {"host": host, "server": served, "rounds": args.rounds, "cases": cases}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(format_table(result))
    return 0

"""Load generator of ``pdserve bench serve``: groups of streaming requests against one endpoint.

A run is a list of :class:`GroupSpec` (for example 8 steady decoders plus a stream of long
prompts) sent concurrently to one :class:`Target`: an OpenAI-compatible HTTP server
(``/v1/completions``, SSE) or pdserve's gRPC API. Each group is closed-loop (``concurrency``
requests in flight) or open-loop (Poisson arrivals at ``rate`` req/s). Every request records
when it was sent and when each output token arrived; :mod:`pdserve.bench.serve_stats` turns
those into TTFT / TPOT / ITL / goodput / stalls (``LoadResult.summary``).

Prompts are token-length exact: lists of token ids in ``prompt`` (pdserve and vLLM both accept
a list of ids there; ``Target.prompt_format = "text"`` sends words instead, whose token count
is then only approximate). Output tokens are counted from the stream: pdserve's chunks carry
their ``token_ids``; for another server each non-empty chunk counts as one token and the
final ``usage`` (``stream_options.include_usage``) is kept to check that count.

Bounded: every group stops at ``num_requests`` and the whole run at ``time_limit_s`` (requests
still in flight then are cancelled and reported as errors "time limit").
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

from pdserve.bench.serve_stats import CpuMeter, LoadResult, RequestRecord

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class LogNormal:
    """A length drawn from a log-normal distribution (``median``, ``sigma`` of its log), clipped
    to ``[lo, hi]``: the long tail of chat output lengths (ShareGPT's outputs are close to it)."""

    median: float
    sigma: float
    lo: int
    hi: int

    def draw(self, rng: random.Random) -> int:
        return max(self.lo, min(self.hi, round(rng.lognormvariate(math.log(self.median), self.sigma))))


Length = int | tuple[int, int] | LogNormal


@dataclass
class GroupSpec:
    """One client group: how many requests, their shape, and how they arrive."""

    name: str
    num_requests: int
    prompt_len: Length = 32
    output_len: Length = 64
    concurrency: int | None = None
    rate: float | None = None             # Poisson arrivals, requests per second
    ignore_eos: bool = True
    shared_prefix_len: int = 0            # first tokens identical across the group (a system prompt)
    start_delay_s: float = 0.0
    trace: str | Path | None = None       # JSONL: {"prompt_len", "output_len"} or {"prompt", "output_len"}
    seed: int = 0
    arrival_seed: int | None = None       # Poisson arrival times from this seed (default: ``seed``)

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.rate is None):
            raise ValueError(f"group {self.name!r}: give exactly one of concurrency and rate")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"group {self.name!r}: concurrency must be >= 1")
        if self.rate is not None and self.rate <= 0:
            raise ValueError(f"group {self.name!r}: rate must be > 0 requests/s")
        if self.num_requests < 1:
            raise ValueError(f"group {self.name!r}: num_requests must be >= 1")
        for what, v in (("prompt_len", self.prompt_len), ("output_len", self.output_len)):
            lo, hi = (v, v) if isinstance(v, int) else (v.lo, v.hi) if isinstance(v, LogNormal) else v
            if lo < 1 or hi < lo:
                raise ValueError(f"group {self.name!r}: {what} must be >= 1 (or a range lo <= hi), got {v}")
        if self.shared_prefix_len < 0 or self.start_delay_s < 0:
            raise ValueError(f"group {self.name!r}: shared_prefix_len and start_delay_s must be >= 0")


@dataclass
class Target:
    """Where the load goes: ``kind`` "openai" (url = http://127.0.0.1:PORT) or "grpc" (url = 127.0.0.1:PORT)."""

    kind: str
    url: str
    model: str
    api_key: str | None = None
    vocab_size: int = 256                 # random prompt ids are drawn from [3, vocab_size)
    prompt_format: str = "ids"            # "ids" (exact lengths) or "text"
    request_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.kind not in ("openai", "grpc"):
            raise ValueError(f"target kind must be 'openai' or 'grpc', got {self.kind!r}")
        if self.prompt_format not in ("ids", "text"):
            raise ValueError(f"prompt_format must be 'ids' or 'text', got {self.prompt_format!r}")
        if self.vocab_size < 4:
            raise ValueError("vocab_size must be >= 4")


# --------------------------------------------------------------------------- prompts
@dataclass
class _Item:
    prompt: list[int] | str
    prompt_len: int
    output_len: int


def _draw(v: Length, rng: random.Random) -> int:
    if isinstance(v, int):
        return v
    if isinstance(v, LogNormal):
        return v.draw(rng)
    return rng.randint(v[0], v[1])


def build_items(group: GroupSpec, vocab_size: int) -> list[_Item]:
    """The group's prompts (token ids of exact length) and output lengths, reproducible from its seed."""
    rng = random.Random(group.seed)
    prefix_rng = random.Random(f"prefix-{group.seed}")
    prefix = [prefix_rng.randrange(3, vocab_size) for _ in range(group.shared_prefix_len)]
    rows: list[dict] = []
    if group.trace is not None:
        with open(group.trace) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        if not rows:
            raise ValueError(f"trace {group.trace} has no rows")
    items = []
    for i in range(group.num_requests):
        row = rows[i % len(rows)] if rows else {}
        out = int(row["output_len"]) if "output_len" in row else _draw(group.output_len, rng)
        if "prompt" in row:
            items.append(_Item(str(row["prompt"]), len(str(row["prompt"]).split()), out))
            continue
        n = int(row["prompt_len"]) if "prompt_len" in row else _draw(group.prompt_len, rng)
        body = [rng.randrange(3, vocab_size) for _ in range(max(0, n - len(prefix)))]
        items.append(_Item((prefix + body)[:n] if n >= len(prefix) else prefix[:n], n, out))
    return items


def _as_text(ids: list[int]) -> str:
    """A text prompt for a server without token-id prompts: one short word per id (about one token each)."""
    return " ".join(f"w{t % 1000}" for t in ids)


# --------------------------------------------------------------------------- clients
class _OpenAIClient:
    def __init__(self, target: Target) -> None:
        import aiohttp

        self.t = target
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=target.request_timeout_s),
            connector=aiohttp.TCPConnector(limit=0))
        self.headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}

    async def close(self) -> None:
        await self.session.close()

    async def send(self, item: _Item, rec: RequestRecord, ignore_eos: bool) -> None:
        prompt = item.prompt if (self.t.prompt_format == "ids" or isinstance(item.prompt, str)) \
            else _as_text(item.prompt)
        body = {"model": self.t.model, "prompt": prompt, "max_tokens": item.output_len, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        if ignore_eos:
            body["ignore_eos"] = True
        rec.sent = time.monotonic()
        async with self.session.post(self.t.url.rstrip("/") + "/v1/completions", json=body,
                                     headers=self.headers) as resp:
            rec.request_id = resp.headers.get("X-Request-Id", "")
            if resp.status != 200:
                rec.error = _short(f"HTTP {resp.status}: {await resp.text()}")
                return
            async for line in resp.content:
                if not line.startswith(b"data: {"):
                    continue
                now = time.monotonic()
                event = json.loads(line[6:])
                if "error" in event:
                    rec.error = _short(str(event["error"]))
                    return
                usage = event.get("usage")
                if usage:
                    rec.usage_completion_tokens = usage.get("completion_tokens")
                    rec.usage_prompt_tokens = usage.get("prompt_tokens")
                    rec.cached_prompt_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                ext = event.get("pdserve") or {}
                if "phase" in ext:
                    rec.phase = ext["phase"]
                ids = ext.get("token_ids")
                if ids is not None:
                    n = len(ids)
                else:
                    choices = event.get("choices") or []
                    n = 1 if choices and (choices[0].get("text") or choices[0].get("token_ids")) else 0
                rec.token_times.extend([now] * n)


class _GrpcClient:
    def __init__(self, target: Target) -> None:
        import grpc

        from pdserve.proto import pdserve_pb2_grpc as pb_grpc

        self.t = target
        self.channel = grpc.aio.insecure_channel(target.url)
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.metadata = (("authorization", f"Bearer {target.api_key}"),) if target.api_key else None

    async def close(self) -> None:
        await self.channel.close()

    async def send(self, item: _Item, rec: RequestRecord, ignore_eos: bool) -> None:
        import grpc

        from pdserve.proto import pdserve_pb2 as pb

        sampling = pb.SamplingParams(max_tokens=item.output_len, temperature=0.0, ignore_eos=ignore_eos)
        if isinstance(item.prompt, str):
            req = pb.GenerateRequest(prompt=item.prompt, sampling=sampling)
        else:
            req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=item.prompt), sampling=sampling)
        rec.sent = time.monotonic()
        try:
            async for msg in self.stub.Generate(req, timeout=self.t.request_timeout_s, metadata=self.metadata):
                if msg.token_ids:
                    rec.token_times.extend([time.monotonic()] * len(msg.token_ids))
                if msg.request_id:
                    rec.request_id = msg.request_id
                if msg.HasField("final"):
                    rec.usage_completion_tokens = msg.final.usage.completion_tokens
                    rec.usage_prompt_tokens = msg.final.usage.prompt_tokens
                    rec.cached_prompt_tokens = msg.final.usage.cached_prompt_tokens
        except grpc.aio.AioRpcError as exc:
            rec.error = _short(f"{exc.code().name}: {exc.details()}")


def _short(message: str) -> str:
    text = " | ".join(ln.strip() for ln in message.splitlines() if ln.strip())
    return text if len(text) <= 400 else text[:150] + " ... " + text[-250:]


# --------------------------------------------------------------------------- driver
async def _run_group(client, group: GroupSpec, items: list[_Item], out: list[RequestRecord]) -> None:
    if group.start_delay_s:
        await asyncio.sleep(group.start_delay_s)

    async def one(i: int, item: _Item) -> None:
        rec = RequestRecord(group.name, i, item.prompt_len, item.output_len)
        out.append(rec)
        try:
            await client.send(item, rec, group.ignore_eos)
        except asyncio.CancelledError:
            rec.error = rec.error or "time limit: cancelled in flight"
            raise
        except Exception as exc:  # noqa: BLE001 - a failed request is a figure, not a crash
            rec.error = _short(f"{type(exc).__name__}: {exc}")

    if group.concurrency is not None:
        todo = iter(enumerate(items))

        async def worker() -> None:
            for i, item in todo:  # shared iterator: each worker takes the next request
                await one(i, item)

        await asyncio.gather(*(worker() for _ in range(min(group.concurrency, len(items)))))
        return
    tasks = []
    for i, (item, gap) in enumerate(zip(items, arrival_gaps(group))):
        if i:
            await asyncio.sleep(gap)
        tasks.append(asyncio.create_task(one(i, item)))
    await asyncio.gather(*tasks)


def arrival_gaps(group: GroupSpec) -> list[float]:
    """A rate group's Poisson schedule: the seconds before each request is sent after the one
    before it (the first's is not waited). The same group always draws the same schedule, so a
    simulator can be given a load's arrivals before it runs."""
    if group.rate is None:
        raise ValueError(f"group {group.name!r}: a schedule needs a rate")
    rng = random.Random(f"arrivals-{group.seed if group.arrival_seed is None else group.arrival_seed}")
    return [0.0 if i == 0 else rng.expovariate(group.rate) for i in range(group.num_requests)]


async def run_load(target: Target, groups: list[GroupSpec], *, time_limit_s: float,
                   stall_threshold_s: float = 1.0) -> LoadResult:
    """Send every group's requests concurrently to ``target``; stop at ``time_limit_s``."""
    if not groups:
        raise ValueError("run_load needs at least one group")
    if len({g.name for g in groups}) != len(groups):
        raise ValueError("group names must be unique")
    if time_limit_s <= 0 or stall_threshold_s <= 0:
        raise ValueError("time_limit_s and stall_threshold_s must be > 0")
    plans = [(g, build_items(g, target.vocab_size)) for g in groups]
    client = _OpenAIClient(target) if target.kind == "openai" else _GrpcClient(target)
    records: list[RequestRecord] = []
    meter = CpuMeter()
    started = time.monotonic()
    limited = False
    try:
        runs = asyncio.gather(*(_run_group(client, g, items, records) for g, items in plans))
        try:
            await asyncio.wait_for(runs, time_limit_s)
        except TimeoutError:
            limited = True
            logger.warning("load stopped at the time limit (%.0fs)", time_limit_s)
    finally:
        await client.close()
    wall = time.monotonic() - started
    for r in records:
        if limited and r.error is None and (not r.token_times or len(r.token_times) < r.output_len) \
                and r.usage_completion_tokens is None:
            r.error = "time limit: cancelled in flight"
    records.sort(key=lambda r: (r.group, r.index))
    return LoadResult(records, started, wall, meter.cpu_s(), stall_threshold_s, limited)

"""The OpenAI Batch API's logic: input files checked line by line, batches run on spare capacity,
results kept durably and matched by ``custom_id``.

The router holds no state of its own here: files, batches and per-item results live in a
``BatchStore`` (``cluster/batch_store.py`` keeps them in Redis, with persistence on), so a router
restart or a Redis restart loses no accepted item. ``BatchRunner`` is a task of the router: it
takes every active batch's items that have no result yet and runs them through ``Serving`` at
the engine's batch priority (``Priority.BATCH``: scheduled after every interactive request), a
few at a time, outside the router's admission (an item takes no slot, so interactive requests
never wait for one, nor get a 429, because of a batch) and none while an interactive request
waits for a slot. A result is recorded once per item (``record_result`` keeps the first), so an
item that was running when the router died is run again and still answered exactly once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

from pdserve.engine.errors import PdserveError
from pdserve.engine.sequence import Priority
from pdserve.router import errors
from pdserve.router.backend import Finished
from pdserve.router.errors import InvalidParameterError
from pdserve.router.openai_format import ResponseBuilder
from pdserve.router.serving import BATCH_API, Chunk, Serving
from pdserve.router.validation import parse_chat_body, parse_completion_bodies

logger = logging.getLogger(__name__)

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
MAX_FILE_BYTES = 64 * 1024 * 1024
MAX_LINES = 50_000
COMPLETION_WINDOWS = {"24h": 24 * 3600.0}
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")


class BatchStore(Protocol):
    """Durable files, batches and per-item results (``cluster/batch_store.py``)."""

    def put_file(self, meta: dict, content: bytes) -> None: ...
    def file(self, file_id: str) -> dict | None: ...
    def file_content(self, file_id: str) -> bytes | None: ...
    def put_batch(self, batch: dict, items: list[str]) -> None: ...
    def batch(self, batch_id: str) -> dict | None: ...
    def batches(self, limit: int, after: str | None = None) -> list[dict]: ...
    def update_batch(self, batch_id: str, changes: dict) -> dict | None: ...
    def item(self, batch_id: str, index: int) -> str: ...
    def pending_items(self, batch_id: str, total: int) -> list[int]: ...
    def record_result(self, batch_id: str, index: int, line: str, ok: bool) -> bool: ...
    def results(self, batch_id: str) -> list[tuple[int, str, bool]]: ...
    def active_batches(self) -> list[str]: ...


def _bad(param: str, message: str) -> InvalidParameterError:
    return InvalidParameterError(message, param=param)


def file_object(meta: dict) -> dict:
    return {"id": meta["id"], "object": "file", "bytes": meta["bytes"], "created_at": meta["created_at"],
            "filename": meta["filename"], "purpose": meta["purpose"], "status": "processed",
            "status_details": None}


def new_file(content: bytes, filename: str, purpose: str) -> dict:
    return {"id": f"file-{uuid.uuid4().hex}", "bytes": len(content), "created_at": int(time.time()),
            "filename": filename[:256] or "upload.jsonl", "purpose": purpose}


def check_upload(purpose: str | None, content: bytes) -> None:
    if purpose != "batch":
        raise _bad("purpose", f"'purpose' must be \"batch\" (the only kind of file this server keeps), got {purpose!r}")
    if not content:
        raise _bad("file", "the file is empty; send a JSONL file with one request per line")
    if len(content) > MAX_FILE_BYTES:
        raise errors.RequestTooLargeError(f"the file is {len(content)} bytes; at most {MAX_FILE_BYTES} are accepted")


def check_lines(content: bytes, endpoint: str) -> tuple[list[str], list[dict]]:
    """The input file's request lines, or the errors of the lines that are not valid requests for
    ``endpoint`` (OpenAI's shape: ``code``, ``message``, ``line``, 1-based)."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError:
        return [], [{"code": "invalid_file", "message": "the file is not UTF-8 text", "param": None, "line": None}]
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if len(lines) > MAX_LINES:
        return [], [{"code": "too_many_requests", "message": f"the file has {len(lines)} requests; at most "
                     f"{MAX_LINES} fit one batch", "param": None, "line": None}]
    found: list[dict] = []
    seen: set[str] = set()
    items: list[str] = []
    for n, line in enumerate(lines, 1):
        def err(code: str, message: str, param: str | None = None) -> None:
            found.append({"code": code, "message": message, "param": param, "line": n})
        try:
            obj = json.loads(line)
        except ValueError:
            err("invalid_json", "the line is not valid JSON")
            continue
        if not isinstance(obj, dict):
            err("invalid_request", "the line must be a JSON object")
            continue
        unknown = sorted(set(obj) - {"custom_id", "method", "url", "body"})
        cid = obj.get("custom_id")
        if unknown:
            err("invalid_request", f"unknown field '{str(unknown[0])[:64]}'", unknown[0])
        elif not isinstance(cid, str) or not cid or len(cid) > 512:
            err("missing_required_parameter", "'custom_id' must be a non-empty string (at most 512 characters)",
                "custom_id")
        elif cid in seen:
            err("duplicate_custom_id", f"the custom_id '{cid[:64]}' is used by an earlier line; each must be unique",
                "custom_id")
        elif obj.get("method") != "POST":
            err("invalid_request", "'method' must be \"POST\"", "method")
        elif obj.get("url") != endpoint:
            err("invalid_url", f"'url' must be this batch's endpoint {endpoint}, got {str(obj.get('url'))[:64]!r}",
                "url")
        elif not isinstance(obj.get("body"), dict):
            err("invalid_request", "'body' must be a JSON object (the request)", "body")
        else:
            seen.add(cid)
            items.append(line)
    if not items and not found:
        found.append({"code": "empty_file", "message": "the file has no requests", "param": None, "line": None})
    return items, found


def new_batch(input_file_id: str, endpoint: str, window: str, metadata: dict | None, total: int) -> dict:
    now = int(time.time())
    return {"id": f"batch_{uuid.uuid4().hex}", "object": "batch", "endpoint": endpoint, "errors": None,
            "input_file_id": input_file_id, "completion_window": window, "status": "in_progress",
            "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": now,
            "expires_at": now + int(COMPLETION_WINDOWS[window]), "finalizing_at": None, "completed_at": None,
            "failed_at": None, "expired_at": None, "cancelling_at": None, "cancelled_at": None,
            "request_counts": {"total": total, "completed": 0, "failed": 0}, "metadata": metadata}


def check_create(body: object) -> tuple[str, str, str, dict | None]:
    """``POST /v1/batches``: (input_file_id, endpoint, completion_window, metadata)."""
    if not isinstance(body, dict):
        raise InvalidParameterError("the request body must be a JSON object")
    unknown = sorted(set(body) - {"input_file_id", "endpoint", "completion_window", "metadata"})
    if unknown:
        raise _bad(unknown[0], f"unknown parameter '{str(unknown[0])[:64]}'; /v1/batches accepts input_file_id, "
                               "endpoint, completion_window and metadata")
    fid, endpoint, window = body.get("input_file_id"), body.get("endpoint"), body.get("completion_window")
    if not isinstance(fid, str) or not fid:
        raise _bad("input_file_id", "'input_file_id' is required: the id of a file uploaded with purpose \"batch\"")
    if endpoint not in ENDPOINTS:
        raise _bad("endpoint", f"'endpoint' must be one of {', '.join(ENDPOINTS)}, got {str(endpoint)[:64]!r}")
    if window not in COMPLETION_WINDOWS:
        raise _bad("completion_window", f"'completion_window' must be one of {sorted(COMPLETION_WINDOWS)}")
    meta = body.get("metadata")
    if meta is not None and (not isinstance(meta, dict) or len(meta) > 16
                             or not all(isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
                                        for k, v in meta.items())):
        raise _bad("metadata", "'metadata' must be at most 16 string keys (64 characters) to strings (512)")
    return fid, endpoint, window, meta


async def respond(serving: Serving, url: str, body: dict, client_id: str) -> tuple[int, dict]:
    """Run one request body to its full (non-streamed) response: (HTTP status, body), the error's
    status and OpenAI error body when it fails. Runs at the engine's batch priority."""
    chat = url == "/v1/chat/completions"
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    try:
        if body.get("stream"):
            raise _bad("stream", "a batch request cannot stream; leave 'stream' out")
        parsed_list = [parse_chat_body(body)] if chat else parse_completion_bodies(body)
        parsed = parsed_list[0]
        if len(parsed_list) > 1 or parsed.n > 1 or parsed.best_of > 1 or parsed.echo:
            raise _bad("n", "a batch request has one prompt and one choice (no n, best_of, echo or prompt lists)")
        parsed = replace(parsed, priority=Priority.BATCH)
        prepared = await serving.prepare(parsed, client_id, default_max_tokens=None if chat else 16)
        builder = ResponseBuilder(rid, serving.info.name, serving.tokenizer, chat=chat,
                                  logprobs=prepared.params.logprobs, tools=parsed.tools,
                                  tokens_as_ids=parsed.tokens_as_ids)
        chunks: list[Chunk] = []
        async with serving.stream(prepared, api=BATCH_API) as events:
            async for ev in events:
                if isinstance(ev, Finished):
                    if ev.error is not None:
                        raise ev.error
                    return 200, builder.full(chunks, ev)
                chunks.append(ev)
        raise PdserveError("the request ended without a final result")
    except PdserveError as exc:
        return errors.http_status(exc), errors.openai_error_body(exc)


def result_line(index: int, custom_id: str, status: int, body: dict) -> str:
    return json.dumps({"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
                       "response": {"status_code": status, "request_id": body.get("id") or f"req_{index}",
                                    "body": body}, "error": None}, separators=(",", ":"))


class BatchRunner:
    """Runs active batches' pending items on spare capacity; finalizes batches into output and
    error files. ``run()`` is the router's task; it survives Redis outages (it retries)."""

    def __init__(self, serving: Serving, store: BatchStore, *, poll_s: float = 0.2,
                 max_concurrent: int | None = None, on_item: Callable[[bool], None] | None = None) -> None:
        self.serving = serving
        self.store = store
        self.poll_s = poll_s
        cap = serving.admission.config.max_in_flight
        self.max_concurrent = max_concurrent or max(1, cap // 2)
        self._running: dict[tuple[str, int], asyncio.Task] = {}
        self._on_item = on_item
        self.snapshot: list[dict] = []   # the active batches as the last tick saw them (pdserve status)

    @property
    def running(self) -> int:
        """Items running now."""
        return len(self._running)

    def _spare(self) -> int:
        """Items that may start now: room under the runner's own limit, with no interactive request
        waiting for an admission slot; while interactive requests run, the runner keeps a quarter
        of its limit (fewer batch sequences make their steps shorter). Items take no admission
        slot (``Serving`` admits only interactive requests), so a batch never makes an interactive
        request wait for one, let alone get a 429; the engine schedules them after interactive work."""
        adm = self.serving.admission
        if adm.queued:
            return 0
        limit = self.max_concurrent if adm.in_flight == 0 else max(1, self.max_concurrent // 4)
        return max(0, limit - len(self._running))

    async def _io(self, fn, *args):
        return await asyncio.to_thread(fn, *args)

    async def run(self) -> None:
        while True:
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception as exc:   # Redis down, most likely: the items wait, nothing is lost
                logger.warning("batch runner: %s; retrying", exc)
            await asyncio.sleep(self.poll_s)

    async def close(self) -> None:
        for t in self._running.values():
            t.cancel()
        await asyncio.gather(*self._running.values(), return_exceptions=True)
        self._running.clear()

    async def tick(self) -> None:
        seen: list[dict] = []
        try:
            await self._tick(seen)
        finally:
            self.snapshot = seen

    async def _tick(self, seen: list[dict]) -> None:
        for batch_id in await self._io(self.store.active_batches):
            b = await self._io(self.store.batch, batch_id)
            if b is None:
                continue
            seen.append({"id": b["id"], "status": b["status"], "endpoint": b["endpoint"],
                         **b["request_counts"], "running": sum(1 for k in self._running if k[0] == batch_id)})
            total = b["request_counts"]["total"]
            pending = await self._io(self.store.pending_items, batch_id, total)
            mine = [i for i in pending if (batch_id, i) in self._running]
            if b["status"] == "cancelling":
                for i in mine:
                    self._running[(batch_id, i)].cancel()
                if not mine:
                    await self._finalize(b, "cancelled")
                continue
            if time.time() >= b["expires_at"]:
                if not mine:
                    await self._finalize(b, "expired")
                continue
            if not pending:
                await self._finalize(b, "completed")
                continue
            for i in [i for i in pending if (batch_id, i) not in self._running][: self._spare()]:
                task = asyncio.get_running_loop().create_task(self._item(batch_id, i), name=f"batch-{i}")
                self._running[(batch_id, i)] = task
                task.add_done_callback(lambda _t, key=(batch_id, i): self._running.pop(key, None))

    async def _item(self, batch_id: str, index: int) -> None:
        line = json.loads(await self._io(self.store.item, batch_id, index))
        status, body = await respond(self.serving, line["url"], line["body"], f"{line['custom_id'][:96]}")
        out = result_line(index, line["custom_id"], status, body)
        delay = 0.2
        while True:   # a result is never dropped: Redis may be restarting
            try:
                await self._io(self.store.record_result, batch_id, index, out, status == 200)
                break
            except Exception as exc:
                logger.warning("batch %s item %d: result not stored yet (%s); retrying", batch_id, index, exc)
                await asyncio.sleep(delay)
                delay = min(2.0, delay * 2)
        if self._on_item is not None:
            self._on_item(status == 200)

    async def _finalize(self, b: dict, final: str) -> None:
        results = await self._io(self.store.results, b["id"])
        files = {}
        for ok, purpose, key in ((True, "batch_output", "output_file_id"), (False, "batch_error", "error_file_id")):
            lines = [line for _, line, good in sorted(results) if good is ok]
            if final in ("expired", "cancelled") and not ok:
                done = {i for i, _, _ in results}
                lines += [json.dumps({"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": json.loads(
                    await self._io(self.store.item, b["id"], i))["custom_id"], "response": None,
                    "error": {"code": f"batch_{final}", "message": f"the batch was {final} before this request ran"}})
                    for i in range(b["request_counts"]["total"]) if i not in done]
            if lines:
                content = ("\n".join(lines) + "\n").encode()
                meta = new_file(content, f"{b['id']}_{'output' if ok else 'error'}.jsonl", purpose)
                await self._io(self.store.put_file, meta, content)
                files[key] = meta["id"]
        now = int(time.time())
        changes = {**files, "status": final, f"{final}_at": now}
        await self._io(self.store.update_batch, b["id"], changes)
        logger.info("batch %s %s (%d results)", b["id"], final, len(results))

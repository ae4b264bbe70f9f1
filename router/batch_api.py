"""The OpenAI Batch API's logic: batches run on spare capacity, results kept durably and matched
by ``custom_id``, every file and batch owned by the API key that made it. Input checks are in
``router/batch_input.py``.

The router holds no state of its own here: files, batches and per-item results live in a
``BatchStore`` (``cluster/state/batch_store.py`` keeps them in Redis, with persistence on), so a router
restart or a Redis restart loses no accepted item. ``BatchRunner`` is a task of every router.
Life of an item:

1. A runner with spare capacity claims it: a lease in the store (``claim_items``: no result yet,
   no live lease), which it renews every third of ``lease_s`` while the item runs; the runners
   of the other routers skip it.
2. It runs through ``Serving`` at the engine's batch priority (``Priority.BATCH``: scheduled
   after every interactive request), outside the router's admission (an item takes no slot, so
   interactive requests never wait for one, nor get a 429, because of a batch), and none start
   while an interactive request waits for a slot.
3. Its result is recorded once (``record_result`` keeps the first) and the lease released.
   A router that dies mid-item stops renewing: the lease expires and another runner takes the
   item over and runs it again (its claim count goes to 2); one that stalls past its lease and
   comes back finds the lease lost and drops the item. Either way the item is answered once.
4. When every item has a result (or the batch is cancelled or expired and no item is leased),
   one runner (``claim_finalize``) writes the output and error files, owned as the batch is.

Ownership: ``owner`` (``router/auth.py``'s owner id of the matched key, the empty anonymous id
without keys) is recorded in every file and batch; the HTTP handlers answer 404 for another
owner's, as for an unknown id. Objects stored before owners existed belong to the anonymous owner.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from typing import Protocol

from pdserve.engine.errors import PdserveError
from pdserve.engine.sequence import Priority
from pdserve.router import errors
from pdserve.router.auth import ANONYMOUS
from pdserve.router.backend import Finished
from pdserve.router.errors import InvalidParameterError
from pdserve.router.openai_format import ResponseBuilder
from pdserve.router.serving import BATCH_API, Chunk, Serving
from pdserve.router.validation import parse_chat_body, parse_completion_bodies

logger = logging.getLogger(__name__)

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
COMPLETION_WINDOWS = {"24h": 24 * 3600.0}
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
FINAL = ("failed", "completed", "cancelled", "expired")
DEFAULT_LEASE_S = 15.0


class BatchStore(Protocol):
    """Durable files, batches and per-item results (``cluster/state/batch_store.py``)."""

    def put_file(self, meta: dict, content: bytes) -> None: ...
    def file(self, file_id: str) -> dict | None: ...
    def file_content(self, file_id: str) -> bytes | None: ...
    def file_chunks(self, file_id: str) -> Iterator[bytes] | None: ...
    def put_batch(self, batch: dict, items: list[str]) -> None: ...
    def batch(self, batch_id: str) -> dict | None: ...
    def batches(self, limit: int, after: str | None = None, owner: str = ANONYMOUS) -> list[dict]: ...
    def update_batch(self, batch_id: str, changes: dict) -> dict | None: ...
    def item(self, batch_id: str, index: int) -> str: ...
    def items(self, batch_id: str) -> list[str]: ...
    def record_result(self, batch_id: str, index: int, line: str, ok: bool) -> bool: ...
    def results(self, batch_id: str) -> list[tuple[int, str, bool]]: ...
    def active_batches(self) -> list[str]: ...
    def claim_items(self, batch_id: str, holder: str, lease_s: float, want: int, total: int,
                    start: int) -> tuple[list[int], int]: ...
    def renew_items(self, batch_id: str, holder: str, lease_s: float, indexes: list[int]) -> list[int]: ...
    def release_item(self, batch_id: str, holder: str, index: int) -> None: ...
    def live_leases(self, batch_id: str) -> int: ...
    def claim_finalize(self, batch_id: str, holder: str, lease_s: float) -> bool: ...


def _bad(param: str, message: str) -> InvalidParameterError:
    return InvalidParameterError(message, param=param)


def file_object(meta: dict) -> dict:
    return {"id": meta["id"], "object": "file", "bytes": meta["bytes"], "created_at": meta["created_at"],
            "filename": meta["filename"], "purpose": meta["purpose"], "status": "processed",
            "status_details": None}


def new_file(content: bytes, filename: str, purpose: str, owner: str = ANONYMOUS) -> dict:
    return {"id": f"file-{uuid.uuid4().hex}", "bytes": len(content), "created_at": int(time.time()),
            "filename": filename[:256] or "upload.jsonl", "purpose": purpose, "owner": owner}


def owned_by(obj: dict | None, owner: str) -> bool:
    """Whether a stored file or batch belongs to ``owner`` (one stored without an owner belongs to
    the anonymous owner)."""
    return obj is not None and obj.get("owner", ANONYMOUS) == owner


def batch_object(doc: dict) -> dict:
    """The batch as the client sees it (the owner id stays on the server)."""
    return {k: v for k, v in doc.items() if k != "owner"}


def new_batch(input_file_id: str, endpoint: str, window: str, metadata: dict | None, total: int,
              owner: str = ANONYMOUS) -> dict:
    now = int(time.time())
    return {"id": f"batch_{uuid.uuid4().hex}", "object": "batch", "endpoint": endpoint, "errors": None,
            "input_file_id": input_file_id, "completion_window": window, "status": "in_progress",
            "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": now,
            "expires_at": now + int(COMPLETION_WINDOWS[window]), "finalizing_at": None, "completed_at": None,
            "failed_at": None, "expired_at": None, "cancelling_at": None, "cancelled_at": None,
            "request_counts": {"total": total, "completed": 0, "failed": 0}, "metadata": metadata,
            "owner": owner}


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


async def respond(serving: Serving, url: str, body: dict, client_id: str,
                  owner: str = ANONYMOUS) -> tuple[int, dict]:
    """Run one request body to its full (non-streamed) response: (HTTP status, body), the error's
    status and OpenAI error body when it fails. Runs at the engine's batch priority; the request
    log records it under ``owner``, the batch's."""
    chat = url == "/v1/chat/completions"
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    try:
        if body.get("stream"):
            raise _bad("stream", "a batch request cannot stream; leave 'stream' out")
        parsed_list = [parse_chat_body(body)] if chat else parse_completion_bodies(body)
        parsed = parsed_list[0]
        if len(parsed_list) > 1 or parsed.n > 1 or parsed.best_of > 1 or parsed.echo:
            raise _bad("n", "a batch request has one prompt and one choice (no n, best_of, echo or prompt lists)")
        if parsed.beam_width:
            raise _bad("use_beam_search", "a batch request cannot use beam search; send it to "
                                          "/v1/completions or /v1/chat/completions directly")
        parsed = replace(parsed, priority=Priority.BATCH)
        prepared = replace(await serving.prepare(parsed, client_id, default_max_tokens=None if chat else 16),
                           owner=owner)
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
    except Exception as exc:   # a bug: the item fails (logged), the runner goes on
        err = errors.as_pdserve_error(exc)
        return errors.http_status(err), errors.openai_error_body(err)


def result_line(index: int, custom_id: str, status: int, body: dict) -> str:
    return json.dumps({"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
                       "response": {"status_code": status, "request_id": body.get("id") or f"req_{index}",
                                    "body": body}, "error": None}, separators=(",", ":"))



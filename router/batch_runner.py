"""``BatchRunner``: one router's share of the Batch API's work (``router/batch_api.py`` has the life
of an item: claimed under a lease, run at batch priority, recorded once, released).

Every router runs one. Each tick it renews the leases of the items it runs (every third of
``lease_s``; an item whose lease it lost is cancelled here, since another runner has it), then,
for each active batch: cancels its own items of a cancelled batch, finalizes a batch that is
done (or cancelled or expired with no item leased anywhere), or claims as many pending items as
it has room for and starts them. Store calls run in threads, so a slow Redis never stalls the
event loop; a Redis outage makes a tick fail, and the next one retries.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Callable

from pdserve.router.auth import ANONYMOUS
from pdserve.router.batch_api import DEFAULT_LEASE_S, FINAL, BatchStore, new_file, respond, result_line
from pdserve.router.serving import Serving

logger = logging.getLogger(__name__)


class BatchRunner:
    """Runs active batches' pending items on spare capacity; finalizes batches into output and
    error files. ``run()`` is the router's task; it survives Redis outages (it retries)."""

    def __init__(self, serving: Serving, store: BatchStore, *, poll_s: float = 0.2,
                 max_concurrent: int | None = None, on_item: Callable[[bool], None] | None = None,
                 lease_s: float = DEFAULT_LEASE_S, holder: str | None = None) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        self.serving = serving
        self.store = store
        self.poll_s = poll_s
        cap = serving.admission.config.max_in_flight
        self.max_concurrent = max_concurrent or max(1, cap // 2)
        self.lease_s = lease_s
        # Unique per runner: a router restarted under the same id must not renew its past self's leases.
        self.holder = f"{holder or 'runner'}-{uuid.uuid4().hex[:12]}"
        self._running: dict[tuple[str, int], asyncio.Task] = {}
        self._cursor: dict[str, int] = {}      # batch -> where its next claim starts looking
        self._renewed_at = time.monotonic()
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
            await self._renew()
            await self._tick(seen)
        finally:
            self.snapshot = seen

    async def _renew(self) -> None:
        """Every third of the lease: extend this runner's leases; cancel the items whose lease it lost."""
        now = time.monotonic()
        if now - self._renewed_at < self.lease_s / 3:
            return
        by_batch: dict[str, list[int]] = {}
        for batch_id, i in list(self._running):
            by_batch.setdefault(batch_id, []).append(i)
        for batch_id, indexes in by_batch.items():
            for i in await self._io(self.store.renew_items, batch_id, self.holder, self.lease_s, indexes):
                task = self._running.get((batch_id, i))
                if task is not None:
                    logger.warning("batch %s item %d: its lease was lost (another runner has it); dropped here",
                                   batch_id, i)
                    task.cancel()
        self._renewed_at = now

    async def _tick(self, seen: list[dict]) -> None:
        active = await self._io(self.store.active_batches)
        for gone in set(self._cursor) - set(active):
            del self._cursor[gone]
        for batch_id in active:
            b = await self._io(self.store.batch, batch_id)
            if b is None or b["status"] in FINAL:
                continue
            counts = b["request_counts"]
            mine = [i for bid, i in self._running if bid == batch_id]
            seen.append({"id": b["id"], "status": b["status"], "endpoint": b["endpoint"], **counts,
                         "running": len(mine)})
            if b["status"] == "cancelling" or time.time() >= b["expires_at"]:
                final = "cancelled" if b["status"] == "cancelling" else "expired"
                if final == "cancelled":
                    for i in mine:
                        self._running[(batch_id, i)].cancel()
                if not mine and await self._io(self.store.live_leases, batch_id) == 0:
                    await self._finalize(b, final)
                continue
            if counts["completed"] + counts["failed"] >= counts["total"]:
                await self._finalize(b, "completed")
                continue
            spare = self._spare()
            if spare == 0:
                continue
            claimed, self._cursor[batch_id] = await self._io(
                self.store.claim_items, batch_id, self.holder, self.lease_s, spare, counts["total"],
                self._cursor.get(batch_id, 0))
            for i in claimed:
                task = asyncio.get_running_loop().create_task(self._item(batch_id, i, b.get("owner", ANONYMOUS)),
                                                              name=f"batch-{i}")
                self._running[(batch_id, i)] = task
                task.add_done_callback(lambda _t, key=(batch_id, i): self._running.pop(key, None))

    async def _item(self, batch_id: str, index: int, owner: str) -> None:
        try:
            line = json.loads(await self._io(self.store.item, batch_id, index))
            status, body = await respond(self.serving, line["url"], line["body"], f"{line['custom_id'][:96]}", owner)
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
        finally:   # cancelled or done: another runner may take it at once (else the lease expires)
            try:
                await asyncio.shield(self._io(self.store.release_item, batch_id, self.holder, index))
            except Exception as exc:
                logger.debug("batch %s item %d: lease not released (%s); it expires", batch_id, index, exc)

    async def _finalize(self, b: dict, final: str) -> None:
        """Write the output and error files and end the batch, by one runner (``claim_finalize``)."""
        if not await self._io(self.store.claim_finalize, b["id"], self.holder, max(60.0, self.lease_s)):
            return
        count = await self._io(self._finalize_now, b, final)
        logger.info("batch %s %s (%d results)", b["id"], final, count)

    def _finalize_now(self, b: dict, final: str) -> int:
        """``_finalize``'s work, in a thread: every line of a large batch is read and written here."""
        results = sorted(self.store.results(b["id"]))
        files = {}
        unanswered: list[str] = []
        if final in ("expired", "cancelled"):
            done = {i for i, _, _ in results}
            items = self.store.items(b["id"])
            unanswered = [json.dumps({"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": json.loads(items[i])[
                "custom_id"], "response": None, "error": {"code": f"batch_{final}", "message": f"the batch was "
                                                          f"{final} before this request ran"}})
                          for i in range(b["request_counts"]["total"]) if i not in done]
        for ok, purpose, key in ((True, "batch_output", "output_file_id"), (False, "batch_error", "error_file_id")):
            lines = [line for _, line, good in results if good is ok] + ([] if ok else unanswered)
            if lines:
                content = ("\n".join(lines) + "\n").encode()
                meta = new_file(content, f"{b['id']}_{'output' if ok else 'error'}.jsonl", purpose,
                                b.get("owner", ANONYMOUS))
                self.store.put_file(meta, content)
                files[key] = meta["id"]
        self.store.update_batch(b["id"], {**files, "status": final, f"{final}_at": int(time.time())})
        return len(results)

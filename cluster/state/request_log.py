"""Per-request records in a bounded Redis stream, for ``pdserve requests tail [--follow]``.

Each record is one stream entry whose field values are JSON, so numbers, lists and nested
dicts come back as they went in. The stream is trimmed approximately (``MAXLEN ~``) on every
append, which keeps it near ``maxlen`` entries at no extra cost. An append retried after a
dropped connection may be stored twice; readers of a log can live with that.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import redis

from pdserve.cluster.state.redis_server import connect

_MIN_BLOCK_MS = 10


class RequestLog:
    """Append-only log of finished requests' records, newest kept, oldest trimmed."""

    def __init__(
        self,
        client_or_url: redis.Redis | str,
        stream: str = "pdserve:requests",
        maxlen: int = 10000,
    ) -> None:
        if not stream:
            raise ValueError("stream name must be non-empty")
        if maxlen < 1:
            raise ValueError(f"maxlen must be >= 1, got {maxlen}")
        self.client = connect(client_or_url)
        self.stream = stream
        self.maxlen = maxlen

    def append(self, record: dict[str, object]) -> str:
        """Add one record; returns its stream id. Values must be JSON-serialisable."""
        if not record:
            raise ValueError("a request record needs at least one field")
        fields = {str(k): json.dumps(v, separators=(",", ":")) for k, v in record.items()}
        entry_id = self.client.xadd(self.stream, fields, maxlen=self.maxlen, approximate=True)
        return entry_id.decode()

    def __len__(self) -> int:
        return int(self.client.xlen(self.stream))

    def tail(self, count: int = 20) -> list[dict[str, object]]:
        """The newest ``count`` records, oldest first."""
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        newest_first = self.client.xrevrange(self.stream, count=count)
        return [_decode(fields) for _, fields in reversed(newest_first)]

    def follow(
        self, block_ms: int = 1000, *, from_start: bool = False, max_idle_s: float | None = None
    ) -> Iterator[dict[str, object]]:
        """Iterate over records appended after this call (all records with ``from_start``).

        Runs until the caller stops iterating, or until no record arrived for ``max_idle_s``.
        Each blocking read lasts at most ``block_ms`` and stays under the client's socket
        timeout, so a quiet stream is not mistaken for a dead connection.
        """
        if block_ms < _MIN_BLOCK_MS:
            raise ValueError(f"block_ms must be >= {_MIN_BLOCK_MS}, got {block_ms}")
        sock_timeout = self.client.connection_pool.connection_kwargs.get("socket_timeout")
        if sock_timeout:
            block_ms = max(_MIN_BLOCK_MS, min(block_ms, int(sock_timeout * 1000 * 0.8)))
        start_id = b"0-0" if from_start else self._last_id()  # fixed now, not at first next()
        return self._follow(start_id, block_ms, max_idle_s)

    def _follow(
        self, last_id: bytes, block_ms: int, max_idle_s: float | None
    ) -> Iterator[dict[str, object]]:
        idle_since = time.monotonic()
        while max_idle_s is None or time.monotonic() - idle_since < max_idle_s:
            reply = self.client.xread({self.stream: last_id}, count=100, block=block_ms)
            for _, entries in reply or []:
                for entry_id, fields in entries:
                    last_id = entry_id
                    idle_since = time.monotonic()
                    yield _decode(fields)

    def _last_id(self) -> bytes:
        newest = self.client.xrevrange(self.stream, count=1)
        return newest[0][0] if newest else b"0-0"


def _decode(fields: dict[bytes, bytes]) -> dict[str, object]:
    return {k.decode(): json.loads(v) for k, v in fields.items()}

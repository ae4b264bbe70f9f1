"""A time limit on reading each HTTP request's line and headers (slow-loris clients).

aiohttp has no header-read timeout of its own: its keep-alive timer closes a connection that
completed no request head within ``keepalive_timeout`` (an hour by default in ``AppRunner``), so
a client that sends a header byte every few seconds holds its connection (and a file descriptor)
that long. ``HeaderDeadline`` wraps each connection's aiohttp protocol and closes the connection
when a head is not complete in time:

1. The connection opens: its first request's head must be complete within ``timeout_s``.
2. After a request is answered the connection may idle (aiohttp's keep-alive timer bounds that);
   the first byte of the next request starts a new ``timeout_s`` for its head.
3. The head is complete (aiohttp parsed it and has the request): the timer stops. Reading the
   body is bounded separately (``router.body_timeout_s``), answering by the request's deadline.
4. The timer fires while aiohttp still waits for the head: the connection is closed, and the
   count of such closes goes up (``closed_total``).

Whether aiohttp waits for a head is read from its protocol's waiter (the future its request
loop awaits between requests); the integration tests check this against the aiohttp in use.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

logger = logging.getLogger(__name__)


class HeaderDeadlineStats:
    """Counts shared by all connections of one server."""

    def __init__(self) -> None:
        self.closed_total = 0


class HeaderDeadline(asyncio.Protocol):
    """One connection: forwards everything to aiohttp's protocol, and closes the connection when
    a request head takes longer than ``timeout_s``."""

    def __init__(self, inner: asyncio.Protocol, timeout_s: float, stats: HeaderDeadlineStats) -> None:
        self._inner = inner
        self._timeout_s = timeout_s
        self._stats = stats
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None

    # ----------------------------------------------------------- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        self._inner.connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        self._inner.data_received(data)
        if not self._awaiting_head():
            self._disarm()      # the head is complete (or a request is being handled)
        elif self._timer is None and data:
            self._arm()         # the first bytes of a new request's head

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._transport = None
        self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    # ----------------------------------------------------------------- inside
    def _awaiting_head(self) -> bool:
        """aiohttp's request loop waits for the next request's head (none is complete yet)."""
        waiter = getattr(self._inner, "_waiter", None)
        return waiter is not None and not waiter.done()

    def _arm(self) -> None:
        self._disarm()
        self._timer = asyncio.get_running_loop().call_later(self._timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self) -> None:
        self._timer = None
        if self._transport is None or not self._awaiting_head():
            return  # the head came in time (a request is being handled, or the loop is just starting)
        self._stats.closed_total += 1
        peer = self._transport.get_extra_info("peername")
        logger.debug("closing the connection from %s: no complete request head within %g s", peer, self._timeout_s)
        self._transport.close()


def with_header_deadline(factory: Callable[[], asyncio.Protocol], timeout_s: float,
                         stats: HeaderDeadlineStats) -> Callable[[], asyncio.Protocol]:
    """A protocol factory for ``loop.create_server``: ``factory``'s protocols, each in a ``HeaderDeadline``."""
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    return lambda: HeaderDeadline(factory(), timeout_s, stats)

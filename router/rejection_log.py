"""One log line per refused request, never a traceback, and never a flood.

A client can send malformed requests as fast as the server answers them; each is worth one
INFO line (what was refused and why), but a burst must not fill the disk. ``RejectionLog``
writes at most ``burst`` lines per ``window_s`` and then one line counting what it skipped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

MAX_MESSAGE_CHARS = 200


class RejectionLog:
    def __init__(self, logger: logging.Logger, *, burst: int = 20, window_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._logger = logger
        self._burst = burst
        self._window_s = window_s
        self._clock = clock
        self._window_start = clock()
        self._written = 0
        self._skipped = 0

    def refused(self, what: str, status: int, message: str) -> bool:
        """Log ``what`` (e.g. "POST /v1/completions") refused with ``status``; False if skipped."""
        now = self._clock()
        if now - self._window_start >= self._window_s:
            if self._skipped:
                self._logger.info("%d more refused requests not logged in the last %.0f s",
                                  self._skipped, now - self._window_start)
            self._window_start, self._written, self._skipped = now, 0, 0
        if self._written >= self._burst:
            self._skipped += 1
            return False
        self._written += 1
        short = message if len(message) <= MAX_MESSAGE_CHARS else message[:MAX_MESSAGE_CHARS] + "..."
        self._logger.info("refused %s: %d %s", what, status, short.replace("\n", " "))
        return True

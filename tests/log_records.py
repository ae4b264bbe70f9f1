"""A logging handler that keeps every record, from any thread (tests that check what a server logs)."""

from __future__ import annotations

import logging


class LogRecords(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def tracebacks(self) -> list[str]:
        """The start of each record that carries a traceback."""
        return [r.getMessage()[:200] for r in self.records if r.exc_info or "Traceback" in r.getMessage()]

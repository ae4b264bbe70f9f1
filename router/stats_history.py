"""A worker's recent stats reports, kept where they are polled: the one owner of "what its
counters said a while ago", from which every reader takes its rates.

1. The worker pool polls a worker's ``stats()`` (every 0.25 s) and ``add``s the report with the
   wall time it arrived.
2. A reader that wants a rate over its own window (the status page: since its previous call; the
   planner: since its previous pass) asks ``since(t)``: the newest report taken at or before
   ``t`` and the latest one, as a ``Progress``. The reader keeps only when it last read (one
   time, not a copy of each worker's counters).
3. Reports older than ``horizon_s`` are dropped, except the newest of them, so that every window
   up to ``horizon_s`` long starts on a report taken at or before it; a longer window starts on
   that oldest report.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.engine.contract import WorkerStats

HORIZON_S = 60.0   # how far back the reports reach (a window longer than this is shortened to it)


@dataclass(frozen=True, slots=True)
class Progress:
    """What a worker's counters gained between two of its reports, ``span_s`` seconds apart."""

    span_s: float
    earlier: WorkerStats
    latest: WorkerStats

    def per_s(self, counter: Callable[[WorkerStats], float]) -> float:
        """``counter``'s gain per second (never below 0: a restarted worker's counters went back)."""
        return max(0.0, (counter(self.latest) - counter(self.earlier)) / self.span_s)

    def gained(self, counter: Callable[[WorkerStats], float]) -> float:
        return counter(self.latest) - counter(self.earlier)


class StatsHistory:
    def __init__(self, horizon_s: float = HORIZON_S) -> None:
        if horizon_s <= 0:
            raise ValueError(f"horizon_s must be > 0, got {horizon_s}")
        self.horizon_s = horizon_s
        self._reports: deque[tuple[float, WorkerStats]] = deque()
        self._dropped = False   # reports older than the first kept one existed

    def add(self, at: float, stats: WorkerStats) -> None:
        """A report that arrived at wall time ``at`` (reports arrive in time order)."""
        self._reports.append((at, stats))
        while len(self._reports) > 1 and self._reports[1][0] <= at - self.horizon_s:
            self._reports.popleft()
            self._dropped = True

    def since(self, at: float) -> Progress | None:
        """From the newest report taken at or before ``at`` (the oldest kept, if ``at`` lies
        further back than ``horizon_s``) to the latest; None when no report is that old or the
        latest is no newer."""
        if not self._reports or (self._reports[0][0] > at and not self._dropped):
            return None
        earlier = self._reports[0]
        for report in self._reports:
            if report[0] > at:
                break
            earlier = report
        latest = self._reports[-1]
        if latest[0] <= earlier[0]:
            return None
        return Progress(latest[0] - earlier[0], earlier[1], latest[1])

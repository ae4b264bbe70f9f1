"""Distinct CPU cores for the workers of one host (as two GPUs are never shared).

Life of a claim:
1. A worker process, before it builds its engine, asks for ``n`` cores (its Ray ``num_cpus``,
   rounded down, or ``engine.num_threads``), clamped to the cores it may run on at all.
2. Under an exclusive lock (``filelock``: ``flock`` underneath) on ``<dir>/pdserve-cores.lock`` (``/tmp`` by default: one file
   per host, since Ray's workers of one node share it), the allocator reads the table
   ``core -> owner pid``, drops owners that are no longer alive (a crashed worker frees its cores
   by dying), and takes the ``n`` lowest free cores.
3. If fewer than ``n`` are free, nothing is claimed and the worker runs unpinned (logged): an
   oversubscribed host (a test advertising 8 Ray CPUs on 2 cores) still works.
4. The worker pins itself (``os.sched_setaffinity``); its engine computes on ``n`` threads.
5. ``release`` (worker shutdown) or the process's death gives the cores back.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from filelock import FileLock

from pdserve.cluster.pids import pid_alive
from pdserve.engine.contract import WorkerStats

logger = logging.getLogger(__name__)

TABLE = "pdserve-cores.json"
LOCK = "pdserve-cores.lock"


@dataclass(frozen=True, slots=True)
class CorePlacement:
    threads: int
    cores: tuple[int, ...]    # () = not pinned
    reason: str               # why it is (not) pinned, for status and logs

    def stamp(self, stats: WorkerStats) -> WorkerStats:
        """``stats`` with these cores and why; the thread count is reported by the engine itself
        (what torch uses)."""
        return replace(stats, cores=list(self.cores), pinning=self.reason)


def wanted_threads(num_cpus: float, num_threads: int | None, usable: int) -> int:
    """``num_threads`` when set, else the Ray CPUs rounded down; at least 1, at most ``usable``."""
    want = num_threads if num_threads is not None else int(num_cpus)
    return max(1, min(want, usable))


class CoreAllocator:
    def __init__(self, directory: Path | None = None) -> None:
        self.dir = directory or Path(os.environ.get("PDSERVE_CORE_DIR", "/tmp"))

    @contextlib.contextmanager
    def _table(self) -> Iterator[dict[str, int]]:
        with FileLock(self.dir / LOCK, mode=0o666):
            path = self.dir / TABLE
            try:
                table = {k: int(v) for k, v in json.loads(path.read_text()).items()}
            except (FileNotFoundError, ValueError, AttributeError):
                table = {}
            table = {core: pid for core, pid in table.items() if pid_alive(pid)}
            yield table
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(table, sort_keys=True))
            os.replace(tmp, path)

    def claim(self, n: int, usable: set[int], pid: int | None = None) -> tuple[int, ...]:
        """``n`` free cores of ``usable`` for ``pid`` (this process), or () when too few are free."""
        pid = pid or os.getpid()
        with self._table() as table:
            free = sorted(c for c in usable if str(c) not in table or table[str(c)] == pid)
            if len(free) < n:
                return ()
            cores = tuple(free[:n])
            table.update({str(c): pid for c in cores})
        return cores

    def release(self, pid: int | None = None) -> None:
        pid = pid or os.getpid()
        with self._table() as table:
            for core in [c for c, owner in table.items() if owner == pid]:
                del table[core]


def place_this_process(num_cpus: float, num_threads: int | None,
                       allocator: CoreAllocator | None = None) -> CorePlacement:
    """Claim cores for this process and pin it (steps 1-4); the engine is then built with
    ``placement.threads`` threads."""
    usable = os.sched_getaffinity(0)
    threads = wanted_threads(num_cpus, num_threads, len(usable))
    try:
        cores = (allocator or CoreAllocator()).claim(threads, usable)
    except OSError as exc:
        cores, why = (), f"core table unavailable ({exc})"
    else:
        why = "pinned" if cores else f"fewer than {threads} free cores on this host"
    if cores:
        os.sched_setaffinity(0, cores)
    else:
        logger.warning("worker not pinned to cores: %s", why)
    # Ray sets OMP_NUM_THREADS=1 for a 1-CPU actor; the engine's own count wins.
    os.environ["OMP_NUM_THREADS"] = str(threads)
    placement = CorePlacement(threads, cores, why)
    logger.info("worker computes on %d thread(s), cores %s", threads, list(cores) or "unpinned")
    return placement


class CorePinning:
    """A worker process's pinning policy: claim distinct cores of its host at start (``claim``),
    give them back when it stops (``release``)."""

    def __init__(self, placement: CorePlacement, allocator: CoreAllocator | None = None) -> None:
        self.placement = placement
        self._allocator = allocator or CoreAllocator()

    @classmethod
    def claim(cls, num_cpus: float, num_threads: int | None, allocator: CoreAllocator | None = None) -> CorePinning:
        allocator = allocator or CoreAllocator()
        return cls(place_this_process(num_cpus, num_threads, allocator), allocator)

    def release(self) -> None:
        self._allocator.release()

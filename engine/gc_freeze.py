"""Keep a serving process's start-up heap out of Python's full garbage collections.

A worker's heap after start-up is large and lives as long as the process: the model's modules and
parameters, the tokenizer, Ray's and gRPC's objects. A full (generation 2) collection walks all of
it, and every thread of the process waits meanwhile: one took 190 ms in ``pdserve bench batch``,
and an interactive request that arrived then waited for it. ``gc.freeze()`` moves what exists now
into a permanent generation that collections skip; objects made later are collected as before, and
frozen objects that lose their last reference are still freed by reference counting (only cycles
among them stay until the process ends). For a process that holds one engine for its whole life;
not for a process that builds and drops engines (a test session).
"""

from __future__ import annotations

import gc
import logging
import time

logger = logging.getLogger(__name__)


def freeze_startup_heap(what: str) -> int:
    """Collect once, then freeze every object that survives; returns how many were frozen."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info("%s: %d start-up objects frozen out of garbage collection (%.0f ms)", what, frozen,
                (time.perf_counter() - t0) * 1000)
    return frozen

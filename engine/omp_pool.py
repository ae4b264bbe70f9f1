"""Run an engine's one-off heavy work (model load, kernel timing, warm-up) on a thread that then exits.

Why: torch's CPU build uses GNU OpenMP (libgomp), which keeps a pool of worker threads for every
thread that has opened a parallel region, for as long as that thread lives. libgomp counts the
threads of every pool together, and once they outnumber the CPUs the process may use, its
workers stop spinning between parallel regions and sleep on a futex instead ("throttled spin").
A decode step opens several parallel regions per layer, so every region then pays a sleep and a
wake-up. That is exactly the shape of a worker: its actor thread loads and warms the model (one
pool), then ``EngineLoop``'s thread steps it (a second pool). On 2 cores with 2 threads per pool,
decode steps of the `small` model took 40-45 ms instead of 23-27 ms, and the OpenMP worker slept
~350 times a step.

A pool dies with the thread that owns it, so work done on a short-lived thread leaves none behind:
the thread that steps the engine later owns the only live pool.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def on_fresh_thread(fn: Callable[[], T], name: str = "engine-setup") -> T:
    """Call ``fn`` on a new thread, wait for it to exit, and return its result (or raise what it raised)."""
    result: list[T] = []
    error: list[BaseException] = []

    def body() -> None:
        try:
            result.append(fn())
        except BaseException as exc:  # handed to the caller
            error.append(exc)

    thread = threading.Thread(target=body, name=name, daemon=True)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]

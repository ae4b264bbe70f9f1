"""Runs one engine's step loop on its own thread; every other thread talks to it by commands.

The engine is not thread-safe, so exactly one thread touches it: this loop. Callers ``submit``
a function that runs on the loop thread between two steps and get a ``Future`` for its result.
After each step the loop hands the step's outputs to ``on_outputs``; ``on_tick`` runs once per
iteration (busy or idle) for work that must be polled, such as KV transfers.

Starting a loop shortens the process's GIL switch interval to ``SWITCH_INTERVAL_S`` (Python's
default is 5 ms). The loop thread shares the GIL with the process's serving threads (an event
loop streaming tokens, Redis calls, Ray's and gRPC's callbacks): a thread that wants the GIL while
another runs Python code waits up to one interval for it. At 5 ms that is a tenth of a prefill
step here, paid by an interactive request's first token whenever a busy neighbour holds the GIL;
``pdserve bench batch`` measured it (docs/benchmarks.md, Batch API).
"""

from __future__ import annotations

import logging
import sys
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from pdserve.engine.llm_engine import LLMEngine, StepOutput

logger = logging.getLogger(__name__)

T = TypeVar("T")

SWITCH_INTERVAL_S = 0.0005  # the longest a thread holds the GIL while another waits for it


class EngineLoop:
    def __init__(
        self,
        engine: LLMEngine,
        on_outputs: Callable[[list[StepOutput]], None],
        on_tick: Callable[[], bool] | None = None,
        *,
        idle_wait_s: float = 0.05,
        busy_tick_wait_s: float = 0.0005,
        name: str = "engine-loop",
    ) -> None:
        """``on_tick`` returns True while it has work in flight (the loop then polls it often)."""
        self.engine = engine
        self._on_outputs = on_outputs
        self._on_tick = on_tick
        self._idle_wait_s = idle_wait_s
        self._busy_tick_wait_s = busy_tick_wait_s
        self._commands: deque[tuple[Callable[[LLMEngine], object], Future]] = deque()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.last_error: BaseException | None = None

    def start(self) -> None:
        if sys.getswitchinterval() > SWITCH_INTERVAL_S:
            sys.setswitchinterval(SWITCH_INTERVAL_S)
            logger.info("GIL switch interval set to %.1f ms for the engine loop", SWITCH_INTERVAL_S * 1000)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, fn: Callable[[LLMEngine], T], *, urgent: bool = False) -> Future[T]:
        """Run ``fn(engine)`` on the loop thread before the next step. ``urgent`` (it adds an
        interactive request): a step running only batch-priority work is cut short for it
        (``LLMEngine.interrupt``), so the command runs within a layer's time, not a step's."""
        fut: Future[T] = Future()
        if self._stop.is_set():
            fut.set_exception(RuntimeError("the engine loop is stopped"))
            return fut
        self._commands.append((fn, fut))
        if urgent:
            self.engine.interrupt.set()
        self._wake.set()
        return fut

    def call(self, fn: Callable[[LLMEngine], T], timeout_s: float | None = 30.0, *, urgent: bool = False) -> T:
        """``submit`` and wait for the result (raises what ``fn`` raised)."""
        return self.submit(fn, urgent=urgent).result(timeout=timeout_s)

    def wake(self) -> None:
        self._wake.set()

    # ------------------------------------------------------------------ loop
    def _run(self) -> None:
        logger.info("%s started", self._thread.name)
        while not self._stop.is_set():
            # Cleared before the commands run: an urgent command queued from now on interrupts the
            # next step; one queued before runs first anyway.
            self.engine.interrupt.clear()
            self._run_commands()
            ticking = self._tick()
            if self.engine.has_unfinished():
                self._step()
                continue
            self._wake.wait(self._busy_tick_wait_s if ticking else self._idle_wait_s)
            self._wake.clear()
        # Fail whatever is still queued so no caller waits forever.
        while self._commands:
            _fn, fut = self._commands.popleft()
            fut.set_exception(RuntimeError("the engine loop stopped"))
        logger.info("%s stopped", self._thread.name)

    def _run_commands(self) -> None:
        while self._commands:
            fn, fut = self._commands.popleft()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(self.engine))
            except BaseException as exc:  # handed to the caller, who decides
                fut.set_exception(exc)

    def _tick(self) -> bool:
        if self._on_tick is None:
            return False
        try:
            return bool(self._on_tick())
        except Exception:
            logger.exception("%s: on_tick failed", self._thread.name)
            return False

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            # A failed forward pass must not strand requests: fail them all, explicitly.
            logger.exception("%s: engine step failed; failing every request in flight", self._thread.name)
            self.last_error = exc
            outputs = self.engine.fail_all(f"engine step failed: {exc}")
        if outputs:
            try:
                self._on_outputs(outputs)
            except Exception:
                logger.exception("%s: on_outputs failed", self._thread.name)

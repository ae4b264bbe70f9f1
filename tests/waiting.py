"""The one polling helper of the integration tests."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str = "condition",
               interval_s: float = 0.05) -> None:
    """Poll ``predicate`` every ``interval_s`` until it is true; ``TimeoutError`` naming ``what``
    after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what}: not reached within {timeout_s:.1f} s")
        time.sleep(interval_s)

"""Who hears of a request's end: the one seam the router's metrics and the request log hang on.

``Serving`` builds one ``RequestRecord`` (``engine/contract.py``) per request it accepted or
refused, when that request is over, and hands it to each observer in turn: the router's own
``/metrics`` text (``router/metrics_text.py``) always, and in a cluster the Ray metrics and the
Redis request log (``cluster/head/router_service.py``). An observer that raises is logged and harms
neither the request nor the other observers.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from pdserve.engine.contract import RequestRecord

logger = logging.getLogger(__name__)


@runtime_checkable
class RequestObserver(Protocol):
    def request_ended(self, record: RequestRecord) -> None:
        """Called once per request, on the router's event loop; must not block."""


def tell_all(observers: Sequence[RequestObserver], record: RequestRecord) -> None:
    for observer in observers:
        try:
            observer.request_ended(record)
        except Exception:
            logger.exception("request observer %s failed", type(observer).__name__)

"""Optional C++ kernels of the engine (``torch.ops.pdserve.*``), built ahead of time by ``make setup``.

``load()`` loads the library built for this host once per process and says whether it is usable;
when it is not (never built, no compiler, a failed build) it logs one line and the engine keeps
its torch paths. Nothing is compiled at run time: ``python -m pdserve.engine.kernels.build`` does.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class KernelStatus:
    available: bool
    reason: str   # the library's path when available, otherwise why not


@functools.cache
def load() -> KernelStatus:
    """Load the kernel library once; never raises."""
    import torch

    from pdserve.engine.kernels.build import library_path

    try:
        path = library_path()
    except OSError as exc:  # sources unreadable (a broken install)
        status = KernelStatus(False, f"kernel sources unreadable: {exc}")
    else:
        if not path.exists():
            status = KernelStatus(False, f"{path} not built (run `make setup` or "
                                         "`python -m pdserve.engine.kernels.build`)")
        else:
            try:
                torch.ops.load_library(str(path))
                status = KernelStatus(True, str(path))
            except (OSError, RuntimeError) as exc:
                status = KernelStatus(False, f"{path} failed to load: {exc}")
    if not status.available:
        logger.warning("pdserve C++ kernels unavailable, using torch attention: %s", status.reason)
    return status

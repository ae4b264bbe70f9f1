"""Keeping a local Ray on the loopback interface.

Ray replaces a node IP of 127.0.0.1 with the host's routable address unless its "local-only
cluster" switch is on; that switch is read from the environment when ``ray`` is first imported.
Call ``use_loopback()`` before importing ray (the CLI, the tests and the demo do).
"""

from __future__ import annotations

import os
import sys

LOOPBACK_IP = "127.0.0.1"
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}


def use_loopback() -> None:
    """Make a local Ray (and every process it starts) use 127.0.0.1 as its node IP."""
    for key, value in LOOPBACK_ENV.items():
        os.environ.setdefault(key, value)
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:  # ray already imported: the switch was read; set it directly
        constants.ENABLE_RAY_CLUSTER = os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] not in ("0", "false")


def use_routable() -> None:
    """Undo ``use_loopback`` for a process that joins a multi-host Ray cluster (KubeRay): there
    the node IP must be the host's routable address, as Ray chooses it."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "1"
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:
        constants.ENABLE_RAY_CLUSTER = True

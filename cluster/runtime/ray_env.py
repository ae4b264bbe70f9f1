"""Keeping a local Ray on the loopback interface.

Ray replaces a node IP of 127.0.0.1 with the host's routable address unless its "local-only
cluster" switch is on; that switch is read from the environment when ``ray`` is first imported.
Call ``use_loopback()`` before importing ray (the CLI, the tests and the demo do).

Both calls also keep Ray's worker processes at normal CPU priority: the raylet starts workers
with niceness 15 unless ``RAY_worker_niceness`` says otherwise, which suits batch jobs but not
serving. pdserve's workers are the serving path; at niceness 15 every other process on the host
(the router, a client, a noisy neighbour) takes the cores first, and on a loaded 2-core host a
worker took 290 s to start instead of 8 s. The variable must be set before Ray starts (the
raylet reads it); the KubeRay manifests set it on every pod.
"""

from __future__ import annotations

import os
import sys

LOOPBACK_IP = "127.0.0.1"
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
SERVING_ENV = {"RAY_worker_niceness": "0"}


def use_serving_priority() -> None:
    """Workers Ray starts from now on run at niceness 0, like the router (an operator's own
    ``RAY_worker_niceness`` wins)."""
    for key, value in SERVING_ENV.items():
        os.environ.setdefault(key, value)


def use_loopback() -> None:
    """Make a local Ray (and every process it starts) use 127.0.0.1 as its node IP."""
    use_serving_priority()
    for key, value in LOOPBACK_ENV.items():
        os.environ.setdefault(key, value)
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:  # ray already imported: the switch was read; set it directly
        constants.ENABLE_RAY_CLUSTER = os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] not in ("0", "false")


def use_routable() -> None:
    """Undo ``use_loopback`` for a process that joins a multi-host Ray cluster (KubeRay): there
    the node IP must be the host's routable address, as Ray chooses it."""
    use_serving_priority()
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "1"
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:
        constants.ENABLE_RAY_CLUSTER = True


def use_token_auth_if_available() -> bool:
    """Before ``ray.init(address=...)`` joins a running cluster: Ray 2.60 turns its token
    authentication on by itself only for a cluster it finds on its own (``address`` None or
    "auto"), so a process joining at an explicit address (``pdserve router``, a head with
    ``ray.address``) would present no token to a cluster that wants one. With a token at hand
    (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` or ~/.ray/auth_token) and no ``RAY_AUTH_MODE``
    chosen by the operator, ask for token mode; True when token mode is on."""
    from pathlib import Path

    mode = os.environ.get("RAY_AUTH_MODE")
    if mode is not None:
        return mode.lower() == "token"
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    if os.environ.get("RAY_AUTH_TOKEN") or path.is_file():
        os.environ["RAY_AUTH_MODE"] = "token"
        return True
    return False

"""A Ray Serve ingress beside the router actors, for ``pdserve bench router --routers N --ingress
actors,serve``: what Ray Serve's own path costs a streamed token.

Issue 18 asked whether several routers should be Ray actors with their own HTTP servers (what
``router.replicas`` runs) or a Ray Serve ingress deployment. This measures the lower bound of the
second: a Serve deployment of ``N`` replicas that does nothing but stream the tokens, the same
OpenAI completion chunks at the same pace as the synthetic workers emit them (one per
``step_s``), with no routing, no worker call, no tokenizer. Serve's HTTP proxy actor takes the
request and relays every chunk from the replica as a streamed Ray object, so its CPU a token is
what any router inside Serve would pay before doing any work of its own; the router actors' CPU a
token (measured by the same client, in the same run) includes all of theirs.

Ray Serve is not one of pdserve's dependencies: ``pip install "ray[serve]==<the installed ray>"``
into the venv first (the benchmark says so when it is missing).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from pathlib import Path

APP_NAME = "pdserve-bench-ingress"
# the Serve processes, by the titles Ray gives its actors' processes
_TITLES = {"serve_replicas": "ServeReplica", "serve_proxy": "ProxyActor", "serve_controller": "ServeController"}


def serve_available() -> str | None:
    """None when Ray Serve can be imported here, else what to install."""
    import ray

    try:
        from ray import serve  # noqa: F401
        from starlette.responses import StreamingResponse  # noqa: F401
    except ImportError:
        return (f"Ray Serve is not installed: .venv/bin/pip install \"ray[serve]=={ray.__version__}\" "
                "(pdserve does not need it; only this comparison does)")
    return None


class SyntheticStreamIngress:
    """The Serve deployment: a completion stream of ``max_tokens`` chunks, one every ``step_s``."""

    def __init__(self, model: str, step_s: float) -> None:
        self.model = model
        self.step_s = step_s

    async def __call__(self, request):
        from starlette.responses import JSONResponse, StreamingResponse

        try:
            body = await request.json()
            n = int(body["max_tokens"])
        except (ValueError, KeyError, TypeError):
            return JSONResponse({"error": {"message": "a JSON body with max_tokens", "type": "invalid_request_error"}},
                                status_code=400)
        rid, created, model, step_s = f"cmpl-{os.urandom(8).hex()}", int(time.time()), self.model, self.step_s

        def event(text: str, finish: str | None) -> str:
            chunk = {"id": rid, "object": "text_completion", "created": created, "model": model,
                     "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}
            return f"data: {json.dumps(chunk)}\n\n"

        async def stream():
            for i in range(n):
                await asyncio.sleep(step_s)
                yield event(f" t{i % 251}", None)
            yield event("", "length")
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_pids() -> dict[str, list[int]]:
    """The Serve processes on this host, from their process titles (``/proc/PID/cmdline``)."""
    out: dict[str, list[int]] = {k: [] for k in _TITLES}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            title = (entry / "cmdline").read_bytes().split(b"\0", 1)[0].decode(errors="replace")
        except OSError:
            continue
        if not title.startswith("ray::"):
            continue
        for key, marker in _TITLES.items():
            if marker in title:
                out[key].append(int(entry.name))
    return out


class ServeIngress:
    """Ray Serve on this Ray (its HTTP proxy on 127.0.0.1), the deployment at ``replicas``."""

    def __init__(self, model: str, step_s: float, streams: int) -> None:
        self.model, self.step_s, self.streams = model, step_s, streams
        self.port = 0

    def __enter__(self) -> ServeIngress:
        from ray import serve

        self.port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": self.port}, proxy_location="HeadOnly")
        return self

    def deploy(self, replicas: int) -> str:
        """The deployment at ``replicas`` replicas, each taking every stream the client opens; its URL."""
        from ray import serve

        app = serve.deployment(SyntheticStreamIngress, name="ingress", num_replicas=replicas,
                               max_ongoing_requests=2 * self.streams, ray_actor_options={"num_cpus": 0})
        serve.run(app.bind(self.model, self.step_s), name=APP_NAME, route_prefix="/", blocking=False)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            status = serve.status().applications.get(APP_NAME)
            if status is not None and str(status.status).endswith("RUNNING"):
                break
            time.sleep(0.25)
        else:
            raise RuntimeError(f"Ray Serve did not run the ingress at {replicas} replicas within 120 s")
        return f"http://127.0.0.1:{self.port}"

    def undeploy(self) -> None:
        from ray import serve

        serve.delete(APP_NAME)

    def __exit__(self, *exc: object) -> None:
        from ray import serve

        serve.shutdown()

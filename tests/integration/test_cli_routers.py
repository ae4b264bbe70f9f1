"""Several routers on one cluster, as an operator runs them: ``pdserve up`` with an elected
control plane and ``router.replicas: 2`` (the head's router and a router actor), then
``pdserve router`` joining it (the head's Ray and Redis, found from the state directory), all
three serving the same workers; ``status`` lists the routers and which one leads; the joined
router leaves on SIGTERM and the others serve on; ``down`` stops everything."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from test_cli_ops import GEN, PROMPT, SETTINGS, _pdserve_argv, http_json, overrides, pdserve, state_dir  # noqa: F401

from scripts import procs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

UP_TIMEOUT_S = 240
ELECTED = {**SETTINGS, "control_plane.election": "true", "control_plane.lease_s": 3}
REPLICAS = {**ELECTED, "router.replicas": 2}


def complete(base_url: str, model: str) -> dict:
    body = {"model": model, "prompt": PROMPT, "max_tokens": GEN, "temperature": 0, "ignore_eos": True}
    return http_json(base_url + "/v1/completions", body)


def test_router_refuses_without_an_elected_control_plane(state_dir: Path, tiny_model: Path) -> None:
    out = pdserve(state_dir, "router", "--model", str(tiny_model), *overrides(SETTINGS))
    assert out.returncode != 0
    assert "control_plane.election" in out.stderr, out.stderr


def test_a_second_router_joins_serves_and_leaves(state_dir: Path, tiny_model: Path) -> None:
    up = pdserve(state_dir, "up", "--model", str(tiny_model), *overrides(REPLICAS), "--timeout", str(UP_TIMEOUT_S),
                 timeout_s=UP_TIMEOUT_S + 30)
    log = (state_dir / "head.log").read_text(errors="replace") if (state_dir / "head.log").exists() else ""
    assert up.returncode == 0, f"{up.stdout}\n{up.stderr}\n--- head.log ---\n{log[-4000:]}"
    state = json.loads((state_dir / "state.json").read_text())
    head_tree = procs.descendants(state["pid"])
    assert [r["http"] for r in state["routers"]][0] == state["http"] and len(state["routers"]) == 2
    actor_http = state["routers"][1]["http"]
    assert actor_http.startswith("http://127.0.0.1:") and actor_http in up.stdout
    env = dict(os.environ, PDSERVE_STATE_DIR=str(state_dir), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    router = subprocess.Popen([*_pdserve_argv(), "router", "--model", str(tiny_model), *overrides(ELECTED)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.append(router.stdout.readline()), daemon=True)
        reader.start()
        reader.join(120)
        if not lines or "is up" not in lines[0]:
            router.kill()
            raise AssertionError(f"router did not come up: {lines} rc {router.wait(10)}\n{router.stderr.read()[-4000:]}")
        http = lines[0].split("HTTP ")[1].split()[0]
        assert http.startswith("http://127.0.0.1:") and http != state["http"]
        assert "follows the control plane" in lines[0]

        # the three routers serve the same workers, token for token. The prompt is cached first:
        # in bf16 a prompt prefilled after its cached blocks need not give the same greedy tokens
        # as one prefilled whole (random weights, near-tied logits; seen on an AMX host), so
        # every compared request finds the same cache
        cold = complete(state["http"], state["model"])
        via_router, via_head = complete(http, state["model"]), complete(state["http"], state["model"])
        via_actor = complete(actor_http, state["model"])
        assert via_router["choices"][0]["text"] == via_head["choices"][0]["text"] == via_actor["choices"][0]["text"], \
            f"cold {cold['choices'][0]['text']!r}"
        assert via_router["pdserve"]["phase"]["decode_worker"] == via_head["pdserve"]["phase"]["decode_worker"] \
            == via_actor["pdserve"]["phase"]["decode_worker"]

        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            status = json.loads(pdserve(state_dir, "status", "--json").stdout)
            routers = (status.get("control_plane") or {}).get("routers", [])
            if len(routers) == 3:
                break
            time.sleep(0.5)
        assert len(routers) == 3, status.get("control_plane")
        assert sorted(r["leader"] for r in routers) == [False, False, True]
        assert {r["http"] for r in routers} == {http, state["http"], actor_http}
        text = pdserve(state_dir, "status").stdout
        assert "control plane: elected" in text and text.count("\nrouter ") == 3, text

        router.send_signal(signal.SIGTERM)
        assert router.wait(60) == 0, router.stderr.read()[-3000:]
        # the head (the leader) and the router actor serve on, with the same workers
        for url in (state["http"], actor_http):
            assert complete(url, state["model"])["choices"][0]["text"] == via_head["choices"][0]["text"]
    finally:
        if router.poll() is None:
            router.kill()
    down = pdserve(state_dir, "down", timeout_s=150)
    assert down.returncode == 0 and "pdserve is down" in down.stdout, down.stdout + down.stderr
    left = procs.wait_gone(head_tree, 20.0)
    assert not left, f"processes of the head still running: {procs.describe(left)}"

"""Pools placed by Ray custom resources on a three-node Ray cluster (all on 127.0.0.1).

``tests/scripts/multinode_run.py`` runs in its own process (its Ray must not meet the test
session's): a head node without pool resources, a node with ``{prefill: 1}`` and a node with
``{decode: 1}``, and a ``RouterService`` whose pools ask for those resources. It reports where
each pool's actor runs, what a few greedy completions returned over HTTP (prefilled on one
node, KV moved over NIXL into a process of the other) and what the engine alone returns.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from scripts import procs

# `make test-all` only: test_netns_hosts places the pools by the same custom resources on three
# Ray nodes (each in a network namespace, KV over TCP), and runs in `make test` where namespaces exist
pytestmark = [pytest.mark.timeout(360), pytest.mark.long]

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "multinode_run.py"
RUN_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def result(tiny_model) -> dict:
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen([sys.executable, str(SCRIPT), str(tiny_model)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=env, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate(timeout=30)
        pytest.fail(f"the multi-node run did not finish in {RUN_TIMEOUT_S} s:\n{out[-4000:]}")
    finally:
        # Every process of the run (3 raylets, GCS, workers, Redis) is gone once it has exited.
        left = procs.wait_gone(procs.in_session(proc.pid), 20.0)
        for pid, _ in left:
            os.kill(pid, 9)
    assert proc.returncode == 0, out[-4000:]
    assert not left, f"processes left running: {procs.describe(left)}"
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, out[-4000:]
    return json.loads(lines[0][len("RESULT "):])


def test_every_node_is_on_loopback(result: dict) -> None:
    nodes = result["nodes"]
    assert len(set(nodes.values())) == 3
    assert result["node_ips"] == ["127.0.0.1"]


def test_each_pool_runs_on_the_node_with_its_resource(result: dict) -> None:
    nodes = result["nodes"]
    assert result["placement"] == {"prefill": [nodes["prefill"]], "decode": [nodes["decode"]]}
    assert result["reported_nodes"] == result["placement"]  # and each worker reports its node


def test_requests_cross_the_nodes_token_identical_to_the_engine(result: dict) -> None:
    served = result["served"]
    assert [s["token_ids"] for s in served] == result["reference"]
    for s, prompt_tokens in zip(served, result["prompt_tokens"]):
        phase = s["phase"]
        assert phase["prefill_worker"].startswith("prefill-") and phase["decode_worker"].startswith("decode-")
        assert phase["kv_bytes"] > 0, phase  # the prompt's KV moved from one node to the other
        assert phase["prompt_tokens"] == prompt_tokens and phase["output_tokens"] == len(s["token_ids"])
        assert phase["attempts"] == 1 and phase["finish_reason"] == "length", phase


def test_nothing_is_held_or_left_running(result: dict) -> None:
    assert set(result["blocks_in_use"].values()) == {0}, result["blocks_in_use"]
    assert result["ledger_active"] == 0
    assert result["actors_after_stop"] == []

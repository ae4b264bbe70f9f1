"""`pdserve up` with a GPU config on a Ray cluster that has no GPU (these hosts have none).

Life cycle:

1. A config whose prefill pool reserves one GPU per replica (``num_gpus: 1``; the engine on CPU,
   which the loader accepts), written for this host's local Ray.
2. ``pdserve up -c cluster.yaml``: the head starts Ray, finds no GPU on it, and exits before any
   worker starts; ``up`` prints the reason in one line on stderr and exits 1.
3. ``pdserve up --foreground``: the same refusal is the last line of its stderr, exit code 2.
4. Nothing is left: no state file; the head's log ends at the refusal (the pools start after the
   pre-flight, in the router service).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

REFUSAL = ("pdserve: error: prefill.num_gpus: a replica needs 1 GPU, but the Ray cluster has no GPU (1 node, 2 CPUs) "
           "and no autoscaler group that adds one; run pdserve on a Ray cluster with GPUs, or set prefill.num_gpus: 0 "
           "and prefill.engine.device: cpu")


def _pdserve_argv() -> list[str]:
    script = Path(sys.executable).parent / "pdserve"
    return [str(script)] if script.exists() else [sys.executable, "-m", "pdserve.cli"]


def _env(state_dir: Path) -> dict[str, str]:
    return dict(os.environ, PDSERVE_STATE_DIR=str(state_dir), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
                HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", RAY_ADDRESS="127.0.0.1:9")


def _config(tmp_path: Path, tiny_model: Path) -> Path:
    config = {
        "model": {"path": str(tiny_model)},
        "prefill": {"num_gpus": 1, "num_cpus": 1, "engine": {"kv_cache_memory_gb": 0.03, "num_threads": 1}},
        "decode": {"num_cpus": 1, "engine": {"kv_cache_memory_gb": 0.03, "num_threads": 1}},
        "router": {"http_port": 0, "grpc_port": 0},
        "ray": {"include_dashboard": False, "num_cpus": 2},
    }
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_up_refuses_a_gpu_config_on_a_cluster_without_gpus_in_one_line(tiny_model: Path, tmp_path: Path) -> None:
    config = _config(tmp_path, tiny_model)
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    done = subprocess.run([*_pdserve_argv(), "up", "-c", str(config), "--timeout", "120"], env=_env(state_dir),
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.splitlines() == [REFUSAL], done.stderr
    # the head's log ends at the refusal: nothing after it started (the pools start after the pre-flight)
    log = (state_dir / "head.log").read_text().splitlines()
    assert log[-1] == REFUSAL and log[-2].endswith("GPU pre-flight: refused: " + REFUSAL.split("error: ", 1)[1]), log
    assert sorted(p.name for p in state_dir.iterdir()) == ["head.log"]   # no head.json, no state.json

    fg = subprocess.run([*_pdserve_argv(), "up", "-c", str(config), "--foreground"], env=_env(state_dir),
                        capture_output=True, text=True, timeout=180, start_new_session=True)
    assert fg.returncode == 2, fg.stdout + fg.stderr
    assert fg.stderr.splitlines()[-1] == REFUSAL and fg.stderr.count("pdserve: error:") == 1, fg.stderr
    assert "Traceback" not in fg.stderr
    assert sorted(p.name for p in state_dir.iterdir()) == ["head.log"]

"""``scripts/gpu_check_engine.py`` on a machine without CUDA and without ``--device``: one line,
nothing written, exit 0 (the GPU check's runner relies on all three)."""

from __future__ import annotations

import os
import subprocess
import sys

from gpu_machine_env import REPO


def test_without_cuda_it_says_it_skipped(tmp_path):
    out = tmp_path / "engine.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}   # no GPU even on a machine that has one
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check_engine.py"), "--out", str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (0, "skipped: no CUDA\n"), done.stderr[-2000:]
    assert not out.exists()

"""`pdserve up --set router.api_keys=...` as an operator runs it leaves the key nowhere to be read.

1. ``pdserve up`` (a subprocess, state directory in a temporary folder) with an API key given
   as ``--set``; it returns once ``/health`` answers.
2. The key is in no process's argv (``/proc/<pid>/cmdline`` of the head and every process it
   started, which ``ps`` shows to every user), not in ``state.json`` nor the head's log.
3. The state directory is 0700 and every file in it 0600; the hand-off file is gone.
4. The key was applied all the same: a request without it is 401, with it 200.
5. ``pdserve down`` leaves no process of the head running.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from scripts import procs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

UP_TIMEOUT_S = 240
KEY = "sk-argv-7d41e09b5c"
SETTINGS = {
    "router.http_port": 0, "router.grpc_port": 0, "ray.include_dashboard": "false", "ray.num_cpus": 4,
    "planner.enabled": "false", "router.disaggregation.local_prefill_max_tokens": 0,
    **{f"{role}.engine.{key}": value for role in ("prefill", "decode")
       for key, value in (("kv_cache_memory_gb", 0.03), ("num_threads", 1))},
}


def pdserve(state_dir: Path, *args: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess:
    script = Path(sys.executable).parent / "pdserve"
    argv = [str(script)] if script.exists() else [sys.executable, "-m", "pdserve.cli"]
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_API_KEYS"}
    env.update(PDSERVE_STATE_DIR=str(state_dir), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_ADDRESS="127.0.0.1:9")
    return subprocess.run([*argv, *args], env=env, capture_output=True, text=True, timeout=timeout_s)


def post(url: str, key: str | None) -> int:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    body = json.dumps({"prompt": "hello", "max_tokens": 2}).encode()
    try:
        with urllib.request.urlopen(urllib.request.Request(url + "/v1/completions", body, headers), timeout=60) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        return ""


def test_an_api_key_given_to_up_is_in_no_argv_and_no_world_readable_file(tmp_path: Path, tiny_model: Path) -> None:
    state_dir = tmp_path / "state"
    sets = [a for k, v in {**SETTINGS, "router.api_keys": f'["{KEY}"]'}.items() for a in ("--set", f"{k}={v}")]
    up = pdserve(state_dir, "up", "--model", str(tiny_model), *sets, "--timeout", str(UP_TIMEOUT_S),
                 timeout_s=UP_TIMEOUT_S + 30)
    log = (state_dir / "head.log").read_text(errors="replace") if (state_dir / "head.log").exists() else ""
    state_path = state_dir / "state.json"
    tree: set = set()
    try:
        assert up.returncode == 0, f"{up.stdout}\n{up.stderr}\n--- head.log ---\n{log[-4000:]}"
        state = json.loads(state_path.read_text())
        head = state["pid"]
        tree = procs.descendants(head)
        argvs = {pid: cmdline(pid) for pid in {head, *(p for p, _ in tree)}}
        assert "_head" in argvs[head] and "--set" not in argvs[head], argvs[head]
        leaked = {pid: argv for pid, argv in argvs.items() if KEY in argv}
        assert not leaked, leaked

        assert stat.S_IMODE(state_dir.stat().st_mode) == 0o700
        files = sorted(p for p in state_dir.iterdir() if p.is_file())
        assert {p.name for p in files} >= {"state.json", "head.log", "redis-password"}, files
        assert not [p for p in files if p.name.startswith("head-overrides-")], files
        assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in files), \
            {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in files}
        assert KEY not in state_path.read_text() and KEY not in (state_dir / "head.log").read_text(errors="replace")

        assert post(state["http"], None) == 401
        assert post(state["http"], KEY) == 200
    finally:
        if state_path.exists():
            down = pdserve(state_dir, "down", timeout_s=150)
            assert down.returncode == 0, down.stdout + down.stderr
        left = procs.wait_gone(tree, 20.0)
        for p, _ in left:
            os.kill(p, 9)
    assert not left, f"processes of the head still running: {procs.describe(left)}"

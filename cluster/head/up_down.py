"""``pdserve up`` and ``pdserve down`` on the operator's side: start the head as a background
process and wait until it serves; stop it, and whatever it left running.

1. ``clear_for_a_new_head``: ``up`` refuses beside a head that runs (or still starts), and beside
   what a dead head left running (``down`` stops that); a dead head that left nothing only has its
   state files removed.
2. ``start_head``: the head (``pdserve _head``, ``launcher.run_head``) is started in a session of
   its own, its output in ``head.log``, with ``up``'s ``--set`` values in a 0600 hand-off file
   (never in argv: ``ps`` shows argv to every user); ``up`` returns once its ``/health`` answers,
   or stops what it started when it exits during its start.
3. ``down``: SIGTERM (the head drains, stops its workers, Redis and Ray, and removes its state),
   SIGKILL to its process group after the timeout, then ``stop_leftovers`` for what a killed head
   left; the state files go once nothing runs.

Nothing here imports Ray, Redis or the config: the head itself is in ``launcher.py``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from pdserve.cluster.head.head_processes import (HEAD_ID_ENV, HeadIdentity, describe, leftovers, new_head_id,
                                                 stop_leftovers)
from pdserve.cluster.head.state_files import (ensure_state_dir, give_overrides, read_head, read_state,
                                              remove_state)
from pdserve.cluster.head.status_report import dashboard_hint
from pdserve.cluster.pids import boot_id, start_ticks


def clear_for_a_new_head() -> int | None:
    """None when a new head may start here; else ``up``'s exit code (1), having said why."""
    st = read_head()
    if not st:
        return None
    head = HeadIdentity.from_state(st)
    if head.alive():
        print(f"pdserve is already up (pid {head.pid}): HTTP {st['http']}, gRPC {st['grpc']}" if "http" in st
              else f"pdserve is already up (pid {head.pid}), still starting")
        return 1
    left = leftovers(head)
    if left:
        print(f"pdserve: error: the last head (pid {head.pid}) died and left {len(left)} process(es) "
              f"running: {describe(left)}; run `pdserve down` to stop them first", file=sys.stderr)
        return 1
    remove_state()  # a dead head that left nothing running
    return None


def start_head(config_path: str | None, model: str | None, overrides: list[str], timeout_s: float = 600.0) -> int:
    """The head as a background process; 0 once it serves, 1 if it exits or is not healthy in time."""
    args = [sys.executable, "-m", "pdserve.cli", "_head"]
    if config_path:
        args += ["-c", config_path]
    if model:
        args += ["--model", model]
    handoff = give_overrides(overrides) if overrides else None
    if handoff is not None:  # never `--set` in argv: `ps` shows argv to every user, and values may be secrets
        args += ["--overrides-file", str(handoff)]
    log_path = ensure_state_dir() / "head.log"
    head_id = new_head_id()
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               **{HEAD_ID_ENV: head_id})
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "ab") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)
    print(f"starting pdserve (pid {proc.pid}, log {log_path}) ...", flush=True)
    identity = HeadIdentity(proc.pid, start_ticks(proc.pid), head_id, proc.pid, boot_id())  # it leads its session
    try:
        return _wait_up(proc, log_path, timeout_s, identity)
    finally:
        if handoff is not None:
            handoff.unlink(missing_ok=True)  # the head deleted it, unless it died first


def _wait_up(proc: subprocess.Popen, log_path: Path, timeout_s: float, identity: HeadIdentity | None = None) -> int:
    """Until the head answers /health (0), exits, or ``timeout_s`` passes (1). A head that exits
    during its start leaves nothing running: what it started is stopped, its state removed."""
    deadline = time.monotonic() + timeout_s
    last_note = 0.0
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace").splitlines()[-15:]
            if tail and tail[-1].startswith("pdserve: error: "):   # the head refused, with its reason in one line
                print(tail[-1], file=sys.stderr)
            else:
                print(f"pdserve: error: the head exited with code {proc.returncode}; see {log_path}", file=sys.stderr)
                print("\n".join(tail), file=sys.stderr)
            stop_leftovers(identity or HeadIdentity(proc.pid))
            st = read_head()
            if st and st.get("pid") == proc.pid:
                remove_state()
            return 1
        st = read_state()
        if st and st.get("pid") == proc.pid and "http" in st and _healthy(st["http"]):
            print(f"pdserve is up: HTTP {st['http']}  gRPC {st['grpc']}  model {st['model']}")
            for r in st.get("routers", [])[1:]:
                print(f"  router {r['router_id']}: HTTP {r['http']}  gRPC {r['grpc']}")
            if st.get("dashboard"):
                print(dashboard_hint(st["dashboard"]))
            return 0
        if time.monotonic() - last_note > 10:
            last_note = time.monotonic()
            print("  waiting for the workers to load the model and report ready ...", flush=True)
        time.sleep(0.5)
    print(f"pdserve: error: not healthy after {timeout_s:.0f} s; see {log_path}", file=sys.stderr)
    return 1


def _healthy(http_url: str) -> bool:
    try:
        with urllib.request.urlopen(http_url + "/health", timeout=2) as resp:
            return resp.status == 200
    except Exception:
        return False


def down(timeout_s: float = 120.0) -> int:
    """Stop the head (SIGTERM, SIGKILL after ``timeout_s``), then whatever it started that still
    runs (a head killed with SIGKILL left its Valkey and Ray's agents): 0 once none runs, 1 if
    some would not stop (the state is kept, so ``down`` can be run again)."""
    st = read_head()
    if not st:
        print("pdserve is not up (no state file)")
        return 0
    head = HeadIdentity.from_state(st)
    if head.alive():
        os.kill(head.pid, signal.SIGTERM)
        print(f"stopping pdserve (pid {head.pid}): draining requests, stopping workers ...", flush=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and head.alive():
            time.sleep(0.3)
        if head.alive():
            _kill_head(head.pid)
            print("pdserve: the head did not stop in time and was killed", file=sys.stderr)
    else:
        print(f"pdserve's head (pid {head.pid}) is not running: it died without stopping what it started")
    stopped, left = stop_leftovers(head)
    if stopped:
        print(f"stopped {len(stopped)} process(es) the head left running: {describe(stopped)}")
    if left:
        print(f"pdserve: error: still running after SIGKILL: {describe(left)}", file=sys.stderr)
        return 1
    remove_state()
    print("pdserve is down")
    return 0


def _kill_head(pid: int) -> None:
    """SIGKILL a head that did not stop, with the Ray processes and Redis it started.

    A head started by ``up`` leads its own process group, which its GCS, raylet, agents and
    Redis share, so killing the group leaves none of them orphaned (Ray's worker processes have
    groups of their own and exit when their raylet dies). A head run in the foreground shares
    the operator's process group: only the head itself is killed then.
    """
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass

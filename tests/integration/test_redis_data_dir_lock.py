"""One server per Redis data directory (``cluster/state/data_dir_lock.py``), with the real server binary.

A second ``EmbeddedRedis`` on a directory in use is refused with an error naming the directory
and the holder; so is one beside a server whose owner was killed with SIGKILL (the server keeps
the lock it inherited). Once that server is stopped, the stale lock is taken over and the
directory's AOF is loaded: the data written before the crash is there.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdserve.cluster.state.data_dir_lock import LOCK_NAME, DataDirLockedError
from pdserve.cluster.pids import pid_alive
from pdserve.cluster.state.redis_server import EmbeddedRedis, connect

pytestmark = pytest.mark.timeout(120)

# An owner that starts a server on a data directory, writes a key, reports, and waits to be killed.
OWNER = """
import json, sys, time
from pdserve.cluster.state.redis_server import EmbeddedRedis, connect
server = EmbeddedRedis(password="pw", data_dir=sys.argv[1]).start()
client = connect(server.url)
client.set("written-before-the-crash", b"still here")
time.sleep(1.2)  # appendfsync everysec: the write reaches the AOF on disk
print(json.dumps({"server_pid": server.pid}), flush=True)
time.sleep(300)
"""


def wait_gone(pid: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(pid), f"pid {pid} still runs"


def test_a_second_server_on_a_data_dir_in_use_is_refused(tmp_path: Path) -> None:
    data = tmp_path / "redis"
    first = EmbeddedRedis(password="pw", data_dir=data).start()
    try:
        connect(first.url).set("k", b"v")
        second = EmbeddedRedis(password="other", data_dir=data)
        with pytest.raises(DataDirLockedError) as refused:
            second.start()
        message = str(refused.value)
        assert str(data.resolve()) in message and f"pid {os.getpid()}" in message and f"pid {first.pid}" in message
        assert not second.is_running()
        first.restart()  # its own restarts keep the lock: not refused
        assert connect(first.url).get("k") == b"v"
    finally:
        first.stop()
    second = EmbeddedRedis(password="pw", data_dir=data).start()  # free once stopped
    try:
        assert connect(second.url).get("k") == b"v"
    finally:
        second.stop()


def test_a_server_that_outlived_its_killed_owner_keeps_the_dir_until_stopped(tmp_path: Path) -> None:
    data = tmp_path / "redis"
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(data)], stdout=subprocess.PIPE, text=True)
    server_pid = None
    try:
        line = owner.stdout.readline()
        assert line, f"the owner exited with {owner.wait()}"
        server_pid = json.loads(line)["server_pid"]
        owner.send_signal(signal.SIGKILL)  # no clean-up runs: its server goes on
        owner.wait(10)
        assert pid_alive(server_pid)

        with pytest.raises(DataDirLockedError) as refused:
            EmbeddedRedis(password="pw", data_dir=data).start()
        message = str(refused.value)
        assert str(data.resolve()) in message and f"pid {owner.pid} no longer runs" in message
        assert f"its server: pid {server_pid}" in message and "pdserve down" in message

        os.kill(server_pid, signal.SIGTERM)  # what `pdserve down` does to a dead head's Valkey
        wait_gone(server_pid)
        assert json.loads((data / LOCK_NAME).read_text())["owner_pid"] == owner.pid  # a stale file, now free
        after = EmbeddedRedis(password="pw", data_dir=data).start()
        try:
            assert connect(after.url).get("written-before-the-crash") == b"still here"  # the AOF was loaded
            assert json.loads((data / LOCK_NAME).read_text()) == {"owner_pid": os.getpid(), "server_pid": after.pid}
        finally:
            after.stop()
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait(10)
        if server_pid is not None and pid_alive(server_pid):
            os.kill(server_pid, signal.SIGKILL)

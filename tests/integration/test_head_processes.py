"""What a head killed with SIGKILL leaves running is found and ended (``cluster/head/head_processes.py``),
and nothing else is: checked with a stand-in head (plain processes, no Ray) so that every case
runs in seconds. The real head's case is ``test_cli_ops.py``.

The stand-in leads its own session, as ``pdserve up`` starts the head, with the head id in its
environment, and starts: a child in its session without the id (found by the session), a child
that left for a session of its own but carries the id (found by the id), and a child of its session that ignores
SIGTERM. Beside them runs a process of the test's own session without the id: never ours.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from pdserve.cluster.head.head_processes import HEAD_ID_ENV, HeadIdentity, leftovers, new_head_id, stop_leftovers
from pdserve.cluster.pids import start_ticks

pytestmark = pytest.mark.timeout(60)

SLEEP = "import time; time.sleep(300)"
STAND_IN_HEAD = f"""
import json, os, subprocess, sys, time
from pdserve.cluster.head.head_processes import HeadIdentity
bare = {{k: v for k, v in os.environ.items() if k != "{HEAD_ID_ENV}"}}
kids = [
    subprocess.Popen([sys.executable, "-c", {SLEEP!r}], env=bare),  # found by its session alone
    subprocess.Popen([sys.executable, "-c", {SLEEP!r}], start_new_session=True),
    subprocess.Popen([sys.executable, "-c",
                      "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); "
                      "time.sleep(300)"], stdout=subprocess.PIPE),
]
kids[2].stdout.readline()  # its SIGTERM handler is in place
print(json.dumps({{"identity": HeadIdentity.of_this_process().as_state(), "kids": [k.pid for k in kids]}}), flush=True)
time.sleep(300)
"""


def test_a_dead_heads_processes_are_found_and_ended_and_no_other_is_touched() -> None:
    head_id = new_head_id()
    env = dict(os.environ, **{HEAD_ID_ENV: head_id})
    head = subprocess.Popen([sys.executable, "-c", STAND_IN_HEAD], stdout=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    bystander = subprocess.Popen([sys.executable, "-c", SLEEP])  # this session, no head id: not ours
    kids: list[int] = []
    try:
        report = json.loads(head.stdout.readline())
        identity, kids = HeadIdentity.from_state(report["identity"]), report["kids"]
        assert identity.pid == head.pid and identity.leads_session and identity.head_id == head_id
        assert identity.alive()

        head.send_signal(signal.SIGKILL)  # the head dies without its clean-up
        head.wait(10)
        assert not identity.alive()
        found = leftovers(identity)
        assert sorted(p.pid for p in found) == sorted(kids), found
        assert all("python" in p.name for p in found)

        t0 = time.monotonic()
        stopped, left = stop_leftovers(identity, term_wait_s=1.0, kill_wait_s=5.0)
        assert not left and sorted(p.pid for p in stopped) == sorted(kids)
        assert time.monotonic() - t0 < 10
        assert all(start_ticks(pid) is None for pid in kids)  # gone, the one that ignored SIGTERM too
        assert leftovers(identity) == []
        assert bystander.poll() is None and start_ticks(os.getpid()) is not None  # untouched
    finally:
        for pid in [head.pid, *kids]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        bystander.kill()
        bystander.wait(10)


def test_a_foreground_heads_session_is_never_searched_and_a_reused_pid_is_not_the_head() -> None:
    """A head run in the foreground shares the operator's session: only the head id counts there."""
    bystander = subprocess.Popen([sys.executable, "-c", SLEEP])  # the test's session, no head id
    try:
        me = HeadIdentity.of_this_process()
        foreground = HeadIdentity(pid=2**22 + 7, start_ticks=me.start_ticks, head_id=new_head_id(),
                                  sid=me.sid, boot_id=me.boot_id)  # a dead head of this session
        assert not foreground.leads_session and not foreground.alive()
        assert leftovers(foreground) == []
        assert bystander.poll() is None
        reused = HeadIdentity(pid=os.getpid(), start_ticks=(me.start_ticks or 0) - 1, boot_id=me.boot_id)
        assert not reused.alive()  # this pid runs, but it is not the process that started then
        assert HeadIdentity.from_state({"pid": 5}) == HeadIdentity(5)  # a state file of an older version
        assert HeadIdentity.from_state(me.as_state()) == me
    finally:
        bystander.kill()
        bystander.wait(10)

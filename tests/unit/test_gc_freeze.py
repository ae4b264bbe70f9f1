"""freeze_startup_heap moves what exists into the permanent generation; later objects are collected
as before. Run in a subprocess: a freeze is process-wide, and this test session builds many engines."""

from __future__ import annotations

import subprocess
import sys
import textwrap

_SCRIPT = textwrap.dedent("""
    import gc
    from pdserve.engine.gc_freeze import freeze_startup_heap

    class Node:
        def __init__(self):
            self.me = self                      # a cycle: only the collector frees it

    startup = [[i] for i in range(20000)]       # the long-lived heap
    frozen = freeze_startup_heap("test")
    tracked_old = sum(len(gc.get_objects(g)) for g in range(3))
    garbage = [Node() for _ in range(1000)]
    del garbage
    freed = gc.collect()                        # the later cycles are still found
    print(frozen, tracked_old, freed, len(startup))
""")


def test_freeze_keeps_the_startup_heap_out_and_still_collects_later_cycles():
    done = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    frozen, tracked_old, freed, kept = map(int, done.stdout.split())
    assert frozen >= 20000                      # the 20,000 lists and what was there before them
    assert tracked_old < 1000, f"{tracked_old} objects still in the collected generations after the freeze"
    assert freed >= 1000                        # each Node's cycle (and its __dict__) collected
    assert kept == 20000

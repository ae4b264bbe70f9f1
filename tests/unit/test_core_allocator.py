"""The per-host core table (claim, refuse, reclaim a dead owner's cores, release) and the
default share of cores per replica."""

from __future__ import annotations

import os
import subprocess
import sys

from pdserve.cluster.config_io import apply_overrides, config_from_model
from pdserve.cluster.runtime.core_allocator import CoreAllocator, wanted_threads


def test_threads_follow_num_cpus_unless_overridden_and_fit_the_cores():
    assert wanted_threads(4.0, None, 8) == 4
    assert wanted_threads(2.7, None, 8) == 2      # rounded down
    assert wanted_threads(0.5, None, 8) == 1      # at least one
    assert wanted_threads(8.0, None, 2) == 2      # 8 Ray CPUs advertised on 2 cores
    assert wanted_threads(1.0, 3, 8) == 3         # engine.num_threads wins


def test_cores_are_distinct_refused_when_short_and_freed_by_death_or_release(tmp_path):
    alloc = CoreAllocator(tmp_path)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert alloc.claim(2, {0, 1, 2, 3}, pid=dead.pid) == (0, 1)
    me = os.getpid()
    assert alloc.claim(2, {0, 1, 2, 3}, pid=me) == (0, 1)      # the dead owner's cores came back
    other = os.getppid()                                        # alive: its cores stay taken
    assert alloc.claim(2, {0, 1, 2, 3}, pid=other) == (2, 3)
    assert alloc.claim(1, {0, 1, 2, 3}, pid=1) == ()           # none left: run unpinned
    alloc.release(me)
    assert alloc.claim(1, {0, 1, 2, 3}, pid=1) == (0,)
    alloc.release(other)
    alloc.release(1)
    assert (tmp_path / "pdserve-cores.json").read_text() == "{}"


def test_default_num_cpus_shares_the_host_cores(tmp_path):
    cores = len(os.sched_getaffinity(0))
    (tmp_path / "config.json").write_text("{}")
    base = config_from_model(tmp_path)
    assert base.replica_cpus("prefill") == base.replica_cpus("decode") == max(1, cores // 2)
    solo = apply_overrides(base, {"prefill.min_replicas": 0})
    assert solo.replica_cpus("decode") == cores                 # single colocated worker: every core
    assert apply_overrides(base, {"decode.num_cpus": 3}).replica_cpus("decode") == 3
    assert apply_overrides(base, {"ray.address": "auto"}).replica_cpus("decode") == 1

"""An engine's setup leaves no OpenMP pool behind on the thread that built it (engine/omp_pool.py).

A leftover pool on the builder's thread plus the stepping thread's own pool outnumber the cores of
a 2-core worker, and libgomp then sleeps its workers between parallel regions (decode steps 1.6x
slower in a served worker). The check counts the process's threads: a parallel region on the main
thread leaves one more (the control), building an engine there leaves none.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from pdserve.engine.omp_pool import on_fresh_thread


def test_on_fresh_thread_returns_the_result_from_another_thread():
    import threading

    main = threading.get_ident()
    assert on_fresh_thread(lambda: threading.get_ident() != main) is True


def test_on_fresh_thread_raises_what_the_call_raised():
    def boom() -> None:
        raise KeyError("no such model")

    with pytest.raises(KeyError, match="no such model"):
        on_fresh_thread(boom)


_SCRIPT = textwrap.dedent("""
    import os, sys, time
    import torch
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.sampling_params import SamplingParams

    def threads() -> int:
        return len(os.listdir("/proc/self/task"))

    torch.set_num_threads(2)
    torch.ones(8).sum()                       # torch's own lazy setup, outside the counts
    before = threads()
    engine = LLMEngine(EngineConfig(model_dir=sys.argv[1], num_threads=2, num_blocks=64, warm_up=True))
    deadline = time.monotonic() + 10     # the setup thread's pool workers exit just after it does
    while threads() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    built = threads()
    assert len(engine.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=2, ignore_eos=True))[0]) == 2
    a = torch.randn(512, 512)
    for _ in range(3):
        (a @ a).relu_()
    after_region = threads()
    print(before, built, after_region, torch.get_num_threads())
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc")
def test_building_an_engine_leaves_no_openmp_pool_on_the_building_thread(tiny_model):
    done = subprocess.run([sys.executable, "-c", _SCRIPT, str(tiny_model)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert done.returncode == 0, done.stderr[-2000:]
    before, built, after_region, num_threads = map(int, done.stdout.split()[-4:])
    assert num_threads == 2
    # Setup (model load, kernel timing, warm-up) ran its parallel regions on a thread that has exited;
    # its pool's workers are gone soon after (the script waits up to 10 s for them).
    assert built == before, f"engine setup left {built - before} thread(s) behind"
    # The control: a parallel region run on this thread leaves its pool's worker (2 threads: 1 more).
    assert after_region == before + 1, (before, built, after_region)

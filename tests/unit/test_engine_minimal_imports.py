"""The engine and the GPU check's engine half import and run with torch and transformers only
(``tests/gpu_machine_env.py``: Ray, NIXL, Redis, pydantic, gguf, xgrammar, ... absent; pdserve
not installed), and give the same tokens as here."""

from __future__ import annotations

import json

import pytest
from gpu_machine_env import ABSENT, run_python

CHECK = """
import json
import gpu_check_engine
gpu_check_engine.use_source_tree()
from pdserve.bench.gpu_engine import engine_greedy, make_engine, parity_prompts

missing = []
for name in ABSENT:
    try:
        __import__(name)
    except ImportError:
        missing.append(name)
engine = make_engine(sys.argv[1], "cpu", "float32", kv_gb=0.02, step_tokens=32, seqs=8)
prompts, shared = parity_prompts(engine.spec.vocab_size)
out = engine_greedy(engine, prompts + [shared], 4)
loaded = sorted({m.split(".")[0] for m in sys.modules} & set(ABSENT))
print(json.dumps({"tokens": [t for t, _ in out], "missing": missing, "loaded": loaded,
                  "engine_from": sys.modules["pdserve.engine"].__file__}))
"""


@pytest.mark.timeout(300)
def test_engine_runs_without_the_optional_packages(tiny_model, tmp_path):
    from pdserve.bench.gpu_engine import engine_greedy, make_engine, parity_prompts

    done = run_python(CHECK, tmp_path, str(tiny_model))
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["missing"] == list(ABSENT)       # each one really was absent there
    assert got["loaded"] == []
    assert got["engine_from"].endswith("engine/__init__.py")
    engine = make_engine(tiny_model, "cpu", "float32", kv_gb=0.02, step_tokens=32, seqs=8)
    prompts, shared = parity_prompts(engine.spec.vocab_size)
    assert got["tokens"] == [t for t, _ in engine_greedy(engine, prompts + [shared], 4)]

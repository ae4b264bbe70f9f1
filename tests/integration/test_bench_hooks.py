"""The benchmarks' hooks into the engine still reach what they time (a hook that misses makes a
benchmark print nothing or divide by zero, and no other test runs the benchmarks)."""

from __future__ import annotations


from pdserve.bench.engine import EngineDecode
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine



def test_bench_engine_times_the_model_runner_inside_each_step(tiny_model) -> None:
    engine = LLMEngine(EngineConfig(model_dir=str(tiny_model), num_blocks=128, warm_up=False))
    decode = EngineDecode(engine, [[5, 6, 7, 8], [9, 10, 11, 12]], max_steps=4)
    try:
        for _ in range(3):
            step_s, runner_s = decode.step()
            assert 0.0 < runner_s <= step_s
    finally:
        decode.close()
    assert "execute_scored" not in vars(engine.runner)   # the hook is gone again


def test_bench_linear_runs_the_backends_side_by_side(tmp_path, capsys) -> None:
    """``pdserve bench linear`` end to end on the tiny model: each backend's engine runs, the JSON
    has every decode batch and prompt length with a ratio, and bad arguments are refused."""
    import argparse
    import json

    from pdserve.bench import linear as bench_linear

    def args(**kw) -> argparse.Namespace:
        base = dict(json=tmp_path / "linear.json", backends="dense,mkl_packed", threads=1, batches="1,3",
                    prompts="20", model="tiny", steps=5, rounds=1)
        return argparse.Namespace(**{**base, **kw})

    assert bench_linear.run(args()) == 0
    out = json.loads((tmp_path / "linear.json").read_text())
    assert set(out["decode_step_ms"]) == {"1", "3"} and set(out["prefill_ms"]) == {"20"}
    assert out["kernels"]["mkl_packed"].startswith("qkv=mkl_packed")
    assert all(v["mkl_packed"] > 0 for v in out["decode_speedup"].values())
    assert "mkl_packed/dense" in capsys.readouterr().out
    for bad in (dict(backends="dense"), dict(backends="dense,fast"), dict(batches="0"), dict(model="huge"),
                dict(prompts="x")):
        assert bench_linear.run(args(**bad)) == 2


def test_bench_shapes_runs_both_arms_in_their_own_processes(tmp_path, capsys) -> None:
    """``pdserve bench shapes`` end to end on the tiny model in bf16: each arm in a fresh process,
    the bucketed one with its buckets' kernels built, a ratio per pass; bad arguments refused."""
    import argparse
    import json

    from pdserve.bench import shapes as bench_shapes

    def args(**kw) -> argparse.Namespace:
        base = dict(model=None, preset="tiny", dtype="bfloat16", threads=1, steps=8, max_seqs=8, pairs=1,
                    seed=0, json=str(tmp_path / "shapes.json"), arm=None)
        return argparse.Namespace(**{**base, **kw})

    assert bench_shapes.run(args()) == 0
    (pair,) = json.loads((tmp_path / "shapes.json").read_text())["pairs"]
    assert pair["bucketed"]["bucket_rows"] and not pair["exact"]["bucket_rows"]
    assert pair["bucketed"]["build_s"] > 0 and pair["exact"]["build_s"] == 0
    assert pair["first_pass_x"] > 0 and pair["second_pass_x"] > 0
    assert "exact / bucketed" in capsys.readouterr().out
    for bad in (dict(steps=0), dict(pairs=0), dict(max_seqs=0)):
        assert bench_shapes.run(args(**bad)) == 2

"""``pdserve profile`` on a real engine and real NIXL processes, then ``plan`` and ``simulate`` on
what it measured, through the command line; and the clear errors of every capacity command."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.capacity.profile import Profile

CLI = [sys.executable, "-m", "pdserve.cli"]


def pdserve(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def tiny_profile(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("capacity") / "profile.json"
    done = pdserve("profile", "--model", str(tiny_model), "--json", str(out), "--quick", "--no-served")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "decode step ms by batch" in done.stdout and "KV handoff" in done.stdout
    return out


def test_the_profile_holds_real_measurements(tiny_profile: Path, tiny_model: Path) -> None:
    prof = Profile.load(tiny_profile)
    cfg = json.loads((tiny_model / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    elem = {"float32": 4, "bfloat16": 2}[prof.model["dtype"]]
    assert prof.kv_bytes_per_token == cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim * elem
    for role in ("prefill", "decode", "colocated"):
        e = prof.role(role)
        assert all(s > 0 for s in e.prefill_s + e.decode_s)
        # a longer prompt takes longer; a bigger batch gives more tokens per second
        assert e.prefill_s[-1] > e.prefill_s[0]
        assert e.decode_batch[-1] / e.decode_s[-1] > e.decode_batch[0] / e.decode_s[0]
    t = prof.transfer
    assert t.bytes_per_s > 1e6 and len(t.measured) == 2 and t.measured[0]["backend"]
    assert prof.worker_start_s > 0 and prof.speed_probe_s > 0 and prof.serving == {}


def test_plan_and_simulate_run_on_the_profile(tiny_profile: Path, tmp_path: Path) -> None:
    traffic = tmp_path / "traffic.yaml"
    traffic.write_text("rate: 20\nprompt_len: {mean: 64, dist: lognormal, max: 256}\n"
                       "output_len: {mean: 16, dist: exponential, max: 64}\nslo: {ttft_s: 0.5, itl_s: 0.05}\n"
                       "requests: 2000\n")
    plan = pdserve("plan", "--profile", str(tiny_profile), "--traffic", str(traffic), "--json", str(tmp_path / "p.json"))
    assert plan.returncode == 0, plan.stderr
    assert "5. Workers for decode" in plan.stdout and "Plan:" in plan.stdout and "Colocated alternative" in plan.stdout
    result = json.loads((tmp_path / "p.json").read_text())
    assert result["simulation"]["met"] and result["answer"]["decode"] >= 1 and result["answer"]["prefill"] >= 1
    sim = pdserve("simulate", "--profile", str(tiny_profile), "--traffic", str(traffic), "--prefill",
                  str(result["answer"]["prefill"]), "--decode", str(result["answer"]["decode"]),
                  "--json", str(tmp_path / "s.json"))
    assert sim.returncode == 0, sim.stderr
    out = json.loads((tmp_path / "s.json").read_text())
    assert out["requests"] == 2000 and out["ttft_s"]["p99"] <= 0.5 and out["itl_s"]["p99"] <= 0.05
    assert "TTFT p50" in sim.stdout
    # the same traffic from one worker per pool, the cluster's own planner scaling them
    config = tmp_path / "cluster.yaml"
    config.write_text("model: {path: /models/m}\nrouter: {disaggregation: {mode: always}}\n"
                      "prefill: {min_replicas: 1, max_replicas: 8}\ndecode: {min_replicas: 1, max_replicas: 8}\n"
                      "slo: {ttft_ms: 500, itl_ms: 50}\n"
                      "planner: {interval_s: 2, warmup_s: 1, scale_up_cooldown_s: 2, scale_down_cooldown_s: 5, "
                      "scale_down_stable_s: 4}\n")
    sim = pdserve("simulate", "--profile", str(tiny_profile), "--traffic", str(traffic), "--planner", str(config),
                  "--worker-start-s", "1", "--json", str(tmp_path / "sp.json"))
    assert sim.returncode == 0, sim.stderr
    out = json.loads((tmp_path / "sp.json").read_text())
    assert out["requests"] == 2000 and not out["notes"]
    planner = out["planner"]
    assert planner["setup"]["worker_start_s"] == 1 and planner["setup"]["decode"] == [1, 1, 8]
    assert planner["ticks"] > 0 and planner["most_replicas"]["decode"] <= 8
    # more traffic than one worker per pool can serve: the planner adds workers
    heavy = tmp_path / "heavy.yaml"
    heavy.write_text(traffic.read_text().replace("rate: 20", "rate: 400").replace("requests: 2000", "requests: 20000"))
    sim = pdserve("simulate", "--profile", str(tiny_profile), "--traffic", str(heavy), "--planner", str(config),
                  "--worker-start-s", "1", "--json", str(tmp_path / "sp.json"))
    assert sim.returncode == 0, sim.stderr
    planner = json.loads((tmp_path / "sp.json").read_text())["planner"]
    assert planner["scale_ups"] >= 1 and max(planner["most_replicas"].values()) > 1
    assert all(d["reason"] for d in planner["decisions"]) and "scale-ups" in sim.stdout


def _write_profile(path: Path) -> Path:
    from pdserve.capacity.profile import EngineProfile, TransferProfile

    e = EngineProfile(1, [16, 512], [0.01, 0.2], [1, 32], [0.02, 0.05], 64)
    Profile(host={}, model={"name": "m", "kv_bytes_per_token": 1000},
            engine={"block_size": 16, "max_num_seqs": 32, "max_num_batched_tokens": 512, "num_kv_blocks": 1000},
            engines={"1": e}, roles={"prefill": 1, "decode": 1, "colocated": 1},
            transfer=TransferProfile(0.0, 1e9)).save(path)
    return path


def test_capacity_commands_refuse_bad_input_naming_what_is_wrong(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from pdserve.cli import main

    good = _write_profile(tmp_path / "p.json")
    traffic = tmp_path / "t.json"
    traffic.write_text(json.dumps({"rate": 5, "prompt_len": {"mean": 10}, "output_len": {"mean": 4, "dist": "zipf"}}))
    assert main(["plan", "--profile", str(good), "--traffic", str(traffic)]) == 2
    assert "output_len.dist" in capsys.readouterr().err
    traffic.write_text(json.dumps({"rate": 5, "prompt_len": {"mean": 10}, "output_len": {"mean": 4}}))
    assert main(["simulate", "--profile", str(good), "--traffic", str(traffic), "--mode", "colocated",
                 "--prefill", "2"]) == 2
    assert "give --prefill 0" in capsys.readouterr().err
    assert main(["plan", "--profile", str(tmp_path / "none.json"), "--traffic", str(traffic)]) == 2
    assert "cannot read profile" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{}")
    assert main(["simulate", "--profile", str(tmp_path / "bad.json"), "--traffic", str(traffic)]) == 2
    assert "not a pdserve profile" in capsys.readouterr().err
    assert main(["profile", "--model", str(tmp_path), "--json", str(tmp_path / "o.json")]) == 2
    assert "no config.json there" in capsys.readouterr().err
    assert main(["simulate", "--profile", str(good), "--traffic", str(traffic), "--requests", "0"]) == 2
    assert main(["simulate", "--profile", str(good), "--traffic", str(traffic), "--requests", "10000000000"]) == 2
    assert "--requests must be between 1 and 50,000,000" in capsys.readouterr().err
    config = tmp_path / "cluster.yaml"
    config.write_text("model: {path: /models/m}\ndecode: {min_replicas: 1, max_replicas: 4}\n")
    assert main(["simulate", "--profile", str(good), "--traffic", str(traffic), "--planner", str(config),
                 "--decode", "3"]) == 2
    assert "drop --decode" in capsys.readouterr().err
    assert main(["simulate", "--profile", str(good), "--traffic", str(traffic), "--planner", str(config)]) == 2
    assert "set prefill.max_replicas to simulate the planner" in capsys.readouterr().err
    assert main(["simulate", "--profile", str(good), "--traffic", str(traffic), "--worker-start-s", "3"]) == 2
    assert "give it with --planner" in capsys.readouterr().err
    config.write_text("model: {path: /models/m}\nplanner: {interval_s: -1}\n")
    assert main(["simulate", "--profile", str(good), "--traffic", str(traffic), "--planner", str(config)]) == 2
    assert "interval_s" in capsys.readouterr().err
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert main(["profile", "--model", str(model), "--json", str(tmp_path / "o.json"), "--kv-cache-memory-gb", "0"]) == 2
    assert "--kv-cache-memory-gb must be > 0" in capsys.readouterr().err

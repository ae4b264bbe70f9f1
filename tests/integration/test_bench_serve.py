"""``pdserve bench serve``'s load generator against a real cluster: a ``RouterService`` (one
prefill, two decode Ray actors, ledger in Redis: the session's ``router_cluster``) behind HTTP and gRPC on 127.0.0.1, the tiny model.

What the benchmark reports must be what the server did: every request of every group completes,
each with exactly ``output_len`` streamed tokens (``ignore_eos``), the client's token count agrees
with the server's ``usage``, the prompt lengths are exact, a shared prefix is reported as cached
by the server, and the run leaves no block held and no ledger entry live.
"""

from __future__ import annotations

import asyncio

import pytest
from cluster_helpers import ClusterHarness
from pdserve.bench.serve_load import GroupSpec, Target, run_load

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def cluster(router_cluster: ClusterHarness):
    yield router_cluster
    router_cluster.assert_nothing_held()


def _vocab(cluster: ClusterHarness) -> int:
    return cluster.service.serving.info.vocab_size


def test_http_groups_complete_with_exact_token_counts(cluster: ClusterHarness) -> None:
    target = Target("openai", cluster.http_url, cluster.model_name, vocab_size=_vocab(cluster))
    groups = [GroupSpec("steady", 6, prompt_len=24, output_len=12, concurrency=3, seed=1),
              GroupSpec("arrivals", 5, prompt_len=(8, 40), output_len=(4, 9), rate=20.0, seed=2)]
    result = asyncio.run(run_load(target, groups, time_limit_s=120))
    assert result.errors == []
    for r in result.records:
        assert len(r.token_times) == r.output_len == r.usage_completion_tokens
        assert r.usage_prompt_tokens == r.prompt_len
    summary = result.summary(ttft_slo_s=60.0, itl_slo_s=60.0)
    assert summary["groups"]["steady"]["completed"] == 6 and summary["groups"]["arrivals"]["completed"] == 5
    assert summary["overall"]["usage_mismatch"] == 0
    assert summary["groups"]["steady"]["slo_met_frac"] == 1.0
    assert summary["client_cpu_s"] > 0


def test_grpc_target_and_a_shared_prefix_hits_the_cache(cluster: ClusterHarness) -> None:
    target = Target("grpc", cluster.grpc_target, cluster.model_name, vocab_size=_vocab(cluster))
    group = GroupSpec("prefix", 4, prompt_len=80, output_len=6, concurrency=1, shared_prefix_len=64, seed=5)
    result = asyncio.run(run_load(target, [group], time_limit_s=120))
    assert result.errors == []
    assert all(len(r.token_times) == 6 == r.usage_completion_tokens for r in result.records)
    # one at a time: every request after the first finds the 64-token prefix cached (whole blocks)
    assert all((r.cached_prompt_tokens or 0) >= 48 for r in result.records[1:])


def test_the_command_sweeps_rates_and_writes_json_and_plots(cluster: ClusterHarness, tiny_model, tmp_path) -> None:
    import argparse
    import json

    from pdserve.bench import serve

    p = argparse.ArgumentParser()
    serve.add_args(p)
    out = tmp_path / "run.json"
    args = p.parse_args(["--url", cluster.http_url, "--json", str(out), "--model-dir", str(tiny_model),
                         "--num-prompts", "6", "--prompt-len", "16", "--output-len", "6",
                         "--sweep-rates", "20,5", "--ttft-slo-s", "60", "--itl-slo-s", "60"])
    assert serve.run(args) == 0
    result = json.loads(out.read_text())
    assert "_records" not in result
    points = result["sweeps"]["server"]
    assert [pt["rate"] for pt in points] == [5.0, 20.0]
    assert all(pt["failed"] == 0 and pt["slo_met_frac"] == 1.0 for pt in points)
    assert result["ratios"]["max_rate_90pct_slo"] == {"server": 20.0}
    plots = [tmp_path / "run-latency.png", tmp_path / "run-goodput.png"]
    assert result["plots"] == [str(x) for x in plots]
    for png in plots:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_the_command_refuses_a_sweep_with_a_scenario_it_does_not_apply_to(tmp_path) -> None:
    import argparse

    from pdserve.bench import serve

    p = argparse.ArgumentParser()
    serve.add_args(p)
    args = p.parse_args(["--scenario", "interference", "--json", str(tmp_path / "x.json"), "--sweep-rates", "1"])
    assert serve.run(args) == 2
    with pytest.raises(SystemExit):
        p.parse_args(["--url", "http://127.0.0.1:1", "--json", "x.json", "--sweep-rates", "0,-1"])

"""The Ray options a worker is started with (``cluster.workers.actor_options``): every pool
setting that places a worker reaches Ray, in a form Ray accepts."""

from __future__ import annotations

import ray

from pdserve.cluster.runtime.workers import ACTOR_PREFIX, actor_options


class _Probe:
    pass


def test_accelerator_type_and_resources_reach_the_actor_options() -> None:
    opts = actor_options("decode", "decode-1-abc", num_cpus=2, num_gpus=1, resources={"decode": 1.0},
                         accelerator_type="H100", namespace="ns", detached=True)
    assert opts["name"] == ACTOR_PREFIX["decode"] + "decode-1-abc"
    assert opts["accelerator_type"] == "H100"
    assert opts["resources"] == {"decode": 1.0} and opts["num_cpus"] == 2 and opts["num_gpus"] == 1
    assert opts["lifetime"] == "detached" and opts["namespace"] == "ns"
    assert opts["runtime_env"]["env_vars"]["HF_HUB_OFFLINE"] == "1"
    ray.remote(_Probe).options(**opts)  # Ray validates every option name and value here


def test_without_an_accelerator_type_none_is_asked_for() -> None:
    opts = actor_options("prefill", "prefill-0-abc")
    assert "accelerator_type" not in opts and "lifetime" not in opts
    ray.remote(_Probe).options(**opts)

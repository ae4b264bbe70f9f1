"""The settings and tables of ``pdserve bench failover`` and ``pdserve bench router --routers``.
The runs themselves need Ray, Redis and several router processes: they are benchmarks, run by
hand (``test_control_plane_failover`` and ``test_cli_ops`` cover the same paths as tests)."""

from __future__ import annotations

import argparse

import pytest

from pdserve.bench.failover import Settings, format_table, settings_from_args


def args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"lease_s": 6.0, "clients": 8, "max_tokens": 128, **kw})


def test_settings_are_checked() -> None:
    assert settings_from_args(args()) == Settings(6.0, 8, 128)
    for bad in ({"lease_s": 0.5}, {"clients": 0}, {"clients": 65}, {"max_tokens": 4}):
        with pytest.raises(ValueError):
            settings_from_args(args(**bad))


def test_table_names_every_figure() -> None:
    text = format_table({"host": {"cpu": "cpu", "cpu_count": 2}, "settings": {"lease_s": 6.0},
                         "leader_failover_s": 6.7, "takeover_s": 6.72, "workers_restarted": [],
                         "router_failover_s": 1.0, "retried_requests": 8, "requests": 8, "lost_requests": 0,
                         "retried_mismatch": 0})
    assert "6.70 s to the next scaling decision" in text and "lost 0" in text and "8/8 resumed" in text


def test_router_scale_settings_and_table() -> None:
    from pdserve.bench.router_scale import ScaleSettings, format_scale, settings_from_args

    st = settings_from_args(argparse.Namespace(routers="1,3", streams=64, seconds=5.0))
    assert st.routers == (1, 3) and st.streams == 64
    for bad in ({"routers": ()}, {"routers": (0, 3)}, {"routers": (9,)}, {"streams": 0}, {"seconds": 0.5}):
        with pytest.raises(ValueError):
            ScaleSettings(**bad)
    text = format_scale({"host": {"cpu": "cpu", "cpu_count": 2}, "routers_3_over_1": 1.26, "levels": [
        {"routers": 1, "tokens_per_s": 5793.0, "requests": 975, "errors": 0, "client_cpu_s": 4.3}]})
    assert "5793" in text and "routers_3_over_1 = 1.26" in text


def test_router_scale_reads_where_the_cpu_went() -> None:
    """The CPU accounting of ``bench router --routers``: this process's own CPU time from /proc
    grows while it spins, and a window takes the samples around it."""
    import os
    import time

    from pdserve.bench.router_scale import CpuSampler, host_cpu_s, process_cpu_s

    assert process_cpu_s(2**22 + 12345) is None          # no such process
    busy, total = host_cpu_s()
    assert 0 < busy <= total
    with CpuSampler({"me": [os.getpid()]}, period_s=0.05) as sampler:
        t0 = time.time()
        while time.time() - t0 < 0.3:
            pass                                          # ~0.3 s of this thread's CPU
        t1 = time.time()
        time.sleep(0.1)
    cpu = sampler.window(t0, t1)
    assert 0.15 <= cpu["me"] <= 0.3 + 2 * 0.05 + 0.05, cpu
    assert 0 < cpu["host_busy_frac"] <= 1 and cpu["span_s"] >= t1 - t0
    text_row = {"routers": 1, "tokens_per_s": 10.0, "requests": 1, "errors": 0, "client_cpu_s": 0.1, "cpu": {
        "routers": 1.0, "workers": 0.5, "client": 0.4, "rest_of_host": 0.1, "host_busy_frac": 0.97},
        "router_cores": 0.95, "router_cpu_ms_per_token": 0.2}
    from pdserve.bench.router_scale import format_scale

    text = format_scale({"host": {"cpu": "cpu", "cpu_count": 2}, "levels": [text_row]})
    assert "0.95" in text and "97%" in text and "routers 1.0, workers 0.5, client 0.4, rest_of_host 0.1" in text


def test_ray_serve_ingress_is_compared_side_by_side_or_refused_with_what_to_install() -> None:
    import importlib.util

    from pdserve.bench.router_scale import ScaleSettings, format_scale, settings_from_args
    from pdserve.bench.serve_ingress import serve_available

    with pytest.raises(ValueError, match="--ingress"):
        ScaleSettings(ingress=("actors", "gateway"))
    with pytest.raises(ValueError, match="--ingress"):
        ScaleSettings(ingress=())
    have_serve = importlib.util.find_spec("starlette") is not None
    missing = serve_available()
    assert (missing is None) == have_serve
    namespace = argparse.Namespace(routers="1", streams=8, seconds=5.0, ingress="actors,serve")
    if missing:
        assert 'pip install "ray[serve]==' in missing
        with pytest.raises(ValueError, match="Ray Serve is not installed"):
            settings_from_args(namespace)
    else:
        assert settings_from_args(namespace).ingress == ("actors", "serve")
    row = {"routers": 1, "tokens_per_s": 100.0, "requests": 1, "errors": 0, "client_cpu_s": 0.1}
    text = format_scale({"host": {"cpu": "cpu", "cpu_count": 2}, "levels": [
        {**row, "ingress": "actors"}, {**row, "ingress": "serve", "tokens_per_s": 40.0}],
        "serve_over_actors": {"1": {"tokens_per_s": 0.4, "cpu_ms_per_token": 3.1}}})
    assert "tokens/s x0.40, CPU per token x3.10" in text and "  serve" in text

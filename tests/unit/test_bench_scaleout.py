"""The settings and tables of ``pdserve bench failover`` and ``pdserve bench router --routers``.
The runs themselves need Ray, Redis and several router processes: they are benchmarks, run by
hand (``test_control_plane_failover`` and ``test_cli_routers`` cover the same paths as tests)."""

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

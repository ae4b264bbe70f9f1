"""``pdserve bench failover``'s settings and table (the run itself needs Ray, Redis and three
router processes: it is a benchmark, run by hand; ``test_control_plane_failover`` covers the
same failures as a test)."""

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

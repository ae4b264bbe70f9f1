"""The figures of ``pdserve bench transfer --link`` from a driver's records (pure), and link rates."""

from __future__ import annotations

import pytest

from pdserve.bench.netns import rate_bits
from pdserve.bench.transfer_link import link_figures


def rec(kv_bytes: int, ttft: float, exposed: float, transfer: float, prefill: float) -> dict:
    return {"kv_bytes": kv_bytes, "ttft_s": ttft, "kv_exposed_s": exposed, "kv_transfer_s": transfer,
            "prefill_s": prefill}


def test_rates_in_tc_syntax() -> None:
    assert rate_bits("1gbit") == 1e9 and rate_bits("500mbit") == 5e8 and rate_bits("2.5Gbit") == 2.5e9
    for bad in ("1gb", "fast", "0gbit", "-1gbit", "10 gbit"):
        with pytest.raises(ValueError):
            rate_bits(bad)


def test_link_figures_from_records() -> None:
    mb = 1_000_000
    cluster = {
        "prompt_len": 2048, "errors": 0, "leaked_blocks": 0, "bytes_match": True,
        "warmup": {"overlap": {"kv_bytes": 100 * mb}, "no_overlap": {"kv_bytes": 100 * mb}},
        "runs": {"overlap": [rec(100 * mb, 4.0, 0.1, 0.9, 3.5), rec(100 * mb, 4.2, 0.3, 0.9, 3.6)],
                 "no_overlap": [rec(100 * mb, 4.5, 0.8, 0.8, 3.5), rec(100 * mb, 4.7, 0.8, 0.8, 3.5),
                                {"kv_bytes": 0, "error": "timed out"}]},
        "by_length": {"512": {"overlap": [rec(25 * mb, 1.0, 0.2, 0.3, 0.8)], "no_overlap": [rec(25 * mb, 1, 0.1, 0.1, 0.8)]}},
    }
    f = link_figures("1gbit", cluster, wire_tx=700 * mb)
    assert f["link_gbps"] == 1.0 and f["kv_bytes"] == 100 * mb
    assert f["transfer_gbps_at_prompt_len"] == pytest.approx(1.0)   # 100 MB in 0.8 s, the failed run left out
    assert f["pushes"] == 3 and f["transfer_gbps"] == pytest.approx(1.0)   # median of 1.0, 1.0, 2.0 Gbit/s
    assert f["link_utilization"] == pytest.approx(1.0)
    assert f["ttft_s"]["overlap"] == pytest.approx(4.1)
    assert f["transfer_share_of_ttft"]["overlap"] == pytest.approx(0.2 / 4.1)
    assert f["share_by_length"] == {"512": pytest.approx(0.2), "2048": pytest.approx(0.2 / 4.1)}
    assert f["hidden_up_to_tokens"] == 2048                     # 0.049 <= 0.05; 512 at 0.2 is not
    # 100 MB per 2,048 tokens made in 3.5 s: 0.229 Gbit/s of KV
    assert f["break_even_gbps"] == pytest.approx(100 * mb * 8 / 3.5 / 1e9)
    assert f["wire_bytes_per_kv_byte"] == pytest.approx(700 / 650)   # 5 runs + warm-ups + two at 512

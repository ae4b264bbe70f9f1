"""Headline figures and the printed table of ``pdserve bench transfer``.

Medians are taken per field over the measured requests of a case (failed requests excluded);
shares are ratios of those medians. ``transfer_gbps`` uses the ``no_overlap`` case, where the
whole prompt moves in one burst after the compute, so bytes / transfer time is a bandwidth;
with overlap the transfer window spans later chunks' compute and is not one.
``transfer_vs_memcpy_ratio`` sets the median burst against the best in-process copy
(conservative); ``transfer_vs_memcpy_ratio_best`` sets best against best.
"""

from __future__ import annotations

import statistics
from typing import Any

_FIELDS = ("ttft_s", "reserve_s", "prefill_call_s", "queue_s", "prefill_s", "kv_transfer_s",
           "kv_exposed_s", "non_compute_s")


def _median(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if not r.get("error")]
    return statistics.median(values) if values else None


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarize(result: dict, nbytes: int) -> dict[str, Any]:
    """The headline fields merged into the result (see the module docstring)."""
    cases: dict[str, dict[str, Any]] = {}
    for case, runs in result["cluster"]["runs"].items():
        c: dict[str, Any] = {k: _median(runs, k) for k in _FIELDS}
        ok = [r for r in runs if not r.get("error")]
        # Descriptors vary with how fragmented the two block tables are (prefix-cache reuse).
        c["kv_descriptors"] = _median(runs, "kv_descriptors")
        c["kv_descriptors_each"] = [r["kv_descriptors"] for r in ok]
        c["kv_bytes"] = ok[0]["kv_bytes"] if ok else None
        c["runs"] = len(ok)
        c["transfer_share_of_ttft"] = _div(c["kv_exposed_s"], c["ttft_s"])
        c["non_compute_share_of_ttft"] = _div(c["non_compute_s"], c["ttft_s"])
        cases[case] = c
    burst = cases.get("no_overlap", {})
    kv_bytes = burst.get("kv_bytes") or nbytes
    transfer_gbps = _div(kv_bytes / 1e9, burst.get("kv_transfer_s"))
    burst_times = [x["kv_transfer_s"] for x in result["cluster"]["runs"].get("no_overlap", [])
                   if not x.get("error") and x["kv_transfer_s"] > 0]
    transfer_gbps_best = kv_bytes / min(burst_times) / 1e9 if burst_times else None
    memcpy_gbps = result["memcpy"]["gather_gbps"]
    raw = {}
    for entry in result.get("raw_nixl", []):
        if not entry["error"]:
            label = ";".join(f"{k}={v}" for k, v in entry["env"].items() if k != "UCX_NET_DEVICES") or "default"
            raw[label] = {str(p["descriptors"]): p["median_gbps"] for p in entry["patterns"]}
    share = {c: v["transfer_share_of_ttft"] for c, v in cases.items()}
    ratio = _div(transfer_gbps, memcpy_gbps)
    aims = result["aims"]
    return {
        "kv_bytes": kv_bytes,
        "descriptors": burst.get("kv_descriptors"),
        "descriptors_overlap": cases.get("overlap", {}).get("kv_descriptors"),
        "transfer_s": burst.get("kv_transfer_s"),
        "transfer_gbps": transfer_gbps,
        "memcpy_gbps": memcpy_gbps,
        "transfer_vs_memcpy_ratio": ratio,
        "transfer_gbps_best": transfer_gbps_best,
        "transfer_vs_memcpy_ratio_best": _div(transfer_gbps_best, memcpy_gbps),
        "transfer_share_of_ttft": share,
        "non_compute_share_of_ttft": {c: v["non_compute_share_of_ttft"] for c, v in cases.items()},
        "raw_nixl_gbps": raw,
        "cases": cases,
        "meets_aims": {
            "transfer_vs_memcpy_ratio": ratio is not None and ratio >= aims["transfer_vs_memcpy_ratio"],
            "transfer_share_of_ttft_overlap": share.get("overlap") is not None
            and share["overlap"] <= aims["transfer_share_of_ttft_overlap"],
        },
    }


def _f(x: float | None, spec: str = ".1f", scale: float = 1.0) -> str:
    return "-" if x is None else format(x * scale, spec)


def format_table(r: dict) -> str:
    m, cl, s = r["model"], r["cluster"], r["settings"]
    blocks = -(-r["prompt_tokens"] // m["block_size"])
    lines = [
        f"pdserve bench transfer  {r['date']}  torch {r['torch_version']}  cpu {r['host']['cpu_model']} "
        f"x{r['host']['cpus']}  load {r['host']['load_avg_1m']:.1f}",
        f"small model, prompt {r['prompt_tokens']} tokens = {blocks} blocks x {m['block_bytes'] / 1e6:.2f} MB "
        f"= {r['kv_bytes'] / 1e6:.1f} MB; worker threads {s['threads']}, chunk {s['chunk_tokens']} tokens, "
        f"{s['repeats']} measured requests per case (median)",
        f"copy in one process (index_select of the blocks, best of {r['memcpy']['repeats']}): "
        f"{r['memcpy']['gather_s'] * 1e3:.1f} ms = {r['memcpy']['gather_gbps']:.2f} GB/s "
        f"(contiguous slice {r['memcpy']['contiguous_gbps']:.2f} GB/s)",
    ]
    for entry in r.get("raw_nixl", []):
        env = ";".join(f"{k}={v}" for k, v in entry["env"].items() if k != "UCX_NET_DEVICES") or "default UCX"
        if entry["error"]:
            lines.append(f"raw NIXL pair [{env}]: failed: {entry['error']}")
            continue
        parts = [f"{p['descriptors']} desc {p['median_ms']:.1f} ms = {p['median_gbps']:.2f} GB/s "
                 f"(post {p['median_post_ms']:.1f} ms)" for p in entry["patterns"]]
        pt = ", progress thread" if entry["progress_thread"] else ""
        lines.append(f"raw NIXL pair [{env}{pt}], median: " + "; ".join(parts))
    lines.append(f"P->D via Ray actors + NIXL [{';'.join(f'{k}={v}' for k, v in cl['env'].items())}]: "
                 f"startup {_f(cl.get('startup_s'))} s, bytes landed intact: {cl['bytes_match']}, "
                 f"errors {cl['errors']}, leaked blocks {cl['leaked_blocks']}")
    lines.append(f"  {'case':<10} {'TTFT':>8} {'prefill':>8} {'reserve':>7} {'non-comp':>8} {'transfer':>8} "
                 f"{'exposed':>8} {'desc':>5} {'exposed/TTFT':>12} {'non-comp/TTFT':>13}   (ms)")
    for case, c in r["cases"].items():
        lines.append(
            f"  {case:<10} {_f(c['ttft_s'], '.0f', 1e3):>8} {_f(c['prefill_s'], '.0f', 1e3):>8} "
            f"{_f(c['reserve_s'], '.1f', 1e3):>7} {_f(c['non_compute_s'], '.1f', 1e3):>8} "
            f"{_f(c['kv_transfer_s'], '.1f', 1e3):>8} {_f(c['kv_exposed_s'], '.1f', 1e3):>8} "
            f"{_f(c['kv_descriptors'], '.0f'):>5} "
            f"{_f(c['transfer_share_of_ttft'], '.4f'):>12} {_f(c['non_compute_share_of_ttft'], '.4f'):>13}")
    aims, meets = r["aims"], r["meets_aims"]
    lines.append(
        f"headline: transfer_gbps {_f(r['transfer_gbps'], '.2f')} (no_overlap burst) / memcpy_gbps "
        f"{_f(r['memcpy_gbps'], '.2f')} -> transfer_vs_memcpy_ratio {_f(r['transfer_vs_memcpy_ratio'], '.2f')} "
        f"(aim >= {aims['transfer_vs_memcpy_ratio']}: {'met' if meets['transfer_vs_memcpy_ratio'] else 'MISSED'}); "
        f"transfer_share_of_ttft overlap {_f(r['transfer_share_of_ttft'].get('overlap'), '.4f')} "
        f"(aim <= {aims['transfer_share_of_ttft_overlap']}: "
        f"{'met' if meets['transfer_share_of_ttft_overlap'] else 'MISSED'}), "
        f"no_overlap {_f(r['transfer_share_of_ttft'].get('no_overlap'), '.4f')}; best burst "
        f"{_f(r['transfer_gbps_best'], '.2f')} GB/s = {_f(r['transfer_vs_memcpy_ratio_best'], '.2f')} of memcpy")
    return "\n".join(lines)


def _kv_per_token(result: dict) -> str:
    kv = next((v["kv_bytes"] for v in result["links"].values() if v.get("kv_bytes")), None)
    return f"{kv / result['prompt_tokens'] / 1024:.1f} KiB" if kv else "? KiB"


def format_links(result: dict) -> str:
    """The ``--link`` run as a table: one row per link rate."""
    host = result["host"]
    lines = [f"pdserve bench transfer --link  {result['date']}  cpu {host['cpu_model']} x{host['cpus']}  "
             f"prompt {result['prompt_tokens']} tokens, small model ({_kv_per_token(result)} of KV per token), "
             "UCX over TCP between emulated hosts",
             f"{'link':>8} {'transfer':>10} {'util':>6} {'ttft ovl':>9} {'ttft no':>9} {'share ovl':>9} "
             f"{'share no':>9} {'hidden<=':>9} {'wire/kv':>8} {'err':>4} {'leak':>5}"]
    for rate, v in result["links"].items():
        def f(x, fmt):
            return format(x, fmt) if x is not None else "-"
        lines.append(f"{rate:>8} {f(v['transfer_gbps'], '8.2f')}Gb {f(v['link_utilization'], '6.2f')} "
                     f"{f(v['ttft_s'].get('overlap'), '8.3f')}s {f(v['ttft_s'].get('no_overlap'), '8.3f')}s "
                     f"{f(v['transfer_share_of_ttft'].get('overlap'), '9.3f')} "
                     f"{f(v['transfer_share_of_ttft'].get('no_overlap'), '9.3f')} "
                     f"{f(v['hidden_up_to_tokens'], '9d')} {f(v['wire_bytes_per_kv_byte'], '8.2f')} "
                     f"{v['errors']:>4} {v['leaked_blocks']:>5}")
        lines.append(f"{'':>8} overlap share by prompt length: "
                     + ", ".join(f"{n}: {f(x, '.3f')}" for n, x in v["share_by_length"].items())
                     + f"; break-even link {f(v.get('break_even_gbps'), '.2f')} Gbit/s")
    return "\n".join(lines)

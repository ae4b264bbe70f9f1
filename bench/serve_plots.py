"""PNG plots of `pdserve bench serve` runs: latency CDFs (TTFT and ITL) per server, an ITL
timeline that shows stalls, and goodput against request rate. matplotlib (a dependency) draws
them off-screen; every function writes one file and returns its path."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from pdserve.bench.serve_stats import RequestRecord, gaps, ttft


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, axes, title: str, path: Path, legend_loc: str = "best") -> Path:
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc=legend_loc)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _cdf(ax, values: Sequence[float], label: str) -> None:
    xs = sorted(values)
    if xs:
        ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=f"{label} (n={len(xs)})")


def latency_cdfs(path: Path, series: Mapping[str, Sequence[RequestRecord]], title: str) -> Path:
    """TTFT and inter-token latency CDFs, one line per server (completed requests only)."""
    plt = _pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for label, recs in series.items():
        ok = [r for r in recs if r.ok]
        _cdf(a, [t * 1000 for r in ok if (t := ttft(r)) is not None], label)
        _cdf(b, [g * 1000 for r in ok for g in gaps(r.token_times)], label)
    a.set(title="time to first token", xlabel="ms", ylabel="fraction of requests")
    b.set(title="inter-token latency", xlabel="ms (log)", ylabel="fraction of gaps", xscale="log")
    return _save(plt, fig, (a, b), title, path)


def itl_timeline(path: Path, series: Mapping[str, Sequence[RequestRecord]], group: str,
                 stall_threshold_s: float, title: str) -> Path:
    """Every gap between two tokens of ``group``'s streams against when it ended (seconds from the
    run's first request), one panel per server, with the stall threshold drawn across."""
    plt = _pyplot()
    fig, axes = plt.subplots(len(series), 1, figsize=(11, 2.6 * max(1, len(series))), sharex=True, squeeze=False)
    for ax, (label, recs) in zip(axes[:, 0], series.items()):
        sent = [r.sent for r in recs if r.sent is not None]
        t0 = min(sent) if sent else 0.0
        xs, ys = [], []
        for r in recs:
            if r.group != group:
                continue
            for prev, cur in zip(r.token_times, r.token_times[1:]):
                xs.append(cur - t0)
                ys.append((cur - prev) * 1000)
        ax.scatter(xs, ys, s=3, alpha=0.6)
        ax.axhline(stall_threshold_s * 1000, color="red", lw=0.8, ls="--", label=f"stall ({stall_threshold_s:g} s)")
        ax.set(ylabel="gap, ms (log)", yscale="log", title=label)
    axes[-1, 0].set_xlabel("seconds from the first request")
    return _save(plt, fig, axes[:, 0], title, path, legend_loc="upper right")


def goodput_vs_rate(path: Path, sweeps: Mapping[str, Sequence[Mapping]], title: str) -> Path:
    """Goodput and the share of requests within SLO against the offered rate, per server
    (``sweeps[label]`` = points with ``rate``, ``goodput_req_per_s``, ``slo_met_frac``)."""
    plt = _pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for label, points in sweeps.items():
        pts = sorted(points, key=lambda p: p["rate"])
        a.plot([p["rate"] for p in pts], [p.get("goodput_req_per_s") or 0.0 for p in pts], marker="o", label=label)
        b.plot([p["rate"] for p in pts], [p.get("slo_met_frac") or 0.0 for p in pts], marker="o", label=label)
    a.set(title="goodput", xlabel="offered requests/s", ylabel="requests/s within both SLOs")
    b.set(title="requests within SLO", xlabel="offered requests/s", ylabel="fraction", ylim=(0, 1.05))
    b.axhline(0.9, color="grey", lw=0.8, ls="--")
    return _save(plt, fig, (a, b), title, path)

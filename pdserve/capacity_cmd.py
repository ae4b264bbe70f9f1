"""The capacity subcommands: ``pdserve profile``, ``pdserve plan`` and ``pdserve simulate``
(``docs/capacity.md`` walks through them)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


MAX_REQUESTS = 50_000_000   # as a traffic file's `requests`


def _load(args: argparse.Namespace):
    from pdserve.capacity.profile import Profile, ProfileError
    from pdserve.capacity.traffic import Traffic, TrafficError
    from pdserve.engine.errors import InvalidRequestError

    try:
        profile, traffic = Profile.load(args.profile), Traffic.load(args.traffic)
        if args.link_gbps is not None or args.link_json is not None:
            profile = profile.with_link(gbps=args.link_gbps, link_json=args.link_json, rate=args.link)
        elif args.link is not None:
            raise ProfileError("--link names a rate of --link-json")
        return profile, traffic
    except (ProfileError, TrafficError) as exc:
        raise InvalidRequestError(str(exc)) from None


def run_simulate(args: argparse.Namespace) -> int:
    from pdserve.capacity.simulate import ClusterShape, simulate
    from pdserve.engine.errors import InvalidRequestError

    profile, traffic = _load(args)
    if args.requests is not None and not 1 <= args.requests <= MAX_REQUESTS:
        raise InvalidRequestError(f"--requests must be between 1 and {MAX_REQUESTS:,}")
    planner = None
    try:
        if args.planner is not None:
            planner, mode = _planner(args, profile)
            prefill, decode = planner.setup.prefill.initial, planner.setup.decode.initial
        else:
            if args.worker_start_s is not None:
                raise InvalidRequestError("--worker-start-s is the simulated planner's; give it with --planner")
            mode = args.mode or "disaggregated"
            prefill = 1 if args.prefill is None else args.prefill
            decode = 1 if args.decode is None else args.decode
        shape = ClusterShape(mode, prefill, decode, local_prefill_max_tokens=args.local_prefill_max_tokens,
                             itl_target_s=traffic.slo.itl_s, shared_host=args.shared_host)
        if planner is not None and shape.shared_host:
            raise ValueError("--shared-host pairs fixed workers; it does not go with --planner")
    except ValueError as exc:
        raise InvalidRequestError(str(exc)) from None
    arrays = traffic.draw(args.requests)
    result = simulate(profile, shape, *arrays, planner=planner)
    out = {"shape": {"mode": shape.mode, "prefill": shape.prefill, "decode": shape.decode},
           "traffic": {"peak_rate": traffic.peak_rate, "requests": len(arrays[0])}, **result.summary()}
    if planner is not None:
        setup = planner.setup
        out["planner"]["setup"] = {
            "config": str(args.planner), "interval_s": setup.interval_s, "worker_start_s": setup.worker_start_s,
            "capacity_model": setup.use_model,
            "prefill": [setup.prefill.min_replicas, setup.prefill.initial, setup.prefill.max_replicas],
            "decode": [setup.decode.min_replicas, setup.decode.initial, setup.decode.max_replicas]}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    print(format_sim(out))
    return 0


def _planner(args: argparse.Namespace, profile):
    """The simulated planner from ``--planner CONFIG``: (SimPlanner, mode)."""
    from pdserve.capacity.sim_planner import SimPlanner
    from pdserve.engine.errors import InvalidRequestError

    given = [f for f, v in (("--prefill", args.prefill), ("--decode", args.decode), ("--mode", args.mode))
             if v is not None]
    if given:
        raise InvalidRequestError(f"with --planner the mode and the pools' sizes come from {args.planner} "
                                  f"(disaggregation.mode; initial, min and max replicas): drop {', '.join(given)}")
    start = profile.worker_start_s if args.worker_start_s is None else args.worker_start_s
    setup, mode = load_planner_setup(args.planner, worker_start_s=start)   # ConfigError: a 4xx already
    max_seqs = int(profile.engine["max_num_seqs"])
    return SimPlanner(setup, profile, mode, max_seqs), mode


def load_planner_setup(path: str | Path, *, worker_start_s: float) -> tuple[PlannerSetup, str]:
    """The simulated planner's settings, pool bounds and mode from a cluster config file:
    (setup, mode) for ``pdserve simulate --planner``."""
    from pdserve.capacity.sim_planner import PlannerSetup, PoolBounds
    from pdserve.cluster.config_io import load_config

    config = load_config(path, check_paths=False)
    mode = {"always": "disaggregated", "conditional": "conditional",
            "never": "colocated"}[config.router.disaggregation.mode]
    bounds = {}
    for name in ("prefill", "decode"):
        pool = getattr(config, name)
        if pool.max_replicas is None:
            raise ValueError(f"{path}: set {name}.max_replicas to simulate the planner (the default, "
                             f"'as many as Ray has room for', depends on a real cluster)")
        if mode == "colocated" and name == "prefill":
            bounds[name] = PoolBounds(0, 0, 0)
        else:
            bounds[name] = PoolBounds(pool.min_replicas, pool.initial_replicas, pool.max_replicas)
    p = config.planner
    if not p.enabled:
        raise ValueError(f"{path}: planner.enabled is false; nothing to simulate")
    setup = PlannerSetup(config.planner_policy(), bounds["prefill"], bounds["decode"], interval_s=p.interval_s,
                         worker_start_s=worker_start_s, use_model=p.profile is not None,
                         window_s=p.traffic_window_s)
    return setup, mode


def format_sim(out: dict) -> str:
    def ms(d: dict, k: str) -> str:
        v = d.get(k)
        return "-" if v is None else f"{v * 1e3:.0f} ms"

    s = out["shape"]
    lines = [f"{s['mode']}: {s['prefill']} prefill + {s['decode']} decode workers, {out['requests']} requests "
             f"over {out['span_s']:.1f} simulated s",
             f"  output {out['output_tokens_per_s']:.1f} tok/s   TTFT p50 {ms(out['ttft_s'], 'p50')} p99 "
             f"{ms(out['ttft_s'], 'p99')}   ITL p50 {ms(out['itl_s'], 'p50')} p99 {ms(out['itl_s'], 'p99')}   "
             f"e2e p50 {ms(out['e2e_s'], 'p50')} p99 {ms(out['e2e_s'], 'p99')}",
             f"  simulated in {out['sim_wall_s']:.2f} s ({out['events']} events)"]
    if (pl := out.get("planner")) is not None:
        su = pl.get("setup", {})
        ws = pl["worker_seconds"]
        lines.append(f"  planner ({su.get('config', '')}; every {su.get('interval_s', '?')} s, workers start in "
                     f"{su.get('worker_start_s', 0):.0f} s, capacity model {'on' if su.get('capacity_model') else 'off'}): "
                     f"{pl['scale_ups']} scale-ups, {pl['scale_downs']} scale-downs; most replicas "
                     f"{pl['most_replicas']['prefill']} prefill + {pl['most_replicas']['decode']} decode; "
                     f"worker-hours {ws['prefill'] / 3600:.2f} prefill + {ws['decode'] / 3600:.2f} decode")
        for d in pl["decisions"][:20]:
            lines.append(f"    t={d['t']:.0f} s {d['pool']} {d['action']} {d['from']} -> {d['to']}: {d['reason']}")
        if len(pl["decisions"]) > 20:
            lines.append(f"    ... {len(pl['decisions']) - 20} more in the JSON")
    lines += [f"  note: {n}" for n in out.get("notes", [])]
    return "\n".join(lines)


def run_plan(args: argparse.Namespace) -> int:
    from pdserve.capacity.plan import format_plan, make_plan

    profile, traffic = _load(args)
    plan = make_plan(profile, traffic, verify=not args.no_simulate, max_workers=args.max_workers)
    if args.json:
        Path(args.json).write_text(json.dumps(plan, indent=2) + "\n")
    print(format_plan(plan))
    return 0


def _add_link(p: argparse.ArgumentParser) -> None:
    p.add_argument("--link-gbps", type=float, help="KV handoffs cross a network link of this many Gbit/s (what-if)")
    p.add_argument("--link-json", help="KV handoffs at the rate `pdserve bench transfer --link` measured (its JSON)")
    p.add_argument("--link", help="which rate of --link-json (e.g. 10gbit; default: its only one)")


def add_profile_args(p: argparse.ArgumentParser) -> None:
    from pdserve.bench import profiler

    p.description = (profiler.__doc__ or "").strip()
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    profiler.add_args(p)


def run_profile(args: argparse.Namespace) -> int:
    from pdserve.bench.profiler import run

    return run(args)


def add_plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", required=True, help="a `pdserve profile` JSON")
    p.add_argument("--traffic", required=True, help="traffic YAML/JSON (see docs/capacity.md)")
    p.add_argument("--json", help="also write the plan here")
    p.add_argument("--no-simulate", action="store_true", help="the arithmetic only, not checked by simulation")
    p.add_argument("--max-workers", type=int, default=100_000, help="largest pool the search considers")
    _add_link(p)


def add_simulate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", required=True, help="a `pdserve profile` JSON")
    p.add_argument("--traffic", required=True, help="traffic YAML/JSON (see docs/capacity.md)")
    p.add_argument("--prefill", type=int, help="prefill workers (0 with --mode colocated; default 1)")
    p.add_argument("--decode", type=int, help="decode workers (colocated: workers; default 1)")
    p.add_argument("--mode", choices=["disaggregated", "conditional", "colocated"],
                   help="default: disaggregated")
    p.add_argument("--planner", metavar="CONFIG", help="a cluster config (YAML): its planner scales the "
                   "simulated pools between their min and max replicas, from their initial ones, in the mode "
                   "of its disaggregation.mode")
    p.add_argument("--worker-start-s", type=float, help="with --planner: seconds a new worker takes to "
                   "serve (default: the profile's worker start)")
    p.add_argument("--local-prefill-max-tokens", type=int, default=64, help="conditional mode's threshold")
    p.add_argument("--requests", type=int, help="requests to draw (default: the traffic file's)")
    p.add_argument("--shared-host", action="store_true", help="prefill worker i and decode worker i share a host "
                   "(as `pdserve up` on one machine): their steps slow each other by the profile's co-run factors")
    p.add_argument("--json", help="write the result here")
    _add_link(p)


if __name__ == "__main__":   # pragma: no cover - `python -m pdserve.capacity_cmd`: the `pdserve` command
    from pdserve.cli import main

    sys.exit(main())

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


def _simulate(args: argparse.Namespace) -> int:
    from pdserve.capacity.simulate import ClusterShape, simulate
    from pdserve.engine.errors import InvalidRequestError

    profile, traffic = _load(args)
    if args.requests is not None and not 1 <= args.requests <= MAX_REQUESTS:
        raise InvalidRequestError(f"--requests must be between 1 and {MAX_REQUESTS:,}")
    try:
        shape = ClusterShape(args.mode, args.prefill, args.decode, local_prefill_max_tokens=args.local_prefill_max_tokens,
                             itl_target_s=traffic.slo.itl_s, shared_host=args.shared_host)
    except ValueError as exc:
        raise InvalidRequestError(str(exc)) from None
    arrays = traffic.draw(args.requests)
    result = simulate(profile, shape, *arrays)
    out = {"shape": {"mode": shape.mode, "prefill": shape.prefill, "decode": shape.decode},
           "traffic": {"peak_rate": traffic.peak_rate, "requests": len(arrays[0])}, **result.summary()}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    print(format_sim(out))
    return 0


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
    lines += [f"  note: {n}" for n in out.get("notes", [])]
    return "\n".join(lines)


def _plan(args: argparse.Namespace) -> int:
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


def _profile(args: argparse.Namespace) -> int:
    from pdserve.bench.profile import run

    return run(args)


def register(sub: argparse._SubParsersAction) -> None:
    from pdserve.bench import profile

    p = sub.add_parser("profile", help="measure a model on this host into a capacity profile (JSON)",
                       description=(profile.__doc__ or "").strip(), formatter_class=argparse.RawDescriptionHelpFormatter)
    profile.add_args(p)
    p.set_defaults(func=_profile)

    p = sub.add_parser("plan", help="prefill and decode replicas for a traffic description, with the arithmetic")
    p.add_argument("--profile", required=True, help="a `pdserve profile` JSON")
    p.add_argument("--traffic", required=True, help="traffic YAML/JSON (see docs/capacity.md)")
    p.add_argument("--json", help="also write the plan here")
    p.add_argument("--no-simulate", action="store_true", help="the arithmetic only, not checked by simulation")
    p.add_argument("--max-workers", type=int, default=100_000, help="largest pool the search considers")
    _add_link(p)
    p.set_defaults(func=_plan)

    p = sub.add_parser("simulate", help="simulate a cluster shape under a traffic description")
    p.add_argument("--profile", required=True, help="a `pdserve profile` JSON")
    p.add_argument("--traffic", required=True, help="traffic YAML/JSON (see docs/capacity.md)")
    p.add_argument("--prefill", type=int, default=1, help="prefill workers (0 with --mode colocated)")
    p.add_argument("--decode", type=int, default=1, help="decode workers (colocated: workers)")
    p.add_argument("--mode", default="disaggregated", choices=["disaggregated", "conditional", "colocated"])
    p.add_argument("--local-prefill-max-tokens", type=int, default=64, help="conditional mode's threshold")
    p.add_argument("--requests", type=int, help="requests to draw (default: the traffic file's)")
    p.add_argument("--shared-host", action="store_true", help="prefill worker i and decode worker i share a host "
                   "(as `pdserve up` on one machine): their steps slow each other by the profile's co-run factors")
    p.add_argument("--json", help="write the result here")
    _add_link(p)
    p.set_defaults(func=_simulate)


def main() -> int:   # pragma: no cover - `python -m pdserve.bench.capacity_cli`
    parser = argparse.ArgumentParser(prog="pdserve")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args()
    return int(args.func(args) or 0)


if __name__ == "__main__":   # pragma: no cover
    sys.exit(main())

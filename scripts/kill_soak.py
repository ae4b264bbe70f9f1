"""Worker kills under load: streams keep their exact tokens, and nothing leaks.

Starts a real cluster on 127.0.0.1 the way the integration tests do (local Ray, a password-
protected embedded Redis for the ledger, the router with two prefill and two decode workers on
the generated tiny test model, float32), then:

1. runs ``--requests`` greedy streams (``--concurrency`` at a time, 32-64 tokens each, through
   the unmodified ``openai`` client over HTTP) with no fault: the reference tokens;
2. runs the same streams again and, when ``--kill-prefill-at`` / ``--kill-decode-at`` of them
   have completed, SIGKILLs a prefill worker and then a decode worker, each one that holds a
   request at that moment if the router's view shows one;
3. waits (bounded) for the reaper and the workers' timeouts, and counts the ledger's live
   entries and the KV blocks the surviving workers still hold.

Prints the host's CPU model, the date and one JSON object (requests, completed, failed with
reasons, token sequences identical to the reference, the router's retries and migrations, what
was killed when, ledger entries and blocks held after, wall times). Exits 1 if a request failed,
a token differs, a kill did not happen, or anything was left held. Every wait is bounded; the
whole run takes about two minutes on two cores.

    .venv/bin/python scripts/kill_soak.py --requests 200 --seed 1

``--chaos`` (issue 11's chaos scenario, also ``pdserve bench serve --scenario chaos``): 1,000
streams by default; ``--kills`` workers SIGKILLed at random moments (seeded: a random role and
completion count each, at least one of each role), the embedded Redis SIGKILLed once and started
again on its port ``--redis-outage-s`` later; both pools keep two replicas (a killed worker is
replaced). The report adds ``lost`` (requests with neither their tokens nor an explicit error:
must be 0), ``duplicated_tokens`` / ``missing_tokens`` / ``wrong_tokens`` (each completed stream
aligned with its fault-free tokens), and ``leaked_blocks`` (summed over the live workers). It
passes with ``completed`` >= 90% of the requests, no lost request, no duplicated, missing or wrong
token and nothing left held (a stream whose first differing token was a near-tie, its two best
logits within ``NEAR_TIE_LOGIT`` as transformers reads the same weights, diverged by float
summation order, not by a fault: it is listed with its margin and counted in
``near_tie_divergences``, its tokens in none of the three); a failed request (an explicit error) is counted, not a failure. A
scheduled kill that finds no live worker of its role (every one of them is being replaced at
that moment) is skipped and recorded (its ``skipped`` reason, and ``kills_skipped`` in the
report), not a failure: the run goes on with the next kill.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import random
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

# Before torch and ray are imported: one torch thread per process (the cores are shared), Ray on
# the loopback interface, workers at normal priority, no network look-ups for the model.
for _key, _value in (("OMP_NUM_THREADS", "1"), ("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1")):
    os.environ.setdefault(_key, _value)

from pdserve.bench.hw import cpu_model  # noqa: E402
from pdserve.cluster.runtime.ray_env import LOOPBACK_IP, use_loopback  # noqa: E402

use_loopback()

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "tests"))  # the harness the integration tests drive the router with

import ray  # noqa: E402
from cluster_helpers import ClusterHarness, cluster_config, wait_until  # noqa: E402
from pdserve.cluster.state.redis_server import EmbeddedRedis  # noqa: E402
from pdserve.engine.testmodel import ensure_model  # noqa: E402

logger = logging.getLogger("kill_soak")

WORDS = ("cook ticket dish order table oven pan knife salt bread soup plate rice fire lemon herb "
         "kitchen window garden river stone paper clock music engine signal lamp harbor market").split()
STREAM_TIMEOUT_S = 120.0
DRAIN_TIMEOUT_S = 60.0  # reserved blocks whose sender died are freed by the workers' 30 s timeout


@dataclass(frozen=True, slots=True)
class Job:
    index: int
    prompt: str
    max_tokens: int


@dataclass(slots=True)
class Outcome:
    tokens: list[int] | None = None
    error: str | None = None
    attempts: int = 0
    migrations: int = 0
    lost: bool = False


@dataclass(slots=True)
class Kill:
    role: str
    at_completed: int
    worker_id: str = ""
    held_a_request: bool = False
    seconds_into_run: float = 0.0
    skipped: str = ""   # why the kill did not happen: no live worker of its role to kill


@dataclass(slots=True)
class RunResult:
    outcomes: dict[int, Outcome] = field(default_factory=dict)
    wall_s: float = 0.0
    kills: list[Kill] = field(default_factory=list)


def make_jobs(n: int, seed: int) -> list[Job]:
    """``n`` distinct prompts (40-160 words, so most are prefilled in several 64-token chunks)."""
    rng = random.Random(seed)
    return [Job(i, f"Order {i}: " + " ".join(rng.choices(WORDS, k=rng.randint(40, 160))) + ".",
                rng.randint(32, 64)) for i in range(n)]


def stream(h: ClusterHarness, job: Job) -> Outcome:
    """One greedy stream; its token ids and phase record, or the error that ended it."""
    try:
        chunks = h.openai(timeout_s=STREAM_TIMEOUT_S).completions.create(
            model=h.model_name, prompt=job.prompt, max_tokens=job.max_tokens, temperature=0, stream=True,
            extra_body={"ignore_eos": True})
        out = Outcome(tokens=[])
        for chunk in chunks:
            extra = (chunk.model_extra or {}).get("pdserve") or {}
            out.tokens.extend(extra.get("token_ids", []))
            phase = extra.get("phase") or {}
            out.attempts = int(phase.get("attempts", out.attempts))
            out.migrations = int(phase.get("migrations", out.migrations))
        if len(out.tokens) != job.max_tokens:
            # The stream ended without an error event and without all its tokens: lost, not failed.
            out.lost = True
            out.error = f"short stream: {len(out.tokens)} of {job.max_tokens} tokens, no error"
        return out
    except Exception as exc:  # a failed request is a result to report, not a crash of the soak
        return Outcome(error=f"{type(exc).__name__}: {str(exc)[:200]}")


def kill_one(h: ClusterHarness, kill: Kill, t0: float, redis: EmbeddedRedis | None = None,
             redis_outage_s: float = 2.0) -> None:
    """SIGKILL a worker of ``kill.role`` (one holding a request if one shows up within 5 s), or,
    for role ``redis``, the Redis server, started again on its port ``redis_outage_s`` later."""
    if kill.role == "redis":
        assert redis is not None
        pid = redis.pid
        redis.kill()
        kill.worker_id = f"redis (pid {pid})"
        kill.seconds_into_run = round(time.monotonic() - t0, 2)
        logger.info("killed Redis at %d completed; starting it again in %.1f s", kill.at_completed, redis_outage_s)
        time.sleep(redis_outage_s)
        redis.start_again()
        return
    victim = None
    try:
        victim = h.wait_busy(kill.role, timeout_s=5.0, poll_s=0.001)
        kill.held_a_request = True
    except TimeoutError:
        members = h.members(kill.role)
        victim = members[0] if members else None
    if victim is None:
        kill.skipped = f"no live {kill.role} worker to kill"
        kill.seconds_into_run = round(time.monotonic() - t0, 2)
        logger.warning("kill at %d completed skipped: %s", kill.at_completed, kill.skipped)
        return
    h.kill(victim)
    kill.worker_id = victim.worker_id
    kill.seconds_into_run = round(time.monotonic() - t0, 2)
    # The next kill must see this death (a worker still listed would be "killed" twice).
    try:
        wait_until(lambda: all(m.worker_id != victim.worker_id for m in h.members(kill.role)), 30.0,
                   f"{victim.worker_id} seen dead")
    except TimeoutError:
        logger.warning("%s still listed 30 s after its kill", victim.worker_id)
    logger.info("killed %s at %d completed (held a request: %s)", victim.worker_id, kill.at_completed,
                kill.held_a_request)


def run(h: ClusterHarness, jobs: list[Job], concurrency: int, kills: list[Kill],
        redis: EmbeddedRedis | None = None, redis_outage_s: float = 2.0) -> RunResult:
    """All ``jobs``, ``concurrency`` at a time; each kill fires once its count of completions is reached."""
    result = RunResult(kills=kills)
    done = threading.Condition()
    pending = sorted(kills, key=lambda k: k.at_completed)
    t0 = time.monotonic()

    def one(job: Job) -> None:
        out = stream(h, job)
        with done:
            result.outcomes[job.index] = out
            done.notify_all()

    def killer() -> None:
        for kill in pending:
            with done:
                done.wait_for(lambda: len(result.outcomes) >= kill.at_completed, timeout=STREAM_TIMEOUT_S * 3)
            if len(result.outcomes) < len(jobs):
                if kill.role != "redis":
                    # a worker killed a moment ago may still be being replaced: wait (bounded) for
                    # its pool to be whole again, so that a kill never takes the last replica
                    try:
                        wait_until(lambda r=kill.role: len(h.members(r)) >= 2, 90.0, f"two {kill.role} workers")
                    except TimeoutError:
                        logger.warning("%s pool not whole again before the next kill", kill.role)
                kill_one(h, kill, t0, redis, redis_outage_s)

    thread = threading.Thread(target=killer, name="killer", daemon=True)
    thread.start()
    with ThreadPoolExecutor(concurrency, thread_name_prefix="client") as pool:
        list(pool.map(one, jobs))
    thread.join(30)
    result.wall_s = round(time.monotonic() - t0, 2)
    return result


def chaos_kills(args: argparse.Namespace, n: int) -> list[Kill]:
    """``args.kills`` worker kills at random completion counts between 10% and 80% of the run (at
    least one prefill and one decode), plus the Redis restart at a random count among them."""
    rng = random.Random(f"chaos-{args.seed}")
    roles = ["prefill", "decode"] + [rng.choice(("prefill", "decode")) for _ in range(max(0, args.kills - 2))]
    rng.shuffle(roles)
    counts = sorted(rng.sample(range(max(1, n // 10), max(2, 8 * n // 10)), len(roles) + 1))
    redis_at = counts.pop(rng.randrange(len(counts)))
    kills = [Kill(role, c) for role, c in zip(roles, counts)] + [Kill("redis", redis_at)]
    return sorted(kills, key=lambda k: k.at_completed)


# A stream whose first token that differs from the fault-free run's was chosen between two logits
# closer than this diverged at a near-tie, not through a fault: greedy decoding picks the larger of
# two logits that differ by 1e-5 according to the order of the float sums, and that order changes
# with the batch a sequence decodes in (its rows, its bucket), which the kills change. Tokens
# after such a point are another valid continuation, counted apart (``near_tie_divergences``).
NEAR_TIE_LOGIT = 1e-3


@functools.lru_cache(maxsize=2)
def _reference_model(model_dir: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoTokenizer.from_pretrained(model_dir),
            AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval())


def top2_margin(model_dir: str, prompt: str, tokens: list[int]) -> float:
    """The gap between the two largest next-token logits after ``prompt`` and ``tokens`` (the
    model in float32, through transformers: an independent reading of the same weights)."""
    import torch

    tok, model = _reference_model(model_dir)
    ids = tok(prompt)["input_ids"] + list(tokens)
    with torch.no_grad():
        top = torch.topk(model(torch.tensor([ids])).logits[0, -1].double(), 2).values
    return float(top[0] - top[1])


def token_diff(ref: list[int], got: list[int]) -> tuple[int, int, int]:
    """(duplicated, missing, wrong) tokens of ``got`` against ``ref``, by alignment: a token
    sent twice after a resume shows as an insertion, one skipped as a deletion."""
    import difflib

    dup = miss = wrong = 0
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(a=ref, b=got, autojunk=False).get_opcodes():
        if op == "insert":
            dup += j2 - j1
        elif op == "delete":
            miss += i2 - i1
        elif op == "replace":
            wrong += max(i2 - i1, j2 - j1)
    return dup, miss, wrong


def held_after(h: ClusterHarness, timeout_s: float) -> tuple[dict[str, int], list[str], float]:
    """Blocks still held per live worker and live ledger entries, once settled (or at the bound)."""
    t0 = time.monotonic()
    blocks: dict[str, int] = {}
    entries: list[str] = []

    def settled() -> bool:
        blocks.clear()
        blocks.update(h.blocks_in_use())
        entries[:] = [f"{e.request_id}:{e.state.value}" for e in h.ledger_active()]
        return not any(blocks.values()) and not entries

    try:
        wait_until(settled, timeout_s, "blocks freed and ledger empty", 0.2)
    except TimeoutError:
        pass  # reported as a leak below
    return blocks, entries, round(time.monotonic() - t0, 2)


def soak(args: argparse.Namespace) -> dict:
    jobs = make_jobs(args.requests, args.seed)
    model = ensure_model("tiny", "llama")
    pools = {"prefill.initial_replicas": 2, "prefill.max_replicas": 2,
             "decode.initial_replicas": 2, "decode.max_replicas": 2}
    if args.chaos:  # a killed worker is replaced: the pools never run out after several kills
        pools.update({"prefill.min_replicas": 2, "decode.min_replicas": 2})
    config = cluster_config(model, **pools)
    report: dict = {"host": {"cpu": cpu_model(), "cores": os.cpu_count()},
                    "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                    "requests": len(jobs), "concurrency": args.concurrency, "seed": args.seed}
    redis = EmbeddedRedis(password=f"pw-{uuid.uuid4().hex}")  # in memory and a 0600 file, never argv
    redis.start()
    t_start = time.monotonic()
    ray.init(address="local", _node_ip_address=LOOPBACK_IP, include_dashboard=False, num_cpus=8,
             namespace=f"kill-soak-{uuid.uuid4().hex[:8]}", log_to_driver=False,
             runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}})
    h = ClusterHarness(config, redis.url)
    try:
        h.start()
        report["startup_s"] = round(time.monotonic() - t_start, 2)
        ref = run(h, jobs, args.concurrency, [])
        report["reference"] = {"wall_s": ref.wall_s, "failed": sum(o.error is not None for o in ref.outcomes.values())}
        ref_failures = {i: o.error for i, o in ref.outcomes.items() if o.error}
        retries0, migrations0 = h.service.backend.retries, h.service.backend.migrations
        kills = chaos_kills(args, len(jobs)) if args.chaos else [
            Kill("prefill", max(1, round(args.kill_prefill_at * len(jobs)))),
            Kill("decode", max(1, round(args.kill_decode_at * len(jobs))))]
        faulty = run(h, jobs, args.concurrency, kills, redis, args.redis_outage_s)
        for kill in faulty.kills:  # the router has seen the deaths before anything is counted
            if kill.worker_id and kill.role != "redis" and not kill.skipped:
                wait_until(lambda k=kill: all(m.worker_id != k.worker_id for m in h.members(k.role)), 60.0,
                           f"{kill.worker_id} seen dead")
        blocks, entries, settle_s = held_after(h, DRAIN_TIMEOUT_S)
        outs = faulty.outcomes
        failed = {i: o.error for i, o in outs.items() if o.error and not o.lost}
        lost = [i for i in range(len(jobs)) if i not in outs or outs[i].lost]
        dup = miss = wrong = near_ties = 0
        differing = []
        for i, o in outs.items():
            if o.tokens is not None and not o.lost and ref.outcomes[i].tokens is not None:
                d, m, w = token_diff(ref.outcomes[i].tokens, o.tokens)
                if d or m or w:
                    first = next((k for k, (a, b) in enumerate(zip(ref.outcomes[i].tokens, o.tokens)) if a != b), None)
                    margin = None if first is None else top2_margin(str(model), jobs[i].prompt,
                                                                    ref.outcomes[i].tokens[:first])
                    near_tie = margin is not None and margin < NEAR_TIE_LOGIT
                    differing.append({"request": i, "first_difference_at": first, "of": len(o.tokens),
                                      "attempts": o.attempts, "migrations": o.migrations,
                                      "duplicated": d, "missing": m, "wrong": w,
                                      "top2_logit_margin_there": margin, "near_tie": near_tie})
                    if near_tie:
                        near_ties += 1
                        continue
                dup, miss, wrong = dup + d, miss + m, wrong + w
        identical = sum(1 for i, o in outs.items() if o.tokens is not None and ref.outcomes[i].tokens == o.tokens)
        compared = sum(1 for i, o in outs.items() if o.tokens is not None and ref.outcomes[i].tokens is not None)
        report.update({
            "completed": sum(o.error is None for o in outs.values()),
            "failed": len(failed),
            "lost": len(lost),
            "duplicated_tokens": dup, "missing_tokens": miss, "wrong_tokens": wrong,
            "leaked_blocks": sum(blocks.values()),
            "differing_streams": differing[:20],
            "failure_reasons": sorted({r for r in failed.values()})[:10],
            "reference_failures": sorted(set(ref_failures.values()))[:10],
            "identical_to_reference": identical,
            "differing_from_reference": compared - identical,
            "near_tie_divergences": near_ties,
            "router_retries": h.service.backend.retries - retries0,
            "router_migrations": h.service.backend.migrations - migrations0,
            "streams_with_a_retry": sum(o.attempts > 1 and o.migrations == 0 for o in outs.values()),
            "streams_migrated": sum(o.migrations > 0 for o in outs.values()),
            "kills": [asdict(k) for k in faulty.kills],
            "kills_skipped": sum(bool(k.skipped) for k in faulty.kills),
            "wall_s": faulty.wall_s,
            "live_ledger_entries_after": len(entries),
            "ledger_entries_sample": entries[:5],
            "blocks_held_after": blocks,
            "settle_s": settle_s,
        })
    finally:
        h.stop()
        ray.shutdown()
        redis.stop()
    report["total_s"] = round(time.monotonic() - t_start, 2)
    return report


def verdict(report: dict, chaos: bool = False) -> list[str]:
    """What is wrong with a run (empty when it passed)."""
    if chaos:
        return chaos_verdict(report)
    problems = []
    if report["reference_failures"]:
        problems.append(f"{report['reference']['failed']} requests of the fault-free run failed")
    if report["failed"]:
        problems.append(f"{report['failed']} requests failed")
    unexplained = report["requests"] - report["identical_to_reference"] - report.get("near_tie_divergences", 0)
    if unexplained:
        problems.append(f"{unexplained} token sequences not identical (and not diverged at a near-tie)")
    if any(k["skipped"] for k in report["kills"]):
        problems.append("a kill found no worker to kill")
    elif any(not k["worker_id"] for k in report["kills"]):
        problems.append("a kill did not happen (the run ended first)")
    if report["live_ledger_entries_after"] or any(report["blocks_held_after"].values()):
        problems.append("ledger entries or KV blocks left held")
    return problems


def chaos_verdict(report: dict) -> list[str]:
    problems = []
    if report["reference_failures"]:
        problems.append(f"{report['reference']['failed']} requests of the fault-free run failed")
    if report["completed"] < 0.9 * report["requests"]:
        problems.append(f"only {report['completed']} of {report['requests']} completed (< 90%)")
    for name in ("lost", "duplicated_tokens", "missing_tokens", "wrong_tokens", "leaked_blocks",
                 "live_ledger_entries_after"):
        if report[name]:
            problems.append(f"{name}: {report[name]}")
    if any(not k["worker_id"] and not k.get("skipped") for k in report["kills"]):
        problems.append("a kill did not happen (the run ended first)")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chaos", action="store_true", help="random kills of both pools and a Redis restart "
                        "(module doc); --requests defaults to 1000")
    parser.add_argument("--kills", type=int, default=6, help="with --chaos: workers killed (2-20)")
    parser.add_argument("--redis-outage-s", type=float, default=2.0, help="with --chaos: Redis down this long")
    parser.add_argument("--json", type=Path, help="also write the report here")
    parser.add_argument("--requests", type=int, default=None, help="streams per run (1-1000; default 200, 1000 with --chaos)")
    parser.add_argument("--concurrency", type=int, default=32, help="streams at a time (1-64)")
    parser.add_argument("--seed", type=int, default=1, help="prompts and lengths")
    parser.add_argument("--kill-prefill-at", type=float, default=0.25,
                        help="fraction of completed streams at which a prefill worker is killed")
    parser.add_argument("--kill-decode-at", type=float, default=0.5,
                        help="fraction of completed streams at which a decode worker is killed")
    args = parser.parse_args(argv)
    if args.requests is None:
        args.requests = 1000 if args.chaos else 200
    if args.chaos and not 2 <= args.kills <= 20:
        parser.error("--kills must be between 2 and 20")
    if not 0 < args.redis_outage_s <= 30:
        parser.error("--redis-outage-s must be in (0, 30]")
    if not 1 <= args.requests <= 1000:
        parser.error("--requests must be between 1 and 1000")
    if not 1 <= args.concurrency <= 64:
        parser.error("--concurrency must be between 1 and 64")
    for name in ("kill_prefill_at", "kill_decode_at"):
        if not 0.0 < getattr(args, name) < 1.0:
            parser.error(f"--{name.replace('_', '-')} must be between 0 and 1 (exclusive)")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logger.setLevel(logging.INFO)
    report = soak(args)
    report["scenario"] = "chaos" if args.chaos else "kill-soak"
    problems = verdict(report, args.chaos)
    report["problems"] = problems
    print(f"host: {report['host']['cpu']} ({report['host']['cores']} cores); date: {report['date']}")
    print(json.dumps(report, indent=2))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

"""GPU check (b): a 2,048-token prompt's KV pushed over NIXL between two processes on one GPU,
against the device's own copy rate measured in the same run.

    python scripts/gpu_check_nixl.py --out DIR/nixl.json

Run it through ``scripts/gpu_check.sh nixl`` (which makes the tree importable and installs a
carried NIXL wheel); without CUDA, or without an importable ``nixl``, it prints one line
``skipped: ...`` and exits 0. ``--device cpu`` rehearses the whole run on host memory (the
direct pairs then register DRAM), so the script is tested where there is no GPU.

What it does:

1. The KV layout is the ``medium`` preset's (``engine/testmodel.py``: 26 layers, 8 KV heads,
   head_dim 64) in bfloat16 with 16-token blocks: 2,048 tokens are 128 blocks, 104 MiB.
2. The device copy rate: ``dst.copy_(src)`` of those bytes on the GPU, timed with CUDA events.
3. A child process (spawned) holds the decode side: a KV cache on the same GPU, a ``KVAgent``
   and one ``KVReceiver`` per push. This process holds the prefill side: a cache of random
   bytes, a ``KVAgent`` and a ``KVSender``. The push is the product's own path: one
   ``KVSender.write`` of the 128 blocks, ``finish()``, polled to DONE; the child reports when
   its receiver saw every block LANDED (``time.perf_counter`` is the system-wide monotonic
   clock, so the two processes' times compare).
4. Three agent pairs, each timed over ``--iters`` pushes after warm-up pushes: ``direct``
   (VRAM registered as it is, ``staging=never``: one descriptor), ``direct_per_block`` (the
   same, one descriptor per block), and ``staged`` (``staging=always``: each side's pinned
   host mirror, DRAM to DRAM, then into the device cache).
5. After the timed pushes the child's landed blocks are compared with the sent ones (digests).

UCX_TLS is not set: UCX picks its transports (cuda_ipc or cuda_copy for VRAM on one GPU; shared
memory or cma for the staged DRAM path). The JSON records every ``UCX_*`` variable that was set.

JSON: ``device``, ``nixl_vram_over_copy`` (the direct push's rate over the copy rate, from
medians), ``nixl_staged_over_copy``, ``byte_exact`` and the raw figures of each measurement.
Exit status 1 if a push failed or a block did not land byte-exact (the JSON is written anyway).
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

BLOCK_SIZE = 16
PRESET = "medium"
# The medium preset's KV shape (engine/testmodel.py PRESETS; tests/unit/test_gpu_check.py keeps
# the two equal): written out so the check does not import the model generator and its needs.
NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM = 26, 8, 64
WAIT_S = 10.0  # a push takes milliseconds; a failed one must not eat the 4-minute run
PAIRS = {  # name -> (staging mode, one descriptor per block)
    "direct": ("never", False),
    "direct_per_block": ("never", True),
    "staged": ("always", False),
}


def skip_reason(device: str) -> str | None:
    """Why this machine cannot run the check on ``device``, or None."""
    try:
        import torch
    except ImportError as exc:
        return f"torch is not importable ({exc})"
    if device != "cpu" and not torch.cuda.is_available():
        return f"no CUDA device (torch {torch.__version__}, built for CUDA {torch.version.cuda})"
    try:
        import nixl._api  # noqa: F401
    except Exception as exc:  # ImportError, or the meta package's own errors
        return f"nixl is not importable ({type(exc).__name__}: {exc})"
    return None


def make_layout(num_blocks: int) -> Any:
    from pdserve.kv_transfer import KVLayout

    return KVLayout(model_id=f"gpu-check-{PRESET}", dtype="bfloat16", num_layers=NUM_LAYERS,
                    num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, block_size=BLOCK_SIZE,
                    num_blocks=num_blocks)


def digest(kv: Any, blocks: list[int]) -> str:
    import torch

    raw = kv[torch.tensor(blocks, device=kv.device)].contiguous().view(torch.uint8).cpu()
    return hashlib.sha256(raw.numpy().tobytes()).hexdigest()


# ---- the decode side: a spawned child -----------------------------------------------------
def child_main(conn: Connection, layout_dict: dict, device: str) -> None:
    import torch

    from pdserve.kv_transfer import KVAgent, KVAgentConfig, KVLayout, KVReceiver

    layout = KVLayout.from_dict(layout_dict)
    kv: dict[str, Any] = {}
    agents: dict[str, Any] = {}
    while True:
        cmd, *args = conn.recv()
        try:
            if cmd == "agent":
                name, staging = args
                kv[name] = torch.zeros(layout.shape, dtype=torch.bfloat16, device=device)
                agents[name] = KVAgent(name, kv[name], layout, KVAgentConfig(staging=staging))
                conn.send(("ok", agents[name].metadata(), agents[name].region.describe()))
            elif cmd == "add_peer":
                conn.send(("ok", agents[args[0]].add_peer(args[1])))
            elif cmd == "recv":
                name, request_id, dst = args
                receiver = KVReceiver(agents[name], request_id, dst, timeout_s=WAIT_S)
                conn.send(("params", receiver.params().to_bytes()))
                while not receiver.poll().terminal:
                    pass
                conn.send(("end", receiver.state.value, time.perf_counter(), receiver.reason))
                receiver.close()
            elif cmd == "digest":
                conn.send(("ok", digest(kv[args[0]], args[1])))
            elif cmd == "exit":
                for agent in agents.values():
                    agent.close()
                conn.send(("ok",))
                return
        except Exception as exc:  # reported to the parent, which records it
            conn.send(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))


class Child:
    def __init__(self, layout_dict: dict, device: str) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=child_main, args=(child_conn, layout_dict, device),
                                daemon=True)
        self.proc.start()
        child_conn.close()

    def call(self, *cmd: Any) -> tuple[Any, ...]:
        self.conn.send(cmd)
        return self.reply()

    def reply(self) -> tuple[Any, ...]:
        if not self.conn.poll(WAIT_S * 2):
            raise TimeoutError("the decode process did not answer")
        msg = self.conn.recv()
        if msg[0] == "error":
            raise RuntimeError(f"decode process: {msg[1]}\n{msg[2]}")
        return msg


# ---- measurements -------------------------------------------------------------------------
def copy_seconds(nbytes: int, iters: int, device: str) -> list[float]:
    """Seconds of ``dst.copy_(src)`` of ``nbytes`` on ``device`` (CUDA events on a GPU)."""
    import torch

    src = torch.randn(nbytes // 2, device=device).to(torch.bfloat16)
    dst = torch.empty_like(src)
    times = []
    for i in range(iters + 3):  # 3 warm-up copies first
        if device == "cpu":
            started = time.perf_counter()
            dst.copy_(src)
            seconds = time.perf_counter() - started
        else:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        if i >= 3:
            times.append(seconds)
    if not torch.equal(dst, src):
        raise RuntimeError("the device copy did not copy")
    return times


def push(child: Child, sender_agent: Any, name: str, request_id: str, src: list[int],
         dst: list[int], per_block: bool) -> tuple[float, float]:
    """One push of ``src`` into the child's ``dst``: (seconds to the sender's DONE, to LANDED)."""
    from pdserve.kv_transfer import KVSender, SendState, TransferParams

    params = TransferParams.from_bytes(child.call("recv", name, request_id, dst)[1])
    sender = None
    try:
        sender = KVSender(sender_agent, params)
        started = time.perf_counter()
        sender.write(src, dst, coalesce=not per_block)
        sender.finish()
        deadline = started + WAIT_S
        while not sender.poll().terminal and time.perf_counter() < deadline:
            pass
        done = time.perf_counter()
        state, reason = sender.state, sender.reason
    finally:
        if sender is not None:
            sender.close()  # a sender that did not finish tells the receiver it stopped
        _, recv_state, landed_at, recv_reason = child.reply()  # the child's answer, even on failure
    if state is not SendState.DONE or recv_state != "landed":
        raise RuntimeError(f"push {request_id}: sender {state.value} ({reason}), "
                           f"receiver {recv_state} ({recv_reason})")
    return done - started, landed_at - started


def measure_pair(child: Child, layout: Any, src_kv: Any, name: str, staging: str,
                 per_block: bool, iters: int) -> dict:
    from pdserve.kv_transfer import KVAgent, KVAgentConfig

    blocks = layout.num_blocks // 2
    src, dst = list(range(blocks)), list(range(blocks, 2 * blocks))
    result: dict[str, Any] = {"staging": staging, "descriptors": blocks if per_block else 1}
    agent = None
    try:
        agent = KVAgent(f"prefill-{name}", src_kv, layout, KVAgentConfig(staging=staging))
        _, metadata, result["receiver_memory"] = child.call("agent", f"decode-{name}", staging)
        result["sender_memory"] = agent.region.describe()
        agent.add_peer(metadata)
        child.call("add_peer", f"decode-{name}", agent.metadata())
        for i in range(3):  # warm-up: connections, IPC handles, allocator
            push(child, agent, f"decode-{name}", f"{name}-warm-{i}", src, dst, per_block)
        timed = [push(child, agent, f"decode-{name}", f"{name}-{i}", src, dst, per_block)
                 for i in range(iters)]
        landed = statistics.median(t[1] for t in timed)
        result.update(
            iters=iters, landed_s_median=landed,
            sender_done_s_median=statistics.median(t[0] for t in timed),
            landed_s_min=min(t[1] for t in timed), landed_gbs=layout.block_bytes * blocks / landed / 1e9,
            byte_exact=child.call("digest", f"decode-{name}", dst)[1] == digest(src_kv, src))
    except Exception as exc:  # recorded: one failed path must not hide the others' figures
        result["error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    finally:
        if agent is not None:
            agent.close()
    return result


def run(tokens: int, iters: int, device: str) -> dict:
    import torch

    blocks = -(-tokens // BLOCK_SIZE)
    layout = make_layout(2 * blocks)  # the prompt's blocks, and as many to write into
    nbytes = layout.block_bytes * blocks
    copies = copy_seconds(nbytes, iters, device)
    copy_s = statistics.median(copies)
    gen = torch.Generator(device=device).manual_seed(0)
    src_kv = torch.randn(layout.shape, generator=gen, device=device).to(torch.bfloat16)
    child = Child(layout.to_dict(), device)
    try:
        pairs = {name: measure_pair(child, layout, src_kv, name, staging, per_block, iters)
                 for name, (staging, per_block) in PAIRS.items()}
        child.call("exit")
    finally:
        child.proc.join(WAIT_S)
        if child.proc.is_alive():
            child.proc.kill()

    def over_copy(name: str) -> float | None:
        landed = pairs[name].get("landed_s_median")
        return copy_s / landed if landed else None

    import importlib.metadata as md

    return {
        "check": "nixl",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": "cpu (rehearsal)" if device == "cpu" else torch.cuda.get_device_name(0),
        "nixl_vram_over_copy": over_copy("direct"),
        "nixl_staged_over_copy": over_copy("staged"),
        # every push that completed landed byte-exact (a pair that failed says why in "error")
        "byte_exact": all(p["byte_exact"] for p in pairs.values() if "error" not in p)
                      and any("error" not in p for p in pairs.values()),
        "kv": {"preset": PRESET, "dtype": layout.dtype, "tokens": tokens, "block_size": BLOCK_SIZE,
               "blocks": blocks, "bytes": nbytes},
        "copy": {"iters": iters, "seconds_median": copy_s, "seconds_min": min(copies),
                 "gbs": nbytes / copy_s / 1e9},
        "pairs": pairs,
        "ucx_env": {k: v for k, v in os.environ.items() if k.startswith("UCX_")},
        "versions": {"python": sys.version.split()[0], "torch": torch.__version__,
                     "cuda": torch.version.cuda, "nixl": _version(md, "nixl-cu13") or _version(md, "nixl")},
    }


def _version(md: Any, dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _ratio(value: float | None) -> str:
    return "failed" if value is None else f"{value:.3f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="where the JSON goes")
    parser.add_argument("--iters", type=int, default=20, help="timed pushes per path")
    parser.add_argument("--tokens", type=int, default=2048, help="prompt length whose KV is pushed")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: rehearse on host memory where there is no GPU")
    args = parser.parse_args(argv)
    if args.iters < 1 or args.tokens < 1:
        parser.error("--iters and --tokens must be >= 1")
    reason = skip_reason(args.device)
    if reason is not None:
        print(f"skipped: {reason}")
        return 0
    report = run(args.tokens, args.iters, "cuda:0" if args.device == "cuda" else "cpu")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"nixl check on {report['device']}: over the device copy rate, direct push "
          f"{_ratio(report['nixl_vram_over_copy'])}, staged {_ratio(report['nixl_staged_over_copy'])}; "
          f"byte_exact {report['byte_exact']} -> {args.out}")
    failed = not report["byte_exact"] or any("error" in p for p in report["pairs"].values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

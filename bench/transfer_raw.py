"""Raw KV block transfer between two processes over NIXL, against an in-process torch copy.

Moves one 2,048-token prompt of the ``small`` shape (30 layers, 3 KV heads, head dim 64,
block 16, fp32: 128 blocks of 0.74 MB, 94 MB) from a prefill process into a decode process:

* ``scattered``: destination ids out of order, so 128 descriptors (a fragmented reservation);
* ``uncoalesced``: consecutive destination ids, posted with ``coalesce=False``: 128 descriptors;
* ``coalesced``: consecutive ids on both sides, merged by KVSender into one descriptor;

and compares each with ``torch`` copying the same bytes inside one process.

    python -m pdserve.bench.transfer_raw [--iters 20] [--progress-thread]

Prints median seconds, GB/s and the ratio to the in-process copy.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time
from multiprocessing.connection import Connection

import torch

from pdserve.kv_transfer import (KVAgent, KVAgentConfig, KVLayout, KVReceiver, KVSender,
                                 RecvState, SendState, TransferParams)

PROMPT_BLOCKS = 128
LAYOUT = KVLayout("small", "float32", num_layers=30, num_kv_heads=3, head_dim=64,
                  block_size=16, num_blocks=2 * PROMPT_BLOCKS)
SRC = list(range(PROMPT_BLOCKS))
DST = {
    "scattered": list(range(2 * PROMPT_BLOCKS - 1, PROMPT_BLOCKS - 1, -1)),
    "uncoalesced": list(range(PROMPT_BLOCKS, 2 * PROMPT_BLOCKS)),
    "coalesced": list(range(PROMPT_BLOCKS, 2 * PROMPT_BLOCKS)),
}


def _sender_main(conn: Connection, progress_thread: bool) -> None:
    torch.set_num_threads(1)
    kv = torch.randn(LAYOUT.shape)
    agent = KVAgent("bench-prefill", kv, LAYOUT, KVAgentConfig(progress_thread=progress_thread))
    src_sum = kv[SRC].sum().item()  # to check the landed bytes, computed once
    conn.send((agent.metadata(), agent.startup_seconds))
    agent.add_peer(conn.recv())
    while (msg := conn.recv()) is not None:
        mode, params_bytes = msg
        t_cmd = time.perf_counter()
        params = TransferParams.from_bytes(params_bytes)
        sender = KVSender(agent, params)
        t_ready = time.perf_counter()
        sender.write(SRC, list(params.dst_blocks), coalesce=mode != "uncoalesced")
        t_posted = time.perf_counter()
        sender.finish()
        while sender.poll() is SendState.SENDING:
            os.sched_yield()
        seconds, descriptors = sender.stats.seconds, sender.stats.descriptors
        times = (t_cmd, t_ready, t_posted, time.perf_counter())
        conn.send((sender.state.value, seconds, descriptors, src_sum, times))
        sender.close()
    agent.close()


COPIES = ("torch contiguous", "torch scattered")
_COPY_KV: list[torch.Tensor] = []


def _torch_copy_seconds(name: str) -> float:
    """One in-process copy of the prompt's blocks (a separate tensor, like the NIXL peers)."""
    if not _COPY_KV:
        _COPY_KV.append(torch.randn(LAYOUT.shape))
    kv = _COPY_KV[0]
    started = time.perf_counter()
    if name == "torch scattered":
        for s_block, d_block in zip(SRC, DST["scattered"]):
            kv[d_block].copy_(kv[s_block])
    else:
        kv[PROMPT_BLOCKS:].copy_(kv[:PROMPT_BLOCKS])
    return time.perf_counter() - started


def _one_transfer(conn: Connection, agent: KVAgent, kv: torch.Tensor, mode: str, dst: list[int],
                  i: int, verbose: bool) -> tuple[float, float, int]:
    """(sender post->DONE seconds, request->landed seconds, descriptors) of one transfer."""
    kv.zero_()
    receiver = KVReceiver(agent, f"{mode}-{i}", dst, timeout_s=30.0)
    started = time.perf_counter()
    conn.send((mode, receiver.params().to_bytes()))
    while receiver.poll() is RecvState.WAITING and not conn.poll():
        os.sched_yield()
    state, seconds, descriptors, src_sum, times = conn.recv()
    while receiver.poll() is RecvState.WAITING:
        os.sched_yield()
    elapsed = time.perf_counter() - started
    if receiver.state is not RecvState.LANDED or state != SendState.DONE.value:
        raise RuntimeError(f"{mode}: sender {state}, receiver {receiver.state}: {receiver.reason}")
    if abs(kv[dst].sum().item() - src_sum) > 1e-3 * max(1.0, abs(src_sum)):
        raise RuntimeError(f"{mode}: landed bytes differ from the source")
    if verbose:
        marks = (*times, receiver.stats.first_write_at or 0, receiver.stats.ended_at or 0)
        ms = [f"{(t - started) * 1e3:.1f}" for t in marks]
        print(f"  {mode} #{i}: cmd/ready/posted/sender-end/first-notif/landed ms: {ms}")
    receiver.close()
    return seconds, elapsed, descriptors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--progress-thread", action="store_true",
                        help="start NIXL's progress thread (busy-polls one core per agent)")
    parser.add_argument("--verbose", action="store_true", help="print each transfer's timeline")
    args = parser.parse_args()
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    torch.set_num_threads(1)  # NIXL's copy is one thread too; OMP spin-waits distort small copies

    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=_sender_main, args=(child_conn, args.progress_thread))
    child.start()
    kv = torch.zeros(LAYOUT.shape)
    agent = KVAgent("bench-decode", kv, LAYOUT, KVAgentConfig(progress_thread=args.progress_thread))
    peer_md, peer_startup = conn.recv()
    agent.add_peer(peer_md)
    conn.send(agent.metadata())
    nbytes = PROMPT_BLOCKS * LAYOUT.block_bytes
    print(f"agent startup: decode {agent.startup_seconds * 1e3:.0f} ms, "
          f"prefill {peer_startup * 1e3:.0f} ms; prompt {PROMPT_BLOCKS} blocks x "
          f"{LAYOUT.block_bytes} B = {nbytes / 1e6:.1f} MB")

    # Rounds interleave every case, so each sees the same (shared, noisy) machine load.
    samples: dict[str, list[float]] = {name: [] for name in (*COPIES, *DST)}
    landed: dict[str, list[float]] = {mode: [] for mode in DST}
    descriptors: dict[str, int] = {}
    for i in range(args.iters + 1):  # round 0 warms up (and connects the endpoints)
        for name in COPIES:
            seconds = _torch_copy_seconds(name)
            if i:
                samples[name].append(seconds)
        for mode, dst in DST.items():
            seconds, elapsed, descriptors[mode] = _one_transfer(conn, agent, kv, mode, dst, i,
                                                                args.verbose)
            if i:
                samples[mode].append(seconds)
                landed[mode].append(elapsed)
            else:
                print(f"{mode}: first transfer {elapsed * 1e3:.1f} ms")
    base = statistics.median(samples["torch contiguous"])
    for name, values in samples.items():
        med, best = statistics.median(values), min(values)
        extra = (f"{descriptors[name]:3d} desc, request->landed median "
                 f"{statistics.median(landed[name]) * 1e3:6.2f} ms" if name in DST else "")
        print(f"{name:16s}: median {med * 1e3:6.2f} ms {nbytes / med / 1e9:5.2f} GB/s "
              f"(torch-contiguous time / this = {base / med:4.2f}), best {best * 1e3:6.2f} ms "
              f"{nbytes / best / 1e9:5.2f} GB/s  {extra}")
    conn.send(None)
    child.join(30)
    agent.close()


if __name__ == "__main__":
    main()

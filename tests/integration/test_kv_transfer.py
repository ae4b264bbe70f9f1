"""KV blocks moved between two OS processes over real NIXL (UCX, CPU memory).

The same transfers run with either side, or both, staged through a host mirror of the cache
(``KVAgentConfig.staging="always"``: the path a GPU cache takes when NIXL cannot register VRAM).

The decode side (KVAgent + KVReceivers) lives in this pytest process, so the landed bytes
can be compared directly; the prefill side (KVAgent + KVSenders) lives in a spawned child
driven over a Pipe. Both fill their KV tensors from the same seeded generator, so the
expected source bytes are known here without shipping them. The GPU check's NIXL script
(scripts/gpu_check_nixl.py) is rehearsed here on host memory too.
"""

from __future__ import annotations

import gc
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
import traceback
import weakref
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.engine.errors import CompatibilityError, InvalidRequestError
from pdserve.kv_transfer.receiver import EXPIRY_SKEW_S
from pdserve.kv_transfer import (KVAgent, KVAgentConfig, KVLayout, KVReceiver, KVSender, RecvState,
                                 SendState, TransferParams)


WAIT_S = 15.0  # upper bound for any single wait in this file
SEED = 1234


def make_layout(dtype: str = "float32", **overrides: Any) -> KVLayout:
    fields: dict[str, Any] = dict(model_id="tiny-test", dtype=dtype, num_layers=4,
                                  num_kv_heads=2, head_dim=16, block_size=16, num_blocks=64)
    fields.update(overrides)
    return KVLayout(**fields)


def source_kv(layout: KVLayout, seed: int = SEED) -> torch.Tensor:
    """The prefill side's KV cache: identical in every process for the same seed."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(layout.shape, generator=gen).to(getattr(torch, layout.dtype))


# ---- the prefill-side child process -----------------------------------------------------
def _prefill_main(conn: Connection) -> None:
    """Command loop: builds agents and runs senders as the parent asks; replies on ``conn``."""
    agents: dict[str, KVAgent] = {}
    while True:
        cmd, *args = conn.recv()
        try:
            if cmd == "agent":
                name, layout_dict, *staging = args
                layout = KVLayout.from_dict(layout_dict)
                agents[name] = KVAgent(name, source_kv(layout), layout,
                                       KVAgentConfig(staging=staging[0] if staging else "auto"))
                conn.send(("ok", agents[name].metadata(), agents[name].startup_seconds))
            elif cmd == "add_peer":
                conn.send(("ok", agents[args[0]].add_peer(args[1])))
            elif cmd == "send":
                _run_senders(conn, agents[args[0]], *args[1:])
            elif cmd == "staging":  # (blocks copied out of the cache into the mirror, mirror address)
                staging = agents[args[0]].region.staging
                conn.send(("ok", staging.stats.blocks_out, staging.data_ptr()) if staging else ("ok", None, None))
            elif cmd == "exit":
                for agent in agents.values():
                    agent.close()
                conn.send(("ok",))
                return
        except Exception as exc:  # reported to the parent, which fails the test
            conn.send(("error", type(exc).__name__, str(exc), traceback.format_exc()))


def _run_senders(conn: Connection, agent: KVAgent, params: list[bytes],
                 chunks: list[list[tuple[list[int], list[int]]]], mode: str) -> None:
    """Write chunk i of every request in turn (interleaved), then end as ``mode`` says.

    mode: "finish" (DONE), "abort" (sender aborts after chunk 0), "wait" (never finish; wait
    for the receiver to abort), "hang" (stop responding after chunk 0, to be SIGKILLed).
    """
    senders = [KVSender(agent, TransferParams.from_bytes(p)) for p in params]
    for i in range(max(len(c) for c in chunks)):
        for sender, request_chunks in zip(senders, chunks):
            if i < len(request_chunks):
                sender.write(*request_chunks[i])
        conn.send(("posted", i))
        for sender in senders:
            sender.poll()
        if mode in ("abort", "hang"):
            break
    if mode == "hang":
        time.sleep(WAIT_S * 4)
    for sender in senders:
        if mode == "finish":
            sender.finish()
        elif mode == "abort":
            sender.abort("test asked the sender to abort")
    deadline = time.monotonic() + WAIT_S
    while not all(s.poll().terminal for s in senders) and time.monotonic() < deadline:
        time.sleep(0.001)
    results = [(s.state.value, s.reason, s.stats.descriptors, s.stats.nbytes) for s in senders]
    for sender in senders:
        sender.close()
    conn.send(("end", results, agent.open_handles, agent.subscriptions))


# ---- parent-side helpers ----------------------------------------------------------------
class PrefillProcess:
    """Handle on the child: ``call`` for quick commands, ``drive`` while transfers run."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=_prefill_main, args=(child_conn,), daemon=True)
        self.proc.start()
        child_conn.close()

    def call(self, *cmd: Any) -> tuple[Any, ...]:
        self.conn.send(cmd)
        if not self.conn.poll(WAIT_S):
            raise TimeoutError(f"prefill process did not answer {cmd[0]!r}")
        return self.conn.recv()

    def drive(self, receivers: list[KVReceiver], until: Callable[[tuple[Any, ...]], bool],
              timeout: float = WAIT_S, errors_ok: bool = False) -> tuple[Any, ...]:
        """Poll ``receivers`` (the decode side must make progress too) until a child message
        satisfies ``until`` (or is an error, when ``errors_ok``); returns that message."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for receiver in receivers:
                receiver.poll()
            if self.conn.poll(0.001):
                msg = self.conn.recv()
                if msg[0] == "error" and errors_ok:
                    return msg
                if msg[0] == "error":
                    raise AssertionError(f"prefill process failed: {msg[3]}")
                if until(msg):
                    return msg
        raise TimeoutError("prefill process did not report in time")

    def send(self, agent: str, params: list[TransferParams], chunks: list[list[Any]],
             mode: str = "finish") -> None:
        self.conn.send(("send", agent, [p.to_bytes() for p in params], chunks, mode))


def wait_terminal(receivers: list[KVReceiver], timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not all(r.poll().terminal for r in receivers):
        assert time.monotonic() < deadline, [r.state for r in receivers]
        time.sleep(0.001)


def is_end(msg: tuple[Any, ...]) -> bool:
    return msg[0] == "end"


class Pair:
    """A decode agent here and a prefill agent in the child, peered with each other."""

    def __init__(self, child: PrefillProcess, dtype: str, decode_staging: str = "auto",
                 prefill_staging: str = "auto") -> None:
        self.layout = make_layout(dtype)
        self.kv = torch.zeros(self.layout.shape, dtype=getattr(torch, dtype))
        suffix = dtype + "".join(f"-{side}-{mode}" for side, mode in
                                 (("d", decode_staging), ("p", prefill_staging)) if mode != "auto")
        self.decode = KVAgent(f"decode-{suffix}", self.kv, self.layout,
                              KVAgentConfig(staging=decode_staging))
        self.prefill_name = f"prefill-{suffix}"
        status, metadata, self.prefill_startup_s = child.call(
            "agent", self.prefill_name, self.layout.to_dict(), prefill_staging)
        assert status == "ok"
        assert self.decode.add_peer(metadata) == self.prefill_name
        assert child.call("add_peer", self.prefill_name, self.decode.metadata())[0] == "ok"
        self.src = source_kv(self.layout)

    def assert_landed_only(self, pairs: dict[int, int]) -> None:
        """dst block d holds src block pairs[d]; every other block is still zero."""
        for dst, src in pairs.items():
            assert torch.equal(self.kv[dst], self.src[src]), (dst, src)
        untouched = [b for b in range(self.layout.num_blocks) if b not in pairs]
        assert not self.kv[untouched].any()

    def assert_no_leaks(self) -> None:
        assert self.decode.open_handles == 0 and self.decode.subscriptions == 0


@pytest.fixture(scope="module")
def child() -> Iterator[PrefillProcess]:
    saved = os.environ.get("UCX_NET_DEVICES")
    os.environ["UCX_NET_DEVICES"] = "lo"  # loopback only; the child inherits it at spawn
    proc = PrefillProcess()
    yield proc
    assert proc.call("exit") == ("ok",)
    proc.proc.join(WAIT_S)
    assert proc.proc.exitcode == 0
    if saved is None:
        os.environ.pop("UCX_NET_DEVICES", None)
    else:
        os.environ["UCX_NET_DEVICES"] = saved


@pytest.fixture(scope="module")
def pairs(child: PrefillProcess) -> Iterator[dict[str, Pair]]:
    made: dict[str, Pair] = {}
    yield made
    for pair in made.values():
        pair.decode.close()


def get_pair(child: PrefillProcess, pairs: dict[str, Pair], dtype: str) -> Pair:
    """The module's pair for ``dtype`` (made once), with the decode KV zeroed."""
    if dtype not in pairs:
        pairs[dtype] = Pair(child, dtype)
    pairs[dtype].kv.zero_()
    return pairs[dtype]


@pytest.fixture(params=["float32", "bfloat16"])
def pair(request: pytest.FixtureRequest, child: PrefillProcess, pairs: dict[str, Pair]) -> Pair:
    return get_pair(child, pairs, request.param)


@pytest.fixture
def fp32_pair(child: PrefillProcess, pairs: dict[str, Pair]) -> Pair:
    return get_pair(child, pairs, "float32")


# ---- tests ------------------------------------------------------------------------------
def test_scattered_blocks_land_exactly_in_three_chunks(child: PrefillProcess, pair: Pair) -> None:
    src = [3, 17, 5, 40, 41, 42, 8, 60, 0]
    dst = [50, 2, 33, 10, 11, 12, 63, 7, 21]
    receiver = KVReceiver(pair.decode, "scatter", dst, timeout_s=WAIT_S)
    chunks = [(src[:3], dst[:3]), (src[3:6], dst[3:6]), (src[6:], dst[6:])]
    child.send(pair.prefill_name, [receiver.params()], [chunks])
    posted = child.drive([receiver], lambda m: m == ("posted", 0))
    assert posted == ("posted", 0)
    _, results, open_handles, subscriptions = child.drive([receiver], is_end)
    wait_terminal([receiver])
    assert receiver.state is RecvState.LANDED, receiver.reason
    state, _, descriptors, nbytes = results[0]
    assert state == SendState.DONE.value
    assert descriptors == 7  # 40,41,42 -> 10,11,12 is one run; the rest are singles
    assert nbytes == receiver.stats.nbytes == len(dst) * pair.layout.block_bytes
    assert receiver.stats.writes == 3 and receiver.blocks_reusable
    pair.assert_landed_only(dict(zip(dst, src)))
    receiver.close()
    assert (open_handles, subscriptions) == (0, 0)
    pair.assert_no_leaks()


def test_two_concurrent_requests_do_not_steal_notifications(child: PrefillProcess,
                                                            pair: Pair) -> None:
    dst_a, dst_b = list(range(0, 16)), list(range(32, 48))
    src_a, src_b = list(range(16, 32)), list(range(40, 56))
    rec_a = KVReceiver(pair.decode, "req-a", dst_a, timeout_s=WAIT_S)
    rec_b = KVReceiver(pair.decode, "req-b", dst_b, timeout_s=WAIT_S)
    chunks_a = [(src_a[:8], dst_a[:8]), (src_a[8:], dst_a[8:])]
    chunks_b = [(src_b[:8], dst_b[:8]), (src_b[8:], dst_b[8:])]
    child.send(pair.prefill_name, [rec_a.params(), rec_b.params()], [chunks_a, chunks_b])
    _, results, open_handles, _ = child.drive([rec_a, rec_b], is_end)
    wait_terminal([rec_a, rec_b])
    assert (rec_a.state, rec_b.state) == (RecvState.LANDED, RecvState.LANDED)
    # both chunks of a fully consecutive request coalesce to one descriptor each
    assert [r[2] for r in results] == [2, 2]
    assert rec_a.stats.writes == rec_b.stats.writes == 2
    pair.assert_landed_only({**dict(zip(dst_a, src_a)), **dict(zip(dst_b, src_b))})
    for receiver in (rec_a, rec_b):
        receiver.close()
    assert open_handles == 0
    pair.assert_no_leaks()


def test_incompatible_layouts_are_refused_before_any_write(child: PrefillProcess,
                                                           fp32_pair: Pair) -> None:
    pair = fp32_pair
    for name, layout in [("prefill-hd32", make_layout(head_dim=32)),
                         ("prefill-bf16-x", make_layout("bfloat16"))]:
        status, metadata, _ = child.call("agent", name, layout.to_dict())
        assert status == "ok"
        field = "head_dim" if "hd32" in name else "dtype"
        with pytest.raises(CompatibilityError, match=field):
            pair.decode.add_peer(metadata)
        reply = child.call("add_peer", name, pair.decode.metadata())
        assert reply[:2] == ("error", "CompatibilityError") and field in reply[2]
        # params made for our layout are refused by the mismatched sender, before a write
        receiver = KVReceiver(pair.decode, f"mismatch-{name}", [1, 2], timeout_s=WAIT_S,
                              quarantine_s=0.0)
        child.send(name, [receiver.params()], [[([1, 2], [1, 2])]])
        reply = child.drive([receiver], lambda m: False, errors_ok=True)
        assert reply[:2] == ("error", "CompatibilityError") and "hash" in reply[2]
        assert receiver.poll() is RecvState.WAITING and receiver.stats.writes == 0
        receiver.abort()
        # Nothing confirmed that no sender will write before the params expire, so the blocks
        # stay quarantined until then; a sender that learns of the owner's death can say so.
        assert receiver.state is RecvState.ABORTED and not receiver.blocks_reusable
        receiver.sender_gone()
        assert receiver.blocks_reusable
        receiver.close()
    assert not pair.kv.any()
    assert not pair.decode.has_peer("prefill-hd32")
    pair.assert_no_leaks()


def test_sender_abort_ends_receiver_aborted_with_blocks_reusable(child: PrefillProcess,
                                                                 fp32_pair: Pair) -> None:
    dst = [4, 5, 6, 7]
    receiver = KVReceiver(fp32_pair.decode, "sender-aborts", dst, timeout_s=WAIT_S)
    child.send(fp32_pair.prefill_name, [receiver.params()],
               [[([0, 1], dst[:2]), ([2, 3], dst[2:])]], mode="abort")
    _, results, open_handles, subscriptions = child.drive([receiver], is_end)
    wait_terminal([receiver])
    assert results[0][0] == SendState.ABORTED.value
    assert receiver.state is RecvState.ABORTED and "sender aborted" in receiver.reason
    assert receiver.blocks_reusable  # the sender said nothing is in flight
    receiver.close()
    assert (open_handles, subscriptions) == (0, 0)
    fp32_pair.assert_no_leaks()


def test_receiver_abort_stops_the_sender(child: PrefillProcess, fp32_pair: Pair) -> None:
    dst = [30, 31, 32, 33]
    receiver = KVReceiver(fp32_pair.decode, "receiver-aborts", dst, timeout_s=WAIT_S)
    child.send(fp32_pair.prefill_name, [receiver.params()],
               [[([0, 1], dst[:2]), ([2, 3], dst[2:])]], mode="wait")
    child.drive([receiver], lambda m: m[0] == "posted")
    deadline = time.monotonic() + WAIT_S
    while receiver.src_agent is None:  # learnt from the first WRITE notification
        assert time.monotonic() < deadline
        receiver.poll()
    receiver.abort("client cancelled")
    assert receiver.state is RecvState.ABORTED and not receiver.blocks_reusable
    _, results, open_handles, subscriptions = child.drive([receiver], is_end)
    assert results[0][0] == SendState.ABORTED.value and "client cancelled" in results[0][1]
    while not receiver.blocks_reusable:  # the sender's SENDER_ABORT confirms nothing in flight
        assert time.monotonic() < deadline
        receiver.poll()
    receiver.close()
    assert (open_handles, subscriptions) == (0, 0)
    fp32_pair.assert_no_leaks()


def test_killed_sender_times_out_the_receiver_without_hanging(fp32_pair: Pair) -> None:
    doomed = PrefillProcess()
    try:
        layout = fp32_pair.layout
        status, metadata, _ = doomed.call("agent", "prefill-doomed", layout.to_dict())
        assert status == "ok"
        fp32_pair.decode.add_peer(metadata)
        assert doomed.call("add_peer", "prefill-doomed", fp32_pair.decode.metadata())[0] == "ok"
        dst = [60, 61, 62, 63]
        receiver = KVReceiver(fp32_pair.decode, "orphan", dst, timeout_s=2.0, quarantine_s=1.0)
        doomed.send("prefill-doomed", [receiver.params()], [[([0, 1], dst[:2])]], mode="hang")
        doomed.drive([receiver], lambda m: m == ("posted", 0))
        os.kill(doomed.proc.pid, signal.SIGKILL)
        doomed.proc.join(WAIT_S)
        assert doomed.proc.exitcode == -signal.SIGKILL
        started = time.monotonic()
        wait_terminal([receiver], timeout=WAIT_S)
        assert receiver.state is RecvState.TIMED_OUT, receiver.reason
        assert time.monotonic() - started < 5.0
        receiver.abort()  # no-op once terminal, must not raise or hang
        assert receiver.state is RecvState.TIMED_OUT
        assert not receiver.blocks_reusable  # a write of the dead sender might still land
        time.sleep(1.05)
        # Quarantine passed but the params have not expired (plus skew): still not reusable.
        assert time.time() >= receiver.expires_at + EXPIRY_SKEW_S or not receiver.blocks_reusable
        wait_s = receiver.expires_at + EXPIRY_SKEW_S - time.time()
        time.sleep(max(0.0, wait_s) + 0.05)
        assert receiver.blocks_reusable  # expiry and quarantine passed; nobody confirmed
        receiver.close()
        fp32_pair.decode.remove_peer("prefill-doomed")
        fp32_pair.assert_no_leaks()
    finally:
        if doomed.proc.is_alive():
            doomed.proc.kill()
            doomed.proc.join(WAIT_S)


def test_sender_refuses_blocks_outside_its_reservation(fp32_pair: Pair) -> None:
    # here the decode agent acts as a sender towards the child's agent; nothing is posted
    params = TransferParams(request_id="bad-writes", dst_agent=fp32_pair.prefill_name,
                            dst_blocks=(1, 2, 3), compat_hash=fp32_pair.layout.compat_hash())
    sender = KVSender(fp32_pair.decode, params)
    for src, dst, match in [([0], [5], "not reserved"), ([0, 1], [1, 1], "already written"),
                            ([64], [1], "outside"), ([0, 1], [1], "equal")]:
        with pytest.raises(InvalidRequestError, match=match):
            sender.write(src, dst)
    assert sender.state is SendState.IDLE and sender.stats.writes == 0
    with pytest.raises(InvalidRequestError, match="outside"):
        KVSender(fp32_pair.decode, TransferParams(
            request_id="too-far", dst_agent=fp32_pair.prefill_name, dst_blocks=(64,),
            compat_hash=fp32_pair.layout.compat_hash()))
    sender.close()
    assert sender.state is SendState.ABORTED
    fp32_pair.assert_no_leaks()


# ---- staged through host mirrors --------------------------------------------------------
# (decode side, prefill side): both staged, a staged receiver fed by a direct sender, and a
# staged sender feeding a direct receiver (a GPU worker without VRAM support beside a CPU one).
STAGINGS = [("always", "always"), ("always", "never"), ("never", "always")]


@pytest.fixture(params=STAGINGS, ids=lambda p: f"decode_{p[0]}-prefill_{p[1]}")
def staged_pair(request: pytest.FixtureRequest, child: PrefillProcess,
                pairs: dict[str, Pair]) -> Pair:
    decode_staging, prefill_staging = request.param
    key = f"float32-{decode_staging}-{prefill_staging}"
    if key not in pairs:
        pairs[key] = Pair(child, "float32", decode_staging, prefill_staging)
    pairs[key].kv.zero_()
    return pairs[key]


def test_staged_transfers_land_byte_exact_through_reused_mirrors(child: PrefillProcess,
                                                                 staged_pair: Pair) -> None:
    pair = staged_pair
    mirror = pair.decode.region.staging
    if mirror is not None:  # the cache itself is never registered: peers write into the mirror
        assert pair.decode.region.base_addr == mirror.data_ptr() != pair.kv.data_ptr()
        mirror_at, landed_before = mirror.data_ptr(), mirror.stats.blocks_in
    else:
        assert pair.decode.region.base_addr == pair.kv.data_ptr()
    _, staged_out_before, prefill_mirror_at = child.call("staging", pair.prefill_name)
    assert (staged_out_before is None) == (pair.prefill_name.endswith("-p-never"))
    rounds = [([3, 17, 5, 40, 41, 42, 8, 60, 0], [50, 2, 33, 10, 11, 12, 63, 7, 21]),
              ([20, 21, 22, 23], [30, 31, 32, 33])]
    landed: dict[int, int] = {}
    for i, (src, dst) in enumerate(rounds):
        receiver = KVReceiver(pair.decode, f"staged-{i}", dst, timeout_s=WAIT_S)
        half = len(src) // 2
        child.send(pair.prefill_name, [receiver.params()], [[(src[:half], dst[:half]),
                                                            (src[half:], dst[half:])]])
        _, results, open_handles, subscriptions = child.drive([receiver], is_end)
        wait_terminal([receiver])
        assert receiver.state is RecvState.LANDED, receiver.reason
        assert results[0][0] == SendState.DONE.value
        landed.update(zip(dst, src))
        pair.assert_landed_only(landed)  # byte-exact in the cache, nothing else touched
        receiver.close()
        assert (open_handles, subscriptions) == (0, 0)
    moved = sum(len(dst) for _, dst in rounds)
    if mirror is not None:  # every landed block was copied out of the one mirror, never reallocated
        assert mirror.stats.blocks_in - landed_before == moved and mirror.data_ptr() == mirror_at
    _, staged_out, mirror_now = child.call("staging", pair.prefill_name)
    if staged_out is not None:
        assert staged_out - staged_out_before == moved and mirror_now == prefill_mirror_at
    pair.assert_no_leaks()


def test_closing_a_staged_agent_frees_its_mirror() -> None:
    layout = make_layout()
    agent = KVAgent("staged-close", torch.zeros(layout.shape), layout,
                    KVAgentConfig(staging="always"))
    staging = agent.region.staging
    assert staging is not None and not staging.pinned  # a host cache needs no pinned memory
    assert staging.nbytes == layout.total_bytes
    host = weakref.ref(staging.host)
    agent.close()
    assert staging.closed and agent.closed
    gc.collect()
    assert host() is None  # nothing, NIXL included, still holds the mirror
    agent.close()  # idempotent


@pytest.mark.parametrize("staging, staged", [("always", True), ("auto", False)])
def test_a_workers_kv_staging_setting_reaches_its_agent(tiny_model: Path, staging: str, staged: bool) -> None:
    """``{prefill,decode}.engine.kv_staging`` travels in the engine config to the worker's KV agent
    (on host memory ``auto`` registers the cache itself)."""
    from pdserve.engine.config import EngineConfig, EngineMode
    from pdserve.prefill_worker.worker import PrefillWorker

    worker = PrefillWorker(f"staging-{staging}", EngineConfig(
        model_dir=str(tiny_model), kv_cache_memory_gb=0.01, num_threads=1, dtype="float32",
        mode=EngineMode.PREFILL, kv_staging=staging))
    try:
        assert worker.agent.region.staged is staged, worker.agent.region.describe()
    finally:
        worker.shutdown()


def test_the_gpu_check_rehearses_on_host_memory(tmp_path: Path) -> None:
    """scripts/gpu_check_nixl.py, run where there is no GPU: the same pushes (direct, one
    descriptor per block, staged) between two processes, on host memory, landing byte-exact."""
    out = tmp_path / "nixl.json"
    done = subprocess.run(
        [sys.executable, "scripts/gpu_check_nixl.py", "--device", "cpu", "--tokens", "64",
         "--iters", "2", "--out", str(out)], cwd=Path(__file__).resolve().parents[2],
        capture_output=True, text=True, timeout=120, env={**os.environ, "UCX_NET_DEVICES": "lo"})
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["device"] == "cpu (rehearsal)" and report["byte_exact"] is True
    assert set(report["pairs"]) == {"direct", "direct_per_block", "staged"}
    assert report["pairs"]["staged"]["receiver_memory"] == "DRAM:0 staged via DRAM"
    assert report["pairs"]["direct_per_block"]["descriptors"] == 4  # 64 tokens, 16-token blocks
    assert report["nixl_vram_over_copy"] > 0 and report["nixl_staged_over_copy"] > 0
    assert report["kv"]["bytes"] == 64 * 26 * 2 * 8 * 64 * 2

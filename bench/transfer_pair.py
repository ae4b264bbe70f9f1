"""Raw NIXL (UCX) write bandwidth between two OS processes, without pdserve's layers.

One agent pair: a target process registers a buffer and polls its notifications every 0.5 ms
(as a decode worker's loop does); an initiator process registers a buffer of the same size and
writes it into the target's, timed from ``initialize_xfer`` until ``check_xfer_state`` says
DONE (busy polling, so the initiator drives UCX progress all the time). Each pattern moves the
same bytes: ``descriptors=1`` is one coalesced region, ``descriptors=128`` the same region cut
into 128 descriptors (one per KV block of a 2,048-token prompt of the ``small`` model).

Both agents run in fresh ``spawn`` processes, so each UCX environment variant (``UCX_TLS``, ...)
is read by a new UCX context. ``UCX_NET_DEVICES=lo`` is the default: loopback only.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import statistics
import time
from dataclasses import asdict, dataclass, field

logger = logging.getLogger(__name__)

_START_TIMEOUT_S = 120.0


@dataclass(frozen=True, slots=True)
class RawPattern:
    """Figures of one descriptor pattern: ``seconds`` are post-to-DONE wall times."""

    descriptors: int
    nbytes: int
    seconds: list[float]
    post_seconds: list[float]    # initialize_xfer + transfer only: what posting costs the caller

    @property
    def best_gbps(self) -> float:
        return self.nbytes / min(self.seconds) / 1e9

    @property
    def median_gbps(self) -> float:
        return self.nbytes / statistics.median(self.seconds) / 1e9

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(best_gbps=self.best_gbps, median_gbps=self.median_gbps,
                 median_ms=statistics.median(self.seconds) * 1e3,
                 median_post_ms=statistics.median(self.post_seconds) * 1e3)
        return d


@dataclass(frozen=True, slots=True)
class RawResult:
    env: dict[str, str]
    progress_thread: bool
    patterns: list[RawPattern] = field(default_factory=list)
    backend: str = ""
    error: str | None = None

    def to_dict(self) -> dict:
        return {"env": self.env, "progress_thread": self.progress_thread, "backend": self.backend,
                "error": self.error, "patterns": [p.to_dict() for p in self.patterns]}


def _agent(name: str, progress_thread: bool):
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"]))


def _target_main(conn, nbytes: int, env: dict[str, str], progress_thread: bool) -> None:
    os.environ.update(env)
    import torch

    torch.set_num_threads(1)
    buf = torch.zeros(nbytes // 4, dtype=torch.float32)
    agent = _agent("raw-target", progress_thread)
    reg = agent.register_memory(buf)
    conn.send((agent.get_agent_metadata(), buf.data_ptr()))
    while not conn.poll(0.0005):
        agent.get_new_notifs()
    conn.recv()
    conn.send("bye")
    agent.deregister_memory(reg)


def _initiator_main(conn, nbytes: int, env: dict[str, str], progress_thread: bool,
                    descriptor_counts: list[int], repeats: int) -> None:
    os.environ.update(env)
    import numpy as np
    import torch

    torch.set_num_threads(1)
    target_md, target_addr = conn.recv()
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    agent = _agent("raw-initiator", progress_thread)
    reg = agent.register_memory(buf)
    peer = agent.add_remote_agent(target_md)
    peer = peer.decode() if isinstance(peer, bytes) else peer
    out: list[tuple[int, list[float], list[float]]] = []
    backend = ""
    try:
        for count in descriptor_counts:
            size = nbytes // count
            local = np.array([(buf.data_ptr() + i * size, size, 0) for i in range(count)], dtype=np.uint64)
            remote = np.array([(target_addr + i * size, size, 0) for i in range(count)], dtype=np.uint64)
            times: list[float] = []
            posts: list[float] = []
            for i in range(repeats + 1):  # the first write also opens the connection: not counted
                t0 = time.perf_counter()
                h = agent.initialize_xfer("WRITE", agent.get_xfer_descs(local, "DRAM"),
                                          agent.get_xfer_descs(remote, "DRAM"), peer, b"raw")
                state = agent.transfer(h)
                t1 = time.perf_counter()
                while state == "PROC":
                    state = agent.check_xfer_state(h)
                t2 = time.perf_counter()
                if state != "DONE":
                    raise RuntimeError(f"NIXL write ended in {state}")
                backend = backend or str(agent.query_xfer_backend(h))
                agent.release_xfer_handle(h)
                if i:
                    times.append(t2 - t0)
                    posts.append(t1 - t0)
            out.append((count, times, posts))
        conn.send(("ok", backend, out))
    except Exception as exc:  # reported to the parent, which records it next to the env
        conn.send(("error", f"{type(exc).__name__}: {exc}", out))
    finally:
        agent.remove_remote_agent(peer)
        agent.deregister_memory(reg)


def measure_raw(nbytes: int, descriptor_counts: list[int], *, repeats: int = 5,
                env: dict[str, str] | None = None, progress_thread: bool = False) -> RawResult:
    """Write ``nbytes`` from one process into another, once per descriptor count, ``repeats``
    times after one warm-up write. ``env`` is set in both processes before NIXL starts."""
    if nbytes < 4 or repeats < 1 or not descriptor_counts:
        raise ValueError("need nbytes >= 4, repeats >= 1 and at least one descriptor count")
    if any(c < 1 or nbytes % c or (nbytes // c) % 4 for c in descriptor_counts):
        raise ValueError(f"{nbytes} bytes do not split evenly into {descriptor_counts} descriptors")
    env = {"UCX_NET_DEVICES": "lo", **(env or {})}
    ctx = mp.get_context("spawn")
    t_parent, t_child = ctx.Pipe()
    i_parent, i_child = ctx.Pipe()
    target = ctx.Process(target=_target_main, args=(t_child, nbytes, env, progress_thread), daemon=True)
    initiator = ctx.Process(target=_initiator_main, daemon=True,
                            args=(i_child, nbytes, env, progress_thread, descriptor_counts, repeats))
    target.start()
    initiator.start()
    try:
        _wait(t_parent, target, _START_TIMEOUT_S, "raw NIXL target did not start")
        i_parent.send(t_parent.recv())
        _wait(i_parent, initiator, _START_TIMEOUT_S + 30 * repeats, "raw NIXL initiator did not finish")
        status, info, out = i_parent.recv()
        t_parent.send("stop")
        _wait(t_parent, target, 30, "raw NIXL target did not stop")
        t_parent.recv()
    except (TimeoutError, EOFError, OSError) as exc:
        status, info, out = "error", f"{type(exc).__name__}: {exc}", []
    finally:
        for p in (initiator, target):
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join(5)
    patterns = [RawPattern(c, nbytes, t, s) for c, t, s in out]
    if status != "ok":
        logger.warning("raw NIXL with %s failed: %s", env, info)
        return RawResult(env, progress_thread, patterns, error=info)
    return RawResult(env, progress_thread, patterns, backend=info)


def _wait(conn, proc, timeout_s: float, what: str) -> None:
    """Wait for a message from ``proc``; fail early if it died."""
    deadline = time.monotonic() + timeout_s
    while not conn.poll(0.2):
        if not proc.is_alive():
            raise EOFError(f"{what}: process exited with code {proc.exitcode}")
        if time.monotonic() > deadline:
            raise TimeoutError(what)

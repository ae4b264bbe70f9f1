"""Emulated hosts on one machine: network namespaces joined through a bridge by shaped links.

The KV cache of a disaggregated cluster crosses a network between the prefill and the decode
machines. On one machine that network is emulated: each "host" is a network namespace with one
interface, and each host's link is shaped with ``tc``'s token bucket (``tbf``) in both directions.

Life cycle of ``EmulatedHosts(n, rate)``:
1. ``check_available()`` says what is missing (not root, no ``ip`` or ``tc``, namespaces refused)
   as ``HostsUnavailable``; nothing is created before it passes.
2. ``__enter__`` creates a bridge namespace holding ``br0`` and, per host ``i``, a namespace with
   ``lo`` up and ``eth0`` at ``10.77.0.{i+1}/24``: a private range that exists only inside these
   namespaces. Each ``eth0`` is one end of a veth pair whose other end is a port of ``br0``. The
   egress of ``eth0`` (host -> bridge) and of the bridge port (bridge -> host) are shaped with
   ``tbf`` at ``rate``. Nothing is created in or changed on the host's own network namespace.
3. ``popen(i, argv)`` runs a process inside host ``i`` (``ip netns exec``), in its own process
   group; ``link_bytes(i)`` reads host ``i``'s interface counters; ``set_port(bridge_ns, i, up)``
   takes its link down or up at the bridge (a failure in the middle of a transfer), from any
   process on the machine.
4. ``__exit__``, also after a failure: every process group it started is killed, then the
   namespaces are deleted (which deletes their interfaces). ``remove_stale()`` deletes namespaces a
   crashed run left behind (their owner pid, part of the name, is no longer alive).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
from dataclasses import dataclass

from pdserve.cluster.pids import pid_alive

logger = logging.getLogger(__name__)

PREFIX = "pdn"            # every namespace this module creates starts with it
SUBNET = "10.77.0"        # host i is SUBNET.{i+1}; exists only inside the namespaces
MAX_HOSTS = 8
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit)$")
_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}


class HostsUnavailable(RuntimeError):
    """This machine cannot emulate hosts (the message names what is missing)."""


def rate_bits(rate: str) -> float:
    """Bits per second of a ``tc`` rate such as ``10gbit`` or ``500mbit`` (ValueError otherwise)."""
    m = _RATE.match(rate.strip().lower())
    if not m:
        raise ValueError(f"link rate {rate!r}: expected a number and one of {'/'.join(_UNITS)}, e.g. 10gbit")
    bits = float(m.group(1)) * _UNITS[m.group(2)]
    if bits <= 0:
        raise ValueError(f"link rate {rate!r} must be above zero")
    return bits


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(list(argv), capture_output=True, text=True, check=False, timeout=30)
    if check and res.returncode:
        raise HostsUnavailable(f"`{' '.join(argv)}` failed ({res.returncode}): {res.stderr.strip()[:500]}")
    return res


def check_available() -> None:
    """Raise ``HostsUnavailable`` naming what is missing; create nothing that outlives the check."""
    if os.geteuid() != 0:
        raise HostsUnavailable("emulated hosts need root (network namespaces, veth pairs, tc)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise HostsUnavailable(f"emulated hosts need `{tool}` (Debian package iproute2)")
    probe = f"{PREFIX}{os.getpid()}probe"
    res = _run("ip", "netns", "add", probe, check=False)
    if res.returncode:
        raise HostsUnavailable(f"cannot create a network namespace here: {res.stderr.strip()[:300]}")
    try:
        veth = _run("ip", "-n", probe, "link", "add", "a0", "type", "veth", "peer", "name", "b0", check=False)
        if veth.returncode:
            raise HostsUnavailable(f"cannot create a veth pair here: {veth.stderr.strip()[:300]}")
        tbf = _run("ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "a0", "root", "tbf", "rate", "1gbit",
                   "burst", "256kb", "latency", "50ms", check=False)
        if tbf.returncode:
            raise HostsUnavailable(f"tc cannot shape a link here (tbf): {tbf.stderr.strip()[:300]}")
    finally:
        _run("ip", "netns", "del", probe, check=False)


def remove_stale() -> list[str]:
    """Delete namespaces of this module whose creating process is gone; returns their names."""
    res = _run("ip", "-j", "netns", "list", check=False)
    try:
        names = [entry["name"] for entry in json.loads(res.stdout or "[]")]
    except ValueError:
        names = []
    removed = []
    for name in names:
        m = re.match(rf"^{PREFIX}(\d+)(?:br|h\d+)$", name)
        if m and not pid_alive(int(m.group(1))):
            _run("ip", "netns", "del", name, check=False)
            removed.append(name)
    if removed:
        logger.info("removed namespaces left by earlier runs: %s", removed)
    return removed


@dataclass(frozen=True, slots=True)
class LinkBytes:
    tx: int
    rx: int


def read_link_bytes(namespace: str) -> LinkBytes:
    """The ``eth0`` counters of a host namespace (usable from any process on the machine)."""
    res = _run("ip", "-n", namespace, "-j", "-s", "link", "show", "dev", "eth0")
    stats = json.loads(res.stdout)[0]["stats64"]
    return LinkBytes(tx=int(stats["tx"]["bytes"]), rx=int(stats["rx"]["bytes"]))


def set_port(bridge_ns: str, i: int, up: bool) -> None:
    """Take host ``i``'s bridge port down or up (usable from any process on the machine)."""
    _run("ip", "-n", bridge_ns, "link", "set", f"p{i}", "up" if up else "down")


class EmulatedHosts:
    """``n`` hosts (network namespaces) on one bridge, each link shaped to ``rate`` both ways."""

    def __init__(self, n: int, rate: str, *, latency_ms: float = 50.0) -> None:
        if not 1 <= n <= MAX_HOSTS:
            raise ValueError(f"between 1 and {MAX_HOSTS} hosts, got {n}")
        self.n, self.rate, self.rate_bits = n, rate, rate_bits(rate)
        self.latency_ms = latency_ms
        self.tag = f"{PREFIX}{os.getpid()}"
        self.bridge_ns = f"{self.tag}br"
        self.namespaces = [f"{self.tag}h{i}" for i in range(n)]
        self._procs: list[subprocess.Popen] = []
        self._created: list[str] = []

    def ip(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    # ------------------------------------------------------------------ life cycle
    def __enter__(self) -> EmulatedHosts:
        check_available()
        remove_stale()
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _create(self) -> None:
        br = self.bridge_ns
        _run("ip", "netns", "add", br)
        self._created.append(br)
        _run("ip", "-n", br, "link", "set", "lo", "up")
        _run("ip", "-n", br, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", br, "link", "set", "br0", "up")
        for i, ns in enumerate(self.namespaces):
            _run("ip", "netns", "add", ns)
            self._created.append(ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            port = f"p{i}"
            _run("ip", "-n", br, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _run("ip", "-n", br, "link", "set", port, "master", "br0")
            _run("ip", "-n", br, "link", "set", port, "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.ip(i)}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            self._shape(ns, "eth0")
            self._shape(br, port)
        logger.info("emulated %d hosts %s-%s on %s links", self.n, self.ip(0), self.ip(self.n - 1), self.rate)

    def _shape(self, ns: str, dev: str) -> None:
        # burst: at least 4 ms of the rate (a 1,000 Hz timer must not starve the bucket) and a
        # whole 64 KiB segment (veths pass GSO segments that large)
        burst = max(64 * 1024 + 1514, int(self.rate_bits / 8 / 250))
        _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate,
             "burst", str(burst), "latency", f"{self.latency_ms:g}ms")

    def close(self) -> None:
        """Kill every process group started here, then delete the namespaces (idempotent)."""
        for proc in self._procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self._procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                logger.warning("process %d did not exit after SIGKILL", proc.pid)
        self._procs.clear()
        for ns in reversed(self._created):
            _run("ip", "netns", "del", ns, check=False)
        self._created.clear()

    # ------------------------------------------------------------------ use
    def popen(self, i: int, argv: list[str], *, env: dict[str, str] | None = None,
              **kwargs: object) -> subprocess.Popen:
        """Start ``argv`` inside host ``i``, in a new session (its process group is killed at close)."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.namespaces[i], *argv], env=env,
                                start_new_session=True, **kwargs)  # type: ignore[arg-type]
        self._procs.append(proc)
        return proc

    def link_bytes(self, i: int) -> LinkBytes:
        """Bytes host ``i`` sent and received on its link (its ``eth0`` counters)."""
        return read_link_bytes(self.namespaces[i])

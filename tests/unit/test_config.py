"""The user-facing cluster config: defaults, validation messages, YAML loading, env, schema, docs."""

from __future__ import annotations

import re
from pathlib import Path

import jsonschema
import pydantic
import pytest
import yaml

from pdserve.cluster.config import ClusterConfig, ConfigError
from pdserve.cluster.config_io import (apply_env, apply_overrides, config_from_model, config_to_yaml, json_schema,
                                       load_config)
from pdserve.capacity.planner import PlannerPolicy
from pdserve.engine.config import EngineConfig, EngineMode
from pdserve.engine.errors import InvalidRequestError

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "cluster.yaml"
DOCS = REPO / "docs" / "configuration.md"
NO_ENV: dict[str, str] = {}


def write(tmp_path: Path, text: str, name: str = "cluster.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def load_text(tmp_path: Path, text: str) -> ClusterConfig:
    return load_config(write(tmp_path, text), check_paths=False, environ=NO_ENV)


def problems_of(tmp_path: Path, text: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_text(tmp_path, text)
    return info.value.problems


def all_fields(model: type[pydantic.BaseModel], prefix: str = "") -> list[tuple[type[pydantic.BaseModel], str]]:
    """(model, dotted name) for every field, descending into sections."""
    out = []
    for name, info in model.model_fields.items():
        out.append((model, prefix + name))
        if isinstance(info.annotation, type) and issubclass(info.annotation, pydantic.BaseModel):
            out.extend(all_fields(info.annotation, f"{prefix}{name}."))
    return out


def test_model_dir_alone_gives_a_complete_single_machine_config(tmp_path: Path) -> None:
    model_dir = tmp_path / "tiny-llama"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    config = config_from_model(model_dir, environ=NO_ENV)
    assert config.model.path == model_dir and config.model.path.is_absolute()
    assert config.model.served_name == "tiny-llama"
    for pool in (config.prefill, config.decode):
        # max_replicas unset: the pool may grow while Ray has room (cluster/control/pool_manager.auto_max_replicas)
        assert (pool.min_replicas, pool.initial_replicas, pool.max_replicas) == (1, 1, None)
        assert pool.resources == {} and pool.num_gpus == 0
    assert config.router.host == "127.0.0.1" and config.ray.node_ip_address == "127.0.0.1"
    assert config.redis.url is None and config.router.api_keys == []


def test_example_file_loads_and_matches_the_json_schema() -> None:
    config = load_config(EXAMPLE, check_paths=False, environ=NO_ENV)
    assert config.model.served_name == "tiny"
    assert config.prefill.max_replicas == 2 and config.decode.max_replicas == 2
    jsonschema.validate(yaml.safe_load(EXAMPLE.read_text()), json_schema())
    with pytest.raises(jsonschema.ValidationError, match="min_replica"):  # editors flag typos too
        jsonschema.validate({"model": {"path": "/m"}, "prefill": {"min_replica": 1}}, json_schema())


def test_example_file_shows_every_field() -> None:
    text = EXAMPLE.read_text()
    missing = [dotted for _, dotted in all_fields(ClusterConfig)
               if not re.search(rf"^\s*#?\s*{dotted.rsplit('.', 1)[-1]}:", text, re.MULTILINE)]
    assert missing == []


def test_every_field_has_a_description_and_is_documented() -> None:
    docs = DOCS.read_text()
    undocumented, no_description = [], []
    for model, dotted in all_fields(ClusterConfig):
        if not model.model_fields[dotted.rsplit(".", 1)[-1]].description:
            no_description.append(dotted)
        if f"`{dotted.rsplit('.', 1)[-1]}`" not in docs:
            undocumented.append(dotted)
    assert no_description == [] and undocumented == []


def test_relative_paths_resolve_against_the_file_directory(tmp_path: Path) -> None:
    (tmp_path / "conf").mkdir()
    path = write(tmp_path / "conf", "model: {path: ../models/m}\nrouter: {tls_cert_file: c.pem, tls_key_file: k.pem}\n")
    config = load_config(path, check_paths=False, environ=NO_ENV)
    assert config.model.path == tmp_path / "models" / "m"
    assert config.router.tls_cert_file == tmp_path / "conf" / "c.pem"


def test_empty_sections_mean_defaults(tmp_path: Path) -> None:
    config = load_text(tmp_path, "model: {path: /m}\nredis:\nprefill:\n  engine:\nrouter:\n  disaggregation:\n")
    assert config.redis == ClusterConfig.model_fields["redis"].default_factory()  # type: ignore[misc]
    assert config.prefill.engine.block_size == 16
    assert config.router.disaggregation.local_prefill_max_tokens == 64


M = "model: {path: /m}\n"
# (case, YAML, one problem exactly as reported; the file is always named cluster.yaml)
ERROR_CASES = [
    ("max below min", M + "prefill:\n  min_replicas: 1\n  max_replicas: 0\n",
     "cluster.yaml:4: prefill.max_replicas: must be >= min_replicas (1) (got 0)"),
    ("initial below min", M + "decode:\n  min_replicas: 2\n  initial_replicas: 1\n",
     "cluster.yaml:4: decode.initial_replicas: must be >= min_replicas (2) (got 1)"),
    ("max below initial", M + "decode: {initial_replicas: 3, max_replicas: 2}\n",
     "cluster.yaml:2: decode.max_replicas: must be >= initial_replicas (3) (got 2)"),
    ("negative replicas", M + "prefill: {min_replicas: -1}\n",
     "cluster.yaml:2: prefill.min_replicas: Input should be greater than or equal to 0 (got -1)"),
    ("misspelt key", M + "prefill:\n  min_replica: 2\n",
     "cluster.yaml:3: prefill.min_replica: unknown key (did you mean 'min_replicas'?)"),
    ("unknown section", M + "routr: {}\n", "cluster.yaml:2: routr: unknown key (did you mean 'router'?)"),
    ("missing model", "prefill: {}\n", "cluster.yaml:1: model: Field required"),
    ("block size not a power of two", M + "prefill: {engine: {block_size: 24, num_kv_blocks: 8}}\n",
     "cluster.yaml:2: prefill.engine.block_size: must be a power of two (1, 2, 4, ... 256), got 24 (got 24)"),
    ("block sizes differ", M + "prefill: {engine: {block_size: 32}}\n",
     "cluster.yaml:1: decode.engine.block_size: must equal prefill.engine.block_size (32); "
     "KV blocks move between the pools as is"),
    ("mkl_packed in bf16", "model: {path: /m, dtype: bfloat16}\ndecode: {engine: {linear_backend: mkl_packed}}\n",
     "cluster.yaml:2: decode.engine.linear_backend: 'mkl_packed' packs float32 weights; with model.dtype "
     "'bfloat16' use 'auto', 'packed' or 'dense'"),
    ("both KV sizes", M + "decode: {engine: {num_kv_blocks: 100, kv_cache_memory_gb: 1}}\n",
     "cluster.yaml:2: decode.engine.num_kv_blocks: set either num_kv_blocks or kv_cache_memory_gb, not both"),
    ("batch smaller than seqs", M + "decode: {engine: {max_num_seqs: 128, max_num_batched_tokens: 64}}\n",
     "cluster.yaml:2: decode.engine.max_num_batched_tokens: must be >= max_num_seqs (128) so that every "
     "running sequence can decode in one step"),
    ("cuda without a GPU", M + "decode: {engine: {device: cuda}}\n",
     "cluster.yaml:2: decode.engine.device: 'cuda' needs num_gpus > 0: Ray places a worker on a GPU of its own "
     "only when its pool reserves one (set num_gpus: 1, or a fraction to share one)"),
    ("cuda with the C++ attention", M + "prefill: {num_gpus: 1, engine: {device: cuda, attention_backend: native}}\n",
     "cluster.yaml:2: prefill.engine.attention_backend: 'native' is the C++ CPU kernel; on 'cuda' use 'auto' "
     "or 'sdpa'"),
    ("varlen on CPU", M + "decode: {engine: {attention_backend: varlen}}\n",
     "cluster.yaml:2: decode.engine.attention_backend: 'varlen' is flash attention, which runs on 'cuda' only; "
     "on CPU use 'auto', 'native' or 'sdpa'"),
    ("varlen in float32", M.replace("}", ", dtype: float32}") + "decode: {num_gpus: 1, engine: {device: cuda, "
     "attention_backend: varlen}}\n",
     "cluster.yaml:2: decode.engine.attention_backend: 'varlen' (flash attention) needs bfloat16 KV; with "
     "model.dtype 'float32' use 'auto', 'sdpa' or 'flex'"),
    ("cuda with a CPU linear", M + "decode: {num_gpus: 0.5, engine: {device: cuda, linear_backend: gemv}}\n",
     "cluster.yaml:2: decode.engine.linear_backend: 'gemv' is a CPU backend; on 'cuda' use 'auto' or 'dense'"),
    ("reserved resource", M + "prefill: {resources: {GPU: 1}}\n",
     "cluster.yaml:2: prefill.resources: 'GPU' is set by num_cpus/num_gpus, not as a custom resource"),
    ("decode pool at zero", M + "decode: {min_replicas: 0}\n",
     "cluster.yaml:2: decode.min_replicas: must be >= 1 (decode workers serve every request)"),
    ("dtype", M.replace("}", ", dtype: float16}"),
     "cluster.yaml:1: model.dtype: Input should be 'auto', 'float32' or 'bfloat16' (got 'float16')"),
    ("half a TLS pair", M + "router: {tls_cert_file: /c.pem}\n",
     "cluster.yaml:2: router.tls_key_file: tls_cert_file and tls_key_file must be set together"),
    ("same ports", M + "router: {http_port: 9000, grpc_port: 9000}\n",
     "cluster.yaml:2: router.grpc_port: must differ from http_port (9000)"),
    ("transfer timeout", M + "router: {disaggregation: {kv_transfer_timeout_s: 0}}\n",
     "cluster.yaml:2: router.disaggregation.kv_transfer_timeout_s: Input should be greater than 0 (got 0)"),
    ("liveness thresholds", M + "router: {worker_stats_timeout_s: 10, worker_dead_after_s: 10}\n",
     "cluster.yaml:2: router.worker_dead_after_s: must be longer than worker_stats_timeout_s (10.0)"),
    ("redis scheme", M + "redis: {url: 'http://x'}\n",
     "cluster.yaml:2: redis.url: must start with redis://, rediss:// or unix:// (got 'http://x')"),
    ("data_dir with external redis", M + "redis: {url: 'redis://x:6379', data_dir: /d}\n",
     "cluster.yaml:2: redis.data_dir: only applies to the embedded server (remove url or data_dir)"),
    ("node ip", M + "ray: {node_ip_address: localhost}\n",
     "cluster.yaml:2: ray.node_ip_address: 'localhost' does not appear to be an IPv4 or IPv6 address "
     "(got 'localhost')"),
    ("hysteresis band", M + "planner: {scale_up_utilization: 0.5, scale_down_utilization: 0.6}\n",
     "cluster.yaml:2: planner.scale_down_utilization: must be < scale_up_utilization (0.5)"),
    ("duplicate key", M + "router: {}\nrouter: {}\n", "cluster.yaml:3: invalid YAML: duplicate key 'router'"),
    ("bad YAML", M + "prefill: [\n", "cluster.yaml:3: invalid YAML: expected the node content, but found '<stream end>'"),
    ("top level a list", "- model\n",
     "cluster.yaml: the top level must be a mapping of sections (model:, prefill:, ...)"),
]


@pytest.mark.parametrize(("case", "text", "expected"), ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_errors_name_file_line_and_field(tmp_path: Path, case: str, text: str, expected: str) -> None:
    problems = problems_of(tmp_path, text)
    assert [p.replace(str(tmp_path) + "/", "") for p in problems] == [expected]


def test_config_error_is_an_invalid_request_error_listing_every_problem(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequestError) as info:
        load_text(tmp_path, "model: {path: /m, colour: red}\nslo: {ttft_ms: 0, itl_ms: -1}\n")
    assert isinstance(info.value, ConfigError) and len(info.value.problems) == 3
    assert "slo.itl_ms" in str(info.value)


def test_a_cuda_pool_with_gpus_loads_and_reaches_its_engine(tmp_path: Path) -> None:
    """A GPU prefill pool beside a CPU decode pool: the pools may differ, and the device reaches
    each replica's engine config (the pools' KV has the same meaning wherever it lives)."""
    config = load_text(tmp_path, M + "prefill: {num_gpus: 1, accelerator_type: H100, engine: {device: cuda, "
                                     "kv_staging: always}}\n")
    prefill = config.prefill.engine_config(config.model, EngineMode.PREFILL)
    assert (prefill.device, prefill.kv_staging) == ("cuda", "always")
    decode = config.decode.engine_config(config.model, EngineMode.DECODE)
    assert (decode.device, decode.kv_staging) == ("cpu", "auto")


def test_secrets_never_appear_in_errors_or_dumps(tmp_path: Path) -> None:
    problems = problems_of(tmp_path, M + "router: {api_keys: ['sk-1 2']}\nredis: {password: 12345}\n")
    assert len(problems) == 2 and not any("sk-1" in p or "12345" in p for p in problems)
    config = load_text(tmp_path, M + "router: {api_keys: [sk-abc]}\nredis: {password: hunter2}\n")
    assert config.router.api_keys[0].get_secret_value() == "sk-abc"
    shown = repr(config) + config_to_yaml(config)
    assert "sk-abc" not in shown and "hunter2" not in shown


def test_missing_files_are_reported_only_when_checked(tmp_path: Path) -> None:
    path = write(tmp_path, "model: {path: nowhere}\nrouter: {tls_cert_file: c.pem, tls_key_file: k.pem}\n")
    assert load_config(path, check_paths=False, environ=NO_ENV).model.path == tmp_path / "nowhere"
    with pytest.raises(ConfigError) as info:
        load_config(path, environ=NO_ENV)
    assert info.value.problems == [
        f"{path}: model.path: {tmp_path / 'nowhere'} is not a directory",
        f"{path}: router.tls_cert_file: {tmp_path / 'c.pem'} is not a file",
        f"{path}: router.tls_key_file: {tmp_path / 'k.pem'} is not a file",
    ]
    (tmp_path / "nowhere").mkdir()
    with pytest.raises(ConfigError, match="has no config.json"):
        config_from_model(tmp_path / "nowhere", environ=NO_ENV)


def test_environment_adds_api_keys_and_sets_the_redis_password(tmp_path: Path) -> None:
    config = load_text(tmp_path, M + "router: {api_keys: [a]}\nredis: {password: old}\n")
    env = {"PDSERVE_API_KEYS": " b, a ,,c", "PDSERVE_REDIS_PASSWORD": "new"}
    merged = apply_env(config, env)
    assert [k.get_secret_value() for k in merged.router.api_keys] == ["a", "b", "c"]
    assert merged.redis.password is not None and merged.redis.password.get_secret_value() == "new"
    assert apply_env(config, {}) is config
    with pytest.raises(ConfigError, match="environment: redis.password"):
        apply_env(config, {"PDSERVE_REDIS_PASSWORD": "has space"})


def test_overrides_revalidate_and_rederive_defaults(tmp_path: Path) -> None:
    config = load_text(tmp_path, "model: {path: /models/a}\ndecode: {min_replicas: 2}\n")
    assert (config.model.served_name, config.decode.initial_replicas, config.decode.max_replicas) == ("a", 2, None)
    changed = apply_overrides(config, {"model.path": "/models/b", "decode.max_replicas": 4,
                                       "router.disaggregation.mode": "never"})
    assert (changed.model.served_name, changed.decode.max_replicas) == ("b", 4)
    assert changed.router.disaggregation.mode == "never" and changed.decode.min_replicas == 2
    with pytest.raises(ConfigError, match=r"command line: decode.max_replicas: must be >= min_replicas \(2\)"):
        apply_overrides(config, {"decode.max_replicas": 1})
    with pytest.raises(ConfigError, match="unknown key"):
        apply_overrides(config, {"router.htp_port": 1})
    with pytest.raises(ConfigError, match="command line: router.host: Input should be a valid string"):
        apply_overrides(config, {"router.host.name": "x"})


def test_config_is_frozen(tmp_path: Path) -> None:
    config = load_text(tmp_path, M)
    with pytest.raises(pydantic.ValidationError):
        config.router.http_port = 1  # type: ignore[misc]


def test_internal_dataclasses_built_from_settings(tmp_path: Path) -> None:
    config = load_text(tmp_path, "model: {path: /m, dtype: bfloat16, max_model_len: 512}\n"
                       "decode: {engine: {num_kv_blocks: 300, max_num_seqs: 8, num_threads: 2}}\n"
                       "slo: {ttft_ms: 500}\nplanner: {max_step: 3, scale_down_cooldown_s: 5}\n")
    engine = config.decode.engine_config(config.model, EngineMode.DECODE)
    assert isinstance(engine, EngineConfig)
    assert (engine.model_dir, engine.dtype, engine.num_blocks, engine.max_num_seqs, engine.num_threads,
            engine.max_model_len, engine.mode) == ("/m", "bfloat16", 300, 8, 2, 512, EngineMode.DECODE)
    assert config.pool("prefill") is config.prefill
    with pytest.raises(ValueError):
        config.pool("mixed")
    policy = config.planner_policy()
    assert policy == PlannerPolicy(ttft_slo_ms=500.0, itl_slo_ms=100.0, max_step=3, scale_down_cooldown_s=5.0)


def _model_dir(tmp_path: Path) -> Path:
    model_dir = tmp_path / "tiny-llama"
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text("{}")
    return model_dir


def test_decode_workers_get_the_itl_budget_only_in_a_disaggregated_cluster(tmp_path: Path) -> None:
    model = _model_dir(tmp_path)
    cfg = apply_overrides(config_from_model(model, environ=NO_ENV), {"slo.itl_ms": 40})
    assert cfg.worker_engine_config("decode").itl_target_ms == 40
    assert cfg.worker_engine_config("prefill").itl_target_ms is None
    colocated = apply_overrides(config_from_model(model, environ=NO_ENV), {"router.disaggregation.mode": "never"})
    assert colocated.worker_engine_config("decode").itl_target_ms is None


def test_scheduling_policy_reaches_the_engine(tmp_path: Path) -> None:
    from pdserve.engine.config import SchedulingPolicy

    cfg = apply_overrides(config_from_model(_model_dir(tmp_path), environ=NO_ENV), {"decode.engine.scheduling_policy": "static"})
    assert cfg.worker_engine_config("decode").policy is SchedulingPolicy.STATIC
    assert cfg.worker_engine_config("prefill").policy is SchedulingPolicy.CONTINUOUS
    with pytest.raises(ConfigError, match="scheduling_policy"):
        apply_overrides(config_from_model(_model_dir(tmp_path), environ=NO_ENV), {"decode.engine.scheduling_policy": "fifo"})


def test_prefill_pack_tokens_reaches_each_pools_engine(tmp_path: Path) -> None:
    base = config_from_model(_model_dir(tmp_path), environ=NO_ENV)
    # 'auto': prefill workers pack up to 256 prompt tokens a step, decode workers do not cap
    assert base.worker_engine_config("prefill").prefill_pack_tokens == 256
    assert base.worker_engine_config("decode").prefill_pack_tokens is None
    cfg = apply_overrides(base, {"prefill.engine.prefill_pack_tokens": None, "decode.engine.prefill_pack_tokens": 512})
    assert cfg.worker_engine_config("prefill").prefill_pack_tokens is None
    assert cfg.worker_engine_config("decode").prefill_pack_tokens == 512
    for bad in (0, "some"):
        with pytest.raises(ConfigError, match="prefill_pack_tokens"):
            apply_overrides(base, {"prefill.engine.prefill_pack_tokens": bad})


def test_every_config_field_is_read_somewhere() -> None:
    """Documented config does what it says: each field of every section is read (as ``.name``)
    in the code outside the tests; a field nothing reads would be silently ignored."""
    import re

    sources = "\n".join(p.read_text() for pkg in ("engine", "kv_transfer", "worker", "prefill_worker", "decode_worker",
                                                    "router", "cluster", "pdserve")
                        for p in (REPO / pkg).rglob("*.py"))
    unread = sorted({dotted for _, dotted in all_fields(ClusterConfig)
                     if not re.search(rf"\.{re.escape(dotted.rsplit('.', 1)[-1])}\b", sources)})
    assert unread == []


def test_a_planner_profile_that_does_not_load_is_refused_with_the_reason(tmp_path: Path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    bad = tmp_path / "profile.json"
    bad.write_text('{"version": 99}')
    config = load_text(tmp_path, f"model: {{path: {model}}}\nplanner: {{profile: {bad}}}\n")
    assert config.planner.profile == bad and config.planner.traffic_window_s == 120.0
    problems = config.path_problems()
    assert len(problems) == 1 and problems[0].startswith("planner.profile: ") and "pdserve profile" in problems[0]

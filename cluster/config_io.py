"""Loading the cluster configuration: YAML files (errors located by file, line and field, with
"did you mean"), ``--set`` overrides, the environment's secrets, the JSON schema and the YAML
dump. The models themselves are in ``cluster/config.py``.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from collections.abc import Hashable, Mapping
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import BaseModel, ValidationError

from pdserve.cluster.config import ClusterConfig, ConfigError
from pdserve.cluster.redact import redact_url
from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.known_models import resolve_model

ENV_API_KEYS = "PDSERVE_API_KEYS"
ENV_REDIS_PASSWORD = "PDSERVE_REDIS_PASSWORD"
_PATH_PREFIX = re.compile(r"^([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*): (.+)$", re.DOTALL)
_SECRET_FIELDS = frozenset({"api_keys", "password"})


class _StrictLoader(yaml.SafeLoader):
    """Safe YAML loading that refuses a key given twice in one mapping."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):
                continue  # SafeLoader itself reports unhashable keys
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def load_config(path: str | os.PathLike[str], *, check_paths: bool = True,
                environ: Mapping[str, str] | None = None) -> ClusterConfig:
    """Read, validate and complete a YAML config file; raises ``ConfigError``.

    ``check_paths=False`` skips checking that the model directory and TLS files exist here
    (for a config meant for other machines). ``environ`` defaults to ``os.environ``.
    """
    source = Path(path)
    try:
        text = source.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([f"{source}: cannot read: {exc.strerror or exc}"]) from exc
    loader = _StrictLoader(text)
    try:
        root = loader.get_single_node()
        data = loader.construct_document(root) if root is not None else {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark is not None else str(source)
        raise ConfigError([f"{where}: invalid YAML: {getattr(exc, 'problem', None) or exc}"]) from exc
    finally:
        loader.dispose()
    if not isinstance(data, dict):
        raise ConfigError([f"{source}: the top level must be a mapping of sections (model:, prefill:, ...)"])
    config = _validate(data, str(source), source.resolve().parent, root)
    return _finish(config, str(source), check_paths, environ)


def config_from_model(model_path: str | os.PathLike[str], *, check_paths: bool = True,
                      environ: Mapping[str, str] | None = None) -> ClusterConfig:
    """The default single-machine config serving ``model_path`` (``pdserve up --model DIR``)."""
    config = _validate({"model": {"path": str(model_path)}}, "--model", Path.cwd(), None)
    return _finish(config, "--model", check_paths, environ)


def apply_overrides(config: ClusterConfig, overrides: Mapping[str, Any],
                    source: str = "command line") -> ClusterConfig:
    """A copy of ``config`` with dotted keys replaced (``{"router.http_port": 8001}``), revalidated.

    Defaults derived from other fields (served_name, initial_replicas) are derived again.
    """
    data = config.model_dump(exclude_unset=True)
    for dotted, value in overrides.items():
        *parents, leaf = dotted.split(".")
        node = data
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError([f"{source}: {dotted}: {part} is not a section"])
            node = child
        node[leaf] = value
    return _validate(data, source, Path.cwd(), None)


def apply_env(config: ClusterConfig, environ: Mapping[str, str] | None = None) -> ClusterConfig:
    """Add API keys from ``PDSERVE_API_KEYS`` and take the Redis password from ``PDSERVE_REDIS_PASSWORD``."""
    env = os.environ if environ is None else environ
    overrides: dict[str, Any] = {}
    keys = [k.strip() for k in env.get(ENV_API_KEYS, "").split(",") if k.strip()]
    if keys:
        known = [k.get_secret_value() for k in config.router.api_keys]
        overrides["router.api_keys"] = known + [k for k in keys if k not in known]
    if env.get(ENV_REDIS_PASSWORD):
        overrides["redis.password"] = env[ENV_REDIS_PASSWORD]
    return apply_overrides(config, overrides, "environment") if overrides else config


def json_schema() -> dict[str, Any]:
    """JSON Schema of a config file (``pdserve config schema``)."""
    return ClusterConfig.model_json_schema(mode="validation")


def config_to_yaml(config: ClusterConfig) -> str:
    """The effective config as YAML, secrets masked (``pdserve config show``): ``SecretStr``
    fields, and a password written into ``redis.url``."""
    data = config.model_dump(mode="json")
    if data["redis"].get("url"):
        data["redis"]["url"] = redact_url(data["redis"]["url"])
    return yaml.safe_dump(data, sort_keys=False)


def check_exposure(config: ClusterConfig) -> ClusterConfig:
    """``config``, or ``ConfigError`` when it would serve beyond loopback with no key and no TLS."""
    if problems := config.exposure_problems():
        raise ConfigError(problems)
    return config


def _finish(config: ClusterConfig, source: str, check_paths: bool,
            environ: Mapping[str, str] | None) -> ClusterConfig:
    config = apply_env(config, environ)
    if check_paths and (problems := config.path_problems()):
        raise ConfigError([f"{source}: {problem}" for problem in problems])
    return config


def _validate(data: dict[str, Any], source: str, base_dir: Path, root: yaml.Node | None) -> ClusterConfig:
    try:
        return ClusterConfig.model_validate(data, context={"base_dir": base_dir})
    except ValidationError as exc:
        located = [_describe(err, source, root) for err in exc.errors(include_url=False)]
        raise ConfigError([text for _, text in sorted(located, key=lambda x: x[0])]) from None


def _describe(err: Mapping[str, Any], source: str, root: yaml.Node | None) -> tuple[int, str]:
    loc, msg = tuple(err["loc"]), str(err["msg"])
    if err["type"] == "value_error":
        msg = msg.removeprefix("Value error, ")
        if match := _PATH_PREFIX.match(msg):  # a validator naming the field it is about
            loc, msg = loc + tuple(match.group(1).split(".")), match.group(2)
    if err["type"] == "extra_forbidden":
        msg = _unknown_key(loc)
    elif err["type"] != "missing" and isinstance(err.get("input"), (str, int, float, bool)):
        if _SECRET_FIELDS.intersection(map(str, loc)):
            pass  # never echo a secret
        elif loc and loc[-1] == "url" and isinstance(err["input"], str):
            msg = f"{msg} (got {redact_url(err['input'])[:200]!r})"
        else:
            msg = f"{msg} (got {err['input']!r})"
    field = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
    line = _line_of(root, loc)
    where = f"{source}:{line}" if line else source
    return line or 0, f"{where}: {field}: {msg}" if field else f"{where}: {msg}"


def _unknown_key(loc: tuple[Any, ...]) -> str:
    model: type[BaseModel] | None = ClusterConfig
    for part in loc[:-1]:
        info = model.model_fields.get(part) if model and isinstance(part, str) else None
        candidates = (get_args(info.annotation) or (info.annotation,)) if info else ()
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
    if model is None:
        return "unknown key"
    close = difflib.get_close_matches(str(loc[-1]), model.model_fields, n=1)
    if close:
        return f"unknown key (did you mean {close[0]!r}?)"
    return f"unknown key (expected one of: {', '.join(model.model_fields)})"


def _line_of(node: yaml.Node | None, loc: tuple[Any, ...]) -> int | None:
    """1-based line of the YAML key or item at ``loc`` (of its deepest present parent if absent)."""
    if node is None:
        return None
    line = node.start_mark.line + 1
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            pair = next(((k, v) for k, v in node.value if getattr(k, "value", None) == str(part)), None)
            if pair is None:
                break
            line, node = pair[0].start_mark.line + 1, pair[1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            break
    return line


def load_cli_config(config_path: str | None, model: str | None, overrides: list[str], *,
                    offline: bool = False) -> ClusterConfig:
    """The config the CLI runs: file or model, ``--set`` overrides, the environment's secrets;
    ``ConfigError`` also when it would serve beyond loopback with no API key and no TLS.
    ``offline``: a config file meant for another machine (the model directory and TLS files are
    not looked for here, nor the API keys, which that machine's environment gives: ``exposure_note``
    says what it will need; the schema and the cross-field checks still run)."""
    if bool(config_path) == bool(model):
        raise InvalidRequestError("give exactly one of -c/--config FILE or --model DIR")
    if offline and not config_path:
        raise InvalidRequestError("--offline checks a config file (-c FILE) written for another machine; "
                                  "--model names a model here")
    if config_path:
        config = load_config(config_path, check_paths=not offline)
    else:
        model_dir, served_name = resolve_model(model)
        config = config_from_model(model_dir)
        if served_name:  # a .gguf file or a known name: clients use that name, not the cache's
            config = apply_overrides(config, {"model.served_name": served_name}, source="--model")
    parsed = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise InvalidRequestError(f"--set takes KEY=VALUE (e.g. router.http_port=8001), got {item!r}")
        try:
            parsed[key] = json.loads(value)
        except json.JSONDecodeError:
            parsed[key] = value
    if parsed:
        config = apply_overrides(config, parsed, source="command line")
    config = apply_env(config)
    return config if offline else check_exposure(config)

"""Secrets stay out of sight: `config show`, config errors, the state directory, the head's argv
hand-off; and a router open to other machines needs a key or TLS (`config check`).

The CLI runs in this process (``pdserve.cli.main``); the end-to-end check of a real head's
argv and state files is ``tests/integration/test_cli_ops.py``.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from pdserve.cli import main
from pdserve.cluster.head import state_files
from pdserve.cluster.config import ConfigError
from pdserve.cluster.config_io import apply_overrides, config_from_model, config_to_yaml
from pdserve.cluster.redact import redact_url, split_password

KEY = "sk-unit-3f9c1d77"
PASSWORD = "pw-unit-a81b2c"


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDSERVE_API_KEYS", raising=False)
    monkeypatch.delenv("PDSERVE_REDIS_PASSWORD", raising=False)


# ------------------------------------------------------------------ config show
def test_config_show_masks_keys_and_a_password_inside_redis_url(tiny_model: Path, no_env, capsys) -> None:
    rc = main(["config", "show", "--model", str(tiny_model), "--set", f'router.api_keys=["{KEY}"]',
               "--set", f"redis.url=redis://:{PASSWORD}@127.0.0.1:6390/2",
               "--set", f"redis.password={PASSWORD}"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert KEY not in out.out + out.err and PASSWORD not in out.out + out.err, out.out
    assert "url: redis://:**********@127.0.0.1:6390/2" in out.out


def test_config_errors_do_not_echo_a_password_in_a_url(tiny_model: Path, no_env) -> None:
    config = config_from_model(tiny_model, environ={})
    with pytest.raises(ConfigError) as info:
        apply_overrides(config, {"redis.url": f"http://:{PASSWORD}@127.0.0.1:6390/0"})
    assert "redis.url" in str(info.value) and PASSWORD not in str(info.value)


@pytest.mark.parametrize("url, shown, bare, password", [
    ("redis://:pw@h:6379/0", "redis://:**********@h:6379/0", "redis://h:6379/0", "pw"),
    ("rediss://user:p%40ss@h/1", "rediss://user:**********@h/1", "rediss://user@h/1", "p@ss"),
    ("redis://user@h", "redis://user@h", "redis://user@h", None),
    ("redis://127.0.0.1:6379", "redis://127.0.0.1:6379", "redis://127.0.0.1:6379", None),
])
def test_url_passwords_are_masked_and_split_off(url: str, shown: str, bare: str, password: str | None) -> None:
    assert redact_url(url) == shown
    assert split_password(url) == (bare, password)


# ------------------------------------------------------------------ config check: exposure
@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "pdserve.example.com"])
def test_config_check_refuses_a_public_bind_without_key_or_tls(tiny_model: Path, no_env, capsys, host: str) -> None:
    rc = main(["config", "check", "--model", str(tiny_model), "--set", f"router.host={host}"])
    err = capsys.readouterr().err
    assert rc != 0 and "router.host" in err and "allow_insecure_bind" in err, err


@pytest.mark.parametrize("extra", [
    [f'router.api_keys=["{KEY}"]'],
    ["router.allow_insecure_bind=true"],
    ["router.tls_cert_file={cert}", "router.tls_key_file={key}"],
])
def test_config_check_accepts_a_public_bind_with_key_tls_or_explicit_consent(
        tiny_model: Path, no_env, capsys, tmp_path: Path, extra: list[str]) -> None:
    (tmp_path / "c.pem").write_text("cert")
    (tmp_path / "k.pem").write_text("key")
    sets = [a for e in extra for a in ("--set", e.format(cert=tmp_path / "c.pem", key=tmp_path / "k.pem"))]
    rc = main(["config", "check", "--model", str(tiny_model), "--set", "router.host=0.0.0.0", *sets])
    out = capsys.readouterr()
    assert rc == 0 and "config OK" in out.out, out.err


def test_a_key_from_the_environment_counts(tiny_model: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setenv("PDSERVE_API_KEYS", KEY)
    assert main(["config", "check", "--model", str(tiny_model), "--set", "router.host=0.0.0.0"]) == 0


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_loopback_binds_need_nothing(tiny_model: Path, no_env, host: str) -> None:
    assert main(["config", "check", "--model", str(tiny_model), "--set", f"router.host={host}"]) == 0


# ------------------------------------------------------------------ the state directory
def test_state_dir_is_0700_and_its_files_0600(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    state.chmod(0o755)
    monkeypatch.setenv("PDSERVE_STATE_DIR", str(state))
    assert state_files.ensure_state_dir() == state and mode(state) == 0o700
    state_files.write_private(state_files.state_file(), json.dumps({"pid": 1}))
    state_files.write_redis_password(PASSWORD)
    assert mode(state_files.state_file()) == 0o600 and mode(state_files.redis_password_file()) == 0o600
    assert state_files.read_state() == {"pid": 1}


def test_overrides_reach_the_head_through_a_0600_file_it_deletes(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_STATE_DIR", str(tmp_path / "state"))
    overrides = [f'router.api_keys=["{KEY}"]', "router.http_port=0"]
    handoff = state_files.give_overrides(overrides)
    assert handoff.parent == tmp_path / "state" and mode(handoff) == 0o600 and mode(handoff.parent) == 0o700
    assert state_files.take_overrides(handoff) == overrides
    assert not handoff.exists()


# ------------------------------------------------------------------ config check --offline
def test_config_check_offline_checks_a_config_written_for_another_machine(tmp_path: Path, no_env, capsys,
                                                                          monkeypatch) -> None:
    """The k8s overlay's config names /models/llama, which is not on this machine: --offline checks
    everything else; without it the missing directory is the error."""
    monkeypatch.setenv("PDSERVE_API_KEYS", KEY)   # what the overlay's Secret gives its pods
    overlay = Path(__file__).resolve().parents[2] / "k8s" / "overlays" / "cpu-dev" / "cluster.yaml"
    assert main(["config", "check", "-c", str(overlay)]) != 0
    assert "is not a directory" in capsys.readouterr().err
    assert main(["config", "check", "--offline", "-c", str(overlay)]) == 0
    assert "config OK (offline" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text(overlay.read_text().replace("max_num_seqs:", "max_num_seqz:", 1))
    assert main(["config", "check", "--offline", "-c", str(bad)]) != 0
    assert "max_num_seqz" in capsys.readouterr().err
    assert main(["config", "check", "--offline", "--model", str(tmp_path)]) != 0
    assert "--offline checks a config file" in capsys.readouterr().err

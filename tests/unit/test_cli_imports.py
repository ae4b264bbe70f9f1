"""The ``pdserve`` command table (``pdserve/cli.py``): every command builds and resolves, and the
light commands run without loading torch, transformers, Ray or the engine's model code.

An operator's ``pdserve status`` (and the suite's many CLI calls) once paid for torch, loaded
only to build the parser: 2 s of CPU for a command that reads a file. The import check runs the
light commands one after another in a fresh interpreter, with a state directory that does not
exist (nothing is up), and names the first command after which a heavy module is loaded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.cli import COMMANDS, build_parser, chosen_command, load, main

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "ray", "pdserve.engine.llm_engine", "pdserve.engine.model_runner",
         "pdserve.engine.loader", "pdserve.engine.gguf_convert")

# Runs each command line of argv[1] (JSON) through pdserve.cli.main, in order, and writes
# [argv, exit code, heavy modules loaded so far] for each into argv[2].
_RUNNER = """
import contextlib, io, json, sys
from pdserve.cli import main
heavy = tuple(sys.argv[3].split(","))
results = []
for argv in json.loads(sys.argv[1]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            rc = main(argv)
        except SystemExit as exc:
            rc = exc.code
    loaded = sorted(m for m in heavy if m in sys.modules)
    results.append([argv, rc, loaded])
open(sys.argv[2], "w").write(json.dumps(results))
"""


def test_the_light_commands_load_no_torch_transformers_ray_or_engine(tmp_path: Path, tiny_model: Path) -> None:
    config = tmp_path / "cluster.yaml"
    config.write_text(f"model:\n  path: {tiny_model}\n")
    expected = [   # (command line, its exit code: it ran, nothing being up)
        (["--help"], 0),
        (["batch", "--help"], 0),
        (["status"], 1),
        (["status", "--json"], 1),
        (["down"], 0),
        (["requests", "tail"], 1),
        (["batch", "list"], 1),
        (["batch", "status", "batch_1"], 1),
        (["batch", "submit", str(tmp_path / "absent.jsonl")], 1),
        (["config", "schema"], 0),
        (["config", "show", "--model", str(tiny_model)], 0),
        (["config", "check", "--offline", "-c", str(config)], 0),
        (["up", "--model", str(tmp_path / "no-model")], 2),   # refused before a head is started
    ]
    out = tmp_path / "results.json"
    env = dict(os.environ, PDSERVE_STATE_DIR=str(tmp_path / "no-state"))
    proc = subprocess.run([sys.executable, "-c", _RUNNER, json.dumps([a for a, _ in expected]), str(out),
                           ",".join(HEAVY)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    results = json.loads(out.read_text())
    assert [(argv, rc) for argv, rc, _ in results] == [(list(a), rc) for a, rc in expected]
    first_heavy = next(((argv, loaded) for argv, _, loaded in results if loaded), None)
    assert first_heavy is None, f"`pdserve {' '.join(first_heavy[0])}` loaded {first_heavy[1]}"


def test_every_command_builds_and_its_handler_resolves() -> None:
    parser = build_parser(c.name for c in COMMANDS)   # every command's arguments at once: no clash
    for command in COMMANDS:
        assert callable(load(command.run)), command.name
        args = parser.parse_args([command.name, *_required(command.name)])
        assert args.handler == command.run


def _required(name: str) -> list[str]:
    """The fewest arguments a command's parser accepts."""
    return {"make-model": ["--out", "o"], "bench": ["shapes"], "config": ["schema"], "requests": ["tail"], "batch": ["list"],
            "generate": ["hi", "--model", "m"], "prepare-model": ["-c", "c.yaml"],
            "plan": ["--profile", "p", "--traffic", "t"], "simulate": ["--profile", "p", "--traffic", "t"],
            "profile": ["--model", "m", "--json", "o.json"]}.get(name, [])


def test_help_lists_every_command_with_its_one_line_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    shown = " ".join(capsys.readouterr().out.split())   # help lines wrap
    for command in COMMANDS:
        assert command.name in shown
        if not command.name.startswith("_"):
            assert " ".join(command.help.split()) in shown, command.name


def test_the_command_is_the_first_word_that_is_no_option() -> None:
    assert chosen_command(["-v", "status", "--json"]) == "status"
    assert chosen_command(["config", "show", "-c", "x.yaml"]) == "config"
    assert chosen_command(["--help"]) is None
    assert chosen_command([]) is None

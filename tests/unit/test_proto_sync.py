"""The committed generated code of the public gRPC API matches its .proto."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load_generator():
    spec = importlib.util.spec_from_file_location("pdserve_proto_generate", REPO / "proto" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_code_is_in_sync_with_proto(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    gen = _load_generator()
    # protoc runs in its own process: grpc_tools' bundled protobuf crashes (segfault) when loaded
    # into a process that already holds Ray's and grpcio's native libraries.
    proc = subprocess.run([sys.executable, str(REPO / "proto" / "generate.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    written = sorted(tmp_path.iterdir())
    assert sorted(p.name for p in written) == sorted(gen.GENERATED)
    for path in written:
        committed = REPO / "proto" / path.name
        assert committed.exists(), f"{committed} is missing: run `python proto/generate.py`"
        assert path.read_text(encoding="utf-8") == committed.read_text(encoding="utf-8"), (
            f"{committed.name} is stale: run `python proto/generate.py` and commit the result"
        )


def test_generated_modules_import_inside_the_pdserve_namespace() -> None:
    from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc

    assert pdserve_pb2.DESCRIPTOR.package == "pdserve.v1"
    assert pdserve_pb2.DESCRIPTOR.name == "pdserve/v1/pdserve.proto"
    assert pdserve_pb2_grpc.pdserve_dot_v1_dot_pdserve__pb2 is pdserve_pb2
    service = pdserve_pb2.DESCRIPTOR.services_by_name["Generation"]
    assert {m.name for m in service.methods} == {"Generate", "ListModels"}

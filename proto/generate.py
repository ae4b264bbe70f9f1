"""Regenerate the Python code of ``pdserve/v1/pdserve.proto`` with grpc_tools.protoc.

Run ``python proto/generate.py`` after editing the ``.proto``. The generated modules live
flat in ``proto/`` (imported as ``pdserve.proto.pdserve_pb2`` and
``pdserve.proto.pdserve_pb2_grpc``); protoc writes them under ``pdserve/v1/`` and the gRPC
module imports ``from pdserve.v1 import pdserve_pb2``, so this script moves them and rewrites
that import to point into the ``pdserve.proto`` namespace. ``tests/unit/test_proto_sync.py``
regenerates into a temporary directory and compares byte for byte with the committed files.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
PROTO_FILE = "pdserve/v1/pdserve.proto"  # relative to PROTO_DIR; also its name in the descriptor pool
GENERATED = ("pdserve_pb2.py", "pdserve_pb2.pyi", "pdserve_pb2_grpc.py")
_PROTOC_IMPORT = "from pdserve.v1 import pdserve_pb2 as"
_PACKAGE_IMPORT = "from pdserve.proto import pdserve_pb2 as"


def generate(out_dir: Path) -> list[Path]:
    """Run protoc on the ``.proto`` and write the three generated files into ``out_dir``."""
    from grpc_tools import protoc  # test-only dependency (grpcio-tools)

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        well_known = Path(protoc.__file__).resolve().parent / "_proto"
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_DIR}",
            f"-I{well_known}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            str(PROTO_DIR / PROTO_FILE),
        ]
        rc = protoc.main(args)
        if rc != 0:
            raise RuntimeError(f"protoc failed with exit code {rc} on {PROTO_FILE}")
        produced = Path(tmp) / Path(PROTO_FILE).parent
        written = []
        for name in GENERATED:
            text = (produced / name).read_text(encoding="utf-8")
            if name.endswith("_grpc.py"):
                if _PROTOC_IMPORT not in text:
                    raise RuntimeError(f"protoc output changed: {_PROTOC_IMPORT!r} not found in {name}")
                text = text.replace(_PROTOC_IMPORT, _PACKAGE_IMPORT)
            target = out_dir / name
            target.write_text(text, encoding="utf-8")
            written.append(target)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PROTO_DIR, help="output directory (default: proto/)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        sys.stdout.write(f"wrote {path}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Regenerate the Python gRPC code of ``proto/baton.proto``.

From the repository root::

    python -m proto.generate            # regenerates into proto/
    python -m proto.generate OUT_DIR    # regenerates into OUT_DIR

This runs ``grpc_tools.protoc`` from the repository root (equivalent to ``python -m
grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. proto/baton.proto``), so
the generated modules are named ``proto.baton_pb2`` and import each other through the package:
their messages then pickle by a module path that every process can import.
"""

from __future__ import annotations

import argparse
import importlib.resources
import shutil
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
ROOT = PROTO_DIR.parent
PROTO_FILE = "proto/baton.proto"
GENERATED = ("baton_pb2.py", "baton_pb2.pyi", "baton_pb2_grpc.py")


def well_known_include() -> str:
    """Return the include directory of the protobuf well-known types shipped with grpc_tools."""
    return str(importlib.resources.files("grpc_tools") / "_proto")


def run_protoc(out_root: Path) -> None:
    """Run protoc on ``proto/baton.proto``; the files land in ``out_root/proto/``."""
    from grpc_tools import protoc

    out = str(out_root)
    args = ["grpc_tools.protoc", f"-I{ROOT}", f"-I{well_known_include()}",
            f"--python_out={out}", f"--pyi_out={out}", f"--grpc_python_out={out}",
            str(ROOT / PROTO_FILE)]
    code = protoc.main(args)
    if code != 0:
        raise RuntimeError(f"protoc failed with exit code {code}")


def generate(out_dir: Path | str = PROTO_DIR) -> list[Path]:
    """Regenerate the Python code into ``out_dir`` and return the paths of the generated files."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        run_protoc(Path(tmp))
        for name in GENERATED:
            shutil.copyfile(Path(tmp) / "proto" / name, out / name)
    return [out / name for name in GENERATED]


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point: ``python -m proto.generate [OUT_DIR]``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", default=str(PROTO_DIR),
                        help="directory to write the generated files to (default: proto/)")
    args = parser.parse_args(argv)
    for path in generate(args.out_dir):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

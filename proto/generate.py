"""Regenerate the Python gRPC code of ``proto/baton.proto``.

From the repository root::

    python -m proto.generate            # regenerates into proto/
    python -m proto.generate OUT_DIR    # regenerates into OUT_DIR

This runs ``grpc_tools.protoc`` (equivalent to ``python -m grpc_tools.protoc
-I proto --python_out=proto --pyi_out=proto --grpc_python_out=proto
proto/baton.proto``) and then rewrites the top-level ``import baton_pb2`` of
``baton_pb2_grpc.py`` into ``from proto import baton_pb2`` so that the modules
are importable as the package ``proto``.
"""

from __future__ import annotations

import argparse
import importlib.resources
import re
import sys
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
PROTO_FILE = "baton.proto"
GENERATED = ("baton_pb2.py", "baton_pb2.pyi", "baton_pb2_grpc.py")
PACKAGE = "proto"

_BARE_IMPORT = re.compile(r"^import (\w+_pb2) as (\w+)$", re.MULTILINE)


def well_known_include() -> str:
    """Return the include directory of the protobuf well-known types shipped with grpc_tools."""
    return str(importlib.resources.files("grpc_tools") / "_proto")


def run_protoc(out_dir: Path) -> None:
    """Run protoc on ``baton.proto`` and write the three generated files into ``out_dir``."""
    from grpc_tools import protoc

    out = str(out_dir)
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_DIR}",
        f"-I{well_known_include()}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        str(PROTO_DIR / PROTO_FILE),
    ]
    code = protoc.main(args)
    if code != 0:
        raise RuntimeError(f"protoc failed with exit code {code}")


def fix_imports(grpc_file: Path, package: str = PACKAGE) -> None:
    """Make the ``import X_pb2 as Y`` lines of a generated ``*_grpc.py`` package-relative."""
    text = grpc_file.read_text()
    fixed = _BARE_IMPORT.sub(rf"from {package} import \1 as \2", text)
    grpc_file.write_text(fixed)


def generate(out_dir: Path | str = PROTO_DIR) -> list[Path]:
    """Regenerate the Python code into ``out_dir`` and return the paths of the generated files."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    run_protoc(out)
    fix_imports(out / "baton_pb2_grpc.py")
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

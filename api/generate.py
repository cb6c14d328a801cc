"""Regenerate the committed protobuf/gRPC Python code from the .proto files here.

Used by `make proto` (writes into the package) and by tests/test_proto_fresh.py
(writes into a temporary directory and compares), so the two cannot drift apart.
Needs grpcio-tools (the `dev` extra); its bundled protoc fixes the gencode version.

    python api/generate.py [OUT_ROOT]      # OUT_ROOT defaults to the repository root
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

API = Path(__file__).resolve().parent

# proto file -> (package directory relative to the repo root, also generate gRPC stubs?)
TARGETS: dict[str, tuple[str, bool]] = {
    "ttrpc.proto": ("nri_accel/ttrpc", False),
    "nri.proto": ("nri_accel/nri", False),
    "nri_views.proto": ("nri_accel/nri", False),
    "deviceplugin.proto": ("nri_accel/deviceplugin", True),
}


def generated_files(out_root: Path) -> list[Path]:
    files = []
    for proto, (pkg, grpc) in TARGETS.items():
        stem = proto.removesuffix(".proto")
        names = [f"{stem}_pb2.py", f"{stem}_pb2.pyi"] + ([f"{stem}_pb2_grpc.py"] if grpc else [])
        files += [out_root / pkg / n for n in names]
    return files


def generate(out_root: Path) -> None:
    from importlib.resources import files

    from grpc_tools import protoc

    well_known = files("grpc_tools") / "_proto"  # google/protobuf/*.proto, as protoc's CLI adds
    for proto, (pkg, grpc) in TARGETS.items():
        out = out_root / pkg
        out.mkdir(parents=True, exist_ok=True)
        args = ["protoc", f"-I{API}", f"-I{well_known}", f"--python_out={out}", f"--pyi_out={out}"]
        if grpc:
            args.append(f"--grpc_python_out={out}")
        args.append(str(API / proto))
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed on {proto}")
        if grpc:
            # grpc_tools imports the message module as a top-level module; make it a
            # package-relative import so the generated code works inside nri_accel.
            stem = proto.removesuffix(".proto")
            path = out / f"{stem}_pb2_grpc.py"
            text = path.read_text()
            text = re.sub(rf"^import {stem}_pb2 as", f"from . import {stem}_pb2 as",
                          text, flags=re.M)
            path.write_text(text)


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else API.parent)

"""Generate the Python stubs of protos/ with grpcio-tools.

    python protos/generate.py            # writes metrale/worker/v1/*_pb2*.py at the repo root

setup.py runs this at build time; the output is not committed (generated code is
never edited by hand). Pin: grpcio-tools 1.84.0, whose output imports under
grpcio >= 1.84 and protobuf >= 7.34 (the generated modules check both at import).
"""
from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"


def generate(out_dir: pathlib.Path = ROOT) -> list[pathlib.Path]:
    from grpc_tools import protoc
    import grpc_tools

    protos = sorted(PROTO_DIR.rglob("*.proto"))
    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    args = ["grpc_tools.protoc", f"-I{PROTO_DIR}", f"-I{include}",
            f"--python_out={out_dir}", f"--grpc_python_out={out_dir}", f"--pyi_out={out_dir}"]
    args += [str(p) for p in protos]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed on {protos}")
    # Make every generated folder a regular package.
    written = []
    for proto in protos:
        rel = proto.relative_to(PROTO_DIR).parent
        for depth in range(1, len(rel.parts) + 1):
            init = out_dir.joinpath(*rel.parts[:depth], "__init__.py")
            if not init.exists():
                init.write_text("")
        written.append(out_dir / rel)
    return written


if __name__ == "__main__":
    for path in generate():
        print(f"generated {path}", file=sys.stderr)

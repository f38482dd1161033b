"""Generates the Python gRPC/protobuf modules from proto/ into build/generated/, then packages.

Generation runs on every build step (metadata included: setuptools checks that the package
directory exists), takes well under a second, and never touches the source tree.
"""

from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
PROTO_ROOT = ROOT / "proto"
GENERATED_ROOT = ROOT / "build" / "generated"


def generate_proto_modules() -> None:
    import grpc_tools
    from grpc_tools import protoc

    protos = sorted(str(path.relative_to(PROTO_ROOT)) for path in PROTO_ROOT.rglob("*.proto"))
    GENERATED_ROOT.mkdir(parents=True, exist_ok=True)
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={GENERATED_ROOT}",
        f"--pyi_out={GENERATED_ROOT}",
        f"--grpc_python_out={GENERATED_ROOT}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {protos}")
    package_dirs = {GENERATED_ROOT / Path(proto).parent for proto in protos}
    for package_dir in package_dirs | {GENERATED_ROOT / "inferscale"}:
        (package_dir / "__init__.py").touch()


generate_proto_modules()
setup()

"""Generates the API's Python modules (messages, stubs, type stubs) from this folder's .proto files; both packages
that ship them call it at build time: the project (setup.py) and the client (clients/python/setup.py)."""

from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent


def generate_python(out_root: Path) -> None:
    """Writes inferscale/v1/*_pb2{,_grpc}.py{,i} (and the packages' __init__.py) under `out_root`."""
    import grpc_tools
    from grpc_tools import protoc

    protos = sorted(str(path.relative_to(PROTO_ROOT)) for path in PROTO_ROOT.rglob("*.proto"))
    out_root.mkdir(parents=True, exist_ok=True)
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    args = ["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"-I{well_known}", f"--python_out={out_root}",
            f"--pyi_out={out_root}", f"--grpc_python_out={out_root}", *protos]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {protos}")
    for package_dir in {out_root / Path(proto).parent for proto in protos} | {out_root / "inferscale"}:
        (package_dir / "__init__.py").touch()
    (out_root / "inferscale" / "py.typed").touch()  # type checkers read the .pyi stubs beside the modules

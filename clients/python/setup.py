"""Generates the API's Python modules from the repository's proto/ into build/generated/, then packages them with
the client (an in-tree build from a checkout: `pip install clients/python`)."""

import sys
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent
PROTO_ROOT = HERE.parents[1] / "proto"

if not (PROTO_ROOT / "generate_python.py").is_file():
    raise RuntimeError(f"{PROTO_ROOT} not found: build the client from a checkout of the InferScale repository")
sys.path.insert(0, str(PROTO_ROOT))
from generate_python import generate_python  # noqa: E402 (proto/ is not a package)

generate_python(HERE / "build" / "generated")
setup()

"""Generates the Python gRPC/protobuf modules from proto/ into build/generated/, then packages.

Generation runs on every build step (metadata included: setuptools checks that the package
directory exists), takes well under a second, and never touches the source tree.
"""

import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "proto"))
from generate_python import generate_python  # noqa: E402 (proto/ is not a package)

generate_python(ROOT / "build" / "generated")
setup()

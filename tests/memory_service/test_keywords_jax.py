"""Importing the keyword index keeps JAX off the GPU: bm25s imports JAX where it is installed and runs a top-k with
it, and on a GPU host JAX's default preallocation then took 75% of the GPU's memory in the memory service (seen on
the lent H100: the vLLM node beside it could not start). No GPU here, so a stand-in `jax` package records the
platform JAX would have been given when bm25s imported it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def recording_jax(tmp_path: Path) -> tuple[Path, Path]:
    """A `jax` package whose import writes the JAX_PLATFORMS it saw to a file (and offers the top_k bm25s calls)."""
    package = tmp_path / "site" / "jax"
    package.mkdir(parents=True)
    record = tmp_path / "platforms.txt"
    (package / "__init__.py").write_text(
        "import os\n"
        f"open({str(record)!r}, 'w').write(os.environ.get('JAX_PLATFORMS', '<unset>'))\n"
    )
    (package / "lax.py").write_text(
        "import numpy as np\n"
        "def top_k(scores, k):\n"
        "    order = np.argsort(-np.asarray(scores))[:k]\n"
        "    return np.asarray(scores)[order], order\n"
    )
    return tmp_path / "site", record


def _import_keywords(site: Path, environment: dict[str, str]) -> None:
    path = os.pathsep.join([str(site), str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])
    subprocess.run([sys.executable, "-c", "import memory_service.keywords"], check=True, timeout=120,
                   env={**environment, "PYTHONPATH": path})


def test_jax_imported_by_bm25s_is_kept_on_the_cpu(recording_jax: tuple[Path, Path]) -> None:
    site, record = recording_jax
    environment = {name: value for name, value in os.environ.items() if name != "JAX_PLATFORMS"}
    _import_keywords(site, environment)
    assert record.read_text() == "cpu"


def test_an_operators_jax_platform_is_left_alone(recording_jax: tuple[Path, Path]) -> None:
    site, record = recording_jax
    _import_keywords(site, {**os.environ, "JAX_PLATFORMS": "cuda"})
    assert record.read_text() == "cuda"

"""The gRPC API keeps its conventions and stays compatible with the clients built on it: `buf lint` on proto/, and
`buf breaking` (wire and JSON) against the image of the API committed in proto/ (buf.yaml says how to update it).
buf comes from its `buf-bin` wheel, installed with the test tools."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BASELINE = ROOT / "proto" / "inferscale-v1.image.json"
PROTO = ROOT / "proto" / "inferscale" / "v1" / "memory.proto"


def _buf(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    buf = shutil.which("buf", path=str(Path(sys.executable).parent)) or shutil.which("buf")
    if buf is None:
        pytest.fail("buf not found: pip install buf-bin (make install does)")
    return subprocess.run([buf, *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_the_api_passes_buf_lint() -> None:
    linted = _buf("lint")
    assert linted.returncode == 0, linted.stdout + linted.stderr


def test_the_api_is_compatible_with_the_committed_image() -> None:
    checked = _buf("breaking", "--against", str(BASELINE))
    assert checked.returncode == 0, checked.stdout + checked.stderr


@pytest.mark.parametrize(("old", "new", "named"), [
    ("  string user_id = 1;\n  string query = 2;\n  int32 top_k = 3;",
     "  string user_id = 11;\n  string query = 2;\n  int32 top_k = 3;", "RetrieveAndStageRequest"),  # renumbered
    ("  string header_content_id = 5;", "  string header_content_id_renamed = 5;", "header_content_id"),  # JSON name
])
def test_a_change_that_breaks_clients_fails_the_check(tmp_path: Path, old: str, new: str, named: str) -> None:
    shutil.copy(ROOT / "buf.yaml", tmp_path / "buf.yaml")
    shutil.copytree(ROOT / "proto", tmp_path / "proto")
    changed = tmp_path / PROTO.relative_to(ROOT)
    text = changed.read_text()
    assert text.count(old) == 1, old
    changed.write_text(text.replace(old, new))
    checked = _buf("breaking", "--against", str(BASELINE), cwd=tmp_path)
    assert checked.returncode != 0 and named in checked.stdout, checked.stdout + checked.stderr

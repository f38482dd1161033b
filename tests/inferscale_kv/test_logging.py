"""The processes' logs are JSON lines only: structlog's events and libraries' records alike, whole lines from any
thread, nothing below the level asked for.

Regression: the memory service's stderr held bm25s's DEBUG records ("Building index from tokens", bm25s sets its
own logger to DEBUG) as plain text, written by another handler than structlog's, so that one ran into the middle of
a JSON line of another thread (a test parsing the service's rpc lines failed on it)."""

from __future__ import annotations

import json
import subprocess
import sys

PROGRAM = """
import logging, threading
import structlog
from inferscale_kv.runtime import configure_logging

configure_logging("info")
logging.getLogger("bm25s").setLevel(logging.DEBUG)
log = structlog.get_logger("memory_service")

def library():
    for _ in range(300):
        logging.getLogger("bm25s").debug("Building index from tokens")
        logging.getLogger("bm25s").info("Indexed %d documents", 3)

thread = threading.Thread(target=library)
thread.start()
for index in range(300):
    log.info("rpc", method="SearchFacts", index=index)
log.debug("not at info")
thread.join()
"""


def test_every_line_is_json_whole_and_at_the_level_asked_for() -> None:
    done = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [json.loads(line) for line in done.stderr.splitlines()]  # every line, whole
    assert sorted({(line.get("logger", ""), line["event"]) for line in lines}) == [
        ("", "rpc"), ("bm25s", "Indexed 3 documents")]
    assert sum(line["event"] == "rpc" for line in lines) == 300
    assert all(line["level"] == "info" and line["timestamp"] for line in lines)

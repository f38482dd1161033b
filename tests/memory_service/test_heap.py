"""The service caps glibc's malloc arenas before anything starts a thread: two by default, MALLOC_ARENA_MAX wins."""

import os
import subprocess
import sys

import pytest

PROBE = "import memory_service.__main__ as m; print(m.MALLOC_ARENAS)"


@pytest.mark.parametrize(("setting", "expected"), [(None, "2"), ("3", "3"), ("0", "None")])
def test_the_arena_cap_is_two_unless_malloc_arena_max_says_otherwise(setting, expected) -> None:
    env = {key: value for key, value in os.environ.items() if key != "MALLOC_ARENA_MAX"}
    if setting is not None:
        env["MALLOC_ARENA_MAX"] = setting
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == expected

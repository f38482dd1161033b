"""The service sets glibc's malloc up before anything starts a thread: two arenas and a fixed mmap threshold by
default, glibc's own variables left to glibc."""

import ctypes
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(getattr(ctypes.CDLL(None), "mallinfo2", None) is None,
                                reason="glibc >= 2.33 only (mallopt, mallinfo2)")

SETTINGS_PROBE = ("import memory_service.__main__ as m; "
                  "print(m.MALLOC_SETTINGS.arenas, '/', m.MALLOC_SETTINGS.mmap_threshold_bytes)")
# A 1 MiB block mapped, freed and asked for again: glibc's sliding threshold serves the second from the heap
# (mapped blocks: 1, then 0), a fixed one maps it again (1, then 1).
REUSE_PROBE = """
import ctypes
import memory_service.__main__
class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.mallinfo2.restype = MallInfo2
before = libc.mallinfo2().hblks
first = libc.malloc(1 << 20)
first_mapped = libc.mallinfo2().hblks - before
libc.free(first)
second = libc.malloc(1 << 20)
print(first_mapped, libc.mallinfo2().hblks - before)
"""


def _run(probe: str, **variables: str) -> str:
    env = {key: value for key, value in os.environ.items()
           if key not in ("MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_")}
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env={**env, **variables},
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.strip()


@pytest.mark.parametrize(("variables", "expected"), [
    ({}, "2 / 131072"),
    ({"MALLOC_ARENA_MAX": "3", "MALLOC_MMAP_THRESHOLD_": "65536"}, "3 (environment) / 65536 (environment)"),
    ({"MALLOC_MMAP_THRESHOLD_": "-1"}, "2 / -1 (environment)"),
])
def test_two_arenas_and_a_128_kib_mmap_threshold_unless_glibcs_variables_are_set(variables, expected) -> None:
    assert _run(SETTINGS_PROBE, **variables) == expected


def test_a_freed_large_block_does_not_move_the_next_one_into_the_heap() -> None:
    """The search cache's fact matrices are replaced by slightly larger ones on every write: with glibc's sliding
    threshold each would be carved from the heap, leaving a hole too small for the next."""
    assert _run(REUSE_PROBE) == "1 1"

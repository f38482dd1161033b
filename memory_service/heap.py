"""glibc malloc settings for the long-running service, set at the top of `python -m memory_service` before any
import starts a thread (glibc fixes its arena limit once threads start asking for arenas). Elsewhere than on glibc:
a no-op.

- **Arenas.** Its threads (gRPC, LanceDB's runtime, the embedders, the coordination store) each get an arena of
  their own by default, and memory freed in one is seldom reused by another: the full load test grew +18.5% with
  glibc's default arenas and +12.6% with two (2026-12-06).
- **A fixed mmap threshold.** glibc serves blocks from 128 KiB up by mmap, but raises that threshold to the size of
  every such block freed, up to 32 MiB. The search cache replaces a user's fact matrix (~150 KiB per 100 facts) with
  one a write larger, so after the first replacement every matrix lands in the heap, and each freed one leaves a hole
  just too small for the next: the resident size crept ~18 KiB per ingested fact. With the threshold fixed (which
  turns the raising off), each matrix is its own mapping and goes back to the system when replaced.

glibc's own MALLOC_ARENA_MAX and MALLOC_MMAP_THRESHOLD_ variables win where set."""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

DEFAULT_ARENAS = 2
DEFAULT_MMAP_THRESHOLD_BYTES = 128 << 10  # glibc's starting value
_M_MMAP_THRESHOLD = -3  # mallopt parameters (malloc.h)
_M_ARENA_MAX = -8


@dataclass(frozen=True)
class MallocSettings:
    """What was set; None where it did not apply (not glibc, or glibc's variable set to 0 or less, which glibc then
    handles itself: MALLOC_ARENA_MAX=0 is its default count, MALLOC_MMAP_THRESHOLD_=0 maps every block)."""

    arenas: int | None
    mmap_threshold_bytes: int | None


def _setting(variable: str, default: int) -> int:
    try:
        return int(os.environ.get(variable, default))
    except ValueError:
        return default


def configure_malloc() -> MallocSettings:
    """Caps glibc's arenas at MALLOC_ARENA_MAX or DEFAULT_ARENAS, and fixes its mmap threshold at
    MALLOC_MMAP_THRESHOLD_ or DEFAULT_MMAP_THRESHOLD_BYTES (a variable set is applied by glibc itself already)."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return MallocSettings(None, None)
    arenas = _setting("MALLOC_ARENA_MAX", DEFAULT_ARENAS)
    threshold = _setting("MALLOC_MMAP_THRESHOLD_", DEFAULT_MMAP_THRESHOLD_BYTES)
    return MallocSettings(arenas=arenas if arenas > 0 and mallopt(_M_ARENA_MAX, arenas) else None,
                          mmap_threshold_bytes=threshold if threshold > 0 and mallopt(_M_MMAP_THRESHOLD, threshold)
                          else None)

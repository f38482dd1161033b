"""glibc's malloc arenas for the long-running service. Its threads (gRPC, LanceDB's runtime, the embedders, the
coordination store) each get an arena of their own by default, and memory freed in one is seldom reused by another,
so the resident size creeps up under steady ingest. The full load test (five minutes of ingest beside 200 callers)
grew +18.5% with glibc's default arenas and +12.6% with two (2026-12-06); a periodic malloc_trim on top changed
nothing measurable (+12.8%), so the rest is memory still held, not freed. Elsewhere than on glibc: a no-op."""

from __future__ import annotations

import ctypes
import ctypes.util

_M_ARENA_MAX = -8  # mallopt parameter (malloc.h)


def limit_malloc_arenas(count: int) -> bool:
    """Caps glibc's malloc arenas at `count` (call before the service starts its threads; 0 leaves glibc's
    default). Returns whether it applied."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name and count > 0 else None
    except OSError:
        return False
    return bool(libc is not None and hasattr(libc, "mallopt") and libc.mallopt(_M_ARENA_MAX, count))

"""glibc's malloc arenas for the long-running service. Its threads (gRPC, LanceDB's runtime, the embedders, the
coordination store) each get an arena of their own by default, and memory freed in one is seldom reused by another,
so the resident size creeps up under steady ingest. The full load test (five minutes of ingest beside 200 callers)
grew +18.5% with glibc's default arenas and +12.6% with two (MALLOC_ARENA_MAX=2, 2026-12-06); a periodic
malloc_trim on top changed nothing measurable (+12.8%), so the rest is memory still held, not freed.

glibc fixes its arena limit once threads start asking for arenas, so the cap is set at the top of
`python -m memory_service`, before any import starts a thread. Elsewhere than on glibc: a no-op."""

from __future__ import annotations

import ctypes
import os

DEFAULT_ARENAS = 2
_M_ARENA_MAX = -8  # mallopt parameter (malloc.h)


def limit_malloc_arenas() -> int | None:
    """Caps glibc's malloc arenas at MALLOC_ARENA_MAX (glibc's own variable, which then already applies) or else
    DEFAULT_ARENAS. Returns the cap, or None where it did not apply (not glibc, or MALLOC_ARENA_MAX=0)."""
    try:
        count = int(os.environ.get("MALLOC_ARENA_MAX", DEFAULT_ARENAS))
    except ValueError:
        count = DEFAULT_ARENAS
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    return count if count > 0 and mallopt is not None and mallopt(_M_ARENA_MAX, count) else None

"""glibc malloc settings for the long-running service, set at the top of `python -m memory_service` before any
import starts a thread (glibc fixes its arena limit once threads start asking for arenas). Elsewhere than on glibc:
a no-op. Why each, with the load test's figures: benchmarks/RESULTS.md, "Memory service under load".

- **Arenas.** Its threads (gRPC, LanceDB's runtime, the embedders, the coordination store) each get an arena of
  their own by default, and memory freed in one is seldom reused by another: capped at two, the process grows less
  under steady ingest.
- **A fixed mmap threshold.** glibc maps blocks from 128 KiB up that its free lists cannot serve, but raises that
  threshold to the size of every mapped block freed, up to 32 MiB. The search cache replaces a user's fact matrix
  with one a write larger, so after the first replacement the matrices were carved from the heap, each freed one
  leaving a hole just too small for the next, and the resident size crept with every ingested fact; fixing the
  threshold turns the raising off. The cost: a large temporary (an embedding batch's hidden states) is mapped and
  unmapped each time instead of reused from the heap. Each large cached matrix is a mapping of its own; a search
  cache of several GiB of small users could approach the kernel's vm.max_map_count (65,530 by default).

Where glibc's own MALLOC_ARENA_MAX or MALLOC_MMAP_THRESHOLD_ is set, glibc has applied it and it is left alone."""

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
    """Each setting as in effect: the service's default, `<value> (environment)` where glibc's variable set it, or
    None where not on glibc."""

    arenas: str | None
    mmap_threshold_bytes: str | None


def configure_malloc() -> MallocSettings:
    """Caps glibc's arenas at DEFAULT_ARENAS and fixes its mmap threshold at DEFAULT_MMAP_THRESHOLD_BYTES, each
    unless glibc's own variable (MALLOC_ARENA_MAX, MALLOC_MMAP_THRESHOLD_) is set."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return MallocSettings(None, None)

    def setting(variable: str, parameter: int, default: int) -> str | None:
        if variable in os.environ:
            return f"{os.environ[variable]} (environment)"
        return str(default) if mallopt(parameter, default) else None

    return MallocSettings(arenas=setting("MALLOC_ARENA_MAX", _M_ARENA_MAX, DEFAULT_ARENAS),
                          mmap_threshold_bytes=setting("MALLOC_MMAP_THRESHOLD_", _M_MMAP_THRESHOLD,
                                                       DEFAULT_MMAP_THRESHOLD_BYTES))

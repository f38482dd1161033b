"""`python -m memory_service --port 50051 --data-dir DIR [--metrics-port 9400]`"""

from __future__ import annotations

from memory_service.heap import configure_malloc

MALLOC_SETTINGS = configure_malloc()  # first, before an import starts a thread

import asyncio  # noqa: E402
import sys  # noqa: E402

import structlog  # noqa: E402

from inferscale_kv.runtime import configure_logging  # noqa: E402
from memory_service.config import ConfigError, load_config  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    try:
        config = load_config(argv)
        from memory_service.server import serve  # after the flags: --help and a bad flag need no torch

        configure_logging(config.log_level)
        structlog.get_logger("memory_service").info(
            "config", malloc_arenas=MALLOC_SETTINGS.arenas,
            malloc_mmap_threshold_bytes=MALLOC_SETTINGS.mmap_threshold_bytes, **config.as_log_fields())
        asyncio.run(serve(config))  # ConfigError from files it reads (credentials) comes before it listens
    except ConfigError as exc:
        print(f"memory_service: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

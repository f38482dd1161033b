"""`python -m memory_service --port 50051 --data-dir DIR [--metrics-port 9400]`"""

from __future__ import annotations

import asyncio
import sys

import structlog

from memory_service.config import ConfigError, load_config
from memory_service.heap import limit_malloc_arenas
from inferscale_kv.runtime import configure_logging
from memory_service.server import serve


def main(argv: list[str] | None = None) -> int:
    try:
        config = load_config(argv)
        limit_malloc_arenas(config.malloc_arenas)  # before the service starts its threads
        configure_logging(config.log_level)
        structlog.get_logger("memory_service").info("config", **config.as_log_fields())
        asyncio.run(serve(config))  # ConfigError from files it reads (credentials) comes before it listens
    except ConfigError as exc:
        print(f"memory_service: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Process plumbing the three processes share: structured JSON logs and a free loopback port."""

from __future__ import annotations

import logging
import socket
import sys

import structlog


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for child processes started by tools and tests)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def configure_logging(level: str) -> None:
    """structlog: one JSON object per line on stderr, with per-call context bound via contextvars."""
    logging.basicConfig(stream=sys.stderr, level=level.upper(), format="%(message)s")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )

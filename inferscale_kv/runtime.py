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


class _JsonLinesHandler(logging.StreamHandler):
    """The one handler configure_logging installs (replaced, not added again, by a second call)."""


def configure_logging(level: str) -> None:
    """One JSON object per line on stderr, with per-call context bound via contextvars: structlog's events and the
    standard library's records (libraries') alike, through one handler at `level`. One handler writes each line
    whole, so lines of two threads never run into each other; a library that sets its own logger to DEBUG (bm25s
    does) still logs nothing below `level`."""
    threshold = logging.getLevelNamesMapping()[level.upper()]
    stamped: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars, structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True)]
    handler = _JsonLinesHandler(sys.stderr)
    handler.setLevel(threshold)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*stamped, structlog.stdlib.add_logger_name],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]))
    root = logging.getLogger()
    for installed in [h for h in root.handlers if isinstance(h, _JsonLinesHandler)]:
        root.removeHandler(installed)
    root.addHandler(handler)
    root.setLevel(threshold)
    structlog.configure(
        processors=[*stamped, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        wrapper_class=structlog.make_filtering_bound_logger(threshold),
        logger_factory=structlog.stdlib.LoggerFactory(),
        cache_logger_on_first_use=True,
    )

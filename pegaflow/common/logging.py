"""structlog set-up shared by every PegaFlow command (JSON for machines, console for people)."""

from __future__ import annotations

import logging
import sys
import time

import structlog


def _drop(_logger: object, _method: str, _event: structlog.typing.EventDict) -> structlog.typing.EventDict:
    raise structlog.DropEvent


def configure_logging(level: str = "info", fmt: str = "console") -> None:
    """``level``: debug, info, warning, error, or off (nothing at all)."""
    off = level == "off"
    lvl = logging.CRITICAL if off else getattr(logging, level.upper(), logging.INFO)
    logging.basicConfig(level=logging.CRITICAL + 1 if off else lvl, stream=sys.stderr, format="%(message)s")
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer() if fmt == "json" else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            *([_drop] if off else []),
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


def ensure_library_logging() -> None:
    """For code running inside someone else's process (the client in vLLM): if nobody
    configured structlog, log to stderr at info level instead of structlog's stdout default."""
    if not structlog.is_configured():
        structlog.configure(
            processors=[
                structlog.processors.add_log_level,
                structlog.processors.TimeStamper(fmt="iso", utc=True),
                structlog.dev.ConsoleRenderer(colors=False),
            ],
            wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
            logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        )


class RateLimitedLog:
    """One warning line per key and ``every`` seconds, saying how many were suppressed: for
    events a stranger can trigger at will (refused requests), which must not flood the log."""

    def __init__(self, logger: structlog.typing.FilteringBoundLogger, event: str, every: float = 60.0,
                 level: str = "warning") -> None:
        self.log, self.event, self.every = logger, event, every
        self._emit = getattr(logger, level)
        self._last: dict[tuple[str, ...], float] = {}
        self._count: dict[tuple[str, ...], int] = {}

    def note(self, *key: str, **fields: object) -> None:
        self._count[key] = self._count.get(key, 0) + 1
        now = time.monotonic()
        if now - self._last.get(key, -self.every) >= self.every:
            self._last[key] = now
            self._emit(self.event, **fields, occurrences_since_last_line=self._count.pop(key))

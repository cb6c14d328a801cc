"""Logging: structlog configured once, snake_case events, JSON when not on a TTY.

Owns: configure() and get_logger(). Imports structlog and the standard library.

Every module logs with ``log = get_logger(__name__)`` and binds context
(``pod``, ``namespace``, ``container``) rather than formatting it into messages.
Event names are snake_case (``container_created``, ``registered``, ``inventory_changed``).
In pre-registered mode stderr is /dev/null: configure(file=...) sends logs to a file
(or the journal's stderr when run by systemd).
"""

from __future__ import annotations

import logging
import sys
from typing import IO, Any

import structlog
from structlog._config import BoundLoggerLazyProxy

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR}


class _StderrNow:
    """sys.stderr as it is at each write, not at configure(): logs follow a later swap of
    sys.stderr (test capture, daemon redirection)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()

    def isatty(self) -> bool:
        return sys.stderr.isatty()


def configure(level: str = "info", fmt: str = "auto", file: IO[str] | None = None) -> None:
    """Configure structlog for the process. fmt: auto | json | console."""
    out = file if file is not None else _StderrNow()
    if fmt == "auto":
        fmt = "console" if getattr(out, "isatty", lambda: False)() else "json"
    renderer: Any = (
        structlog.dev.ConsoleRenderer(colors=False)
        if fmt == "console"
        else structlog.processors.JSONRenderer(sort_keys=False)
    )
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    # Libraries that log through the standard `logging` module (nri_accel.ttrpc stays
    # free of structlog so it can stand alone) come out in the same format and stream.
    handler = logging.StreamHandler(out)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.processors.format_exc_info, renderer],
    ))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(_LEVELS[level])
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(out),
        # Not cached: configure() may run again (tests, `run --log-file`) and every
        # logger, module-level ones included, must follow the newest configuration.
        cache_logger_on_first_use=False,
    )


def get_logger(name: str = "nri_accel", **context: Any) -> Any:
    """A lazy structlog logger; `name` becomes the `logger` field.

    Lazy: it resolves the configuration at each call, so a module-level logger created
    at import time writes where the latest configure() says (an eager bind() would
    freeze structlog's defaults, which print to stdout)."""
    # structlog.get_logger(logger=...) would clash with wrap_logger's own `logger`
    # parameter, hence the proxy built directly.
    return BoundLoggerLazyProxy(None, initial_values={"logger": name, **context})

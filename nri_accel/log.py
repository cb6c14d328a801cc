"""Logging: structlog configured once, snake_case events, JSON when not on a TTY.

Owns: configure(), get_logger() and the daemon's log file (open_log_file, RotatingFile).
Imports structlog, msgspec (its JSON encoder writes the lines) and the standard library.

Every module logs with ``log = get_logger(__name__)`` and binds context
(``pod``, ``namespace``, ``container``) rather than formatting it into messages.
Event names are snake_case (``container_created``, ``registered``, ``inventory_changed``).
In pre-registered mode stderr is /dev/null: configure(file=...) sends logs to a file
(DEFAULT_PREREGISTERED_LOG unless --log-file says otherwise), which rotates when it
reaches MAX_LOG_BYTES (one older file kept, as `<file>.1`), so a plugin nobody watches
cannot fill the disk. Run by systemd, logs go to stderr, the journal.

get_logger()'s loggers follow the newest configuration, whoever set it (configure()
here, structlog.configure() or structlog.testing.capture_logs() in tests), and are
still cheap on the hot path: each keeps the bound logger it built for the structlog
configuration in force and builds a new one when that configuration changes. That
is read from structlog's private _CONFIG (the defaults its own lazy proxies read).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import IO, Any

import msgspec
import structlog
from structlog._config import _CONFIG

DEFAULT_PREREGISTERED_LOG = "/var/log/nri-accel.log"
MAX_LOG_BYTES = 16 << 20
_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR}
_FILTERING_LEAST = {structlog.make_filtering_bound_logger(level): level
                    for level in (logging.NOTSET, logging.DEBUG, logging.INFO,
                                  logging.WARNING, logging.ERROR, logging.CRITICAL)}
"""structlog's filtering wrapper classes (one per level, made once) -> their least level."""


class _StderrNow:
    """sys.stderr as it is at each write, not at configure(): logs follow a later swap of
    sys.stderr (test capture, daemon redirection)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()

    def isatty(self) -> bool:
        return sys.stderr.isatty()


class RotatingFile:
    """An append-only text log file that starts over in a fresh file once it holds
    `max_bytes` (the full one is kept as `<path>.1`, replacing the previous one). It
    has the part of a file's interface loggers use: write, flush, isatty, close."""

    def __init__(self, path: str, max_bytes: int = MAX_LOG_BYTES) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self._file = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
        self._size = self._file.tell()

    def write(self, text: str) -> int:
        if self._size + len(text) > self.max_bytes and self._size:
            self._file.close()
            os.replace(self.path, self.path + ".1")
            self._file = open(self.path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
            self._size = 0
        self._size += len(text)
        return self._file.write(text)

    def flush(self) -> None:
        self._file.flush()

    def isatty(self) -> bool:
        return False

    def close(self) -> None:
        self._file.close()


def open_log_file(path: str | None, *, preregistered: bool) -> IO[str] | None:
    """Where a daemon logs: `path`, or DEFAULT_PREREGISTERED_LOG when the runtime
    launched it (its stderr is /dev/null), else None (stderr). A `path` that cannot be
    opened is the caller's error (OSError); the default file, when it cannot be, is said
    on stderr, and logging stays there."""
    if path is not None:
        return RotatingFile(path)  # type: ignore[return-value]
    if not preregistered:
        return None
    try:
        return RotatingFile(DEFAULT_PREREGISTERED_LOG)  # type: ignore[return-value]
    except OSError as exc:
        print(f"nri-accel: cannot open log file {DEFAULT_PREREGISTERED_LOG}: "
              f"{exc.strerror}; logging to stderr", file=sys.stderr)
        return None


def configure(level: str = "info", fmt: str = "auto", file: IO[str] | None = None) -> None:
    """Configure structlog for the process. fmt: auto | json | console."""
    out = file if file is not None else _StderrNow()
    if fmt == "auto":
        fmt = "console" if getattr(out, "isatty", lambda: False)() else "json"
    renderer: Any = (
        structlog.dev.ConsoleRenderer(colors=False)
        if fmt == "console"
        else structlog.processors.JSONRenderer(serializer=_to_json)
    )
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        _UtcTimestamp(),
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
    global _factory
    _factory = structlog.WriteLoggerFactory(out)
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=_factory,
        # Not structlog's cache, which would freeze the first configuration for good:
        # configure() may run again (tests, `run --log-file`) and every logger,
        # module-level ones included, must follow the newest one (see _Logger).
        cache_logger_on_first_use=False,
    )


_factory: Any = None
"""The logger factory the latest configure() installed."""

# The canonical line of each CreateContainer that asks is on the hot path: the two
# helpers below do what structlog's TimeStamper(fmt="iso", utc=True) and JSONRenderer
# do, for less. msgspec encodes a line's JSON in a sixth of the instructions of the
# standard library's encoder (7 k against 42 k, a tenth of a 1-GPU create's time in
# the daemon); it writes non-ASCII characters as UTF-8 rather than \u escapes, as
# JSON allows, and escapes control characters alike.
_ENCODER = msgspec.json.Encoder(enc_hook=repr)  # repr: what structlog's JSON fallback does


def _to_json(event_dict: Any, **_: Any) -> str:
    """The line's JSON: every value JSON has a type for, and repr() of any other."""
    return _ENCODER.encode(event_dict).decode()


class _UtcTimestamp:
    """Adds `timestamp`: ISO 8601 in UTC with microseconds ("2024-05-01T10:00:00.123456Z"),
    the part up to the second formatted once per second."""

    __slots__ = ("_second",)

    def __init__(self) -> None:
        self._second: tuple[int, str] = (-1, "")  # one tuple: threads read it whole

    def __call__(self, logger: Any, method: str, event_dict: Any) -> Any:
        now = time.time()
        second = int(now)
        cached = self._second
        if cached[0] != second:
            cached = (second, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second)))
            self._second = cached
        event_dict["timestamp"] = f"{cached[1]}.{int((now - second) * 1e6):06d}Z"
        return event_dict


class _Logger:
    """A logger that behaves as a structlog lazy proxy (it resolves the configuration
    at each call) but keeps the bound logger it built while that configuration stays:
    the same factory, wrapper class, processor list and context class (by identity:
    capture_logs() edits the processor list in place, which a kept logger sees). Only
    loggers built for configure()'s own factory are kept; its output is resolved at
    each write, never frozen at bind time (other factories, such as structlog's
    default printing to the sys.stdout of that moment, are bound per call)."""

    __slots__ = ("_cache", "_level_test", "_values")

    def __init__(self, values: dict[str, Any]) -> None:
        self._values = values
        # (factory, wrapper class, processors, context class, bound logger), one tuple
        # so that a thread reading it never pairs one configuration with another's logger
        self._cache: tuple[Any, ...] = ()
        self._level_test: tuple[Any, ...] = ()  # (wrapper class, the least level it emits)

    # The log methods in use are properties: reaching them through __getattr__ would
    # first build and throw away an AttributeError on every call.
    @property
    def debug(self) -> Any:
        return self._bound().debug

    @property
    def info(self) -> Any:
        return self._bound().info

    @property
    def warning(self) -> Any:
        return self._bound().warning

    @property
    def error(self) -> Any:
        return self._bound().error

    @property
    def exception(self) -> Any:
        return self._bound().exception

    def is_enabled_for(self, level: int) -> bool:
        """Whether a line of `level` (logging.DEBUG, ...) would be emitted: a guard for
        a line on the hot path, where even an unemitted call costs its arguments.
        structlog's filtering wrapper classes (configure() sets one) decide by their
        least level alone, so that level is kept while such a class stays the
        configured one, and the test is a comparison: a sixth of the instructions of
        _bound()'s four checks and a call of the class's own test (it guards the debug
        line of every container created). Any other wrapper class is asked each time."""
        kept = self._level_test
        if kept and kept[0] is _CONFIG.default_wrapper_class:
            return level >= kept[1]  # type: ignore[no-any-return]
        wrapper = _CONFIG.default_wrapper_class
        least = _FILTERING_LEAST.get(wrapper)
        if least is None:
            return self._bound().is_enabled_for(level)  # type: ignore[no-any-return]
        self._level_test = (wrapper, least)
        return level >= least

    def __getattr__(self, name: str) -> Any:  # the rest of the bound logger's interface
        if name.startswith("__"):  # introspection (copy, abc, inspect): not a log method
            raise AttributeError(name)
        return getattr(self._bound(), name)

    def _bound(self) -> Any:
        config = _CONFIG
        factory = config.logger_factory
        wrapper = config.default_wrapper_class
        processors = config.default_processors
        context = config.default_context_class
        cache = self._cache
        if (cache and cache[0] is factory and cache[1] is wrapper and cache[2] is processors
                and cache[3] is context):
            return cache[4]
        bound = wrapper(factory(), processors=processors, context=context(self._values))
        if factory is _factory:
            self._cache = (factory, wrapper, processors, context, bound)
        return bound


def get_logger(name: str = "nri_accel", **context: Any) -> Any:
    """A logger following the latest configuration; `name` becomes the `logger` field.

    A module-level logger created at import time writes where the latest configure()
    says (an eager bind() would freeze structlog's defaults, which print to stdout)."""
    return _Logger({"logger": name, **context})

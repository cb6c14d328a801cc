"""nri_accel.log: loggers follow every reconfiguration although they keep their bound logger.

The stub's and plugin's module-level loggers are created at import; the canonical
CreateContainer line must still go where the latest configuration says, whoever
changed it (configure() here, structlog.configure() or capture_logs() in tests).
"""

from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest
import structlog
from structlog.testing import capture_logs

from nri_accel import log

LOG = log.get_logger("nri_accel.test", component="stub")


@pytest.fixture(autouse=True)
def restore_structlog() -> Iterator[None]:
    saved = structlog.get_config()
    try:
        yield
    finally:
        structlog.configure(**saved)


def lines(out: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_a_logger_writes_where_the_latest_configure_says() -> None:
    first, second = io.StringIO(), io.StringIO()
    log.configure(level="info", fmt="json", file=first)
    LOG.info("container_created", pod="p0")
    LOG.debug("sync_chunk")  # below the level
    log.configure(level="debug", fmt="json", file=second)
    LOG.info("container_created", pod="p1")
    LOG.debug("sync_chunk")
    log.configure(level="warning", fmt="json", file=first)
    LOG.info("container_created", pod="p2")
    LOG.warning("runtime_unavailable")
    assert [(d["event"], d.get("pod")) for d in lines(first)] == [
        ("container_created", "p0"), ("runtime_unavailable", None)]
    assert [(d["event"], d["level"]) for d in lines(second)] == [
        ("container_created", "info"), ("sync_chunk", "debug")]
    assert {d["logger"] for d in lines(first) + lines(second)} == {"nri_accel.test"}
    assert {d["component"] for d in lines(first) + lines(second)} == {"stub"}


def test_a_logger_follows_structlog_configure_and_capture_logs() -> None:
    out = io.StringIO()
    log.configure(level="info", fmt="json", file=out)
    LOG.info("registered")
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG))
    LOG.debug("sync_chunk")
    with capture_logs() as captured:
        LOG.info("container_created", pod="p0")
    LOG.info("plugin_stopped")
    assert [d["event"] for d in lines(out)] == ["registered", "sync_chunk", "plugin_stopped"]
    assert [(d["event"], d["pod"]) for d in captured] == [("container_created", "p0")]


def test_a_json_line_carries_a_utc_timestamp_and_renders_any_value() -> None:
    out = io.StringIO()
    log.configure(level="info", fmt="json", file=out)
    before = datetime.now(UTC)
    LOG.info("container_created", devices=["nvidia.com/gpu=0"], odd=set)
    after = datetime.now(UTC)
    (line,) = lines(out)
    stamp = line["timestamp"]
    assert isinstance(stamp, str) and re.fullmatch(
        r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", stamp)
    assert before.replace(microsecond=0) <= datetime.fromisoformat(stamp) <= after
    assert line["devices"] == ["nvidia.com/gpu=0"] and line["odd"] == repr(set)


def test_a_json_line_stays_one_line_whatever_a_pod_names() -> None:
    # names come from whoever wrote the pod: newlines and control characters are
    # escaped, so a name cannot forge a second line; other characters are kept as UTF-8
    out = io.StringIO()
    log.configure(level="info", fmt="json", file=out)
    LOG.info("container_created", pod='p\n{"event": "forged"}\x1b[2J', namespace="équipe-數")
    text = out.getvalue()
    assert text.count("\n") == 1 and "\x1b" not in text and "équipe-數" in text
    (line,) = lines(out)
    assert (line["pod"], line["namespace"]) == ('p\n{"event": "forged"}\x1b[2J', "équipe-數")


def test_is_enabled_for_asks_a_wrapper_that_is_not_a_filtering_one_each_time() -> None:
    # structlog's stdlib BoundLogger answers by the standard logger's level of the moment
    saved = structlog.get_config()
    structlog.configure(wrapper_class=structlog.stdlib.BoundLogger,
                        logger_factory=structlog.stdlib.LoggerFactory(),
                        processors=[structlog.processors.JSONRenderer()])
    root = logging.getLogger()
    before = root.level
    try:
        for least in (logging.INFO, logging.DEBUG, logging.ERROR):
            root.setLevel(least)
            assert [LOG.is_enabled_for(level) for level in (logging.DEBUG, logging.WARNING)
                    ] == [least <= logging.DEBUG, least <= logging.WARNING]
    finally:
        root.setLevel(before)
        structlog.configure(**saved)


def test_is_enabled_for_follows_the_latest_configuration() -> None:
    levels = (logging.NOTSET, logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR,
              logging.CRITICAL)
    for least in ("info", "debug", "error", "warning"):
        log.configure(level=least, fmt="json", file=io.StringIO())
        for _ in range(2):  # as the first call finds it, and as it is kept
            assert [LOG.is_enabled_for(level) for level in levels] == [
                level >= logging.getLevelName(least.upper()) for level in levels]

"""Shared pytest fixtures, and what the suite does when a prerequisite is missing.

`all_logs`: structlog lets every level through for the test (the suite's own setup, or
the test's module, may have configured a higher level), and the configuration is
restored afterwards. Every test leaves the logging configuration as it found it
(`_logging_as_found`): a test running a verb in process configures it for that verb
(`discover` logs errors only), and a later test reading warnings saw none.
`nri_wire_dir`: the byte captures of a real containerd NRI runtime (../shared/nri-wire,
beside the repository, as in CI's clean clone).

Two prerequisites are not in the repository: the NRI wire captures (../shared/nri-wire)
and a C compiler (the fake libnvidia-ml.so.1 of the NVIDIA tests is compiled from C,
tests/fakes/nvml). Without one, the tests that need it are skipped, all with one reason,
which is also printed before the run: a clone on its own still runs the rest of the
suite. CI sets NRI_ACCEL_REQUIRE_CAPTURES=1 and NRI_ACCEL_REQUIRE_CC=1 (.ci/run): those
tests then fail instead, so that CI never passes without them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import pytest
import structlog
from fakes.nvml import build as nvml_build

from nri_accel import log as nri_log

# The fake hosts the tests build are a root-run host's files, writable by their owner
# alone (nri-accel refuses CDI specs a group or others could write): made so whatever
# umask the shell running the suite has (002 on some CI machines and desktops).
os.umask(0o022)

REPO = Path(__file__).resolve().parents[1]
NRI_WIRE = REPO.parent / "shared" / "nri-wire"
REQUIRE_CAPTURES = "NRI_ACCEL_REQUIRE_CAPTURES"
REQUIRE_CC = "NRI_ACCEL_REQUIRE_CC"
NO_CAPTURES = (f"NRI wire captures not found at {NRI_WIRE}: the capture-replay tests need "
               "the shared/ directory beside the repository, as CI has it")


def _required(env: str) -> bool:
    return os.environ.get(env, "") not in ("", "0")


class CapturesMissing(Exception):
    """Raised by the nri_wire_dir fixture, turned into a skip (or failure) below."""


def _missing(e: Exception) -> NoReturn:
    """Skip the test for want of a prerequisite, or fail it where the prerequisite's
    variable requires it. Raised here, not in a fixture, so that -ra sums every such skip
    up on one line (pytest reports a fixture's skip at each test's own location)."""
    reason = str(e)
    env = REQUIRE_CC if isinstance(e, nvml_build.NoCompilerError) else REQUIRE_CAPTURES
    if _required(env):
        raise pytest.fail.Exception(f"{reason} ({env} is set: a failure, not a skip)",
                                    pytrace=False) from None
    raise pytest.skip.Exception(reason) from None


@pytest.hookimpl(wrapper=True)
def pytest_sessionstart(session: pytest.Session) -> Iterator[None]:
    """Say once, before the run (after pytest's header), what is missing and what that
    skips (or fails)."""
    result = yield
    tr = session.config.pluginmanager.get_plugin("terminalreporter")
    if tr is None:
        return result
    for missing, reason, env in ((not NRI_WIRE.is_dir(), NO_CAPTURES, REQUIRE_CAPTURES),
                                 (nvml_build.compiler() is None, nvml_build.NO_COMPILER,
                                  REQUIRE_CC)):
        if missing:
            then = f"they fail ({env} is set)" if _required(env) else "they are skipped"
            tr.write_line(f"prerequisite missing, {then}: {reason}", yellow=True, bold=True)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    try:
        return (yield)
    except (CapturesMissing, nvml_build.NoCompilerError) as e:
        _missing(e)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    # The fake libnvidia-ml is compiled on first use: by the fake_nvml_lib fixture, by
    # fakes.roots.materialise (NVIDIA roots) or by fakes.nvml.build directly.
    try:
        return (yield)
    except nvml_build.NoCompilerError as e:
        _missing(e)


@pytest.fixture(scope="session")
def nri_wire_dir() -> Path:
    if not NRI_WIRE.is_dir():
        raise CapturesMissing(NO_CAPTURES)
    return NRI_WIRE


@pytest.fixture(autouse=True)
def _logging_as_found() -> Iterator[None]:
    """Restore what nri_accel.log.configure() sets after each test: structlog's
    configuration, the root logger's handlers and level, and the module's logger
    factory."""
    saved = structlog.get_config()
    root = logging.getLogger()
    handlers, level, factory = root.handlers[:], root.level, nri_log._factory
    try:
        yield
    finally:
        structlog.configure(**saved)
        root.handlers[:] = handlers
        root.setLevel(level)
        nri_log._factory = factory


@pytest.fixture
def all_logs() -> Iterator[None]:
    saved = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(0))
    try:
        yield
    finally:
        structlog.configure(**saved)

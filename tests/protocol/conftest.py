"""Fixtures and the async test runner of the NRI protocol tests.

`async def` tests here run in a fresh event loop each, bounded by ASYNC_TEST_TIMEOUT so
that a protocol hang fails the test instead of the suite; each runs twice, on asyncio's
own loop and on uvloop's, the one `run` serves on by default (nri.event_loop = "auto"):
the stubs, endpoints and simulators these tests run in process are held to both (the
daemon they start as a process runs on uvloop either way).
"""

from __future__ import annotations

import asyncio
import inspect
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import uvloop
from daemon import write_daemon_files

ASYNC_TEST_TIMEOUT = 60.0

LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop] | None] = {
    "asyncio": None,  # asyncio.Runner's default: the stock loop
    "uvloop": uvloop.new_event_loop,
}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if inspect.iscoroutinefunction(metafunc.function):
        metafunc.fixturenames.append("event_loop_kind")
        metafunc.parametrize("event_loop_kind", list(LOOPS))


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    if not inspect.iscoroutinefunction(pyfuncitem.obj):
        return None
    args = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    factory = LOOPS[pyfuncitem.callspec.params["event_loop_kind"]]
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(asyncio.wait_for(pyfuncitem.obj(**args), ASYNC_TEST_TIMEOUT))
    return True


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A fresh directory with a short path (unix socket paths are limited to 107 bytes)."""
    directory = tempfile.mkdtemp(prefix="nri-")
    try:
        yield Path(directory)
    finally:
        shutil.rmtree(directory)


@pytest.fixture
def sock_path(short_dir: Path) -> str:
    return str(short_dir / "nri.sock")


@pytest.fixture
def daemon_files(short_dir: Path) -> dict[str, str]:
    """Inventory, config, log and socket paths of a daemon run (see daemon.py)."""
    return write_daemon_files(short_dir)

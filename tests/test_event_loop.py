"""`run`'s event loop (nri.event_loop, App.run_loop): uvloop's by default, the stock
asyncio loop on request, and where uvloop cannot be imported, the stock loop for "auto"
and a configuration error naming the key for "uvloop"."""

from __future__ import annotations

import asyncio
import sys

import pytest

from nri_accel.app import App
from nri_accel.config import Config, NriConfig
from nri_accel.errors import ConfigError


def loop_of(choice: str, path: str = "") -> str:
    """The module of the loop App.run_loop runs a coroutine on, for nri.event_loop."""

    async def running() -> str:
        return type(asyncio.get_running_loop()).__module__

    return App(Config(nri=NriConfig(event_loop=choice), path=path)).run_loop(running())


def test_auto_and_uvloop_run_on_uvloop_and_asyncio_on_the_stock_loop() -> None:
    assert loop_of("auto").split(".")[0] == "uvloop"
    assert loop_of("uvloop").split(".")[0] == "uvloop"
    assert loop_of("asyncio") == "asyncio.unix_events"


def test_without_uvloop_auto_takes_the_stock_loop_and_uvloop_is_refused(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # `import uvloop` raises ImportError
    assert loop_of("auto") == "asyncio.unix_events"
    with pytest.raises(ConfigError) as refused:
        loop_of("uvloop", path="/etc/nri-accel/config.toml")
    assert str(refused.value).startswith("/etc/nri-accel/config.toml: nri.event_loop: "
                                         "uvloop cannot be imported")
    assert 'set "asyncio"' in str(refused.value)


def test_the_coroutine_s_exception_comes_back() -> None:
    async def fails() -> None:
        raise ValueError("from the loop")

    with pytest.raises(ValueError, match="from the loop"):
        App(Config()).run_loop(fails())

"""The longest the event loop goes without a turn while some work runs on it: no request
may hold it for more than a few milliseconds (DESIGN.md). Shared by bench_env.py and
bench_synchronize.py, which hand it the daemon's own request handlers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def held_while(work: Awaitable[T]) -> tuple[T, int]:
    """Await `work` beside a task that notes each turn of the loop: its result, and the
    longest the loop went without a turn meanwhile, in nanoseconds."""
    longest = 0
    done = False

    async def turns() -> None:
        nonlocal longest
        last = time.perf_counter_ns()
        while not done:
            await asyncio.sleep(0)
            now = time.perf_counter_ns()
            longest, last = max(longest, now - last), now

    ticker = asyncio.create_task(turns())
    await asyncio.sleep(0)  # the ticker runs first
    try:
        result = await work
    finally:
        done = True
        await ticker
    return result, longest

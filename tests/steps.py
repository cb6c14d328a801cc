"""Running a generator of steps (nri.convert's readers of large requests) at once, in a
test: the steps taken one after the other, with no event loop between them (the daemon
runs them with nri.stub.run_steps, the loop given a turn before each)."""

from __future__ import annotations

from collections.abc import Generator
from typing import TypeVar

T = TypeVar("T")


def finished(steps: Generator[None, None, T]) -> T:
    """The generator's value, all its steps taken."""
    return counted(steps)[0]


def counted(steps: Generator[None, None, T]) -> tuple[T, int]:
    """The generator's value, all its steps taken, and how many steps it yielded."""
    taken = 0
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value, taken
        taken += 1

"""Memos bounded by the text they were made from, not only by their entries.

Owns: Memo and memoized(). Imports the standard library only.

The hot path remembers what it parsed and built (a workload's replicas and restarts ask
alike), keyed by, or made from, what a pod author wrote: annotation values, env entries.
An entry costs memory in proportion to that text, and more: 6 KiB of NVIDIA_REQUIRE_*
constraints parse into some 150 KiB of objects. A bound on entries alone lets one pod
author who creates a few thousand containers of distinct, large values hold hundreds of
MiB (issue #10: caches have byte bounds). So a Memo counts the characters of the text
behind each entry and starts over when either bound would be passed, and keeps no entry
over a sixteenth of its characters (or the largest its maker gives): such a value is
parsed again each time, as rare as it is (every bound on one value is far above what
real requests write).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from functools import wraps
from typing import Any, Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
F = TypeVar("F", bound=Callable[..., Any])

ENTRY_SHARE = 16  # by default an entry may hold at most 1/ENTRY_SHARE of a memo's characters


class Memo(Generic[K, V]):
    """A dict of at most `entries` entries made from at most `chars` characters of text
    in all (each entry's as its put() says), none over `largest` (by default a
    sixteenth of `chars`)."""

    __slots__ = ("_chars", "_data", "_shared", "chars", "entries", "largest")

    def __init__(self, entries: int, chars: int, largest: int | None = None) -> None:
        self._data: dict[K, V] = {}
        self._chars = 0
        self._shared: dict[int, object] = {}  # id -> what entries share, charged once
        self.entries = entries
        self.chars = chars
        self.largest = chars // ENTRY_SHARE if largest is None else largest

    def get(self, key: K, default: Any = None) -> Any:
        return self._data.get(key, default)

    def put(self, key: K, value: V, chars: int, shared: object = None,
            shared_chars: int = 0) -> None:
        """Remember `value` under `key`, made from `chars` characters, and holding
        `shared` (an object other entries may hold too: a request's parsed options),
        made from `shared_chars`, which is charged once however many entries hold it.
        Not at all when they are over `largest`; after starting over, when a bound
        would be passed."""
        if chars + shared_chars > self.largest:
            return
        new = shared is not None and id(shared) not in self._shared
        owed = chars + (shared_chars if new else 0)
        if len(self._data) >= self.entries or self._chars + owed > self.chars:
            self.clear()
            new, owed = shared is not None, chars + shared_chars
        self._data[key] = value
        self._chars += owed
        if new:
            self._shared[id(shared)] = shared  # kept: its id names no other object

    def clear(self) -> None:
        self._data.clear()
        self._shared.clear()
        self._chars = 0

    def __len__(self) -> int:
        return len(self._data)

    @property
    def held_chars(self) -> int:
        """The characters behind the entries held."""
        return self._chars


def text_chars(value: object) -> int:
    """The characters of a str, or of the strings (nested in tuples) of a key."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, tuple):
        return sum(map(text_chars, value))
    return 0


def memoized(entries: int, chars: int,
             extra: Callable[[Any], int] | None = None) -> Callable[[F], F]:
    """Memoise a pure function of strings (and tuples of them) in a Memo(entries,
    chars), charged with the characters of its arguments, and `extra(result)` more
    where a short text makes a large result (a range of 256 device ids). Exceptions are
    not memoised; a None result is not either (it is computed again)."""

    def wrap(fn: F) -> F:
        memo: Memo[tuple[Any, ...], Any] = Memo(entries, chars)

        @wraps(fn)
        def call(*args: Any) -> Any:
            found = memo.get(args)
            if found is None:
                found = fn(*args)
                memo.put(args, found, text_chars(args) + (extra(found) if extra else 0))
            return found

        call.memo = memo  # type: ignore[attr-defined]
        return call  # type: ignore[return-value]

    return wrap

"""nri_accel.memo: memos bounded by entries and by the characters behind them."""

from __future__ import annotations

import pytest

from nri_accel.memo import Memo, memoized, text_chars


def test_a_memo_starts_over_at_either_bound() -> None:
    memo: Memo[str, int] = Memo(entries=3, chars=160)
    for i in range(3):
        memo.put(f"k{i}", i, 10)
    assert (len(memo), memo.held_chars, memo.get("k2")) == (3, 30, 2)
    memo.put("k3", 3, 10)  # a fourth entry: it starts over
    assert (len(memo), memo.get("k0"), memo.get("k3")) == (1, None, 3)
    for i in range(4, 6):
        memo.put(f"k{i}", i, 10)  # the one entry's bound: 160 // 16
    assert memo.held_chars == 30
    big: Memo[str, int] = Memo(entries=100, chars=160)
    for i in range(17):
        big.put(f"k{i}", i, 10)
    assert (len(big), big.held_chars) == (1, 10)  # 170 characters would be over 160


def test_an_entry_over_a_sixteenth_of_the_characters_is_not_kept() -> None:
    memo: Memo[str, int] = Memo(entries=100, chars=1600)
    memo.put("small", 1, 100)
    memo.put("large", 2, 101)
    assert (memo.get("small"), memo.get("large", "absent")) == (1, "absent")
    assert memo.held_chars == 100


def test_memoized_remembers_results_not_errors() -> None:
    calls: list[str] = []

    @memoized(entries=8, chars=16 * 64)
    def parse(text: str) -> tuple[str, ...]:
        calls.append(text)
        if text == "bad":
            raise ValueError(text)
        return tuple(text)

    assert parse("ab") == ("a", "b") and parse("ab") == ("a", "b")
    for _ in range(2):
        with pytest.raises(ValueError):
            parse("bad")
    assert parse("x" * 65) == tuple("x" * 65)  # over 64 characters: computed each time
    parse("x" * 65)
    assert calls == ["ab", "bad", "bad", "x" * 65, "x" * 65]
    assert parse.memo.held_chars == 2  # type: ignore[attr-defined]


def test_text_chars_counts_strings_in_nested_tuples() -> None:
    assert text_chars(("ab", ("cde", 7, ("f",)), None)) == 6

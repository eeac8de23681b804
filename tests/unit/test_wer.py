"""WER/CER: alignments checked against hand-computed ones, and the text normalisation."""

from __future__ import annotations

import pytest

from edge_agent.metrics.wer import (
    ErrorCounts,
    align,
    char_errors,
    error_rates,
    normalize,
    number_words,
    ordinal_words,
    word_errors,
)


@pytest.mark.parametrize(
    "ref, hyp, s, d, i, pairs",
    [
        ("a b c", "a b c", 0, 0, 0, "= = ="),
        ("a b c", "a x c", 1, 0, 0, "= S ="),
        ("a b c", "a c", 0, 1, 0, "= D ="),
        ("a b c", "a b c d", 0, 0, 1, "= = = I"),
        ("a b c", "", 0, 3, 0, "D D D"),
        ("", "a b", 0, 0, 2, "I I"),
        # "set the light to forty" vs "set light to for tea": cost 3; the backtrace substitutes the last word
        ("set the light to forty", "set light to for tea", 1, 1, 1, "= D = = I S"),
        # a shift costs a deletion and an insertion, not two substitutions' worth more
        ("x a b c", "a b c x", 0, 1, 1, "D = = = I"),
    ],
)
def test_alignment_hand_computed(ref: str, hyp: str, s: int, d: int, i: int, pairs: str) -> None:
    a = align(ref.split(), hyp.split())
    assert (a.counts.substitutions, a.counts.deletions, a.counts.insertions) == (s, d, i)
    assert " ".join(op for op, _, _ in a.pairs) == pairs
    assert a.counts.ref_len == len(ref.split())
    # the alignment reproduces both sequences
    assert [r for _, r, _ in a.pairs if r is not None] == ref.split()
    assert [h for _, _, h in a.pairs if h is not None] == hyp.split()


def test_rates_are_totals_over_totals() -> None:
    words, chars = error_rates([("turn on the light", "turn on the light"), ("call mom", "call tom now")])
    # 0 errors / 4 words + 2 errors (S mom→tom, I now) / 2 words = 2 / 6, not the mean of 0 and 1
    assert (words.errors, words.ref_len) == (2, 6)
    assert words.rate == pytest.approx(2 / 6)
    # characters: "call mom" → "call tom now": m→t and " now" inserted = 1 S + 4 I over 8 characters
    assert (chars.substitutions, chars.insertions, chars.ref_len) == (1, 4, 17 + 8)


def test_word_and_char_errors_normalise_first() -> None:
    assert word_errors("Set the light to 40%.", "set the light to forty percent").errors == 0
    assert char_errors("Hello, World!", "hello world").errors == 0
    assert word_errors("A B", "a b", normalise=False).substitutions == 2


def test_empty_reference() -> None:
    assert ErrorCounts().rate == 0.0
    assert word_errors("", "noise").rate == float("inf")
    assert (ErrorCounts(3, 1, 0, 0) + ErrorCounts(2, 0, 1, 1)).to_dict() == {
        "rate": 0.6,
        "errors": 3,
        "ref_len": 5,
        "substitutions": 1,
        "deletions": 1,
        "insertions": 1,
    }


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Turn ON the Kitchen-Light!", "turn on the kitchen light"),
        ("set it to 40%", "set it to forty percent"),
        ("wake me at 7:05", "wake me at seven oh five"),
        ("wake me at 7:30", "wake me at seven thirty"),
        ("at 11:00", "at eleven o'clock"),
        ("on March 3rd", "on march third"),
        ("the 21st of June", "the twenty first of june"),
        ("it costs 1,250 dollars", "it costs one thousand two hundred fifty dollars"),
        ("the year 2024", "the year two thousand twenty four"),
        ("dial 555", "dial five hundred fifty five"),
        ("it's  o'clock ' ", "it's o'clock"),
        ("Tom & Jerry", "tom and jerry"),
    ],
)
def test_normalize(text: str, expected: str) -> None:
    assert normalize(text) == expected


@pytest.mark.parametrize(
    "n, words",
    [
        (0, "zero"),
        (15, "fifteen"),
        (40, "forty"),
        (42, "forty two"),
        (100, "one hundred"),
        (105, "one hundred five"),
        (1905, "one thousand nine hundred five"),
        (2_000_000, "two million"),
    ],
)
def test_number_words(n: int, words: str) -> None:
    assert number_words(n) == words


@pytest.mark.parametrize(
    "n, words",
    [
        (1, "first"),
        (2, "second"),
        (3, "third"),
        (12, "twelfth"),
        (20, "twentieth"),
        (23, "twenty third"),
        (40, "fortieth"),
        (100, "one hundredth"),
    ],
)
def test_ordinal_words(n: int, words: str) -> None:
    assert ordinal_words(n) == words

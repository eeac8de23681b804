"""Word and character error rates with the standard edit-distance alignment.

``align(ref, hyp)`` finds a minimum-cost alignment (every substitution, deletion and insertion
costs 1) and counts each kind; WER = (S + D + I) / N over reference words, CER the same over
characters of the normalised text (spaces included, as jiwer counts them). Rates over a set are
totals over totals, never a mean of per-utterance rates.

``normalize`` makes references and hypotheses comparable: lowercase, punctuation dropped
(apostrophes inside words kept: "o'clock"), hyphens split words, and numbers written as words the
way the demo corpus speaks them ("40%" → "forty percent", "7:05" → "seven oh five",
"3rd" → "third", "1,250" → "one thousand two hundred fifty").
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

ONES = [
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
    "nineteen",
]
TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
_ORD = {
    "one": "first",
    "two": "second",
    "three": "third",
    "five": "fifth",
    "eight": "eighth",
    "nine": "ninth",
    "twelve": "twelfth",
}


def number_words(n: int) -> str:
    """A non-negative integer as words without "and": 1905 → "one thousand nine hundred five"."""
    if n < 0:
        return "minus " + number_words(-n)
    if n < 20:
        return ONES[n]
    if n < 100:
        return TENS[n // 10] + ("" if n % 10 == 0 else " " + ONES[n % 10])
    for size, name in ((10**9, "billion"), (10**6, "million"), (1000, "thousand"), (100, "hundred")):
        if n >= size:
            rest = n % size
            return number_words(n // size) + " " + name + ("" if rest == 0 else " " + number_words(rest))
    raise AssertionError("unreachable")


def ordinal_words(n: int) -> str:
    """3 → "third", 21 → "twenty first", 40 → "fortieth"."""
    words = number_words(n).split()
    last = words[-1]
    if last in _ORD:
        words[-1] = _ORD[last]
    elif last.endswith("y"):
        words[-1] = last[:-1] + "ieth"
    else:
        words[-1] = last + "th"
    return " ".join(words)


def _time_words(h: int, m: int) -> str:
    if m == 0:
        return f"{number_words(h)} o'clock"
    if m < 10:
        return f"{number_words(h)} oh {number_words(m)}"
    return f"{number_words(h)} {number_words(m)}"


_TIME = re.compile(r"\b(\d{1,2}):(\d{2})\b")
_ORDINAL = re.compile(r"\b(\d+)(st|nd|rd|th)\b")
_PERCENT = re.compile(r"(\d+)\s*%")
_NUMBER = re.compile(r"\d+")


def normalize(text: str) -> str:
    """Lowercase words separated by single spaces, numbers spelled out (see the module docstring)."""
    t = text.lower().replace("’", "'").replace("&", " and ")
    t = re.sub(r"(?<=\d),(?=\d{3}\b)", "", t)  # thousands separators
    t = _TIME.sub(lambda m: " " + _time_words(int(m.group(1)), int(m.group(2))) + " ", t)
    t = _ORDINAL.sub(lambda m: " " + ordinal_words(int(m.group(1))) + " ", t)
    t = _PERCENT.sub(lambda m: " " + number_words(int(m.group(1))) + " percent ", t)
    t = _NUMBER.sub(lambda m: " " + number_words(int(m.group(0))) + " ", t)
    t = re.sub(r"[^a-z' ]+", " ", t)  # punctuation and hyphens become word breaks
    words = (w.strip("'") for w in t.split())
    return " ".join(w for w in words if w)


@dataclass(frozen=True, slots=True)
class ErrorCounts:
    """Alignment counts of one utterance or of a whole set (they add up)."""

    ref_len: int = 0
    substitutions: int = 0
    deletions: int = 0
    insertions: int = 0

    @property
    def errors(self) -> int:
        return self.substitutions + self.deletions + self.insertions

    @property
    def hits(self) -> int:
        return self.ref_len - self.substitutions - self.deletions

    @property
    def rate(self) -> float:
        """Errors per reference unit; an empty reference gives 0.0 when the hypothesis is empty too, else inf."""
        if self.ref_len == 0:
            return 0.0 if self.errors == 0 else float("inf")
        return self.errors / self.ref_len

    def __add__(self, other: ErrorCounts) -> ErrorCounts:
        return ErrorCounts(
            self.ref_len + other.ref_len,
            self.substitutions + other.substitutions,
            self.deletions + other.deletions,
            self.insertions + other.insertions,
        )

    def to_dict(self) -> dict[str, float | int]:
        return {
            "rate": self.rate,
            "errors": self.errors,
            "ref_len": self.ref_len,
            "substitutions": self.substitutions,
            "deletions": self.deletions,
            "insertions": self.insertions,
        }


@dataclass(frozen=True, slots=True)
class Alignment:
    """A minimum edit-distance alignment: the error counts and each aligned pair with its operation."""

    counts: ErrorCounts
    # (op, ref, hyp): op "=" match, "S" substitution, "D" deletion (hyp None), "I" insertion (ref None)
    pairs: tuple[tuple[str, str | None, str | None], ...]


def align(ref: Sequence[str], hyp: Sequence[str]) -> Alignment:
    """Minimum edit-distance alignment of two token sequences, with S/D/I counts.

    Among equal-cost alignments the backtrace prefers a match or substitution, then a deletion,
    then an insertion, so the counts are deterministic.
    """
    n, m = len(ref), len(hyp)
    cost = [[0] * (m + 1) for _ in range(n + 1)]
    for i in range(1, n + 1):
        cost[i][0] = i
    for j in range(1, m + 1):
        cost[0][j] = j
    for i in range(1, n + 1):
        row, prev, r = cost[i], cost[i - 1], ref[i - 1]
        for j in range(1, m + 1):
            row[j] = min(prev[j - 1] + (r != hyp[j - 1]), prev[j] + 1, row[j - 1] + 1)
    pairs: list[tuple[str, str | None, str | None]] = []
    s = d = ins = 0
    i, j = n, m
    while i > 0 or j > 0:
        if i > 0 and j > 0 and cost[i][j] == cost[i - 1][j - 1] + (ref[i - 1] != hyp[j - 1]):
            same = ref[i - 1] == hyp[j - 1]
            pairs.append(("=" if same else "S", ref[i - 1], hyp[j - 1]))
            s += not same
            i, j = i - 1, j - 1
        elif i > 0 and cost[i][j] == cost[i - 1][j] + 1:
            pairs.append(("D", ref[i - 1], None))
            d += 1
            i -= 1
        else:
            pairs.append(("I", None, hyp[j - 1]))
            ins += 1
            j -= 1
    pairs.reverse()
    return Alignment(ErrorCounts(n, s, d, ins), tuple(pairs))


def word_errors(ref: str, hyp: str, normalise: bool = True) -> ErrorCounts:
    if normalise:
        ref, hyp = normalize(ref), normalize(hyp)
    return align(ref.split(), hyp.split()).counts


def char_errors(ref: str, hyp: str, normalise: bool = True) -> ErrorCounts:
    if normalise:
        ref, hyp = normalize(ref), normalize(hyp)
    return align(list(ref), list(hyp)).counts


def error_rates(pairs: Iterable[tuple[str, str]]) -> tuple[ErrorCounts, ErrorCounts]:
    """Totals over ``(reference, hypothesis)`` pairs: (word counts, character counts)."""
    words, chars = ErrorCounts(), ErrorCounts()
    for ref, hyp in pairs:
        ref_n, hyp_n = normalize(ref), normalize(hyp)
        words = words + align(ref_n.split(), hyp_n.split()).counts
        chars = chars + align(list(ref_n), list(hyp_n)).counts
    return words, chars

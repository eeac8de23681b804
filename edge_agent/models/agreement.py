"""LocalAgreement-2: commit what two consecutive hypotheses agree on.

A streaming Whisper re-decodes its growing audio window every step. Early words are re-guessed
as more audio arrives; LocalAgreement-n (Polák et al. 2022, as whisper_streaming uses it with
n = 2) commits the longest common prefix of the last n hypotheses. Committed tokens never change while
the utterance lasts: the next partial's decode is forced to start with them, so every later hypothesis
extends them. The final is decoded free of them (a one pass over the whole utterance), and ``finish``
takes it whole: it may revise a committed word.

Pure and small: tokens are any hashable values (token ids here).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence


def common_prefix(a: Sequence[Hashable], b: Sequence[Hashable]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class LocalAgreement:
    """LocalAgreement-n over a stream of hypotheses: ``committed`` only grows until ``finish`` (the module doc)."""

    def __init__(self, n: int = 2) -> None:
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        self.n = n
        self.committed: list = []
        self._recent: list[list] = []  # the last n hypotheses

    def insert(self, hypothesis: Sequence[Hashable]) -> list:
        """Add a hypothesis; return the tokens newly committed by it (maybe none)."""
        hyp = list(hypothesis)
        if hyp[: len(self.committed)] != self.committed:
            # A hypothesis that rewrites committed text (only possible without prefix forcing)
            # keeps the committed part and is judged on what follows it.
            keep = common_prefix(hyp, self.committed)
            hyp = self.committed + hyp[keep:]
        self._recent = [*self._recent, hyp][-self.n :]
        if len(self._recent) < self.n:
            return []
        agreed = min(common_prefix(self._recent[0], h) for h in self._recent[1:]) if self.n > 1 else len(hyp)
        new = self._recent[-1][len(self.committed) : agreed]
        self.committed.extend(new)
        return new

    @property
    def unstable(self) -> list:
        """The latest hypothesis beyond what is committed."""
        return self._recent[-1][len(self.committed) :] if self._recent else []

    def finish(self, hypothesis: Sequence[Hashable] | None = None) -> list:
        """End of the utterance: the final hypothesis (default: the last one) becomes the committed text whole,
        even where it differs from what was committed. Returns its tokens after the prefix it shares with them."""
        last = list(hypothesis) if hypothesis is not None else (self._recent[-1] if self._recent else self.committed)
        keep = common_prefix(last, self.committed)
        self.committed = list(last)
        self._recent = [list(last)]
        return last[keep:]

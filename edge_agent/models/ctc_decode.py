"""CTC decoding: per-frame scores → token ids → text, greedy or by prefix beam search.

Both decoders are incremental: ``advance(log_probs)`` takes the next frames, ``ids`` is the best
token sequence so far. Feeding an utterance in chunks or at once gives the same result, which is
what lets a stateful streaming model emit partials per chunk and still finish with the same text
as a whole-utterance decode.

    greedy        argmax per frame, merge repeats, drop blanks
    prefix beam   the standard CTC prefix beam search (Hannun et al. 2014) in the log domain:
                  per prefix, the probability of ending in a blank and in a non-blank, so "a a"
                  and "aa" stay distinct; ``beam_width`` prefixes survive each frame, and only
                  tokens within ``prune_db`` … of the frame's best are expanded.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from ..errors import ModelError

NEG_INF = -np.inf
SPECIAL = ("<s>", "</s>", "<unk>", "<pad>", "<blank>", "<blk>", "<eps>")


@dataclass(frozen=True, slots=True)
class CtcVocab:
    """A CTC model's vocabulary: id to token, the blank id and the word delimiter."""

    tokens: tuple[str, ...]  # id → token
    blank_id: int
    word_delimiter: str = "|"

    @classmethod
    def from_folder(cls, folder: Path, config: dict) -> CtcVocab:
        path = folder / "vocab.json"
        try:
            vocab = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ModelError(f"{path}: unreadable CTC vocabulary ({exc})") from exc
        if not isinstance(vocab, dict) or not vocab:
            raise ModelError(f"{path}: expected a JSON object token → id")
        size = max(vocab.values()) + 1
        tokens = [""] * size
        for token, index in vocab.items():
            tokens[int(index)] = token
        tok_cfg_path = folder / "tokenizer_config.json"
        tok_cfg = json.loads(tok_cfg_path.read_text()) if tok_cfg_path.is_file() else {}
        delimiter = str(config.get("word_delimiter") or tok_cfg.get("word_delimiter_token") or "|")
        blank = config.get("blank_id")
        if blank is None:
            pad = tok_cfg.get("pad_token", "<pad>")
            blank = vocab.get(pad, config.get("pad_token_id", 0))
        return cls(tuple(tokens), int(blank), delimiter)

    def text(self, ids: Sequence[int]) -> str:
        words: list[str] = []
        word: list[str] = []
        for i in ids:
            tok = self.tokens[i] if 0 <= i < len(self.tokens) else ""
            if tok == self.word_delimiter or tok == " ":
                if word:
                    words.append("".join(word))
                word = []
            elif tok and tok not in SPECIAL and i != self.blank_id:
                word.append(tok)
        if word:
            words.append("".join(word))
        return " ".join(words)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float32)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


class Decoder(Protocol):
    """An incremental CTC decoder: frames in through ``advance``, the best and the settled labels out."""

    def advance(self, log_probs: np.ndarray) -> None: ...

    def finish(self) -> None: ...  # the utterance ended (end-of-sentence scores, if any)

    @property
    def ids(self) -> tuple[int, ...]: ...

    @property
    def stable_ids(self) -> tuple[int, ...]: ...  # the prefix of ``ids`` that can no longer change


class GreedyDecoder:
    """Best path: the most likely label per frame, repeats merged and blanks dropped; every label is settled."""

    def __init__(self, blank_id: int) -> None:
        self.blank_id = blank_id
        self._ids: list[int] = []
        self._last = blank_id
        self.frames = 0

    def advance(self, log_probs: np.ndarray) -> None:
        for token in np.asarray(log_probs).argmax(axis=-1).tolist():
            if token != self._last and token != self.blank_id:
                self._ids.append(int(token))
            self._last = token
        self.frames += len(log_probs)

    def finish(self) -> None:
        pass

    @property
    def ids(self) -> tuple[int, ...]:
        return tuple(self._ids)

    stable_ids = ids  # greedy output never changes once emitted


def greedy_ids(log_probs: np.ndarray, blank_id: int) -> tuple[int, ...]:
    d = GreedyDecoder(blank_id)
    d.advance(log_probs)
    return d.ids


class PrefixBeamDecoder:
    """Incremental CTC prefix beam search over log-probabilities ``[frames, vocab]``."""

    def __init__(self, blank_id: int, beam_width: int = 8, prune_top_k: int = 12, prune_log_p: float = -12.0) -> None:
        if beam_width < 1:
            raise ValueError(f"beam_width must be >= 1, got {beam_width}")
        self.blank_id, self.beam_width = blank_id, beam_width
        self.prune_top_k, self.prune_log_p = prune_top_k, prune_log_p
        # prefix → (log P(prefix, ends in blank), log P(prefix, ends in non-blank))
        self._beams: dict[tuple[int, ...], tuple[float, float]] = {(): (0.0, NEG_INF)}
        self.frames = 0

    def advance(self, log_probs: np.ndarray) -> None:
        lp_all = np.asarray(log_probs, np.float64)
        for lp in lp_all:
            self._frame(lp)
        self.frames += len(lp_all)

    def _frame(self, lp: np.ndarray) -> None:
        blank = self.blank_id
        k = min(self.prune_top_k, lp.size)
        top = np.argpartition(-lp, k - 1)[:k]
        best = lp[top].max()
        candidates = [int(c) for c in top if c != blank and lp[c] >= best + self.prune_log_p]
        nxt: dict[tuple[int, ...], list[float]] = {}

        def slot(prefix: tuple[int, ...]) -> list[float]:
            s = nxt.get(prefix)
            if s is None:
                s = nxt[prefix] = [NEG_INF, NEG_INF]
            return s

        for prefix, (pb, pnb) in self._beams.items():
            total = np.logaddexp(pb, pnb)
            s = slot(prefix)
            s[0] = np.logaddexp(s[0], total + lp[blank])
            last = prefix[-1] if prefix else None
            for c in candidates:
                p = lp[c]
                ext = slot((*prefix, c))
                if c == last:
                    # A repeat extends only across a blank; without one it collapses into prefix.
                    ext[1] = np.logaddexp(ext[1], pb + p)
                    s[1] = np.logaddexp(s[1], pnb + p)
                else:
                    ext[1] = np.logaddexp(ext[1], total + p)
        ranked = sorted(nxt.items(), key=lambda kv: (-np.logaddexp(kv[1][0], kv[1][1]), kv[0]))
        self._beams = {prefix: (v[0], v[1]) for prefix, v in ranked[: self.beam_width]}

    def finish(self) -> None:
        pass

    @property
    def ids(self) -> tuple[int, ...]:
        return max(self._beams.items(), key=lambda kv: (np.logaddexp(*kv[1]), [-t for t in kv[0]]))[0]

    @property
    def stable_ids(self) -> tuple[int, ...]:
        """The prefix every surviving beam shares: any later beam extends one of them."""
        return common_prefix(list(self._beams))

    def nbest(self) -> list[tuple[tuple[int, ...], float]]:
        return sorted(((p, float(np.logaddexp(*v))) for p, v in self._beams.items()), key=lambda x: -x[1])


def common_prefix(keys: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
    common = keys[0]
    for k in keys[1:]:
        n = 0
        while n < min(len(common), len(k)) and common[n] == k[n]:
            n += 1
        common = common[:n]
    return common

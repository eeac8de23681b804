"""Lexicon-constrained CTC beam search with an optional word n-gram language model, incremental.

A voice assistant knows its words: ``lexicon.txt`` in the model folder (one word per line) lists
them, and ``lm.arpa`` (a standard ARPA back-off n-gram model, any order) says how they follow each
other. ``LexiconBeamDecoder`` is the CTC prefix beam search (Hannun et al. 2014) in which a letter
may extend the current word only while it stays a prefix of a lexicon word and the word delimiter
may end it only when it is a whole word. Each completed word adds
``lm_weight · ln P(word | history) + lm_word_bonus`` (both from ``config.json``), and ``finish()``
adds the end-of-sentence score and keeps only hypotheses that end on a whole word.

Like the other decoders (``ctc_decode``) it is incremental: ``advance(log_probs)`` takes the next
frames, ``ids`` is the best label sequence so far (a partial), ``stable_ids`` the part every
surviving hypothesis shares (it can no longer change). A hypothesis that another one dominates (the
same state from here on, at least as likely) leaves the beam at once: it could never win, and it would
keep the words it disagrees on out of ``stable_ids``. Feeding an utterance in chunks or at once gives
the same result.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import ModelError
from .ctc_decode import CtcVocab, GreedyDecoder, PrefixBeamDecoder, common_prefix

NEG_INF = -math.inf
LN10 = math.log(10.0)
DECODERS = ("auto", "greedy", "beam", "lexicon", "lm")


def _lae(a: float, b: float) -> float:
    """log(exp(a) + exp(b)) for Python floats (np.logaddexp costs ~1 µs a call on scalars)."""
    if a < b:
        a, b = b, a
    return a if b == NEG_INF else a + math.log1p(math.exp(b - a))


@dataclass(frozen=True)
class Lexicon:
    """The words a model may output (``lexicon.txt``) and every prefix of them."""

    words: frozenset[str]
    prefixes: frozenset[str]

    @classmethod
    def of(cls, words: Sequence[str]) -> Lexicon:
        ws = frozenset(words)
        return cls(ws, frozenset(w[:i] for w in ws for i in range(1, len(w) + 1)))

    @classmethod
    def read(cls, path: Path) -> Lexicon | None:
        if not path.is_file():
            return None
        words = [w for w in (line.strip() for line in path.read_text().splitlines()) if w and not w.startswith("#")]
        if not words:
            raise ModelError(f"{path}: no words (one word per line)")
        return cls.of(words)


@dataclass
class NgramLM:
    """A back-off word n-gram model from an ARPA file (log10 probabilities and back-off weights)."""

    order: int
    entries: dict[tuple[str, ...], tuple[float, float]]  # n-gram → (log10 p, log10 back-off)
    weight: float = 0.5
    word_bonus: float = 1.0
    _memo: dict[tuple[tuple[str, ...], str], float] = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def from_arpa(cls, path: Path, weight: float = 0.5, word_bonus: float = 1.0) -> NgramLM:
        entries: dict[tuple[str, ...], tuple[float, float]] = {}
        order = top = 0
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ModelError(f"{path}: unreadable language model ({exc})") from exc
        for number, raw in enumerate(text.splitlines(), 1):
            line = raw.strip()
            if not line or line.startswith("ngram ") or line in ("\\data\\", "\\end\\"):
                continue
            if line.startswith("\\") and line.endswith("-grams:"):
                try:
                    order = int(line[1 : line.index("-")])
                except ValueError:
                    raise ModelError(f"{path}:{number}: not an ARPA section header: {raw!r}") from None
                top = max(top, order)
                continue
            parts = line.split()
            try:
                if order < 1 or len(parts) not in (order + 1, order + 2):
                    raise ValueError
                bow = float(parts[order + 1]) if len(parts) == order + 2 else 0.0
                entries[tuple(parts[1 : order + 1])] = (float(parts[0]), bow)
            except ValueError:
                raise ModelError(f"{path}:{number}: not an ARPA {order}-gram line: {raw!r}") from None
        if not any(len(k) == 1 for k in entries):
            raise ModelError(f"{path}: no unigrams (not an ARPA language model?)")
        return cls(top, entries, weight, word_bonus)

    def log10p(self, history: tuple[str, ...], word: str) -> float:
        """Back-off: the longest listed n-gram ending in ``word``, plus the back-off weights of the
        histories skipped on the way; an unknown word gets the ``<unk>`` unigram (or -7)."""
        history = history[-(self.order - 1) :] if self.order > 1 else ()
        backoff = 0.0
        for start in range(len(history) + 1):
            h = history[start:]
            hit = self.entries.get((*h, word))
            if hit is not None:
                return backoff + hit[0]
            if h:
                backoff += self.entries.get(h, (0.0, 0.0))[1]
        return backoff + self.entries.get(("<unk>",), (-7.0, 0.0))[0]

    def end_probability(self, words: Sequence[str], lexicon: Lexicon | None = None) -> float:
        """P(``</s>`` | ``<s>`` + ``words``): how likely the sentence ends after these words.

        A streaming partial's last word may still be being spelled (the acoustic model's look-ahead
        holds back its last letters until more audio or the end): with ``lexicon``, the last word is
        any lexicon word it begins, and the answer is the sentence-end probability averaged over
        those words weighted by P(word | history). Without one, an unknown last word gives 0."""
        if not words:
            return 0.0
        hist, last = ("<s>", *words[:-1]), words[-1]
        if lexicon is None:
            candidates = [last] if (last,) in self.entries else []
        else:
            candidates = [w for w in lexicon.words if w.startswith(last) and (w,) in self.entries]
        num = den = 0.0
        for w in candidates:
            p = 10.0 ** self.log10p(hist, w)
            num += p * 10.0 ** self.log10p((*hist, w), "</s>")
            den += p
        return num / den if den > 0 else 0.0

    def score(self, history: tuple[str, ...], word: str) -> float:
        """``weight · ln P(word | history) + word_bonus`` (memoised; histories start with ``<s>``)."""
        key = (history[-(self.order - 1) :] if self.order > 1 else (), word)
        s = self._memo.get(key)
        if s is None:
            bonus = 0.0 if word == "</s>" else self.word_bonus
            s = self._memo[key] = self.weight * self.log10p(*key) * LN10 + bonus
        return s


class LexiconBeamDecoder:
    """Incremental lexicon-constrained CTC prefix beam search, with an optional n-gram LM."""

    def __init__(
        self,
        tokens: Sequence[str],
        blank_id: int,
        delimiter_id: int,
        lexicon: Lexicon,
        beam: int = 12,
        prune: float = 12.0,
        lm: NgramLM | None = None,
    ) -> None:
        self.tokens, self.blank_id, self.delimiter_id = tuple(tokens), blank_id, delimiter_id
        self.lexicon, self.beam, self.prune, self.lm = lexicon, beam, prune, lm
        self._usable = np.array(
            [i for i, t in enumerate(self.tokens) if i != blank_id and (i == delimiter_id or not t.startswith("<"))]
        )
        # key (label ids) → [log P ending in blank, log P ending in a label, LM score, current word, words]
        self._beams: dict[tuple[int, ...], list] = {(): [0.0, NEG_INF, 0.0, "", ("<s>",)]}
        self._greedy = GreedyDecoder(blank_id)  # the fallback when no hypothesis ends on a word
        self._final: tuple[int, ...] | None = None
        self._history = lm.order - 1 if lm is not None else 0  # words of history the LM scores a word after
        self.frames = 0

    def advance(self, log_probs: np.ndarray) -> None:
        lp_all = np.asarray(log_probs, np.float64)
        self._greedy.advance(lp_all)
        for frame in lp_all:
            self._frame(frame)
        self.frames += len(lp_all)

    def _frame(self, frame: np.ndarray) -> None:
        usable = self._usable
        floor = float(frame.max()) - self.prune  # the blank included: most frames are blank
        cands = [(int(i), float(p)) for i, p in zip(usable, frame[usable]) if p >= floor]
        blank = float(frame[self.blank_id])
        delim, tokens, prefixes, words = self.delimiter_id, self.tokens, self.lexicon.prefixes, self.lexicon.words
        nxt: dict[tuple[int, ...], list] = {}

        def add(key, pb, pnb, lm, word, hist) -> None:
            cur = nxt.get(key)
            if cur is None:
                nxt[key] = [pb, pnb, lm, word, hist]
            else:
                cur[0], cur[1] = _lae(cur[0], pb), _lae(cur[1], pnb)

        for key, (pb, pnb, lm, word, hist) in self._beams.items():
            total = _lae(pb, pnb)
            add(key, total + blank, NEG_INF, lm, word, hist)
            last = key[-1] if key else -1
            for i, p in cands:
                if i == last:  # the same label again collapses unless a blank came between
                    add(key, NEG_INF, pnb + p, lm, word, hist)
                    extend = pb + p
                else:
                    extend = total + p
                if extend == NEG_INF:
                    continue
                if i == delim:
                    if word not in words:
                        continue
                    score = self.lm.score(hist, word) if self.lm is not None else 0.0
                    add((*key, i), NEG_INF, extend, lm + score, "", (*hist, word))
                else:
                    grown = word + tokens[i]
                    if grown in prefixes:
                        add((*key, i), NEG_INF, extend, lm, grown, hist)
        ranked = sorted(nxt.items(), key=lambda kv: (-(_lae(kv[1][0], kv[1][1]) + kv[1][2]), kv[0]))
        self._beams = self._undominated(ranked)

    def _undominated(self, ranked: list) -> dict[tuple[int, ...], list]:
        """The best ``beam`` of ``ranked`` (best first) less the hypotheses another one dominates: one in
        the same state from here on (the last label, the word being spelled, the words the LM scores the
        next ones after) that is at least as likely both ending in a blank and ending in a label, LM score
        included. Every continuation of a dominated hypothesis scores below the same continuation of the
        other, so it never wins; kept, it would hold ``stable_ids`` back to the end of the utterance (a
        first word heard 10 nats less likely than another stays in a wide beam while the rest of the
        sentence adds the same to both)."""
        keep: dict[tuple[int, ...], list] = {}
        seen: dict[tuple, list[tuple[float, float]]] = {}
        n = self._history
        for key, v in ranked:
            pb, pnb = v[0] + v[2], v[1] + v[2]
            rivals = seen.setdefault((key[-1] if key else -1, v[3], v[4][-n:] if n else ()), [])
            if any(b >= pb and nb >= pnb for b, nb in rivals):
                continue
            rivals.append((pb, pnb))
            keep[key] = v
            if len(keep) == self.beam:
                break
        return keep

    def finish(self) -> None:
        """End of the utterance: score the last word and the sentence end; keep whole words only."""
        best, best_key = NEG_INF, None
        for key, (pb, pnb, lm, word, hist) in self._beams.items():
            if word and word not in self.lexicon.words:
                continue
            score = _lae(pb, pnb) + lm
            if self.lm is not None:
                if word:
                    score += self.lm.score(hist, word)
                    hist = (*hist, word)
                score += self.lm.score(hist, "</s>")
            if score > best or (score == best and best_key is not None and key < best_key):
                best, best_key = score, key
        # Nothing but the empty hypothesis fits while the acoustics spelled something: say what was
        # heard (greedy) rather than nothing.
        self._final = best_key if best_key else self._greedy.ids

    @property
    def ids(self) -> tuple[int, ...]:
        if self._final is not None:
            return self._final
        return max(self._beams.items(), key=lambda kv: (_lae(kv[1][0], kv[1][1]) + kv[1][2], [-t for t in kv[0]]))[0]

    @property
    def stable_ids(self) -> tuple[int, ...]:
        """The words every surviving hypothesis starts with (up to their last shared delimiter)."""
        if self._final is not None:
            return self._final
        common = common_prefix(list(self._beams))
        cut = max((j + 1 for j, t in enumerate(common) if t == self.delimiter_id), default=0)
        return common[:cut]


def resolve_decoder(kind: str, folder: Path) -> str:
    """``auto``: ``lm`` when the folder has lexicon.txt and lm.arpa, ``lexicon`` with a lexicon only,
    else ``greedy``. An explicit ``lexicon``/``lm`` without its files is an error that says so."""
    if kind not in DECODERS:
        raise ModelError(f"unknown CTC decoder {kind!r}; choose one of {', '.join(DECODERS)}")
    has_lex, has_lm = (folder / "lexicon.txt").is_file(), (folder / "lm.arpa").is_file()
    if kind == "auto":
        return "lm" if has_lex and has_lm else "lexicon" if has_lex else "greedy"
    if kind in ("lexicon", "lm") and not has_lex:
        raise ModelError(f"{folder}: no lexicon.txt, so no {kind} decoding (use --decoder greedy or beam)")
    if kind == "lm" and not has_lm:
        raise ModelError(f"{folder}: no lm.arpa, so no language-model decoding (use --decoder lexicon)")
    return kind


def decoder_factory(
    kind: str, vocab: CtcVocab, folder: Path, config: dict, beam_width: int | None = None
) -> tuple[str, Callable[[], object]]:
    """(the resolved kind, a function making a fresh decoder per utterance). Files are read once."""
    kind = resolve_decoder(kind, folder)
    if kind == "greedy":
        return kind, lambda: GreedyDecoder(vocab.blank_id)
    if kind == "beam":
        width = beam_width or 8
        return kind, lambda: PrefixBeamDecoder(vocab.blank_id, width)
    lexicon, lm, beam = read_language(folder, config)
    assert lexicon is not None
    lm = lm if kind == "lm" else None
    if vocab.word_delimiter not in vocab.tokens:
        raise ModelError(f"{folder}: the word delimiter {vocab.word_delimiter!r} is not in vocab.json")
    delimiter = vocab.tokens.index(vocab.word_delimiter)
    width = beam_width or beam
    return kind, lambda: LexiconBeamDecoder(vocab.tokens, vocab.blank_id, delimiter, lexicon, width, lm=lm)


def read_language(folder: Path, config: dict) -> tuple[Lexicon | None, NgramLM | None, int]:
    """A model folder's word list, language model (with ``lm_weight``, ``lm_word_bonus`` from
    ``config.json``) and beam width (``lm_beam``); None for a file the folder does not ship."""
    lm = None
    if (folder / "lm.arpa").is_file():
        lm = NgramLM.from_arpa(
            folder / "lm.arpa", float(config.get("lm_weight", 0.5)), float(config.get("lm_word_bonus", 1.0))
        )
    return Lexicon.read(folder / "lexicon.txt"), lm, int(config.get("lm_beam", 12))


def decode_all(decoder, log_probs: np.ndarray) -> tuple[int, ...]:
    """A whole utterance's frames through ``decoder``: its final label ids."""
    decoder.advance(log_probs)
    if hasattr(decoder, "finish"):
        decoder.finish()
    return decoder.ids

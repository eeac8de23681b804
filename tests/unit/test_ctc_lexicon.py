"""Lexicon-constrained CTC beam search and the ARPA n-gram LM (edge_agent/models/ctc_lexicon.py).

References are computed by hand here (back-off arithmetic) or by exhaustive enumeration of every
CTC alignment (numpy), never by the decoder itself.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pytest

from edge_agent.errors import ModelError
from edge_agent.models.ctc_decode import CtcVocab, greedy_ids
from edge_agent.models.ctc_lexicon import Lexicon, LexiconBeamDecoder, NgramLM, decode_all, decoder_factory

TOKENS = ("<pad>", "<unk>", "|", "'", *"abcdefghijklmnopqrstuvwxyz")
ID = {t: i for i, t in enumerate(TOKENS)}


def _lp(rows: list[dict[int, float]]) -> np.ndarray:
    out = np.full((len(rows), len(TOKENS)), -20.0, np.float32)
    for t, row in enumerate(rows):
        for i, p in row.items():
            out[t, i] = np.log(p)
    return out


def _text(ids) -> str:
    return " ".join("".join(TOKENS[i] for i in ids).replace("|", " ").split())


def _search(lp, words, lm=None, beam=12) -> str:
    return _text(decode_all(LexiconBeamDecoder(TOKENS, 0, ID["|"], Lexicon.of(words), beam, lm=lm), lp))


TRIGRAM = """\\data\\
ngram 1=6
ngram 2=4
ngram 3=2

\\1-grams:
-99\t<s>\t-0.5
-1.0\tto\t-0.3
-1.2\ttoo\t-0.2
-0.9\tgo\t-0.4
-1.1\t</s>\t0
-3.0\t<unk>

\\2-grams:
-0.2\t<s> to\t-0.1
-0.1\tto go\t-0.25
-2.0\ttoo go
-0.3\tgo </s>

\\3-grams:
-0.05\t<s> to go
-0.6\tto go </s>

\\end\\
"""


def test_ngram_back_off_matches_hand_arithmetic(tmp_path: Path) -> None:
    arpa = tmp_path / "lm.arpa"
    arpa.write_text(TRIGRAM)
    lm = NgramLM.from_arpa(arpa, weight=1.0, word_bonus=0.0)
    assert lm.order == 3
    assert lm.log10p(("<s>", "to"), "go") == pytest.approx(-0.05)  # listed trigram
    assert lm.log10p(("too", "to"), "go") == pytest.approx(-0.1)  # trigram history unseen: no bow, bigram
    assert lm.log10p(("<s>", "to"), "too") == pytest.approx(-0.1 + -0.3 + -1.2)  # bow(<s> to) + bow(to) + p(too)
    assert lm.log10p(("go",), "go") == pytest.approx(-0.4 + -0.9)
    assert lm.log10p(("go",), "zebra") == pytest.approx(-0.4 + -3.0)  # unknown word → <unk>
    assert lm.score(("<s>", "to"), "go") == pytest.approx(-0.05 * math.log(10))
    bonus = NgramLM.from_arpa(arpa, weight=0.5, word_bonus=2.0)
    assert bonus.score(("<s>",), "to") == pytest.approx(0.5 * -0.2 * math.log(10) + 2.0)
    assert bonus.score(("go",), "</s>") == pytest.approx(0.5 * -0.3 * math.log(10))  # no bonus for the end


@pytest.mark.parametrize(
    "text, where",
    [
        ("\\data\\\n\\1-grams:\n-1.0\n", "lm.arpa:3"),
        ("\\data\\\n\\2-grams:\n-1.0\ta b\n", "no unigrams"),
        ("\\data\\\n\\x-grams:\n", "lm.arpa:2"),
    ],
)
def test_bad_arpa_files_say_where(tmp_path: Path, text: str, where: str) -> None:
    arpa = tmp_path / "lm.arpa"
    arpa.write_text(text)
    with pytest.raises(ModelError, match=where):
        NgramLM.from_arpa(arpa)


def test_lexicon_search_snaps_to_known_words() -> None:
    # greedy reads "of|tha"; "on|the" is only slightly less likely per frame and is all lexicon words
    lp = _lp(
        [
            {ID["o"]: 0.9, 0: 0.1},
            {ID["f"]: 0.55, ID["n"]: 0.45},
            {ID["|"]: 0.9, 0: 0.1},
            {ID["t"]: 0.9, 0: 0.1},
            {ID["h"]: 0.9, 0: 0.1},
            {ID["a"]: 0.6, ID["e"]: 0.4},
            {0: 1.0},
        ]
    )
    assert _text(greedy_ids(lp, 0)) == "of tha"
    assert _search(lp, {"on", "the", "off"}) == "on the"


def test_double_letters_need_a_blank_between() -> None:
    with_blank = _lp([{ID["t"]: 1.0}, {ID["o"]: 1.0}, {0: 1.0}, {ID["o"]: 1.0}])
    without = _lp([{ID["t"]: 1.0}, {ID["o"]: 1.0}, {ID["o"]: 1.0}, {0: 1.0}])
    assert _search(with_blank, {"too", "to"}) == "too"
    assert _search(without, {"too", "to"}) == "to"


def test_the_language_model_picks_the_likelier_sentence(tmp_path: Path) -> None:
    arpa = tmp_path / "lm.arpa"
    arpa.write_text(TRIGRAM)
    lm = NgramLM.from_arpa(arpa, weight=1.0, word_bonus=0.0)
    # acoustics slightly prefer "too go"; "to go" wins once the LM counts
    lp = _lp(
        [
            {ID["t"]: 1.0},
            {ID["o"]: 1.0},
            {0: 1.0},
            {ID["o"]: 0.7, 0: 0.3},
            {ID["|"]: 1.0},
            {ID["g"]: 1.0},
            {ID["o"]: 1.0},
            {0: 1.0},
        ]
    )
    assert _search(lp, {"to", "too", "go"}) == "too go"
    assert _search(lp, {"to", "too", "go"}, lm=lm) == "to go"


def _exhaustive_best(lp: np.ndarray, words: set[str], max_words: int = 2) -> str:
    """The most probable lexicon sentence by summing every CTC alignment (forward algorithm)."""

    def ctc_logp(labels: list[int]) -> float:
        ext = [0]
        for label in labels:
            ext += [label, 0]
        alpha = np.full(len(ext), -np.inf)
        alpha[0] = lp[0, ext[0]]
        if len(ext) > 1:
            alpha[1] = lp[0, ext[1]]
        for t in range(1, len(lp)):
            new = np.full(len(ext), -np.inf)
            for s in range(len(ext)):
                terms = [alpha[s]] + ([alpha[s - 1]] if s >= 1 else [])
                if s >= 2 and ext[s] != 0 and ext[s] != ext[s - 2]:
                    terms.append(alpha[s - 2])
                new[s] = np.logaddexp.reduce(terms) + lp[t, ext[s]]
            alpha = new
        return float(np.logaddexp(alpha[-1], alpha[-2]) if len(ext) > 1 else alpha[-1])

    best, best_text = -np.inf, ""
    for n in range(1, max_words + 1):
        for combo in itertools.product(sorted(words), repeat=n):
            for trailing in (False, True):
                text = "|".join(combo) + ("|" if trailing else "")
                score = ctc_logp([ID[c] for c in text])
                if score > best:
                    best, best_text = score, " ".join(combo)
    return best_text


def test_a_wide_beam_finds_the_exhaustive_optimum() -> None:
    rng = np.random.default_rng(7)
    words = {"on", "no", "to", "too", "go", "do"}
    letters = [ID[c] for c in "ontgd|"]
    for _ in range(5):
        logits = rng.normal(0, 1.5, (7, len(TOKENS))).astype(np.float32)
        mask = np.full(len(TOKENS), -30.0, np.float32)
        mask[[0, *letters]] = 0.0
        lp = logits + mask
        lp = lp - np.logaddexp.reduce(lp, axis=1, keepdims=True)
        assert _search(lp, words, beam=200) == _exhaustive_best(lp, words)


def test_incremental_equals_whole_and_stable_prefix_never_changes() -> None:
    rng = np.random.default_rng(3)
    sentence = "set|the|light|to|forty|percent"
    words = {"set", "the", "light", "to", "forty", "percent", "fifty", "sit", "tea"}
    rows = []
    for ch in sentence:  # a noisy, blank-padded alignment of the sentence
        rows += [{ID[ch]: 0.7, ID[rng.choice(list("aeiost"))]: 0.2, 0: 0.1}, {0: 0.8, ID[ch]: 0.2}]
    lp = _lp(rows)
    whole = _search(lp, words)
    d = LexiconBeamDecoder(TOKENS, 0, ID["|"], Lexicon.of(words))
    stable_seen: tuple[int, ...] = ()
    for i in range(0, len(lp), 3):
        d.advance(lp[i : i + 3])
        stable = d.stable_ids
        assert stable[: len(stable_seen)] == stable_seen, "a stable prefix changed"
        assert d.ids[: len(stable)] == stable
        stable_seen = stable
    d.finish()
    assert _text(d.ids) == whole == "set the light to forty percent"
    assert d.ids[: len(stable_seen)] == stable_seen


BIGRAM = """\\data\\
ngram 1=7
ngram 2=6

\\1-grams:
-99\t<s>\t-0.3
-1.0\tset\t-0.3
-1.0\tsit\t-0.3
-1.0\tthe\t-0.3
-1.0\tlight\t-0.3
-1.0\t</s>\t0
-3.0\t<unk>

\\2-grams:
-0.3\t<s> set
-0.3\t<s> sit
-0.2\tset the
-0.2\tsit the
-0.1\tthe light
-0.1\tlight </s>

\\end\\
"""


def _set_the_light() -> tuple[np.ndarray, list[int]]:
    """ "set the light" where the second letter is 0.6 "e" / 0.4 "i": "sit the light" stays 0.4 nats behind
    for good (everything after adds the same to both); and the frame after each word's delimiter."""
    rows: list[dict[int, float]] = [{ID["s"]: 0.9, 0: 0.1}, {ID["e"]: 0.6, ID["i"]: 0.4}]
    ends = []
    for ch in "t|the|light|":
        rows += [{ID[ch]: 0.9, 0: 0.1}, {0: 0.9, ID[ch]: 0.1}]
        if ch == "|":
            ends.append(len(rows))
    return _lp(rows), ends


@pytest.mark.parametrize("with_lm", [False, True])
def test_a_word_heard_less_likely_in_every_way_does_not_hold_back_the_stable_words(tmp_path, with_lm) -> None:
    """A hypothesis in the same state as a likelier one (last label, word being spelled, the words the LM
    scores the next after) can never win: it leaves the beam, and the words it disagreed on become stable
    as the utterance goes on, not at its end. Here "sit ..." would hold a place in a beam of 3 for good."""
    lp, (_, second, third) = _set_the_light()
    words = {"set", "sit", "the", "light"}
    lm = None
    if with_lm:
        (tmp_path / "lm.arpa").write_text(BIGRAM)
        lm = NgramLM.from_arpa(tmp_path / "lm.arpa", 0.8, 1.0)
    d = LexiconBeamDecoder(TOKENS, 0, ID["|"], Lexicon.of(words), beam=3, lm=lm)
    d.advance(lp[:second])
    # the LM scores a word after the one before it: "sit the" (not yet past its delimiter) is in another
    # state than "set the" until "the" ends in both
    assert _text(d.stable_ids) == ("" if with_lm else "set")
    d.advance(lp[second:third])
    assert _text(d.stable_ids) == "set the"
    d.finish()
    assert _text(d.ids) == "set the light"
    if not with_lm:
        assert _exhaustive_best(lp, words, max_words=3) == "set the light"


def test_no_lexicon_path_falls_back_to_greedy() -> None:
    lp = _lp([{ID["x"]: 1.0}, {ID["y"]: 1.0}, {0: 1.0}])
    assert _search(lp, {"on"}) == "xy"


def test_factory_resolves_auto_from_the_folder(tmp_path: Path) -> None:
    vocab = CtcVocab(TOKENS, 0, "|")
    assert decoder_factory("auto", vocab, tmp_path, {})[0] == "greedy"
    with pytest.raises(ModelError, match=r"no lexicon\.txt"):
        decoder_factory("lexicon", vocab, tmp_path, {})
    (tmp_path / "lexicon.txt").write_text("# words\non\nthe\n")
    kind, new = decoder_factory("auto", vocab, tmp_path, {})
    assert kind == "lexicon" and isinstance(new(), LexiconBeamDecoder)
    with pytest.raises(ModelError, match=r"no lm\.arpa"):
        decoder_factory("lm", vocab, tmp_path, {})
    (tmp_path / "lm.arpa").write_text(TRIGRAM)
    kind, new = decoder_factory("auto", vocab, tmp_path, {"lm_weight": 0.4, "lm_beam": 5})
    d = new()
    assert kind == "lm" and d.lm.weight == 0.4 and d.beam == 5
    with pytest.raises(ModelError, match="unknown CTC decoder"):
        decoder_factory("viterbi", vocab, tmp_path, {})

"""CTC greedy and prefix beam decoding, including chunked = whole."""

from __future__ import annotations

import json

import numpy as np
import pytest

from edge_agent.models.ctc_decode import CtcVocab, GreedyDecoder, PrefixBeamDecoder, greedy_ids, log_softmax

B = 0  # blank


def onehot_frames(ids, vocab=5, p=0.9):
    lp = np.full((len(ids), vocab), np.log((1 - p) / (vocab - 1)), np.float32)
    lp[np.arange(len(ids)), ids] = np.log(p)
    return lp


@pytest.mark.parametrize(
    "frames, expected",
    [
        ([B, 1, 1, B, 1, 2, 2, B], (1, 1, 2)),  # repeats merge, a blank separates
        ([1, 1, 1], (1,)),
        ([B, B, B], ()),
        ([2, B, 2, 3, B, 3, 3], (2, 2, 3, 3)),
    ],
)
def test_greedy_collapse(frames, expected):
    assert greedy_ids(onehot_frames(frames), B) == expected
    beam = PrefixBeamDecoder(B, beam_width=4)
    beam.advance(onehot_frames(frames))
    assert beam.ids == expected  # peaked frames: beam search agrees with greedy


def test_beam_search_beats_greedy_where_paths_add_up():
    # Greedy picks blank at both frames (0.4 each) → "". But "1" has paths 1-1, 1-B, B-1:
    # 0.35*0.35 + 0.35*0.4 + 0.4*0.35 = 0.4025 > P("") = 0.16.
    p = np.array([[0.4, 0.35, 0.25], [0.4, 0.35, 0.25]], np.float32)
    lp = np.log(p)
    assert greedy_ids(lp, B) == ()
    beam = PrefixBeamDecoder(B, beam_width=4)
    beam.advance(lp)
    assert beam.ids == (1,)
    (best, score), *_ = beam.nbest()
    assert best == (1,) and np.exp(score) == pytest.approx(0.4025, rel=1e-4)


@pytest.mark.parametrize("decoder", [lambda: GreedyDecoder(B), lambda: PrefixBeamDecoder(B, beam_width=6)])
def test_chunked_equals_whole(decoder):
    lp = log_softmax(np.random.default_rng(0).standard_normal((97, 7)).astype(np.float32) * 3)
    whole = decoder()
    whole.advance(lp)
    chunked = decoder()
    for i in range(0, 97, 13):
        chunked.advance(lp[i : i + 13])
    assert chunked.ids == whole.ids and len(whole.ids) > 5


def test_vocab_text_uses_the_word_delimiter_and_drops_specials(tmp_path):
    tokens = ["<pad>", "<s>", "</s>", "<unk>", "|", "H", "I", "'"]
    (tmp_path / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(tokens)}))
    vocab = CtcVocab.from_folder(tmp_path, {})
    assert vocab.blank_id == 0 and vocab.word_delimiter == "|"
    assert vocab.text([4, 5, 6, 4, 4, 1, 6, 7, 5, 3, 4]) == "HI I'H"


def test_log_softmax_normalises():
    lp = log_softmax(np.array([[1.0, 2.0, 3.0], [1000.0, 0.0, -1000.0]]))
    np.testing.assert_allclose(np.exp(lp).sum(-1), 1.0, rtol=1e-6)
    assert np.isfinite(lp[1, :2]).all()


def _ctc_prob(lp: np.ndarray, label: tuple[int, ...]) -> float:
    """P(label | frames) by brute force over every frame path (tiny T only)."""
    import itertools

    total = 0.0
    for path in itertools.product(range(lp.shape[1]), repeat=lp.shape[0]):
        collapsed = [t for i, t in enumerate(path) if t != B and (i == 0 or t != path[i - 1])]
        if tuple(collapsed) == label:
            total += float(np.exp(sum(lp[i, t] for i, t in enumerate(path))))
    return total


@pytest.mark.parametrize("seed", range(6))
def test_wide_beam_finds_the_most_probable_labelling(seed):
    import itertools

    rng = np.random.default_rng(seed)
    lp = log_softmax(rng.standard_normal((4, 3)).astype(np.float32) * 1.5).astype(np.float64)
    labels = [()] + [seq for n in range(1, 5) for seq in itertools.product((1, 2), repeat=n)]
    probs = {lab: _ctc_prob(lp, lab) for lab in labels}
    assert sum(probs.values()) == pytest.approx(1.0, rel=1e-6)
    beam = PrefixBeamDecoder(B, beam_width=64, prune_top_k=3, prune_log_p=-1e9)
    beam.advance(lp)
    best = max(probs, key=probs.get)
    assert beam.ids == best
    assert np.exp(beam.nbest()[0][1]) == pytest.approx(probs[best], rel=1e-5)

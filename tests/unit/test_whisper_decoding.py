"""The decode's guards: where a runaway repetition is cut, and "nothing heard" judged without the context.

``repeat_cut`` is checked on sequences built by hand (its rules are the spec); the no-speech judgement on
demo-whisper against the probability computed here from the decoder's own logits on a lone
``<|startoftranscript|>``, with the threshold set just above and just below it.
"""

from __future__ import annotations

import numpy as np
import pytest

from edge_agent.models import whisper_decoding
from edge_agent.models.whisper_decoding import repeat_cut


@pytest.mark.parametrize(
    "out, start, want",
    [
        ([], 0, None),
        ([1, 2, 3, 4, 5, 6, 7], 0, None),
        ([1, 2, 3, 4, 5, 1, 2, 3, 4, 5], 0, 5),  # a phrase of 5 said twice: the second copy goes
        ([9, 1, 2, 3, 4, 1, 2, 3, 4], 0, 5),  # a block of 4 twice at the end, after other words
        ([1, 2, 3, 4, 5, 6, 1, 2, 3, 4], 0, 6),  # starts over: its last 4 tokens are its first 4
        ([7, 8, 9, 7, 8, 9], 0, None),  # a block of 3 twice ("set a timer set a timer"): kept
        ([7, 8, 9] * 3, 0, None),
        ([7, 8, 9] * 4, 0, 3),  # four times: a loop
        ([6, 8] * 3, 0, None),
        ([5, 6, 8, 6, 8, 6, 8, 6, 8], 0, 3),  # ", bathroom" four times after "5"
        ([5] * 5, 0, None),
        ([4, 5, 5, 5, 5, 5, 5], 0, 2),  # one token six times
        ([1, 2, 3, 4, 1, 2, 3, 4], 6, None),  # never cut into the forced tokens
        ([1, 2, 3, 4, 1, 2, 3, 4], 4, 4),
    ],
)
def test_repeat_cut(out, start, want):
    assert repeat_cut(out, start) == want


def test_a_long_tail_is_judged_on_its_blocks_only():
    words = list(range(100, 160))  # 60 distinct tokens, then a block of 5 repeated
    assert repeat_cut([*words, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5], 0) == 65
    assert repeat_cut([*words, *range(40)], 0) is None


@pytest.fixture(scope="module")
def whisper(tmp_path_factory):
    from edge_agent.backends import SessionOptions
    from edge_agent.models.asr import open_recognizer
    from edge_agent.models.catalog import resolve_model

    engine = open_recognizer(
        resolve_model("demo-whisper", tmp_path_factory.mktemp("models")), "onnxruntime", SessionOptions(threads=1)
    )
    yield engine
    engine.close()


def _p_no_speech(whisper, hidden) -> float:
    logits = whisper.decoder.run({"input_ids": np.array([[whisper.sot]], np.int64), "encoder_hidden_states": hidden})[
        "logits"
    ][0, -1].astype(np.float64)
    p = np.exp(logits - logits.max())
    return float(p[whisper.no_speech_id] / p.sum())


def test_nothing_heard_is_judged_without_the_context_and_only_where_nothing_is_forced(whisper, monkeypatch):
    x = np.random.default_rng(5).standard_normal(24000).astype(np.float32) * 0.1
    hidden = whisper.encode([x])
    p = _p_no_speech(whisper, hidden)
    context = whisper.context_ids("kitchen light")
    prompt = whisper.prompt("en", context)
    plain = whisper.decode(hidden, [prompt], [[]], [12])[0]
    assert plain  # the random model says something
    monkeypatch.setattr(whisper_decoding, "NO_SPEECH", p * 1.01)  # above the model's: heard
    heard = whisper.decode(hidden, [prompt], [[]], [12], guard=True)[0]
    assert heard and heard == plain[: len(heard)]  # greedy's, a repetition cut off at most
    assert heard == whisper.decode(hidden, [prompt], [[]], [12], guard=True, drafts=[plain])[0]
    monkeypatch.setattr(whisper_decoding, "NO_SPEECH", p * 0.99)  # at or below: nothing heard
    assert whisper.decode(hidden, [prompt], [[]], [12], guard=True)[0] == []
    assert whisper.decode(hidden, [prompt], [[]], [12], guard=True, drafts=[heard])[0] == []
    assert whisper.decode(hidden, [prompt], [[]], [12], guard=False)[0] == plain  # plain greedy judges nothing
    forced = plain[:2]
    assert whisper.decode(hidden, [prompt], [forced], [12], guard=True)[0][:2] == forced  # commits: speech heard
    # in a batch, the silent row gives nothing and the other its own decode
    both = whisper.decode(np.concatenate([hidden, hidden]), [prompt, prompt], [[], forced], [12, 12], guard=True)
    assert both[0] == [] and both[1] == whisper.decode(hidden, [prompt], [forced], [12], guard=True)[0]


def test_a_stream_and_transcribe_say_nothing_heard_alike(whisper, monkeypatch):
    x = np.random.default_rng(6).standard_normal(20000).astype(np.float32) * 0.1
    monkeypatch.setattr(whisper_decoding, "NO_SPEECH", 0.0)  # everything is "no speech"
    assert whisper.transcribe(x).token_ids == () and whisper.transcribe(x).text == ""
    s = whisper.new_stream()
    s.add_audio(x)
    s.end()
    (final,) = whisper.step([s])
    assert final.final and final.text == "" and final.token_ids == ()

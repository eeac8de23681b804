"""A streamed Whisper final is the one pass over the same audio and window (``transcribe``), whatever the
partials committed; partial commits only grow; a final with no audio since the last pass over its window
decodes on that pass's encoder states (and, when that pass forced nothing, is its text without a model call).

On a tiny random Whisper imported from CTranslate2's format (the imported graphs take short windows, as
Whisper base's do), and on the real Whisper base (slow) with spoken sentences.
"""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest

from edge_agent.importers import import_model
from edge_agent.models.asr import open_recognizer
from edge_agent.models.catalog import inspect_folder
from tests import ct2_whisper_tiny as tiny

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")
BLOCK = 1600  # 100 ms


class _Counting:
    """A session proxy counting its runs."""

    def __init__(self, session) -> None:
        self.session, self.runs = session, 0

    def __getattr__(self, name):
        return getattr(self.session, name)

    def run(self, feeds, outputs=None):
        self.runs += 1
        return self.session.run(feeds, outputs) if outputs is not None else self.session.run(feeds)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("ct2-finals")
    tiny.write_folder(root / "src", "float32")
    return import_model(root / "src", None, root / "cache").path


@pytest.fixture(scope="module")
def engines(folder):
    made = {}

    def get(**kw):
        key = tuple(sorted(kw.items()))
        if key not in made:
            made[key] = open_recognizer(inspect_folder(folder), "onnxruntime", **kw)
        return made[key]

    yield get
    for e in made.values():
        e.close()


def _audio(seed: int, seconds: float) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(16000 * seconds)) / 16000
    tone = np.sin(2 * np.pi * (150 + 100 * rng.random()) * t) * (0.5 + 0.5 * np.sin(2 * np.pi * 3 * t))
    return (0.2 * tone + 0.05 * rng.standard_normal(t.size)).astype(np.float32)


def _stream(engine, x, block=BLOCK, context=""):
    s = engine.new_stream()
    s.context = engine.context_ids(context)
    partials = []
    for i in range(0, x.size, block):
        s.add_audio(x[i : i + block])
        h = engine.step([s])[0]
        if h is not None:
            partials.append(h)
    committed = list(s.agreement.committed)
    s.end()
    final = engine.step([s])[0]
    assert final is not None and final.final and s.finished
    return partials, final, committed


@pytest.mark.parametrize("language", ["en", "auto"])
@pytest.mark.parametrize("padding", [0.0, 2.0])
def test_a_final_is_the_one_pass_of_its_window_and_partial_commits_only_grow(engines, language, padding):
    engine = engines(language=language, final_padding_s=padding, max_tokens_per_s=4.0)
    assert engine.short_context
    for n in (8000, 40000):  # with a final window, partials take the same one (30 s finals: partials audio + 6 s)
        frames = 2 * int(np.ceil((n / 16000 + (padding or 6.0)) / 1.0)) * 50
        assert engine.context_frames(n, False) == frames
        assert engine.context_frames(n, True) == (frames if padding else 3000)
    revised = 0
    for seed in range(4):
        x = _audio(seed, 2.3 + 0.4 * seed)
        partials, final, committed = _stream(engine, x, context="kitchen light" if seed % 2 else "")
        stable = [p.stable_text for p in partials]
        assert len(partials) >= 3 and all(b.startswith(a) for a, b in pairwise(stable)), "a partial commit changed"
        one_pass = engine.transcribe(x, context="kitchen light" if seed % 2 else "")
        assert final.token_ids == one_pass.token_ids and final.text == final.stable_text == one_pass.text
        revised += list(final.token_ids[: len(committed)]) != committed
    if padding == 0:  # partials over short windows, a final over 30 s: the random model hears them otherwise
        assert revised > 0


def test_batched_finals_and_partials_equal_each_stream_alone(engines):
    engine = engines(final_padding_s=2.0, max_tokens_per_s=4.0)
    xs = [_audio(10 + k, 2.0 + 0.7 * k) for k in range(3)]
    alone = [_stream(engine, x)[1].token_ids for x in xs]
    streams = [engine.new_stream() for _ in xs]
    finals: list = [None] * len(xs)
    for i in range(0, max(x.size for x in xs) + BLOCK, BLOCK):
        for s, x in zip(streams, xs):
            if not s.ended:
                piece = x[i : i + BLOCK]
                s.add_audio(piece) if piece.size else s.end()
        for k, h in enumerate(engine.step(streams)):
            if h is not None and h.final:
                finals[k] = h.token_ids
    assert finals == alone


def test_a_final_with_no_audio_since_the_last_pass_reuses_its_encoder_states(engines, monkeypatch):
    # the partials' window is the audio and 6 s: a final with the same padding has the same window
    engine = engines(final_padding_s=6.0, max_tokens_per_s=4.0)
    x = _audio(20, 2.0)
    encoder, decoder = _Counting(engine.encoder), _Counting(engine.decoder)
    monkeypatch.setattr(engine, "encoder", encoder)
    monkeypatch.setattr(engine, "decoder", decoder)

    # one pass, nothing forced (nothing committed yet): the final is that pass, no model call at all
    s = engine.new_stream()
    s.add_audio(x)
    engine.step([s])
    assert s.unforced and encoder.runs == 1
    s.end()
    runs = encoder.runs, decoder.runs
    (final,) = engine.step([s])
    assert (encoder.runs, decoder.runs) == runs
    assert final.final and final.token_ids == engine.transcribe(x).token_ids

    # passes forced by commits, then the end with no new audio: a decode on the kept states, no encoder pass
    s = engine.new_stream()
    for part in np.array_split(x, 4):
        s.add_audio(part)
        engine.step([s])
    assert s.agreement.committed and not s.unforced and s.hidden is not None
    s.end()
    runs = encoder.runs, decoder.runs
    (final,) = engine.step([s])
    assert encoder.runs == runs[0] and decoder.runs == runs[1] + 1
    assert final.token_ids == engine.transcribe(x).token_ids

    # new audio since: the final encodes again
    s = engine.new_stream()
    s.add_audio(x[:16000])
    engine.step([s])
    s.add_audio(x[16000:])
    s.end()
    runs = encoder.runs
    (final,) = engine.step([s])
    assert encoder.runs == runs + 1 and final.token_ids == engine.transcribe(x).token_ids


def test_a_fork_with_nothing_pending_takes_the_last_pass_and_its_final_is_the_one_pass(engines, monkeypatch):
    engine = engines(final_padding_s=6.0, max_tokens_per_s=4.0)
    x = _audio(30, 2.5)
    s = engine.new_stream()
    for part in np.array_split(x, 3):
        s.add_audio(part)
        engine.step([s])
    twin = s.fork()
    assert twin.hidden is s.hidden and twin.draft == s.last_ids
    encoder = _Counting(engine.encoder)
    monkeypatch.setattr(engine, "encoder", encoder)
    twin.end()
    (final,) = engine.step([twin])
    assert encoder.runs == 0 and final.final and final.token_ids == engine.transcribe(x).token_ids
    s.add_audio(x[:800])  # the stream goes on: its fork was a copy
    pending = s.fork()
    assert pending.hidden is None


class _StopsAt:
    """A session proxy that stops the engine's step (``interrupt``, as another thread would) at its ``at``-th run."""

    def __init__(self, session, engine, at: int) -> None:
        self.session, self.engine, self.at, self.runs = session, engine, at, 0

    def __getattr__(self, name):
        return getattr(self.session, name)

    def run(self, feeds, outputs=None):
        self.runs += 1
        if self.runs == self.at:
            self.engine.interrupt()
        return self.session.run(feeds, outputs) if outputs is not None else self.session.run(feeds)


@pytest.mark.parametrize("where", ["encoder", "decoder"])
def test_a_step_stopped_midway_loses_nothing(engines, monkeypatch, where):
    """A partial step interrupted in its encoder or its decoder raises ``Interrupted``; after ``resume`` the
    stream's next partial and its final are those of a stream whose steps were never stopped."""
    from edge_agent.errors import Interrupted

    engine = engines(final_padding_s=6.0, max_tokens_per_s=4.0)
    assert engine.interruptible
    x = _audio(40, 2.4)
    half = x.size // 2
    plain = engine.new_stream()
    plain.add_audio(x[:half])
    engine.step([plain])
    plain.add_audio(x[half:])
    expected_partial = engine.step([plain])[0]
    plain.end()
    expected_final = engine.step([plain])[0]

    s = engine.new_stream()
    s.add_audio(x[:half])
    engine.step([s])
    s.add_audio(x[half:])
    monkeypatch.setattr(engine, where, _StopsAt(getattr(engine, where), engine, 1))
    with pytest.raises(Interrupted):
        engine.step([s])
    engine.resume()
    partial = engine.step([s])[0]
    assert partial.token_ids == expected_partial.token_ids and partial.stable_text == expected_partial.stable_text
    s.end()
    final = engine.step([s])[0]
    assert final.final and final.token_ids == expected_final.token_ids


@pytest.mark.slow
def test_whisper_base_streamed_finals_equal_its_one_pass_on_spoken_sentences(tmp_path):
    import soundfile as sf

    from tests import whisper_base

    ref = inspect_folder(whisper_base.imported_folder(tmp_path))
    speech = whisper_base.speech_set(tmp_path, whisper_base.SENTENCES[:5])
    engine = open_recognizer(ref, "onnxruntime", language="en", final_padding_s=6.0)
    try:
        for wav, text in speech:
            x = sf.read(str(wav), dtype="float32")[0]
            partials, final, _ = _stream(engine, x, context="kitchen, living room, timer")
            stable = [p.stable_text for p in partials]
            assert all(b.startswith(a) for a, b in pairwise(stable)), text
            one_pass = engine.transcribe(x, context="kitchen, living room, timer")
            assert final.token_ids == one_pass.token_ids, (text, final.text, one_pass.text)
    finally:
        engine.close()

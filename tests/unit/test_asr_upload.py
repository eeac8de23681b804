"""An upload's utterance times, segments, language and errors (``serving/asr/upload.py``).

The recorded spans are checked against a plain ``Endpointer``'s own events on the same audio; the
segments against the spans and finals they are built from."""

from __future__ import annotations

import tempfile
from types import SimpleNamespace

import numpy as np
import pytest

from edge_agent.audio.vad import EndpointConfig, Endpointer, EnergyVAD, SpeechEnd, SpeechStart
from edge_agent.errors import EdgeAgentError, InputError, Overloaded
from edge_agent.serving.asr.service import AsrEvent, UtteranceMetrics
from edge_agent.serving.asr.upload import (
    DEFAULT_LANGUAGE,
    Failures,
    TimedEndpointer,
    check_language,
    check_model,
    model_language,
    read_upload,
    segments,
)

RATE = 16000


def bursts(spec: list[tuple[float, bool]]) -> np.ndarray:
    """Concatenated spans of a 300 Hz tone (True) or silence (False), ``(seconds, voiced)`` each."""
    rng = np.random.default_rng(0)
    parts = []
    for seconds, voiced in spec:
        n = int(seconds * RATE)
        t = np.arange(n) / RATE
        parts.append(0.3 * np.sin(2 * np.pi * 300 * t) if voiced else 1e-5 * rng.standard_normal(n))
    return np.concatenate(parts).astype(np.float32)


@pytest.mark.parametrize("block", [160, 1000, 16000])
def test_timed_endpointer_spans_are_the_endpointers_own_events(block):
    audio = bursts([(0.5, False), (0.8, True), (1.0, False), (0.3, True), (0.05, False), (0.4, True), (0.2, False)])
    config = EndpointConfig(min_speech_ms=100, trailing_silence_ms=500, pre_roll_ms=200)
    plain = Endpointer(EnergyVAD(), config, RATE)
    timed = TimedEndpointer(Endpointer(EnergyVAD(), config, RATE))
    events = []
    for i in range(0, audio.size, block):
        got, want = timed.push(audio[i : i + block]), plain.push(audio[i : i + block])
        assert [type(e) for e in got] == [type(e) for e in want]  # it passes the events on unchanged
        events += want
    got, want = timed.flush(), plain.flush()
    assert [type(e) for e in got] == [type(e) for e in want]
    events += want
    starts = [e.at_s for e in events if isinstance(e, SpeechStart)]
    ends = [e.speech_end_s for e in events if isinstance(e, SpeechEnd)]
    assert len(starts) == 2  # the short pause inside the second burst does not end it
    assert timed.spans == list(zip(starts, ends))
    assert timed.rate == RATE and timed.config == config


def final(utterance: int, text: str, onset_s: float, audio_s: float) -> AsrEvent:
    m = UtteranceMetrics(12.0, 34.567, 0.01234, audio_s, 5.0, "silence")
    return AsrEvent("final", 0, utterance, text, text, onset_s + audio_s, 0.0, m)


def test_segments_follow_utterance_order_and_skip_empty_finals():
    finals = [final(2, "third", 4.0, 1.0), final(0, "first", 0.5, 1.0), final(1, "  ", 2.0, 0.5)]
    spans = [(0.52, 1.3), (2.1, 2.4), (4.2, 4.9)]
    got = segments(finals, spans, duration_s=6.0)
    assert [(s["id"], s["utterance"], s["text"]) for s in got] == [(0, 0, "first"), (1, 2, "third")]
    assert [(s["start"], s["end"]) for s in got] == [(0.52, 1.3), (4.2, 4.9)]
    assert all(s["kind"] == "final" for s in got)
    assert got[0]["final_ms"] == 34.57 and got[0]["rtf"] == 0.0123 and got[0]["first_partial_ms"] == 12.0


def test_segments_stay_inside_the_file_and_fall_back_to_the_finals_timing():
    # a span past the end of the file is clipped; an utterance the endpointer did not record (none
    # here) is timed from its final: onset = audio_s - the audio it covered
    got = segments([final(0, "a", 1.0, 2.0), final(1, "b", 3.5, 1.0)], [(1.0, 9.0)], duration_s=4.0)
    assert [(s["start"], s["end"]) for s in got] == [(1.0, 4.0), (3.5, 4.0)]


def test_model_language_from_the_recogniser_then_its_folder_then_the_default():
    assert model_language(SimpleNamespace(language="de")) == "de"
    assert model_language(SimpleNamespace(language="auto")) == "auto"
    assert model_language(SimpleNamespace(ref=SimpleNamespace(config={"language": "fr"}))) == "fr"
    assert model_language(SimpleNamespace(ref=SimpleNamespace(config={}))) == DEFAULT_LANGUAGE == "en"
    assert model_language(object()) == "en"


def test_language_and_model_checks_name_their_field():
    check_language(None, "en", "ctc")
    check_language("EN", "en", "ctc")
    with pytest.raises(InputError, match="transcribes 'en' only") as err:
        check_language("fr", "en", "ctc")
    assert getattr(err.value, "param", None) == "language"
    with pytest.raises(InputError, match="detects the language"):
        check_language("en", "auto", "whisper")
    check_model(None, ["edge-agent", "ctc"])
    check_model("ctc", ["edge-agent", "ctc"])
    with pytest.raises(InputError, match="edge-agent, ctc") as err:
        check_model("whisper-1", ["edge-agent", "ctc"])
    assert getattr(err.value, "param", None) == "model"


@pytest.mark.parametrize("data", [b"not audio at all", b"RIFF\x24\x00\x00\x00WAVEfmt "])
def test_an_unreadable_upload_names_the_clients_file_not_a_server_path(data):
    with pytest.raises(InputError) as err:
        read_upload(data, "meeting.wav", RATE)
    assert str(err.value).startswith("meeting.wav: ") and tempfile.gettempdir() not in str(err.value)
    assert getattr(err.value, "param", None) == "file"


def test_failures_pass_events_on_and_fail_the_upload_on_the_first_error():
    seen: list[AsrEvent] = []
    failures = Failures(seen.append)
    failures(AsrEvent("speech_start", 0, 0))
    failures.raise_any([(0.5, 1.0)], "a.wav")  # no error: nothing raised
    failures(AsrEvent("error", 0, 0, error="queue full", code="overloaded"))
    failures(AsrEvent("error", 0, 1, error="boom", code="failed"))
    assert len(seen) == 3
    with pytest.raises(Overloaded, match=r"a.wav: utterance 0 \(from 0.50 s\) could not be transcribed: queue full"):
        failures.raise_any([(0.5, 1.0)], "a.wav")
    failed = Failures(seen.append)
    failed(AsrEvent("error", 0, 3, error="boom", code="failed"))
    with pytest.raises(EdgeAgentError, match="utterance 3 could not") as err:
        failed.raise_any([], "b.flac")
    assert not isinstance(err.value, Overloaded)

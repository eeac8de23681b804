"""Audio and the end of a stream that arrive while its recogniser step is running.

A step takes the audio a stream has gathered, then decodes it; meanwhile the stream's owner may
feed more audio and close it (``end()``). That step must not make the final out of the audio it
took: the final comes from the next step, which takes the rest. Here the step is held inside the
engine, right after its ``take()``, on an ``Event`` while the test feeds the rest and closes; the
final must then cover every sample and equal the whole-utterance pass.
"""

from __future__ import annotations

import threading

import pytest

from edge_agent.models.asr import open_recognizer
from edge_agent.models.catalog import resolve_model
from edge_agent.serving.asr.batcher import BatchLimits
from edge_agent.serving.asr.service import AsrService
from tests.speech import speech_samples

RATE = 16000


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    cache = tmp_path_factory.mktemp("models")
    made = {}

    def get(name):
        if name not in made:
            made[name] = open_recognizer(resolve_model(name, cache), "onnxruntime")
        return made[name]

    yield get
    for e in made.values():
        e.close()


class HeldStep:
    """Wraps one stream's ``take`` so that its ``hold``-th call blocks (after taking) until released."""

    def __init__(self, stream, hold: int) -> None:
        self.taken, self.release = threading.Event(), threading.Event()
        self.calls, self.hold = 0, hold
        self._take = stream.take
        stream.take = self.take

    def take(self):
        out = self._take()
        self.calls += 1
        if self.calls == self.hold:
            self.taken.set()
            assert self.release.wait(30), "the test never released the step"
        return out


@pytest.mark.parametrize("name", ["demo-asr", "demo-ctc", pytest.param("demo-whisper", marks=pytest.mark.slow)])
def test_engine_step_does_not_end_a_stream_on_audio_it_never_took(engines, name):
    engine = engines(name)
    x = speech_samples("turn on the kitchen lights")
    half = len(x) // 2
    s = engine.new_stream()
    s.add_audio(x[:half])
    held = HeldStep(s, hold=1)

    def owner():  # the feeder: the rest of the audio and the end arrive while the step runs
        assert held.taken.wait(30)
        s.add_audio(x[half:])
        s.end()
        held.release.set()

    t = threading.Thread(target=owner, daemon=True)
    t.start()
    first = engine.step([s])[0]
    t.join(30)
    assert first is None or not first.final, "the final was made before the rest of the audio was taken"
    final = engine.step([s])[0]
    assert final is not None and final.final and s.finished
    assert final.audio_s == pytest.approx(len(x) / RATE)
    if name != "demo-whisper":  # CTC: the streamed final is the whole-utterance pass, token for token
        assert final.token_ids == engine.transcribe(x).token_ids


def test_service_final_includes_audio_fed_and_closed_during_a_running_step(engines):
    engine = engines("demo-asr")
    x = speech_samples("turn on the kitchen lights")
    half = len(x) // 2
    finals = []
    with AsrService(engine, limits=BatchLimits(max_batch=4, batch_timeout_ms=0)) as svc:
        h = svc.open_stream(vad=False)
        held: list[HeldStep] = []
        orig_new_stream = engine.new_stream

        def new_stream():
            s = orig_new_stream()
            held.append(HeldStep(s, hold=1))
            return s

        engine.new_stream = new_stream  # type: ignore[method-assign]
        try:
            h.feed(x[:half])  # >= chunk_ms of audio: the first step is submitted
        finally:
            del engine.new_stream
        (step,) = held
        assert step.taken.wait(30)
        h.feed(x[half:])  # a step is in flight: this audio waits for the next one
        h.close()  # end of speech while the step still runs
        step.release.set()
        assert h.wait(30)
        finals = [(e.text, e.metrics.audio_s) for e in h.finals]
    assert [e.kind for e in h.finals] == ["final"]
    assert finals == [(engine.transcribe(x).text, pytest.approx(len(x) / RATE))]

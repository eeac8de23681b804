"""The early first step: an utterance asks for its first recogniser step at the speech start, and a
stateful streaming CTC step also runs the frames left over after its whole chunks, so the first
partial does not wait for a whole chunk. The streamed final text stays equal to the one-pass text
(the engine's own whole-utterance decode, and the evaluation runner's, an independent implementation
of the model contract) for any way the audio is cut into steps."""

from __future__ import annotations

import numpy as np
import pytest

from edge_agent.errors import ModelNotFound
from edge_agent.models.asr import open_recognizer
from edge_agent.models.catalog import inspect_folder, resolve_model
from edge_agent.models.recognizer import AudioStream, Hypothesis
from edge_agent.serving.asr.batcher import BatchLimits
from edge_agent.serving.asr.service import AsrService
from tests.integration.test_asr_stateful import SUB, build_running_sum_model
from tests.speech import speech_samples

SENTENCES = ["turn on the kitchen lights", "what is the weather tomorrow", "set a timer for ten minutes"]


@pytest.fixture(scope="module", params=["greedy", "auto"])
def demo_asr(tmp_path_factory, request):
    try:
        ref = resolve_model("demo-asr", tmp_path_factory.mktemp("models"))
    except ModelNotFound as exc:
        pytest.skip(f"demo-asr is not shipped in this checkout ({exc})")
    e = open_recognizer(ref, "onnxruntime", decoder=request.param)
    yield e
    e.close()


def frames_of(samples: int) -> int:
    """Feature frames of ``samples`` (n_fft 400, hop 160, not centred)."""
    return 0 if samples < 400 else (samples - 400) // 160 + 1


def test_a_step_runs_less_than_a_chunk_in_whole_subsampling_groups(demo_asr):
    e = demo_asr
    x = speech_samples(SENTENCES[0])
    seen: list[int] = []
    s = e.new_stream()
    advance = s.decoder.advance
    s.decoder.advance = lambda lp: (seen.append(len(lp)), advance(lp))
    first = 4800  # 300 ms: what the endpointer hands over at a speech start (pre-roll + onset)
    s.add_audio(x[:first])
    h = e.step([s])[0]
    assert frames_of(first) < e.chunk_frames
    assert h is not None and not h.final  # it ran, though a whole chunk was not there yet
    assert seen == [frames_of(first) // e.subsampling]
    # whole chunks only (the behaviour before): the same audio runs nothing
    e.min_chunk_frames = e.chunk_frames
    try:
        t = e.new_stream()
        t.add_audio(x[:first])
        assert e.step([t]) == [None]
    finally:
        e.min_chunk_frames = e.subsampling


@pytest.mark.parametrize("piece", [480, 1600, 2900, 5120])
def test_streamed_in_small_steps_equals_one_pass(demo_asr, piece):
    from edge_agent.models.asr_streaming_ctc import StreamingCtcRunner

    e = demo_asr
    xs = [speech_samples(t) for t in SENTENCES]
    streams = [e.new_stream() for _ in xs]
    finals: list[str | None] = [None] * len(xs)
    for i in range(0, max(map(len, xs)) + piece, piece):  # all streams batched in every step
        for s, x in zip(streams, xs):
            if not s.ended:
                s.add_audio(x[i : i + piece]) if i < len(x) else s.end()
        for k, h in enumerate(e.step(streams)):
            if h is not None and h.final:
                finals[k] = h.text
    assert finals == [e.transcribe(x).text for x in xs]
    runner = StreamingCtcRunner(e.ref.path)
    try:
        assert finals == [runner.decode(runner.full(x), e.decoder_kind) for x in xs]
    finally:
        runner.close()


def test_running_sum_model_gives_the_same_tokens_for_any_split(tmp_path):
    # the running-sum model makes streamed outputs exactly reasoned: the same tokens however frames are cut
    e = open_recognizer(inspect_folder(build_running_sum_model(tmp_path / "sum")), "onnxruntime")
    try:
        assert e.min_chunk_frames == SUB
        x = speech_samples("open the garage door")
        want = e.transcribe(x).token_ids
        for piece in (170, 333, 1000):
            s = e.new_stream()
            for i in range(0, len(x), piece):
                s.add_audio(x[i : i + piece])
                e.step([s])
            s.end()
            assert e.step([s])[0].token_ids == want
    finally:
        e.close()


class CountingRecognizer:
    """A recogniser that records the audio each step takes and says "x" once it has any."""

    name, kind, sample_rate, max_utterance_s = "counting", "test", 16000, 60.0

    def __init__(self) -> None:
        self.taken: list[int] = []

    def new_stream(self) -> AudioStream:
        return AudioStream(self.sample_rate)

    def step(self, streams):
        out = []
        for s in streams:
            x, ended = s.take()
            self.taken.append(x.size)
            out.append(Hypothesis("x", (1,), ended, audio_s=s.samples_in / self.sample_rate))
        return out

    def transcribe(self, samples):
        return Hypothesis("x", (1,), True)

    def close(self) -> None:
        pass


@pytest.mark.parametrize("first_chunk_ms, want_first", [(0, 1600), (None, 6400)])
def test_the_first_step_is_asked_at_the_speech_start(first_chunk_ms, want_first):
    engine = CountingRecognizer()
    limits = BatchLimits(max_batch=2, batch_timeout_ms=50)
    with AsrService(engine, limits=limits, chunk_ms=320, first_chunk_ms=first_chunk_ms, sla_ms=300) as svc:
        h = svc.open_stream(vad=False)  # no detector: the utterance starts with the first block
        for _ in range(8):  # 8 × 100 ms, each block waited on, as a paced source would be
            h.feed(np.full(1600, 0.1, np.float32))
            assert h.wait_steps(10)
        h.close()
        assert h.wait(10)
    assert engine.taken[0] == want_first  # at once (0), or with the block that completes chunk_ms (None)
    assert len(engine.taken) <= 2 + 8 * 1600 // 5120  # later steps: one per chunk_ms of audio, then the final
    assert sum(engine.taken) == 8 * 1600
    # the first partial's latency was told to the batcher's adaptive wait against the SLA
    assert svc.batcher.wait is not None and svc.batcher.wait.met + svc.batcher.wait.breaches == 1

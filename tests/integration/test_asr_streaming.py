"""Streaming and batched recognition equal single-stream recognition, on espeak-ng speech.

Random-weight demo models give meaningless text; what must hold is that the serving paths
(chunked streaming, several streams batched on one engine, the service with endpointing) give
exactly the tokens the plain single-stream path gives.
"""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest

from edge_agent.models.asr import open_recognizer
from edge_agent.models.catalog import resolve_model
from edge_agent.serving.asr.batcher import BatchLimits
from edge_agent.serving.asr.service import AsrService
from tests.speech import speech_samples, two_utterances

SENTENCES = ["turn on the kitchen lights", "what is the weather like tomorrow", "play some music"]
CHUNK = 5120  # 320 ms


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    cache = tmp_path_factory.mktemp("models")
    made = {}

    def get(name, **kw):
        key = (name, tuple(sorted(kw.items())))
        if key not in made:
            made[key] = open_recognizer(resolve_model(name, cache), "onnxruntime", **kw)
        return made[key]

    yield get
    for e in made.values():
        e.close()


@pytest.fixture(scope="module")
def speech():
    return [speech_samples(s) for s in SENTENCES]


def stream_alone(engine, x, chunk=CHUNK):
    s = engine.new_stream()
    partials = []
    for i in range(0, len(x), chunk):
        s.add_audio(x[i : i + chunk])
        h = engine.step([s])[0]
        if h is not None:
            partials.append(h)
    s.end()
    final = engine.step([s])[0]
    assert final is not None and final.final and s.finished
    return partials, final


def stream_batched(engine, xs, chunk=CHUNK):
    """All streams advance one chunk per step, in one batched step call."""
    streams = [engine.new_stream() for _ in xs]
    partials = [[] for _ in xs]
    finals = [None] * len(xs)
    for i in range(0, max(len(x) for x in xs) + chunk, chunk):
        for s, x in zip(streams, xs):
            if s.ended:
                continue
            piece = x[i : i + chunk]
            if piece.size:
                s.add_audio(piece)
            else:
                s.end()
        for k, h in enumerate(engine.step(streams)):
            if h is not None and h.final:
                finals[k] = h
            elif h is not None:
                partials[k].append(h)
    assert all(f is not None for f in finals)
    return partials, finals


@pytest.mark.slow
@pytest.mark.parametrize("decoder", ["greedy", "beam"])
def test_ctc_streaming_final_equals_one_pass_and_batched_equals_alone(engines, speech, decoder):
    engine = engines("demo-ctc", decoder=decoder)
    alone = [stream_alone(engine, x) for x in speech]
    for x, (partials, final) in zip(speech, alone):
        assert len(partials) >= 3  # a partial per chunk
        assert final.token_ids == engine.transcribe(x).token_ids and final.text
    partials, finals = stream_batched(engine, speech)
    assert [f.token_ids for f in finals] == [a[1].token_ids for a in alone]
    assert [[p.token_ids for p in ps] for ps in partials] == [[p.token_ids for p in a[0]] for a in alone]


@pytest.mark.slow
def test_whisper_streaming_batched_equals_alone_partial_commits_only_grow_and_the_final_is_one_pass(engines, speech):
    engine = engines("demo-whisper")
    speech = speech[:2]  # each step re-encodes a 30 s window: two streams keep this test short
    alone = [stream_alone(engine, x) for x in speech]
    for x, (partials, final) in zip(speech, alone):
        stable = [p.stable_text for p in partials]
        assert all(b.startswith(a) for a, b in pairwise(stable)), "a partial's committed text changed"
        # the final decodes freely (the commits only its draft): the one pass over the same audio
        assert final.token_ids == engine.transcribe(x).token_ids and final.text == final.stable_text
    partials, finals = stream_batched(engine, speech)
    assert [f.token_ids for f in finals] == [a[1].token_ids for a in alone]
    assert [[p.token_ids for p in ps] for ps in partials] == [[p.token_ids for p in a[0]] for a in alone]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["demo-ctc", "demo-whisper"])
def test_service_with_concurrent_streams_equals_single_stream(engines, speech, name):
    engine = engines(name)

    def run(streams_audio, max_batch):
        from edge_agent.serving.asr.factory import feed_lockstep

        limits = BatchLimits(max_batch=max_batch, batch_timeout_ms=50.0)
        with AsrService(engine, limits=limits) as svc:
            handles = [svc.open_stream() for _ in streams_audio]
            import threading

            threads = [
                threading.Thread(target=feed_lockstep, args=(h, x, svc.chunk_samples), daemon=True)
                for h, x in zip(handles, streams_audio)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            assert all(h.wait(60) for h in handles)
            return [[(e.text, e.metrics.reason) for e in h.finals] for h in handles], svc

    single, _ = run([speech[0]], 1)
    multi, svc = run([speech[0]] * 3, 4)
    assert multi == [single[0]] * 3 and single[0][0][0]
    assert svc.batcher.batches > 0 and max(svc.batcher.batch_sizes) > 1, "streams were never batched"
    assert svc.snapshot("final_ms").count == 3 and svc.snapshot("rtf").count == 3


def test_service_endpointing_gives_one_final_per_utterance_with_metrics(engines):
    engine = engines("demo-ctc")
    x = two_utterances("turn on the lights", "what time is it")
    events = []
    with AsrService(engine, limits=BatchLimits(max_batch=1, batch_timeout_ms=0)) as svc:
        h = svc.open_stream(on_event=events.append)
        from edge_agent.serving.asr.factory import feed_lockstep

        feed_lockstep(h, x, svc.chunk_samples)
        assert h.wait(30)
    finals = [e for e in events if e.kind == "final"]
    starts = [e for e in events if e.kind == "speech_start"]
    assert len(finals) == 2 and len(starts) == 2
    assert [e.utterance for e in finals] == [0, 1]
    for f in finals:
        m = f.metrics
        assert m.first_partial_ms is not None and m.first_partial_ms >= 0
        assert m.final_ms >= 0 and 0 < m.rtf < 5 and m.reason == "silence"
        # each final equals the one-pass decode of its utterance's audio
    summary = svc.summary()
    assert summary["final_ms"]["count"] == 2 and summary["first_partial_ms"]["count"] == 2
    assert summary["rtf"]["p50"] is not None
    hists = svc.histograms(reset=True)
    assert hists["final_ms"].count == 2 and hists["first_partial_ms"].count == 2
    assert svc.histograms()["final_ms"].count == 0


def test_silence_and_tiny_inputs_never_hang(engines):
    engine = engines("demo-ctc")
    with AsrService(engine, limits=BatchLimits(max_batch=2, batch_timeout_ms=0)) as svc:
        quiet = svc.open_stream()
        quiet.feed(np.zeros(16000, np.float32))
        quiet.close()
        assert quiet.wait(10) and quiet.finals == []
        tiny = svc.open_stream(vad=False)  # one utterance of 10 samples: too short for a frame
        tiny.feed(np.full(10, 0.1, np.float32))
        tiny.close()
        assert tiny.wait(10) and [e.text for e in tiny.finals] == [""]
        empty = svc.open_stream(vad=False)
        empty.close()
        assert empty.wait(10) and empty.finals == []
    whisper = engines("demo-whisper")
    s = whisper.new_stream()
    s.end()
    h = whisper.step([s])[0]
    assert h.final and h.text == ""


def test_engine_failure_is_an_error_event_not_a_hang(engines):
    engine = engines("demo-ctc")

    class Broken:
        name, kind, sample_rate, max_utterance_s = "broken", "ctc", 16000, 30.0

        def new_stream(self):
            return engine.new_stream()

        def step(self, streams):
            raise RuntimeError("device lost")

    with AsrService(Broken(), limits=BatchLimits(max_batch=1, batch_timeout_ms=0)) as svc:
        h = svc.open_stream(vad=False)
        h.feed(np.zeros(16000, np.float32))
        h.close()
        assert h.wait(10)
        kinds = [e.kind for e in h.events(timeout_s=1)]
    assert "error" in kinds and "final" not in kinds


@pytest.mark.parametrize("name", ["demo-asr", "demo-ctc"])
def test_a_fork_decodes_what_the_stream_would_if_it_ended_there_and_the_stream_goes_on_unchanged(engines, speech, name):
    """A pause's head start (``CtcStream.fork``): forked mid-utterance (three times, with audio pending) and
    ended, each copy's final equals that of a stream fed the same audio and ended; the forked stream's own
    final equals an unforked one's."""
    engine = engines(name)
    x = speech[1]
    cuts = [k * len(x) // 4 + CHUNK // 3 for k in (1, 2, 3)]
    _, whole = stream_alone(engine, x)
    s = engine.new_stream()
    fed = 0
    for cut in cuts:
        _, head = stream_alone(engine, x[:cut])
        while fed < cut:
            piece = x[fed : min(fed + CHUNK, cut)]
            s.add_audio(piece)
            fed += piece.size
            if piece.size == CHUNK:
                engine.step([s])  # a short last piece stays pending: the fork must take it too
        twin = s.fork()
        twin.end()
        got = engine.step([twin])[0]
        assert got is not None and got.final and (got.token_ids, got.text) == (head.token_ids, head.text), cut
    s.add_audio(x[fed:])
    engine.step([s])
    s.end()
    final = engine.step([s])[0]
    assert final is not None and final.final and final.token_ids == whole.token_ids

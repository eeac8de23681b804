"""A pause's decode never waits for work it makes useless: it stops the utterance's partial step in flight
(queued or running, on a recogniser that can stop a step), no partial step starts while the speaker is
silent, an utterance that ends while that decode runs takes it as its final (no second decode of the same
speech), and speech that resumes stops a pause's decode still running. Steps are held on events and frames
fed one by one: no sleeps."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from edge_agent.errors import Interrupted
from edge_agent.models.recognizer import AudioStream, Hypothesis
from tests.scripted_vad import FRAME, RATE, Script, frames


class HeldEngine:
    """A recogniser whose steps the test holds: step k (0-based) waits for ``gates[k]`` when the test set one,
    and ``interrupt`` releases it raising ``Interrupted`` (as ONNX Runtime's terminate flag does). Each step is
    recorded as (kind, samples taken so far, interrupted); a final reads "turn on the lights"."""

    name, kind, sample_rate, max_utterance_s = "held", "held", RATE, 30.0
    interruptible = True

    def __init__(self) -> None:
        self.gates: dict[int, threading.Event] = {}
        self.entered: dict[int, threading.Event] = {}
        self.steps: list[list] = []
        self._stopped = False
        self._running: threading.Event | None = None
        self._lock = threading.Lock()
        self.resumes = 0

    def hold(self, k: int) -> threading.Event:
        """Hold step ``k`` until the test sets the returned event; ``entered[k]`` is set when it starts."""
        self.gates[k], self.entered[k] = threading.Event(), threading.Event()
        return self.gates[k]

    def new_stream(self):
        return AudioStream(RATE)

    def interrupt(self) -> None:
        with self._lock:
            self._stopped = True
            if self._running is not None:
                self._running.set()

    def resume(self) -> None:
        with self._lock:
            self._stopped = False
            self.resumes += 1

    def step(self, streams):
        k = len(self.steps)
        ended = [s.ended for s in streams]
        row = ["final" if all(ended) else "partial", [s.samples_in for s in streams], False]
        self.steps.append(row)
        gate = self.gates.get(k)
        if gate is not None:
            with self._lock:
                self._running = gate
                stopped = self._stopped
            self.entered[k].set()
            if not stopped:
                assert gate.wait(10.0), f"step {k} was never released"
        with self._lock:
            self._running = None
            if self._stopped:
                row[2] = True
                raise Interrupted("held step stopped")
        out = []
        for s, end in zip(streams, ended):
            s.take()
            out.append(Hypothesis("turn on the lights" if end else "turn on the", (), end, "", s.samples_in / RATE))
        return out

    def close(self):
        pass


class Feed:
    """An AsrService on ``HeldEngine`` with one stream asking for pauses; frames fed by the test."""

    def __init__(self, voiced: list[bool], chunk_ms: int = 10_000, pause_ms: int | None = 60) -> None:
        from edge_agent.audio.vad import EndpointConfig
        from edge_agent.serving.asr.batcher import BatchLimits
        from edge_agent.serving.asr.service import AsrService

        self.engine = HeldEngine()
        self.service = AsrService(
            self.engine,
            limits=BatchLimits(max_batch=1, batch_timeout_ms=0),
            endpoint=EndpointConfig(60, 500, 100),
            detector_factory=lambda: Script(voiced),
            chunk_ms=chunk_ms,
        ).start()
        self.events: list = []
        self.paused = threading.Event()
        self.final = threading.Event()
        self.stream = self.service.open_stream(on_event=self._on, pause_ms=pause_ms)
        self.fed = 0

    def _on(self, event) -> None:
        self.events.append((self.fed, event))
        if event.kind == "partial" and event.paused:
            self.paused.set()
        if event.kind == "final":
            self.final.set()

    def feed(self, n: int, settle: bool = True) -> None:
        """``n`` frames; with ``settle``, each step they ask for (and not held) finishes before the next."""
        for _ in range(n):
            self.stream.feed(np.full(FRAME, 0.1, np.float32))
            self.fed += 1
            if settle:
                self.stream.wait_steps(10.0)

    def close(self) -> None:
        for gate in self.engine.gates.values():
            gate.set()
        self.stream.close()
        assert self.stream.wait(10.0)
        self.service.stop()

    def kinds(self, kind: str) -> list:
        return [e for _, e in self.events if e.kind == kind]


@pytest.fixture
def feeds():
    made: list[Feed] = []

    def make(*args, **kwargs) -> Feed:
        made.append(Feed(*args, **kwargs))
        return made[-1]

    yield make
    for f in made:
        f.close()


def test_a_pause_stops_the_partial_step_running_and_decodes_at_once(feeds):
    voiced = [True] * frames(600) + [False] * frames(1000)
    f = feeds(voiced)
    f.engine.hold(0)  # the first partial step (asked for at the speech start) runs until stopped
    f.feed(frames(600), settle=False)  # speech
    assert f.engine.entered[0].wait(10.0)
    f.feed(frames(60), settle=False)  # the pause: its decode stops the step and runs at once
    assert f.paused.wait(10.0), "the pause's decode waited for the partial step"
    assert f.engine.steps[0][0] == "partial" and f.engine.steps[0][2], "the partial step was not stopped"
    assert f.service.batcher.preempted == 1
    (pause,) = [e for e in f.kinds("partial") if e.paused]
    assert pause.text == "turn on the lights"  # the pause's decode reads as the final will


def test_a_pause_takes_the_queued_partial_step_out_of_the_queue():
    """Stream A's partial step waits behind stream B's final (held; another caller's urgent work is never
    stopped); A's pause takes that partial out of the queue, and A's pause decode is what runs next."""
    from edge_agent.audio.vad import EndpointConfig
    from edge_agent.serving.asr.batcher import BatchLimits
    from edge_agent.serving.asr.service import AsrService

    scripts = [
        Script([True] * frames(300) + [False] * frames(1000)),
        Script([True] * frames(600) + [False] * frames(1000)),
    ]
    engine = HeldEngine()
    service = AsrService(
        engine,
        limits=BatchLimits(max_batch=1, batch_timeout_ms=0),
        endpoint=EndpointConfig(60, 500, 100),
        detector_factory=lambda: scripts.pop(0),
        chunk_ms=10_000,
    ).start()
    paused = threading.Event()
    frame = np.full(FRAME, 0.1, np.float32)
    try:
        b = service.open_stream()
        a = service.open_stream(on_event=lambda e: e.kind == "partial" and e.paused and paused.set(), pause_ms=60)
        for _ in range(frames(300)):
            b.feed(frame)
            b.wait_steps(10.0)
        k = len(engine.steps)
        gate = engine.hold(k)  # B's final
        for _ in range(frames(500)):
            b.feed(frame)
        assert engine.entered[k].wait(10.0)
        for _ in range(frames(600) + frames(60)):  # A speaks (its first partial queues behind B), then pauses
            a.feed(frame)
        assert service.batcher.dropped == 1  # A's queued partial left the queue
        assert service.batcher.preempted == 0  # B's final was not stopped
        gate.set()
        assert paused.wait(10.0)
        assert [kind for kind, _, _ in engine.steps[k:]] == ["final", "final"]  # B's final, A's pause decode
        for st in (a, b):
            st.close()
            assert st.wait(10.0)
    finally:
        for g in engine.gates.values():
            g.set()
        service.stop()


def test_no_partial_step_starts_while_the_speaker_is_silent(feeds):
    voiced = [True] * frames(600) + [False] * frames(1000)
    f = feeds(voiced, chunk_ms=100)
    f.feed(frames(600))
    during = len(f.engine.steps)
    f.feed(frames(1000))
    after = f.engine.steps[during:]
    # in the silence: the pause's decode only (its fork has ended: a "final" step), and no final step after it
    assert [kind for kind, _, _ in after] == ["final"]
    (final,) = f.kinds("final")
    assert final.text == "turn on the lights"


def test_without_pauses_partial_steps_go_on_in_the_silence(feeds):
    voiced = [True] * frames(600) + [False] * frames(1000)
    f = feeds(voiced, chunk_ms=100, pause_ms=None)
    f.feed(frames(600))
    during = len(f.engine.steps)
    f.feed(frames(1000))
    kinds = [kind for kind, _, _ in f.engine.steps[during:]]
    assert kinds.count("partial") >= 2 and kinds[-1] == "final"


def test_an_utterance_that_ends_while_its_pause_is_decoded_takes_that_decode_as_its_final(feeds):
    voiced = [True] * frames(600) + [False] * frames(1000)
    f = feeds(voiced)
    f.feed(frames(600))
    k = len(f.engine.steps)
    gate = f.engine.hold(k)  # the pause's decode
    f.feed(frames(60), settle=False)
    assert f.engine.entered[k].wait(10.0)
    f.feed(frames(500), settle=False)  # the full silence: the utterance ends, its pause decode still running
    assert not f.final.is_set()
    gate.set()
    assert f.final.wait(10.0)
    f.stream.wait_steps(10.0)
    assert len(f.engine.steps) == k + 1, "the same speech was decoded a second time for the final"
    (final,) = f.kinds("final")
    assert final.text == "turn on the lights" and final.metrics.reason == "silence"
    # its final_ms runs from the decision (the end of the full silence) to when the decode came
    assert final.metrics.final_ms >= 0


def test_speech_that_resumes_stops_the_pause_s_decode_still_running(feeds):
    voiced = [True] * frames(600) + [False] * frames(100) + [True] * frames(400) + [False] * frames(1000)
    f = feeds(voiced)
    f.feed(frames(600))
    k = len(f.engine.steps)
    f.engine.hold(k)  # the first pause's decode: never released by the test
    f.feed(frames(60), settle=False)
    assert f.engine.entered[k].wait(10.0)
    f.feed(frames(40) + frames(400) + frames(600), settle=False)  # the speaker went on, then stopped
    assert f.final.wait(10.0), "the stale pause's decode held the rest of the utterance back"
    assert f.engine.steps[k][2], "the stale pause's decode was not stopped"
    (final,) = f.kinds("final")
    assert final.text == "turn on the lights"
    assert not any(e.kind == "error" for _, e in f.events)


def test_a_stream_aborted_while_its_final_waits_on_the_pause_s_decode_ends_with_an_error(feeds):
    """The client leaves after the utterance ended by silence, its pause's decode (its final) still running:
    the utterance gets an ``error`` event, the stream is done, and the decode's late result goes nowhere."""
    voiced = [True] * frames(600) + [False] * frames(1000)
    f = feeds(voiced)
    f.feed(frames(600))
    k = len(f.engine.steps)
    gate = f.engine.hold(k)
    f.feed(frames(60), settle=False)
    assert f.engine.entered[k].wait(10.0)
    f.feed(frames(500), settle=False)  # ended by silence: the final is that decode's, on its way
    assert f.stream.abort("client left") == 1
    assert f.stream.wait(10.0)
    gate.set()
    f.service.batcher.stop()  # the held decode finishes and its callback runs before this returns
    (error,) = f.kinds("error")
    assert error.code == "cancelled" and not f.kinds("final")

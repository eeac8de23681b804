"""The streaming ASR service: audio streams in, partial and final transcripts out, with latency.

    stream.feed(block) ─▶ Endpointer ─▶ utterance (recogniser stream) ─▶ Batcher ─▶ engine.step(streams)
                                                                                 └─▶ partial / final events

One engine (shared, on the batcher's device thread) serves every stream; each utterance owns its
recogniser state. An utterance asks for its first step once it has ``first_chunk_ms`` of audio (0,
the default: at the speech start, with the pre-roll and the audio that confirmed the onset), then
whenever it has ``chunk_ms`` of new audio and no step in flight (so one slow step never queues a
backlog of them); its end of speech asks at once and goes to the front of the batching rule
(``urgent``). Each utterance's ``first_partial_ms`` is told to the batcher against ``sla_ms`` (the
``[sla.asr]`` target): its adaptive wait for batch-mates grows while the SLA holds and is cut on a
breach.

Metrics per utterance (the vocabulary of docs/metrics.md), also kept in a rolling window:
- ``first_partial_ms``: arrival of the first voiced audio (the block holding the onset) → first
  non-empty partial;
- ``final_ms``: the end-of-speech decision → the final text;
- ``rtf``: engine time spent on the utterance (a batch's time shared equally by its rows) / its audio.

Every ``speech_start`` ends in a ``final`` or an ``error`` event. ``backlog_s`` is a stream's audio that
no step has taken yet (what a caller bounds to apply back-pressure); ``abort`` ends a stream nobody
waits for: its open utterances get an ``error`` and its queued steps leave the batcher unrun.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator

import numpy as np

from ...audio.vad import Detector, EndpointConfig, Endpointer, SpeechAudio, SpeechEnd, SpeechStart
from ...errors import Overloaded
from ...metrics.histogram import ExponentialHistogram
from ...metrics.window import MetricSnapshot, RollingWindow
from ...models.recognizer import Hypothesis, Recognizer
from .batcher import Batcher, BatchLimits
from .events import AsrEvent, UtteranceMetrics

log = logging.getLogger(__name__)

ASR_METRICS = ("first_partial_ms", "final_ms", "rtf")


class _Utterance:
    def __init__(self, handle: AsrStream, index: int, rstream, onset_s: float, voiced_at: float) -> None:
        self.handle, self.index, self.rstream = handle, index, rstream
        self.onset_s, self.voiced_at = onset_s, voiced_at
        self.end_at: float | None = None
        self.reason = ""
        self.unsent = 0
        self.taken = 0  # samples the engine has taken (counted when their step starts)
        self.steps = 0  # steps asked for
        self.in_flight = False
        self.done = False
        self.compute_s = 0.0
        self.first_partial_ms: float | None = None
        self.last_text = ""
        self.pcm: list[np.ndarray] | None = None  # the utterance's audio, kept only while capture is on


_DEFAULT_LIMITS, _DEFAULT_ENDPOINT = BatchLimits(), EndpointConfig()  # frozen: safe to share


class AsrService:
    """One loaded recogniser serving many endpointed streams (``open_stream``), their decode steps
    batched on one device thread (``batcher.Batcher``); ``start``/``stop`` around it."""

    def __init__(
        self,
        engine: Recognizer,
        *,
        limits: BatchLimits = _DEFAULT_LIMITS,
        endpoint: EndpointConfig = _DEFAULT_ENDPOINT,
        detector_factory: Callable[[], Detector | None] | None = None,
        chunk_ms: int = 320,
        first_chunk_ms: int | None = 0,
        sla_ms: float = 300.0,
        window_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine, self.clock = engine, clock
        max_s = min(endpoint.max_utterance_s, getattr(engine, "max_utterance_s", float("inf")) - 1.0)
        self.endpoint = EndpointConfig(
            endpoint.min_speech_ms, endpoint.trailing_silence_ms, endpoint.pre_roll_ms, max_s
        )
        if detector_factory is None:
            from ...audio.vad import EnergyVAD

            detector_factory = EnergyVAD
        self.detector_factory = detector_factory
        self.chunk_samples = max(1, engine.sample_rate * chunk_ms // 1000)
        # None: the first step waits for a whole chunk_ms like the others
        first = chunk_ms if first_chunk_ms is None else first_chunk_ms
        self.first_chunk_samples = max(1, engine.sample_rate * first // 1000)
        self.sla_ms = sla_ms
        self.batcher: Batcher[_Utterance, Hypothesis | None] = Batcher(
            self._run_batch, limits, clock=clock, name=f"asr-{engine.name}"
        )
        self.window = RollingWindow(window_s, clock=clock)
        # Cumulative, mergeable across devices (fleet telemetry); rtf is a ratio, not ms, same encoding.
        self._histograms = {m: ExponentialHistogram() for m in ASR_METRICS}
        self._hist_lock = threading.Lock()
        self.utterances: deque[UtteranceMetrics] = deque(maxlen=10_000)
        self._next_stream = 0
        self._lock = threading.Lock()
        # [calibration] capture: told each utterance's audio, sample rate and final text; it never blocks
        self.capture: Callable[[list[np.ndarray], int, str], None] | None = None

    def start(self) -> AsrService:
        self.batcher.start()
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        self.batcher.stop(timeout_s)

    def __enter__(self) -> AsrService:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def open_stream(self, on_event: Callable[[AsrEvent], None] | None = None, vad: bool = True) -> AsrStream:
        with self._lock:
            sid = self._next_stream
            self._next_stream += 1
        detector = self.detector_factory() if vad else None
        return AsrStream(self, sid, Endpointer(detector, self.endpoint, self.engine.sample_rate), on_event)

    def summary(self) -> dict[str, dict]:
        snap = self.window.snapshot()
        return {m: snap[m].as_dict() for m in ASR_METRICS}

    def snapshot(self, metric: str) -> MetricSnapshot:
        return self.window.snapshot()[metric]

    def histograms(self, *, reset: bool = False) -> dict[str, ExponentialHistogram]:
        """Copies of the cumulative histograms; ``reset`` starts new ones (delta temporality)."""
        with self._hist_lock:
            if reset:
                taken, self._histograms = self._histograms, {m: ExponentialHistogram() for m in ASR_METRICS}
                return taken
            return {m: h.copy() for m, h in self._histograms.items()}

    # -- device thread -----------------------------------------------------------------------

    def _run_batch(self, utts: list[_Utterance]) -> list[Hypothesis | None]:
        # an utterance cut (aborted) between being queued and now is not decoded for nobody
        live = [u for u in utts if not u.done]
        for u in live:  # what this step takes is no longer backlog (audio added meanwhile stays backlog)
            u.taken = u.rstream.samples_in
        if not live:
            return [None] * len(utts)
        start = time.perf_counter()
        hyps = list(self.engine.step([u.rstream for u in live]))
        share = (time.perf_counter() - start) / len(live)
        for u in live:
            u.compute_s += share
        if len(live) == len(utts) or len(hyps) != len(live):
            return hyps  # (a wrong count is the batcher's to report)
        by_utt = {id(u): h for u, h in zip(live, hyps)}
        return [by_utt.get(id(u)) for u in utts]

    def request_step(self, u: _Utterance, urgent: bool) -> None:
        """Under the stream lock: ask for a step unless one is in flight."""
        if u.in_flight or u.done:
            return
        u.in_flight, u.unsent = True, 0
        u.steps += 1
        try:
            future = self.batcher.submit(u, urgent=urgent)
        except Exception as exc:
            u.in_flight = False
            u.handle.fail(u, exc)
            return
        future.add_done_callback(functools.partial(u.handle.absorb, u))

    def step_samples(self, u: _Utterance) -> int:
        """New audio that makes ``u`` ask for a step: its first, or every later one."""
        return self.first_chunk_samples if u.steps == 0 else self.chunk_samples

    def record(self, m: UtteranceMetrics) -> None:
        self.utterances.append(m)
        values = {"first_partial_ms": m.first_partial_ms, "final_ms": m.final_ms, "rtf": m.rtf}
        with self._hist_lock:
            for name, value in values.items():
                if value is not None:
                    self.window.record(name, value)
                    self._histograms[name].record(value)


class AsrStream:
    """One audio stream (a microphone, a file, an API client): feed it blocks, read its events."""

    def __init__(
        self, service: AsrService, stream_id: int, endpointer: Endpointer, on_event: Callable[[AsrEvent], None] | None
    ) -> None:
        self.service, self.id, self.endpointer = service, stream_id, endpointer
        self.on_event = on_event
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.RLock()
        self._idle = threading.Condition(self._lock)
        self._current: _Utterance | None = None
        self._open = 0  # utterances without their final yet
        self._count = 0
        self._arrivals: deque[tuple[int, float]] = deque(maxlen=4096)  # (stream samples after block, clock)
        self._samples = 0
        self.finals: list[AsrEvent] = []
        self.closed = False
        self._live: list[_Utterance] = []  # utterances without their final yet

    def feed(self, samples: np.ndarray) -> None:
        x = np.asarray(samples, np.float32).reshape(-1)
        now = self.service.clock()
        with self._lock:
            if self.closed:
                raise RuntimeError("stream closed")
            self._samples += x.size
            self._arrivals.append((self._samples, now))
            self._handle(self.endpointer.push(x), now)

    def close(self) -> None:
        """End of input: an open utterance ends now (its final still comes as an event)."""
        with self._lock:
            if not self.closed:
                self._handle(self.endpointer.flush(), self.service.clock())
                self.closed = True

    def abort(self, reason: str, code: str = "cancelled") -> int:
        """Nobody waits for this stream any more: input ends, every utterance without its final gets an
        ``error`` event (``reason``, ``code``) and its queued steps leave the batcher without running
        (a step already running finishes, unheard). Returns how many utterances were cut."""
        with self._lock:
            self.closed = True
            live = [u for u in self._live if not u.done]
            for u in live:
                self.fail(u, reason, code)
            self._current = None
        self.service.batcher.drop(lambda item: item.handle is self)
        return len(live)

    @property
    def backlog_s(self) -> float:
        """Seconds of this stream's speech audio that no recogniser step has taken yet."""
        with self._lock:
            pending = sum(u.rstream.samples_in - u.taken for u in self._live if not u.done)
        return pending / self.endpointer.rate

    @property
    def finished(self) -> bool:
        """Closed, and every utterance has its final or error."""
        with self._lock:
            return self.closed and self._open == 0

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait until every utterance has its final; False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._open == 0, timeout_s)

    def wait_backlog(self, limit_s: float, timeout_s: float | None = None) -> bool:
        """Wait until ``backlog_s`` is at most ``limit_s``; False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self.backlog_s <= limit_s, timeout_s)

    def wait_steps(self, timeout_s: float | None = None) -> bool:
        """Wait until no recogniser step of this stream is queued or running; False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: not any(u.in_flight for u in self._live), timeout_s)

    def events(self, timeout_s: float | None = None) -> Iterator[AsrEvent]:
        """Events as they come; ends once the stream is closed and all finals are out, or on timeout."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return
            try:
                event = self._events.get(timeout=0.05 if remaining is None else min(0.05, remaining))
            except queue.Empty:
                with self._lock:
                    if self.closed and self._open == 0 and self._events.empty():
                        return
                continue
            yield event

    # -- internals (stream lock held) ----------------------------------------------------------

    def _arrival_of(self, stream_s: float, default: float) -> float:
        target = stream_s * self.endpointer.rate
        for end, at in self._arrivals:
            if end > target:
                return at
        return default

    def _handle(self, events, now: float) -> None:
        svc = self.service
        for e in events:
            if isinstance(e, SpeechStart):
                u = _Utterance(self, self._count, svc.engine.new_stream(), e.at_s, self._arrival_of(e.at_s, now))
                if svc.capture is not None:
                    u.pcm = []
                self._count += 1
                self._open += 1
                self._current = u
                self._live.append(u)
                self._emit(AsrEvent("speech_start", self.id, u.index, audio_s=e.at_s, at_s=now))
                self._add(u, e.audio)
            elif isinstance(e, SpeechAudio) and self._current is not None:
                self._add(self._current, e.audio)
            elif isinstance(e, SpeechEnd) and self._current is not None:
                u, self._current = self._current, None
                u.end_at, u.reason = now, e.reason
                u.rstream.end()
                svc.request_step(u, urgent=True)

    def _add(self, u: _Utterance, audio: np.ndarray) -> None:
        u.rstream.add_audio(audio)
        u.unsent += audio.size
        if u.pcm is not None:
            u.pcm.append(audio.copy())  # the endpointer may reuse its buffer
        if u.unsent >= self.service.step_samples(u):
            self.service.request_step(u, urgent=False)

    def absorb(self, u: _Utterance, future) -> None:
        """Batcher thread: a step finished for ``u`` (or the thread dropping it: cancelled)."""
        with self._lock:
            u.in_flight = False
            self._idle.notify_all()
            if future.cancelled() or u.done:  # aborted: its result (if any) has nobody to go to
                return
            exc = future.exception()
            if exc is not None:
                self.fail(u, exc)
                return
            hyp: Hypothesis | None = future.result()
            now = self.service.clock()
            if hyp is not None and not hyp.final and hyp.text and hyp.text != u.last_text:
                if u.first_partial_ms is None:
                    u.first_partial_ms = (now - u.voiced_at) * 1e3
                    self.service.batcher.on_latency(u.first_partial_ms, self.service.sla_ms)
                u.last_text = hyp.text
                self._emit(
                    AsrEvent("partial", self.id, u.index, hyp.text, hyp.stable_text, u.onset_s + hyp.audio_s, now)
                )
            if hyp is not None and hyp.final:
                self._finish(u, hyp, now)
            elif u.rstream.ended:
                self.service.request_step(u, urgent=True)
            elif u.unsent >= self.service.step_samples(u):
                self.service.request_step(u, urgent=False)

    def _finish(self, u: _Utterance, hyp: Hypothesis, now: float) -> None:
        u.done = True
        audio_s = max(hyp.audio_s, 1e-9)
        end_at = u.end_at if u.end_at is not None else now
        m = UtteranceMetrics(
            u.first_partial_ms, (now - end_at) * 1e3, u.compute_s / audio_s, hyp.audio_s, u.compute_s * 1e3, u.reason
        )
        self.service.record(m)
        event = AsrEvent("final", self.id, u.index, hyp.text, hyp.text, u.onset_s + hyp.audio_s, now, m, end_at)
        self.finals.append(event)
        self._emit(event)
        self._close_one()
        capture, pcm, u.pcm = self.service.capture, u.pcm, None
        if capture is not None and pcm is not None:
            try:
                capture(pcm, self.service.engine.sample_rate, hyp.text)
            except Exception:  # a capture fault must never stop recognition
                log.exception("calibration capture failed")

    def fail(self, u: _Utterance, exc: BaseException | str, code: str | None = None) -> None:
        if u.done:
            return
        u.done = True
        if code is None:
            code = "overloaded" if isinstance(exc, Overloaded) else "failed"
        # a client that left is routine; anything else is worth a warning
        log.log(
            logging.INFO if code == "cancelled" else logging.WARNING,
            "stream %d utterance %d: %s (%s)",
            self.id,
            u.index,
            exc,
            code,
        )
        if self._current is u:
            self._current = None
        self._emit(AsrEvent("error", self.id, u.index, at_s=self.service.clock(), error=str(exc), code=code))
        self._close_one()

    def _close_one(self) -> None:
        self._live = [u for u in self._live if not u.done]
        self._open -= 1
        self._idle.notify_all()

    def _emit(self, event: AsrEvent) -> None:
        self._events.put(event)
        if self.on_event is not None:
            try:
                self.on_event(event)
            except Exception:  # a consumer's bug must not stop recognition
                log.exception("on_event callback failed")

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
- ``final_ms``: the end-of-speech decision → the final text: the recogniser's time to finish the
  transcript (for a final that is a pause's decode, see below: that pause → its decode);
- ``rtf``: engine time spent on the utterance (a batch's time shared equally by its rows) / its audio.

An early end of turn (``EarlyEnd``, off unless given, and only for streams that ask for it): the
endpointer may end an utterance before the full ``trailing_silence_ms`` when its words, covering all of
the speech, are complete; the stronger the evidence, the shorter the silence (``end_silence_ms``): a
whole command for the stream's own ``complete`` check (a voice turn's ``command_check``) that the
recogniser's language model does not rule out, or the language model alone. The words judged are the
pause's decode when the stream asked for pauses (it reads as the final will), which with no speech since
is the final itself (its ``final_ms``: that decode's time); an utterance that ends by silence while that
decode still runs takes it as its final when it comes (no second decode of the same speech). While the
speaker is silent no partial step starts (``_wants_step``), and a pause's decode does not wait for the
utterance's partial step in flight: a queued one leaves the queue, a running one is stopped where the
recogniser can stop a step (``interruptible``: Whisper's passes re-decode from the audio, nothing is lost).
Speech that comes back within the rest of the full wait continues the utterance: a new ``speech_start``
with the same ``utterance`` number, then a second ``final`` for it, recognised from its start.

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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from ...audio.vad import Detector, EndpointConfig, Endpointer, SpeechAudio, SpeechEnd, SpeechStart
from ...errors import Interrupted, Overloaded
from ...metrics.histogram import ExponentialHistogram
from ...metrics.window import MetricSnapshot, RollingWindow
from ...models.asr_prompt import build_prompt
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
        self.audio: list[np.ndarray] | None = None  # its audio, kept with early end (a resumption re-feeds it)
        self.partial_samples = -1  # utterance samples the latest partial covers (-1: none yet)
        self.partial_text = ""
        self.paused_at = -1  # voiced samples when a pause's partial was last asked for
        self.pause_due = False  # a pause's fork waits for the step in flight
        self.pause_end = -1  # the stream sample where the speech before that pause ended
        self.pause_asked_at = 0.0  # clock: when that pause's decode was asked for
        # the pause decode in flight: (its ``paused_at``, its forked utterance), or None
        self.pause_running: tuple[int, _Utterance] | None = None
        self.final_from_pause = False  # ended while that decode ran, on the same speech: it is the final
        # (voiced samples, decode, ms from asking to the decode) of the latest pause
        self.paused_hyp: tuple[int, Hypothesis, float] | None = None


@dataclass(frozen=True, slots=True)
class EarlyEnd:
    """An earlier end of turn, sooner the stronger the evidence that the words are complete:

    - a stream with its own check (a voice turn's tools): when the check says the words are whole (a whole
      command) and the language model does not rule the sentence end out (P(end | words) >=
      ``command_min_prob``, or there is no LM), after ``command_silence_ms``;
    - a stream without one: when the language model's P(end | words) >= ``min_prob``, after ``silence_ms``;
    - a recogniser with no language model that punctuates (Whisper): a text ending in "?" (a whole question),
      after ``silence_ms``.
    """

    silence_ms: int = 200
    min_prob: float = 0.15
    command_silence_ms: int = 100
    command_min_prob: float = 0.02

    @property
    def first_ms(self) -> int:
        """The silence from which the endpointer asks."""
        return min(self.silence_ms, self.command_silence_ms)


def end_probability_of(engine) -> Callable[[str], float] | None:
    """P(end of sentence | the text's words) from the recogniser's word language model (a CTC model
    decoded with ``lm``: its folder's ``lm.arpa``); None when it has none."""
    ref = getattr(engine, "ref", None)
    if getattr(engine, "decoder_kind", None) != "lm" or ref is None:
        return None
    from ...models.ctc_lexicon import read_language

    lexicon, lm, _ = read_language(Path(ref.path), dict(getattr(ref, "config", {}) or {}))
    if lm is None:
        return None
    # a partial's last word may be unfinished (the model's look-ahead): the lexicon completes it
    return lambda text: lm.end_probability(text.split(), lexicon)


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
        early_end: EarlyEnd | None = None,
        end_probability: Callable[[str], float] | None = None,
    ) -> None:
        self.engine, self.clock = engine, clock
        max_s = min(endpoint.max_utterance_s, getattr(engine, "max_utterance_s", float("inf")) - 1.0)
        self.endpoint = EndpointConfig(
            endpoint.min_speech_ms, endpoint.trailing_silence_ms, endpoint.pre_roll_ms, max_s
        )
        self.early_end: EarlyEnd | None = None
        self.end_probability: Callable[[str], float] | None = None
        self.set_early_end(early_end, end_probability)
        if detector_factory is None:
            from ...audio.vad import EnergyVAD

            detector_factory = EnergyVAD
        self.detector_factory = detector_factory
        self.chunk_samples = max(1, engine.sample_rate * chunk_ms // 1000)
        # None: the first step waits for a whole chunk_ms like the others
        first = chunk_ms if first_chunk_ms is None else first_chunk_ms
        self.first_chunk_samples = max(1, engine.sample_rate * first // 1000)
        self.sla_ms = sla_ms
        self.live_sla: Callable[[], float] | None = None  # the SLA in force, read at each use (daemon.app)
        stoppable = engine if getattr(engine, "interruptible", False) else None
        self.batcher: Batcher[_Utterance, Hypothesis | None] = Batcher(
            self._run_batch,
            limits,
            clock=clock,
            name=f"asr-{engine.name}",
            stoppable=stoppable,  # type: ignore[arg-type]
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
        # [asr] prompt_words: every stream's context, ahead of a voice turn's tools (``AsrStream.set_context``)
        self.prompt_words: tuple[str, ...] = ()
        self.tool_context = True  # [asr] tool_context: a voice turn's tools' words join the context

    def new_engine_stream(self, context: str) -> Any:
        """A recogniser stream carrying ``context`` (the words to expect) when the recogniser takes one."""
        rstream = self.engine.new_stream()
        ids = getattr(self.engine, "context_ids", None)
        if context and ids is not None:
            rstream.context = ids(context)  # type: ignore[attr-defined]  # a recogniser with context_ids
        return rstream

    def target_ms(self) -> float:
        """The SLA the adaptive batch wait answers: the one in force (``live_sla``), else ``sla_ms``."""
        return self.live_sla() if self.live_sla is not None else self.sla_ms

    def start(self) -> AsrService:
        self.batcher.start()
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        self.batcher.stop(timeout_s)

    def __enter__(self) -> AsrService:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def open_stream(
        self,
        on_event: Callable[[AsrEvent], None] | None = None,
        vad: bool = True,
        complete: Callable[[str], bool | None] | None = None,
        pause_ms: int | None = None,
        early_end: bool = False,
    ) -> AsrStream:
        """A new stream. ``early_end``: its utterances may end early, when the service has an ``EarlyEnd``
        (a voice turn's stream; others always wait the full trailing silence); ``complete(text)`` is the
        caller's own completeness check (``end_silence_ms``).
        ``pause_ms``: after that much silence inside an utterance, its text as the final would say it goes
        out as a partial marked ``paused`` (a voice turn starts its reply ahead on it)."""
        with self._lock:
            sid = self._next_stream
            self._next_stream += 1
        detector = self.detector_factory() if vad else None
        endpoint = self.endpoint if early_end else replace(self.endpoint, early_silence_ms=None)
        stream = AsrStream(self, sid, Endpointer(detector, endpoint, self.engine.sample_rate), on_event)
        stream.set_complete(complete)
        stream.pause_ms = pause_ms
        return stream

    def set_early_end(self, early_end: EarlyEnd | None, end_probability: Callable[[str], float] | None = None) -> None:
        """Turn the early end on (or off: None) for streams opened from now on with ``early_end=True``.
        ``end_probability`` overrides the recogniser's own language model (tests, tuning)."""
        e = self.endpoint
        silence = None if early_end is None else min(early_end.first_ms, e.trailing_silence_ms)
        self.endpoint = EndpointConfig(
            e.min_speech_ms, e.trailing_silence_ms, e.pre_roll_ms, e.max_utterance_s, silence
        )
        self.early_end = early_end
        # the recogniser's own completeness signal: its word LM
        self.end_probability = end_probability or (end_probability_of(self.engine) if early_end is not None else None)

    def end_silence_ms(self, text: str, extra: Callable[[str], bool | None] | None = None) -> int | None:
        """The silence after which ``text`` ends the utterance early (``EarlyEnd``), or None: never early.
        ``extra`` is the stream's own check (the voice turn's whole-command check): False vetoes; True
        (whole), with the language model not ruling the end out, gives the shorter ``command_silence_ms``;
        None (it cannot tell) or no check leaves the language model alone, after ``silence_ms``. Without a
        language model, a text that ends in a question mark (a recogniser that punctuates, as Whisper does,
        heard a whole question: "What time is it?") ends after ``silence_ms``, whatever the check says: a
        question is no command to complete."""
        e = self.early_end
        if e is None or not text.strip():
            return None
        verdict = extra(text) if extra is not None else None
        if verdict is not True and self.end_probability is None and text.rstrip().endswith("?"):
            return e.silence_ms  # no word LM, but a recogniser that punctuates (Whisper) heard a whole question
        if verdict is False:
            return None  # vetoed: the language model need not be asked
        p = self.end_probability(text) if self.end_probability is not None else None
        if verdict:
            return e.command_silence_ms if p is None or p >= e.command_min_prob else None
        return e.silence_ms if p is not None and p >= e.min_prob else None  # the words alone cannot tell

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

    def preempt_step(self, u: _Utterance) -> None:
        """Under the stream lock: ``u``'s step in flight is no longer wanted (a partial when a pause's decode
        is due, a pause's decode when the speech resumed): queued, it leaves the queue; running, it stops
        where the engine can stop a step (its batch-mates ask again)."""
        if not self.batcher.drop(lambda item: item is u):
            self.batcher.preempt(lambda item: item is u)

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
        self._early: _Utterance | None = None  # the last utterance, when it ended early (it may resume)
        self._complete_extra: Callable[[str], bool | None] | None = None
        self._checked: tuple[str, int | None] = ("", None)  # the last end_silence_ms answer, per text
        self._endpoints: dict[int, tuple[float, float]] = {}  # utterance → (speech end, decision), clock
        self.pause_ms: int | None = None  # see ``AsrService.open_stream``
        self._pausing = 0  # pause decodes in flight
        self._tools: Sequence[Any] | None = None  # a voice turn's tools: their words are the context
        self._recent: deque[str] = deque(maxlen=2)  # the last finals' text: context for the next utterance
        self.context = build_prompt(None, getattr(service, "prompt_words", ()))
        # told when this stream's speaker starts and stops talking (the LLM admits chats against the turn)
        self._urgency = getattr(service.batcher, "urgency", None)

    def set_context(self, tools: Sequence[Any] | None) -> None:
        """The words the recogniser is told to expect from now on: the service's ``[asr] prompt_words``,
        ``tools``' words (a voice turn's: names, enum values, descriptions) and the last finals' text."""
        with self._lock:
            self._tools = tools if getattr(self.service, "tool_context", True) else None
            self._update_context()

    def _update_context(self) -> None:
        words = getattr(self.service, "prompt_words", ())
        self.context = build_prompt(self._tools, words, tuple(self._recent))

    def set_complete(self, complete: Callable[[str], bool | None] | None) -> None:
        """The caller's completeness check for an early end (see ``AsrService.open_stream``)."""
        self._complete_extra = complete
        self._checked = ("", None)  # answers of the check it replaces
        early = self.service.early_end is not None and self.endpointer.config.early_silence_ms is not None
        has_check = self.service.end_probability is not None or complete is not None
        self.endpointer.complete = self._complete if early and has_check else None

    def endpoint(self, utterance: int) -> tuple[float, float] | None:
        """(end of speech, end-of-turn decision) on the service clock for ``utterance``'s latest end: the
        end of speech is the decision less the silence the endpointer waited (stream time)."""
        with self._lock:
            return self._endpoints.get(utterance)

    def feed(self, samples: np.ndarray) -> None:
        x = np.asarray(samples, np.float32).reshape(-1)
        now = self.service.clock()
        with self._lock:
            if self.closed:
                raise RuntimeError("stream closed")
            self._samples += x.size
            self._arrivals.append((self._samples, now))
            self._handle(self.endpointer.push(x), now)
            u = self._current
            if u is not None and u.pause_running is not None and self.endpointer.voiced_samples > u.pause_running[0]:
                # the speaker went on: that pause's decode would only be superseded by the next one's
                shadow, u.pause_running = u.pause_running[1], None
                self.service.preempt_step(shadow)
            if self.pause_ms is not None:
                self._pause()

    def _pause(self) -> None:
        """Under the lock, after a block: in a pause of ``pause_ms``, decode the utterance as if it ended here
        (the streaming partial holds back its last letters; this is what the final would say) and send that
        text as a partial marked ``paused``, once per pause. The stream is forked for it (``fork``) once no
        step of it runs; a recogniser whose streams cannot fork decodes the audio so far in one pass."""
        u = self._current
        if u is None or u.done or u.audio is None or self.endpointer.silence_ms < (self.pause_ms or 0):
            return
        voiced = self.endpointer.voiced_samples
        if u.paused_at == voiced:
            return  # this pause's decode is asked for already
        u.paused_at, u.pause_end = voiced, self.endpointer.last_voiced_end
        u.pause_asked_at = self.service.clock()
        if u.in_flight:
            u.pause_due = True  # forked when that step is absorbed, which it gives way for
            self.service.preempt_step(u)
        else:
            self._fork_pause(u)

    def _fork_pause(self, u: _Utterance) -> None:
        u.pause_due = False
        fork = getattr(u.rstream, "fork", None)
        if fork is not None:
            twin = fork()
        else:
            twin = self.service.new_engine_stream(self.context)
            for block in u.audio or []:
                twin.add_audio(block)
        twin.end()
        self._pause_step(u, _Utterance(self, u.index, twin, u.onset_s, u.voiced_at))

    def _in_pause(self, u: _Utterance, voiced: int) -> bool:
        """Under the lock: ``u`` is still the open utterance, silent since ``voiced`` samples of speech."""
        return not u.done and self._current is u and u.paused_at == voiced == self.endpointer.voiced_samples

    def _pause_step(self, u: _Utterance, shadow: _Utterance) -> None:
        try:
            future = self.service.batcher.submit(shadow, urgent=True)
        except Exception as exc:  # a pause's partial is only a head start: never worth failing for
            log.debug("stream %d: no pause partial (%s)", self.id, exc)
            if u.final_from_pause:
                self._end_by_step(u)
            return
        self._pausing += 1
        u.pause_running = (u.paused_at, shadow)
        future.add_done_callback(functools.partial(self._paused, u, shadow, u.paused_at))

    def _paused(self, u: _Utterance, shadow: _Utterance, voiced: int, future) -> None:
        """Batcher thread: a pause's one-pass decode ran; its final text goes out as a ``paused`` partial
        while the utterance is still in that pause."""
        with self._lock:
            self._pausing -= 1
            self._idle.notify_all()
            if u.pause_running is not None and u.pause_running[1] is shadow:
                u.pause_running = None
            failed = future.cancelled() or future.exception() is not None
            hyp: Hypothesis | None = None if failed else future.result()
            if u.final_from_pause and not u.done and u.paused_at == voiced:
                if hyp is not None and hyp.final:
                    u.compute_s += shadow.compute_s
                    self._finish(u, hyp, self.service.clock())
                elif failed:
                    self._end_by_step(u)  # the final is the utterance's own step after all
                else:
                    self._pause_step(u, shadow)
                return
            if failed:
                return
            current = self._in_pause(u, voiced)
            if current and (hyp is None or not hyp.final):
                self._pause_step(u, shadow)  # an engine that takes its audio over several steps
            elif current and hyp is not None:
                u.paused_hyp = (voiced, hyp, (self.service.clock() - u.pause_asked_at) * 1e3)
                u.compute_s += shadow.compute_s
                if not hyp.text.strip():
                    return
                now = self.service.clock()
                self._emit(
                    AsrEvent("partial", self.id, u.index, hyp.text, hyp.text, u.onset_s + hyp.audio_s, now, paused=True)
                )

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
            self._current = None  # (fail told the urgency that the open one's speech was cut)
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
            return self._idle.wait_for(
                lambda: not any(u.in_flight for u in self._live) and not self._pausing, timeout_s
            )

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

    def _complete(self, voiced_samples: int) -> bool:
        """The endpointer asks (stream lock held, from ``feed``, each silent frame): may the current
        utterance end now? Only a text that covers all of its speech can say so: the pause's decode when
        this pause asked for one (it reads as the final will; the streaming partial lags by the model's
        look-ahead), else a partial that covers the speech; otherwise a step is asked for to get one.
        The text's answer (``AsrService.end_silence_ms``) is how much silence it needs."""
        u = self._current
        if u is None or u.done:
            return False
        if u.paused_at == voiced_samples:
            if u.paused_hyp is None or u.paused_hyp[0] != voiced_samples:
                return False  # the pause's decode is on its way
            text = u.paused_hyp[1].text
        elif u.partial_samples < voiced_samples:
            self.service.request_step(u, urgent=False)  # no-op while one is in flight
            return False
        else:
            text = u.partial_text
        if self._checked[0] != text:
            self._checked = (text, self.service.end_silence_ms(text, self._complete_extra))
        need = self._checked[1]
        return need is not None and self.endpointer.silence_ms >= need

    def _handle(self, events, now: float) -> None:
        svc = self.service
        for e in events:
            if isinstance(e, SpeechStart):
                resumed = self._early if e.resumes else None
                index = resumed.index if resumed is not None else self._count
                onset_s = resumed.onset_s if resumed is not None else e.at_s
                u = _Utterance(self, index, svc.new_engine_stream(self.context), onset_s, self._arrival_of(e.at_s, now))
                if svc.capture is not None:
                    u.pcm = []
                if self.endpointer.config.early_silence_ms is not None or self.pause_ms is not None:
                    u.audio = []  # a resumption re-feeds it; a pause decodes it in one pass
                if resumed is None:
                    self._count += 1
                else:  # the same utterance goes on: recognised again from its start
                    u.first_partial_ms = resumed.first_partial_ms
                    for block in resumed.audio or []:
                        self._add(u, block)
                self._early = None
                self._open += 1
                self._current = u
                self._live.append(u)
                self._emit(AsrEvent("speech_start", self.id, u.index, audio_s=onset_s, at_s=now))
                if self._urgency is not None:  # a turn is coming: admission counts on it
                    self._urgency.speech_started(self)
                self._add(u, e.audio)
            elif isinstance(e, SpeechAudio) and self._current is not None:
                self._add(self._current, e.audio)
            elif isinstance(e, SpeechEnd) and self._current is not None:
                u, self._current = self._current, None
                if self._urgency is not None:
                    self._urgency.speech_ended(self)
                u.end_at, u.reason = now, e.reason
                self._early = u if e.reason == "early" else None
                self._endpoints[u.index] = (now - (e.at_s - e.speech_end_s), now)
                if len(self._endpoints) > 64:
                    self._endpoints.pop(next(iter(self._endpoints)))
                paused = u.paused_hyp
                if (
                    paused is not None
                    and paused[0] == u.paused_at
                    and u.pause_end == round(e.speech_end_s * self.endpointer.rate)
                ):
                    # no speech since the pause: its decode (what the early end judged, what a reply
                    # ahead was started on) is the final; a second decode could read the silence otherwise
                    self._finish(u, paused[1], now, final_ms=paused[2])
                elif (
                    u.pause_running is not None
                    and u.pause_running[0] == u.paused_at
                    and u.pause_end == round(e.speech_end_s * self.endpointer.rate)
                ):
                    u.final_from_pause = True  # that decode, on its way, is what a final step would compute
                else:
                    self._end_by_step(u)

    def _end_by_step(self, u: _Utterance) -> None:
        u.final_from_pause = False
        u.rstream.end()
        self.service.request_step(u, urgent=True)

    def _add(self, u: _Utterance, audio: np.ndarray) -> None:
        u.rstream.add_audio(audio)
        u.unsent += audio.size
        if u.pcm is not None:
            u.pcm.append(audio.copy())  # the endpointer may reuse its buffer
        if u.audio is not None:
            u.audio.append(audio.copy())
        if self._wants_step(u):
            self.service.request_step(u, urgent=False)

    def _wants_step(self, u: _Utterance, redo: bool = False) -> bool:
        """Whether ``u`` has enough new audio for a partial step, and a partial could say anything new. With
        pause decodes, not while the speaker is silent: within ``pause_ms`` the pause's decode comes (it covers
        all of the speech; a step started now would hold it back and take the cores from the reply it
        starts), and speech that resumes first asks for the step with its next block."""
        silent = self._current is u and self.pause_ms is not None and self.endpointer.silence_ms > 0
        return (redo or u.unsent >= self.service.step_samples(u)) and not silent

    def absorb(self, u: _Utterance, future) -> None:
        """Batcher thread: a step finished for ``u`` (or the thread dropping it: cancelled)."""
        with self._lock:
            u.in_flight = False
            self._idle.notify_all()
            if u.done:  # aborted: its result (if any) has nobody to go to
                return
            cancelled = future.cancelled()
            exc = None if cancelled else future.exception()
            gave_way = cancelled or isinstance(exc, Interrupted)  # dropped or stopped for a pause's decode
            if exc is not None and not gave_way:
                self.fail(u, exc)
                return
            hyp: Hypothesis | None = None if gave_way else future.result()
            now = self.service.clock()
            if not gave_way and (hyp is None or not hyp.final):
                u.partial_samples = u.taken  # None: nothing new to say, so the text it had covers this too
                if hyp is not None:
                    u.partial_text = hyp.text
            if hyp is not None and not hyp.final and hyp.text and hyp.text != u.last_text:
                if u.first_partial_ms is None:
                    u.first_partial_ms = (now - u.voiced_at) * 1e3
                    self.service.batcher.on_latency(u.first_partial_ms, self.service.target_ms())
                u.last_text = hyp.text
                self._emit(
                    AsrEvent("partial", self.id, u.index, hyp.text, hyp.stable_text, u.onset_s + hyp.audio_s, now)
                )
            final = hyp is not None and hyp.final
            if u.pause_due and self._in_pause(u, u.paused_at) and not final:
                self._fork_pause(u)
            if hyp is not None and final:
                self._finish(u, hyp, now)
            elif u.rstream.ended:
                self.service.request_step(u, urgent=True)
            elif not cancelled and self._wants_step(u, redo=gave_way):  # stopped by a batch-mate's pause: again
                self.service.request_step(u, urgent=False)

    def _finish(self, u: _Utterance, hyp: Hypothesis, now: float, final_ms: float | None = None) -> None:
        """``final_ms``: given for a pause's decode (the time it took); else the decision → now."""
        u.done = True
        audio_s = max(hyp.audio_s, 1e-9)
        end_at = u.end_at if u.end_at is not None else now
        if final_ms is None:
            final_ms = (now - end_at) * 1e3
        m = UtteranceMetrics(
            u.first_partial_ms, final_ms, u.compute_s / audio_s, hyp.audio_s, u.compute_s * 1e3, u.reason
        )
        self.service.record(m)
        event = AsrEvent("final", self.id, u.index, hyp.text, hyp.text, u.onset_s + hyp.audio_s, now, m, end_at)
        self.finals.append(event)
        if hyp.text.strip():
            self._recent.append(hyp.text.strip())
            self._update_context()
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
            if self._urgency is not None:  # cut short: no turn comes, and no length to learn
                self._urgency.speech_ended(self, learn=False)
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

"""The ASR workload as the daemon runs it: a ladder of ASR tiers (``[[models.asr]]``, heaviest first),
each one engine behind an ``AsrService``, offered to the local API (whole files, and live PCM16
streams), reporting each utterance's latency, and switched without cutting an utterance.

A switch (``switch_to``) opens the next tier's recogniser (opening warms it) and its service on a
background thread while the current tier keeps serving. Then new streams and uploads go to the new
tier; a stream already open finishes on the tier it started on (its recogniser state belongs to that
model: an utterance never changes model mid-way). The old service is stopped and its engine closed
once its last open stream closes, or after ``drain_s`` (streams still open then get an ``error``
event). One switch at a time, its drain included: at most two tiers in memory.

``shedding`` (set by the tier controller) rejects new streams and uploads with ``Unavailable``
(HTTP 503 with a retry hint); open streams are never cut.

Events sent to API clients are plain dicts: ``{"kind": "speech_start"|"partial"|"final"|"error",
"utterance", "text", "stable_text", "audio_s"}`` and, for finals, ``first_partial_ms``,
``final_ms`` and ``rtf``; errors add ``error`` (what happened) and ``code``.

Guarantees under load: every ``speech_start`` ends in a ``final`` or an ``error``; a live stream's
unprocessed audio is bounded (``backlog_s``, ``max_backlog_s``: the caller stops reading its client
while it is over); ``close(timeout_s)`` returns within its timeout, cutting what is still open with
an ``error``; ``abort`` drops a stream whose client went away, its queued work unrun.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ...config import Settings
from ...errors import DeadlineExceeded, EdgeAgentError, Unavailable, none_loaded
from ...models.recognizer import Recognizer
from ...observe import Observation, Observer
from ..tiers.ladder import Ladder, Switched
from .service import AsrEvent, AsrService

if TYPE_CHECKING:
    from ...config import AsrConfig, AsrTierConfig, AudioConfig, BatchingConfig, EnginesConfig, ModelsConfig

log = logging.getLogger(__name__)
# A few seconds of speech a stream may have waiting for the recogniser: enough to absorb a burst
# (a client sending its buffer after a hiccup), small enough that a fast client cannot queue minutes
# of work ahead of everyone else.
MAX_BACKLOG_S = 4.0
CLOSE_TIMEOUT_S = 30.0  # end of input → every final; past it, what is still open gets an error
UPLOAD_TIMEOUT_S = 300.0


def event_dict(event: AsrEvent) -> dict:
    """An event as the API sends it (see the module doc)."""
    out: dict[str, Any] = {
        "kind": event.kind,
        "utterance": event.utterance,
        "text": event.text,
        "stable_text": event.stable_text,
        "audio_s": round(event.audio_s, 3),
    }
    if event.metrics is not None:
        m = event.metrics
        out.update(first_partial_ms=m.first_partial_ms, final_ms=round(m.final_ms, 2), rtf=round(m.rtf, 4))
    if event.error:
        out["error"] = event.error
        out["code"] = event.code or "failed"
    return out


@dataclass(frozen=True, slots=True)
class SpeechTier:
    """One rung of the ASR ladder: its name and how to open (and warm) its recogniser."""

    name: str
    open: Callable[[], Recognizer]  # loads and warms the recogniser (they warm up as they open)
    engine: Callable[[], str | None] | None = None  # what the tier loaded (model:<sha256>), once open


class _Loaded:
    """One tier in memory: its engine, its service, and how many streams it still serves."""

    def __init__(
        self, index: int, tier: SpeechTier, engine: Recognizer, service: AsrService, observe: Observer
    ) -> None:
        self.index, self.tier, self.engine, self.service = index, tier, engine, service
        self.model = engine.name
        # What this tier opened, asked once now that it is open: every observation carries it.
        self.identity = tier.engine() if tier.engine is not None else None
        self._deliver = observe
        self.streams = 0  # open streams and uploads (under TieredSpeech._lock)

    def _observe(self, event: AsrEvent) -> None:
        if event.kind != "final" or event.metrics is None:
            return
        m = event.metrics
        samples = {"final_ms": (m.final_ms,), "rtf": (m.rtf,)}
        if m.first_partial_ms is not None:
            samples["first_partial_ms"] = (m.first_partial_ms,)
        try:
            self._deliver(Observation("asr", self.tier.name, self.model, samples, self.identity))
        except Exception:  # metrics must never break a stream
            log.exception("ASR metrics observer failed")

    def close(self) -> None:
        self.service.stop()
        self.engine.close()


class PcmStream:
    """One API client's live stream: little-endian PCM16 mono at the engine's rate in, events out.
    ``owner`` is the tier it stays on (its ``service`` and ``_observe``); ``on_close`` runs once, when
    the stream is closed or aborted.

    Back-pressure is the caller's loop: after each ``push``, stop reading the client while
    ``backlog_s > max_backlog_s`` (``wait_backlog`` does it for a thread)."""

    def __init__(
        self,
        owner: _Loaded,
        on_event: Callable[[dict], None],
        on_close: Callable[[], None] | None = None,
        *,
        max_backlog_s: float = MAX_BACKLOG_S,
        close_timeout_s: float = CLOSE_TIMEOUT_S,
        voice: Callable[[AsrEvent], None] | None = None,
        pause_ms: int | None = None,
    ) -> None:
        self.owner = owner
        self.max_backlog_s, self.close_timeout_s = max_backlog_s, close_timeout_s
        self._on_close = on_close

        def deliver(event: AsrEvent) -> None:
            owner._observe(event)
            if not event.paused:  # a pause's partial is for the voice turn only
                on_event(event_dict(event))
            if voice is not None:
                voice(event)

        if voice is None:
            self._stream = owner.service.open_stream(deliver)
        else:  # a voice turn's stream: turns may end early, and pauses send their text ahead
            self._stream = owner.service.open_stream(deliver, pause_ms=pause_ms, early_end=True)
        self._carry = b""

    @property
    def backlog_s(self) -> float:
        return self._stream.backlog_s

    @property
    def over_backlog(self) -> bool:
        return self._stream.backlog_s > self.max_backlog_s

    @property
    def finished(self) -> bool:
        """Input ended and every utterance has its final or error."""
        return self._stream.finished

    def wait_backlog(self, timeout_s: float | None = None) -> bool:
        return self._stream.wait_backlog(self.max_backlog_s, timeout_s)

    def endpoint(self, utterance: int) -> tuple[float, float] | None:
        """(end of speech, end-of-turn decision) of ``utterance`` (``AsrStream.endpoint``)."""
        return self._stream.endpoint(utterance)

    def set_complete(self, complete: Callable[[str], bool | None] | None) -> None:
        """A voice turn's own check of a whole command (``AsrStream.set_complete``), before any audio."""
        self._stream.set_complete(complete)

    def set_context(self, tools: Sequence[dict] | None) -> None:
        """A voice turn's tools, whose words the recogniser is told to expect (``AsrStream.set_context``)."""
        self._stream.set_context(tools)

    def end(self) -> None:
        """No more audio: an open utterance ends now; its final (and any other) still comes."""
        self._stream.close()

    def push(self, pcm16: bytes) -> None:
        data = self._carry + pcm16
        usable = len(data) - len(data) % 2  # a frame split across two messages waits for its other byte
        self._carry = data[usable:]
        if usable:
            self._stream.feed(np.frombuffer(data[:usable], "<i2").astype(np.float32) / 32768.0)

    def close(self, timeout_s: float | None = None) -> None:
        """End the input and wait for the finals, at most ``timeout_s`` (default ``close_timeout_s``);
        utterances still open then get an ``error`` (code ``timeout``) and their work is dropped."""
        timeout_s = self.close_timeout_s if timeout_s is None else timeout_s
        try:
            self._stream.close()
            if not self._stream.wait(timeout_s):
                self._stream.abort(f"no final within {timeout_s:g} s of the end of the stream", "timeout")
        finally:
            self._released()

    def abort(self, reason: str, code: str = "cancelled") -> None:
        """The client is gone (or is being cut off): what is still open gets an ``error`` event and
        its queued work leaves the batcher unrun."""
        try:
            cut = self._stream.abort(reason, code)
            if cut:
                log.info("ASR stream %d aborted (%s): %d utterance(s) cut", self._stream.id, reason, cut)
        finally:
            self._released()

    def _released(self) -> None:
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close()


class TieredSpeech(Ladder):
    """The ASR workload: a ladder of ``SpeechTier``s, one ``AsrService`` serving the active one (see
    the module doc). Each final utterance reaches ``observe`` as an ``observe.Observation``."""

    kind = "ASR tier"
    workload = "asr"

    @classmethod
    def from_config(
        cls,
        models: ModelsConfig,
        audio: AudioConfig,
        batching: BatchingConfig,
        asr: AsrConfig,
        sla_ms: float,
        open_tier: OpenTier,
        observe: Observer | None = None,
        on_switched: Switched | None = None,
        drain_s: float = 120.0,
    ) -> TieredSpeech:
        """The ladder of ``[[models.asr]]`` (not started): each tier opened by ``open_tier`` when first needed
        (what it serves told as its identity), its service from ``[audio]`` and ``[batching]`` with the ASR
        SLA's ``sla_ms``, the words of ``[asr]``, replies ahead on a pause as ``[audio]`` says."""
        from .factory import make_service

        tiers = []
        for t in models.asr:
            opened: dict[str, str] = {}  # "identity" once the tier has opened
            tiers.append(
                SpeechTier(
                    t.name, functools.partial(_open, open_tier, t, opened), functools.partial(opened.get, "identity")
                )
            )
        speech = cls(
            tiers,
            lambda engine: make_service(engine, audio, batching, streams=4, sla_ms=sla_ms, early_end=True),
            observe,
            on_switched,
            drain_s,
            pause_ms=audio.pause_ms if audio.prefill_ahead and audio.respond_ahead else None,
        )
        speech.prompt_words, speech.tool_context = tuple(asr.prompt_words), asr.tool_context
        return speech

    def __init__(
        self,
        tiers: Sequence[SpeechTier],
        make_service: Callable[[Recognizer], AsrService],
        observe: Observer | None = None,
        on_switched: Switched | None = None,
        drain_s: float = 120.0,
        pause_ms: int | None = None,
    ) -> None:
        """``make_service(engine)`` builds a tier's (unstarted) service; ``on_switched(old, new, load_ms,
        error)`` is told when a switch completes or fails; ``pause_ms``: the silence after which a voice
        turn's stream sends its text ahead (None: never)."""
        super().__init__(tiers, on_switched)
        self.pause_ms = pause_ms
        self.prompt_words: tuple[str, ...] = ()  # [asr] prompt_words, set on every tier's service
        self.tool_context = True  # [asr] tool_context
        self._make_service = make_service
        self._observe = observe or (lambda obs: None)
        self._drain_s = drain_s
        self._changed = threading.Condition(self._lock)  # a stream closed
        self._draining: _Loaded | None = None
        self.shedding = False
        self.sla_ms: Callable[[], float] | None = None  # the SLA in force, handed to every tier's service
        # [calibration] capture, handed to every tier's service (set_capture)
        self._capture: Callable[[list[np.ndarray], int, str], None] | None = None

    def _load(self, index: int) -> _Loaded:
        engine = self.tiers[index].open()
        try:
            service = self._make_service(engine).start()
        except BaseException:
            engine.close()
            raise
        service.capture, service.live_sla = self._capture, self.sla_ms
        service.prompt_words, service.tool_context = self.prompt_words, self.tool_context
        return _Loaded(index, self.tiers[index], engine, service, self._observe)

    def set_sla(self, sla_ms: Callable[[], float] | None) -> None:
        """The SLA in force, read at each use by the active tier's service and every tier loaded later."""
        with self._lock:
            self.sla_ms = sla_ms
            if self._active is not None:
                self._active.service.live_sla = sla_ms

    def set_capture(self, capture: Callable[[list[np.ndarray], int, str], None] | None) -> None:
        """Capture utterances from the active tier now and from every tier loaded later."""
        with self._lock:
            self._capture = capture
            if self._active is not None:
                self._active.service.capture = capture

    # -- what the controller, the agent and the API read ----------------------------------------

    @property
    def model(self) -> str:
        loaded = self._active
        return loaded.model if loaded is not None else ""

    @property
    def service(self) -> AsrService:
        """The active tier's service (what new streams go to)."""
        assert self._active is not None, "start() first"
        return self._active.service

    @property
    def active_engine(self) -> Recognizer | None:
        """The active tier's recogniser (its sample rate and language: what a stream is fed), or None."""
        with self._lock:
            return self._active.engine if self._active is not None else None

    @property
    def open_streams(self) -> dict[str, int]:
        """Open streams per tier in memory (the draining one included)."""
        with self._lock:
            return {t.tier.name: t.streams for t in (self._draining, self._active) if t is not None}

    # -- streams -----------------------------------------------------------------------------

    def _acquire(self) -> _Loaded:
        with self._lock:
            loaded = self._active
            if loaded is None:
                raise Unavailable("speech recognition is stopped")
            if self.shedding:
                raise Unavailable(
                    f"shedding load: ASR tier {loaded.tier.name!r} is over its latency target and no "
                    "lighter tier is left; retry in a few seconds"
                )
            loaded.streams += 1
            return loaded

    def _release(self, loaded: _Loaded) -> None:
        with self._changed:
            loaded.streams -= 1
            self._changed.notify_all()

    def transcribe_bytes(
        self, data: bytes, filename: str, *, model: str | None = None, language: str | None = None
    ) -> dict:
        """A whole uploaded file (any format soundfile reads) through the same streaming service: ``text``,
        ``duration`` (s), ``language``, ``segments``, ``model``, ``tier`` (see ``upload``). ``model`` (the
        generic id or a tier name: the active tier serves) and ``language`` are checked first; a refusal
        is a ``FieldError`` naming the field. A failed utterance fails the upload (no hole in the text)."""
        from . import upload

        upload.check_model(model, ["edge-agent", *(t.name for t in self.tiers)])
        if not data:
            raise upload.FieldError(f"{filename}: the upload is empty", "file")
        loaded = self._acquire()
        try:
            lang = upload.model_language(loaded.engine)
            upload.check_language(language, lang, loaded.tier.name)
            samples, info = upload.read_upload(data, filename, loaded.engine.sample_rate)
            failures = upload.Failures(loaded._observe)
            stream = loaded.service.open_stream(failures)
            timed = upload.time_stream(stream)
            upload.feed_bounded(stream, samples, loaded.engine.sample_rate, filename, MAX_BACKLOG_S, UPLOAD_TIMEOUT_S)
            stream.close()
            if not stream.wait(UPLOAD_TIMEOUT_S):
                stream.abort("the transcription timed out", "timeout")
                raise DeadlineExceeded(f"{filename}: transcription did not finish within {UPLOAD_TIMEOUT_S:g} s")
        finally:
            self._release(loaded)
        failures.raise_any(timed.spans, filename)
        segments = upload.segments(stream.finals, timed.spans, info.duration_s)
        text = " ".join(s["text"] for s in segments)
        return dict(
            text=text,
            duration=info.duration_s,
            language=lang,
            segments=segments,
            model=loaded.model,
            tier=loaded.tier.name,
        )

    def open_stream(
        self, on_event: Callable[[dict], None], voice: Callable[[AsrEvent], None] | None = None
    ) -> PcmStream:
        """A live stream on the active tier; it finishes there even if the tier switches meanwhile.
        ``voice``: a voice turn's stream, each event also handed over as it is (``AsrEvent``): its turns
        may end early and its pauses send their text ahead (``[audio] early_end``, ``pause_ms``)."""
        loaded = self._acquire()
        try:
            return PcmStream(
                loaded, on_event, on_close=lambda: self._release(loaded), voice=voice, pause_ms=self.pause_ms
            )
        except BaseException:
            self._release(loaded)
            raise

    # -- switching ---------------------------------------------------------------------------

    def _swapped(self, old: _Loaded) -> None:
        self._draining = old

    def _retire(self, old: _Loaded) -> None:
        self._close_drained(old, self._drain_s)
        with self._lock:
            self._draining = None

    def _close_drained(self, loaded: _Loaded, drain_s: float) -> None:
        with self._changed:
            drained = self._changed.wait_for(lambda: loaded.streams == 0, drain_s)
            left = loaded.streams
        if not drained:
            log.warning(
                "ASR tier %r: %d stream(s) still open after %.0f s; closing it anyway", loaded.tier.name, left, drain_s
            )
        loaded.close()

    def stop(self, drain_s: float | None = None) -> None:
        """Let open streams finish (up to ``drain_s``), then free every tier."""
        self.wait_switched()
        with self._lock:
            loaded, self._active = self._active, None  # new streams are refused from here on
        if loaded is not None:
            self._close_drained(loaded, self._drain_s if drain_s is None else drain_s)


OpenTier = Callable[["AsrTierConfig"], tuple[Recognizer, str]]  # a tier's recogniser and what it serves


def _open(open_tier: OpenTier, tier: AsrTierConfig, opened: dict[str, str]) -> Recognizer:
    recognizer, opened["identity"] = open_tier(tier)
    return recognizer


def cached_opener(engines: EnginesConfig, models_dir: Path, threads: int, final_padding_s: float) -> OpenTier:
    """Open ASR tiers through the engine cache, as LLM tiers are: a Whisper engine the recipe's gate chose
    when one is cached and intact, else the model folder; what it serves is ``engine:KEY`` or ``model:HASH``."""
    from ...engines.cache import EngineCache
    from ...engines.resolve import EngineResolver

    resolver = EngineResolver(
        EngineCache(engines.cache_dir, engines.max_bytes),
        models_dir,
        lambda kind, doc: log.warning("%s: %s", kind, doc),
        engines.recipes_dir,
    )

    def open_tier(tier: AsrTierConfig) -> tuple[Recognizer, str]:
        resolved = resolver.resolve(tier)
        return resolver.open_recognizer(resolved, tier, threads, final_padding_s=final_padding_s), resolved.identity

    return open_tier


def open_speech(
    settings: Settings,
    observe: Observer | None = None,
    on_switched: Switched | None = None,
    on_load_failed: Callable[[str, EdgeAgentError], None] | None = None,
    drain_s: float = 120.0,
    open_tier: OpenTier | None = None,
) -> TieredSpeech:
    """The ASR ladder of ``settings`` (``TieredSpeech.from_config``) serving from its top tier, or the first
    lighter one that loads; ``open_tier`` (default: ``cached_opener`` on ``[engines]``) opens a tier."""
    s = settings
    opener = open_tier or cached_opener(s.engines, s.models.cache_dir, s.device.threads, s.asr.final_padding_s)
    speech = TieredSpeech.from_config(
        s.models, s.audio, s.batching, s.asr, s.sla.asr.target_ms, opener, observe, on_switched, drain_s
    )
    errors = speech.start_first(on_load_failed)
    if speech.active_tier is None:
        raise none_loaded("ASR", errors)
    return speech

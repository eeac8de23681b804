"""What an uploaded file (``POST /v1/audio/transcriptions``) needs beyond a live stream: reading the
upload with errors that name the client's filename (never a server path), the time span of each
utterance in seconds of the upload, its segments, and the language a tier transcribes.

Segment times are the endpointer's own: ``start`` is the utterance's onset (its first voiced frame),
``end`` where its last voiced frame ends (the trailing silence that ended it is not included), both in
seconds from the start of the upload. Consecutive segments never overlap: an utterance starts only
after the previous one ended.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable

import numpy as np

from ...audio.vad import Endpointer, Event, SpeechEnd, SpeechStart
from ...audio.wav import AudioInfo, read_audio
from ...errors import DeadlineExceeded, EdgeAgentError, FieldError, InputError, Overloaded
from .service import AsrEvent, AsrStream

DEFAULT_LANGUAGE = "en"  # what a model folder that does not say (config.json "language") is taken to transcribe


class TimedEndpointer(Endpointer):
    """An ``Endpointer`` that also keeps each utterance's ``(onset_s, speech_end_s)``, by utterance index."""

    def __init__(self, like: Endpointer) -> None:
        super().__init__(like.detector, like.config, like.rate)
        self.spans: list[tuple[float, float | None]] = []

    def push(self, block: np.ndarray) -> list[Event]:
        return self._note(super().push(block))

    def flush(self) -> list[Event]:
        return self._note(super().flush())

    def _note(self, events: list[Event]) -> list[Event]:
        for e in events:
            if isinstance(e, SpeechStart):
                self.spans.append((e.at_s, None))
            elif isinstance(e, SpeechEnd) and self.spans and self.spans[-1][1] is None:
                self.spans[-1] = (self.spans[-1][0], e.speech_end_s)
        return events


def time_stream(stream: AsrStream) -> TimedEndpointer:
    """Give a stream that has not been fed yet an endpointer (the same detector and settings, fresh) that
    records utterance spans."""
    timed = TimedEndpointer(stream.endpointer)
    stream.endpointer = timed
    return timed


def read_upload(data: bytes, filename: str, rate: int) -> tuple[np.ndarray, AudioInfo]:
    """The upload as float32 mono at ``rate``; an unreadable one is an ``FieldError`` naming ``filename``
    (the temporary file it was read from stays out of the message)."""
    if not data:
        raise FieldError(f"{filename}: the upload is empty", param="file")
    suffix = os.path.splitext(filename)[1] or ".wav"
    with tempfile.NamedTemporaryFile(suffix=suffix) as tmp:
        tmp.write(data)
        tmp.flush()
        try:
            return read_audio(tmp.name, rate)
        except InputError as exc:
            raise FieldError(str(exc).replace(tmp.name, filename), param="file") from None


def segments(finals: list[AsrEvent], spans: list[tuple[float, float | None]], duration_s: float) -> list[dict]:
    """OpenAI-shaped segments (``id``, ``start``, ``end``, ``text``) for the finals that have text, in
    utterance order, with the agent's ``kind`` (``final``), ``utterance``, ``first_partial_ms``,
    ``final_ms`` and ``rtf``."""
    out: list[dict] = []
    for e in sorted(finals, key=lambda f: f.utterance):
        if not e.text.strip():
            continue
        onset_s, end_s = spans[e.utterance] if e.utterance < len(spans) else (_onset(e), None)
        if end_s is None:  # not closed by the endpointer (cannot happen after close()): its audio's end
            end_s = e.audio_s
        start = round(min(max(onset_s, 0.0), duration_s), 3)
        seg: dict = {
            "id": len(out),
            "start": start,
            "end": round(min(max(end_s, start), duration_s), 3),
            "text": e.text.strip(),
            "kind": "final",  # the stream event it came from, as the WebSocket sends it
            "utterance": e.utterance,
        }
        if e.metrics is not None:
            m = e.metrics
            seg.update(first_partial_ms=m.first_partial_ms, final_ms=round(m.final_ms, 2), rtf=round(m.rtf, 4))
        out.append(seg)
    return out


def _onset(final: AsrEvent) -> float:
    # a final's audio_s is its onset plus the utterance audio the recogniser covered
    return final.audio_s - (final.metrics.audio_s if final.metrics is not None else 0.0)


def model_language(engine: object) -> str:
    """The language a recogniser transcribes: its own setting (Whisper's ``language``; ``auto`` means it
    detects each utterance's), else its folder's ``config.json`` ``language``, else ``DEFAULT_LANGUAGE``."""
    own = getattr(engine, "language", None)
    if isinstance(own, str) and own.strip():
        return own.strip()
    config = getattr(getattr(engine, "ref", None), "config", None)
    declared = config.get("language") if isinstance(config, dict) else None
    if isinstance(declared, str) and declared.strip():
        return declared.strip()
    return DEFAULT_LANGUAGE


def check_language(requested: str | None, language: str, tier: str) -> None:
    """Refuse a request ``language`` the tier does not transcribe (``FieldError`` naming ``language``)."""
    if requested is None:
        return
    if language == "auto":
        raise FieldError(
            f"language {requested!r} cannot be set per request: ASR tier {tier!r} detects the language of "
            "each utterance itself; omit language",
            param="language",
        )
    if requested.strip().lower() != language.lower():
        raise FieldError(
            f"language {requested!r} is not available: ASR tier {tier!r} transcribes {language!r} only",
            param="language",
        )


def check_model(requested: str | None, known: list[str]) -> None:
    """Refuse a request ``model`` that is neither the generic id nor an ASR tier (``param`` ``model``)."""
    if requested is not None and requested not in known:
        raise FieldError(
            f"model {requested!r} is not served here; the ASR models are {', '.join(known)}", param="model"
        )


class Failures:
    """A stream's event callback that passes every event on to ``deliver`` and keeps its ``error``s."""

    def __init__(self, deliver: Callable[[AsrEvent], None]) -> None:
        self.deliver = deliver
        self.errors: list[AsrEvent] = []

    def __call__(self, event: AsrEvent) -> None:
        self.deliver(event)
        if event.kind == "error":
            self.errors.append(event)

    def raise_any(self, spans: list[tuple[float, float | None]], filename: str) -> None:
        """Fail the upload on its first failed utterance: ``Overloaded`` (429) when the recogniser was
        over capacity, else an ``EdgeAgentError`` (500)."""
        if not self.errors:
            return
        e = self.errors[0]
        at = f" (from {spans[e.utterance][0]:.2f} s)" if e.utterance < len(spans) else ""
        why = f"{filename}: utterance {e.utterance}{at} could not be transcribed: {e.error}"
        raise Overloaded(why) if e.code == "overloaded" else EdgeAgentError(why)


def feed_bounded(
    stream: AsrStream, samples: np.ndarray, rate: int, filename: str, max_backlog_s: float, timeout_s: float
) -> None:
    """Feed a whole file a second at a time, never more than ``max_backlog_s`` ahead of the recogniser:
    a long upload then queues a step or two per utterance, not every utterance of the file at once."""
    deadline = time.monotonic() + timeout_s
    for offset in range(0, len(samples), rate):
        if not stream.wait_backlog(max_backlog_s, max(0.0, deadline - time.monotonic())):
            stream.abort("the transcription timed out", "timeout")
            raise DeadlineExceeded(f"{filename}: transcription did not finish within {timeout_s:g} s")
        stream.feed(samples[offset : offset + rate])

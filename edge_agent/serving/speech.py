"""The ASR workload as the daemon runs it: the top ASR tier's engine behind ``AsrService``, offered to
the local API (whole files, and live PCM16 streams) and reporting each utterance's latency.

Events sent to API clients are plain dicts: ``{"kind": "speech_start"|"partial"|"final"|"error",
"utterance", "text", "stable_text", "audio_s"}`` and, for finals, ``first_partial_ms``,
``final_ms`` and ``rtf``.
"""
from __future__ import annotations

import logging
import os
import tempfile
import threading
from typing import Callable

import numpy as np

from ..config import Settings
from ..errors import InputError
from .asr import AsrEvent, AsrService

log = logging.getLogger(__name__)
Observer = Callable[[str, str, dict], None]  # (tier, model, {metric: [values]})


def event_dict(event: AsrEvent) -> dict:
    out = {"kind": event.kind, "utterance": event.utterance, "text": event.text, "stable_text": event.stable_text,
           "audio_s": round(event.audio_s, 3)}
    if event.metrics is not None:
        m = event.metrics
        out.update(first_partial_ms=m.first_partial_ms, final_ms=round(m.final_ms, 2), rtf=round(m.rtf, 4))
    if event.error:
        out["error"] = event.error
    return out


class PcmStream:
    """One API client's live stream: little-endian PCM16 mono at the engine's rate in, events out."""

    def __init__(self, speech: Speech, on_event: Callable[[dict], None]) -> None:
        self.speech = speech
        self._stream = speech.service.open_stream(lambda e: (speech._observe(e), on_event(event_dict(e))))
        self._carry = b""

    def push(self, pcm16: bytes) -> None:
        data = self._carry + pcm16
        usable = len(data) - len(data) % 2  # a frame split across two messages waits for its other byte
        self._carry = data[usable:]
        if usable:
            self._stream.feed(np.frombuffer(data[:usable], "<i2").astype(np.float32) / 32768.0)

    def close(self) -> None:
        self._stream.close()
        self._stream.wait(120)


class Speech:
    def __init__(self, service: AsrService, tier_name: str, model: str, on_utterance: Observer | None) -> None:
        self.service, self.tier_name, self.model = service, tier_name, model
        self._on_utterance = on_utterance or (lambda tier, model, samples: None)
        self._lock = threading.Lock()

    def _observe(self, event: AsrEvent) -> None:
        if event.kind != "final" or event.metrics is None:
            return
        m = event.metrics
        samples = {"final_ms": [m.final_ms], "rtf": [m.rtf]}
        if m.first_partial_ms is not None:
            samples["first_partial_ms"] = [m.first_partial_ms]
        try:
            self._on_utterance(self.tier_name, self.model, samples)
        except Exception:  # metrics must never break a stream
            log.exception("ASR metrics observer failed")

    def transcribe_bytes(self, data: bytes, filename: str) -> dict:
        """A whole uploaded file (any format soundfile reads), through the same streaming service."""
        from ..audio.wav import read_audio

        if not data:
            raise InputError(f"{filename}: the upload is empty")
        suffix = os.path.splitext(filename)[1] or ".wav"
        with tempfile.NamedTemporaryFile(suffix=suffix) as tmp:
            tmp.write(data)
            tmp.flush()
            samples, info = read_audio(tmp.name, self.service.engine.sample_rate)
        stream = self.service.open_stream(self._observe)
        stream.feed(samples)
        stream.close()
        if not stream.wait(300):
            raise InputError(f"{filename}: transcription did not finish within 300 s")
        finals = [event_dict(e) for e in stream.finals]
        return {"text": " ".join(f["text"] for f in finals if f["text"]).strip(), "duration": info.duration_s,
                "segments": finals, "model": self.model}

    def open_stream(self, on_event: Callable[[dict], None]) -> PcmStream:
        return PcmStream(self, on_event)

    def stop(self) -> None:
        self.service.stop()
        self.service.engine.close()


def open_speech(settings: Settings, on_utterance: Observer | None = None) -> Speech:
    """The top ASR tier, loaded and warmed, behind its service with the configured batching."""
    from ..asr_commands import make_service
    from ..backends import SessionOptions
    from ..models.catalog import resolve_model
    from ..models.recognizer import open_recognizer

    tier = settings.models.asr[0]
    ref = resolve_model(tier.model, settings.models.cache_dir)
    options = SessionOptions(device=tier.device, threads=settings.device.threads, precision=tier.precision,
                             cache_dir=settings.engines.cache_dir)
    engine = open_recognizer(ref, tier.backend, options)
    service = make_service(engine, settings.audio, settings.batching, streams=4).start()
    return Speech(service, tier.name, ref.name, on_utterance)

"""The ASR service made from the configuration (the factory lives with the type), and an unpaced feed.

``make_service`` is the one place that turns the ``audio`` and ``batching`` config sections into
an ``AsrService`` (batch limits, endpointing, the voice-activity detector); the daemon's ASR ladder,
``edge-agent transcribe``/``listen``, ``eval-asr`` and ``bench asr`` all build theirs here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ...config import AudioConfig, BatchingConfig
    from ...models.recognizer import Recognizer
    from .service import AsrService


def make_service(
    engine: Recognizer,
    audio: AudioConfig,
    batching: BatchingConfig,
    streams: int = 1,
    sla_ms: float = 300.0,
    early_end: bool = False,
) -> AsrService:
    """The ASR service for ``engine`` with the ``audio`` and ``batching`` config sections; ``sla_ms`` is
    the first-partial target the adaptive batching wait leaves room for (``[sla.asr] target_ms``).
    ``early_end``: its streams may end a turn early as ``[audio] early_end`` says (the voice turn's
    paths); off, an utterance always ends after the full trailing silence."""
    from ...audio.vad import EndpointConfig, make_detector
    from .batcher import BatchLimits
    from .service import AsrService, EarlyEnd

    limits = BatchLimits(
        max_batch=batching.max_batch,
        # one stream has nobody to wait for: never hold its steps back
        batch_timeout_ms=batching.batch_timeout_ms if streams > 1 else 0.0,
        preferred_batch_sizes=tuple(batching.preferred_batch_sizes) if streams > 1 else (),
        max_queue=batching.max_queue,
        adaptive=batching.adaptive_wait,
    )
    endpoint = EndpointConfig(audio.min_speech_ms, audio.trailing_silence_ms, audio.pre_roll_ms, audio.max_utterance_s)
    make_detector(audio.vad, model=audio.vad_model, threshold_db=audio.energy_threshold_db)  # fail early
    return AsrService(
        engine,
        limits=limits,
        endpoint=endpoint,
        chunk_ms=audio.chunk_ms,
        sla_ms=sla_ms,
        early_end=EarlyEnd(
            audio.early_end_silence_ms,
            audio.early_end_min_prob,
            audio.command_end_silence_ms,
            audio.command_end_min_prob,
        )
        if early_end and audio.early_end
        else None,
        detector_factory=lambda: make_detector(
            audio.vad, model=audio.vad_model, threshold_db=audio.energy_threshold_db
        ),
    )


def feed_lockstep(stream, samples, chunk: int, timeout_s: float = 120.0) -> None:
    """Unpaced replay: feed a chunk, let its step finish, feed the next (partials at every chunk)."""
    for offset in range(0, len(samples), chunk):
        stream.feed(samples[offset : offset + chunk])
        stream.wait_steps(timeout_s)
    stream.close()
